#include "server/cuda/copy_runs.h"

#include <algorithm>
#include <optional>
#include <vector>

namespace ckptd::gpu {

using ckpt::Box;
using ckpt::StoredLayout;

namespace {

// Accumulates blocks, merging a row into the previous block when it
// continues it (same width, constant pitches) and contiguous rows into one.
class Merger {
 public:
  explicit Merger(const std::function<void(const Block2D&)>& emit) : emit_(emit) {}
  ~Merger() { Flush(); }

  void Push(Block2D b) {
    if (b.width <= 0 || b.height <= 0) return;
    if (b.height == 1) {
      b.src_pitch = b.dst_pitch = b.width;
    } else if (b.src_pitch == b.width && b.dst_pitch == b.width) {
      b = Block2D{b.src, b.dst, b.width * b.height, 1, b.width * b.height, b.width * b.height};
    }
    if (pend_ && b.height == 1) {
      Block2D& p = *pend_;
      if (p.height == 1 && p.src + p.width == b.src && p.dst + p.width == b.dst) {
        p.width += b.width;  // contiguous in both: a longer row
        p.src_pitch = p.dst_pitch = p.width;
        return;
      }
      if (p.width == b.width) {
        if (p.height == 1 && b.src - p.src >= p.width && b.dst - p.dst >= p.width) {
          p.src_pitch = b.src - p.src;
          p.dst_pitch = b.dst - p.dst;
          p.height = 2;
          return;
        }
        if (p.height > 1 && b.src == p.src + p.height * p.src_pitch &&
            b.dst == p.dst + p.height * p.dst_pitch) {
          ++p.height;
          return;
        }
      }
    }
    Flush();
    pend_ = b;
  }

  void Flush() {
    if (!pend_) return;
    total_ += pend_->elements();
    emit_(*pend_);
    pend_.reset();
  }
  int64_t total() const { return total_; }

 private:
  const std::function<void(const Block2D&)>& emit_;
  std::optional<Block2D> pend_;
  int64_t total_ = 0;
};

}  // namespace

int64_t ForEachBlock(const StoredLayout& src, const StoredLayout& dst, const Box& region,
                     const std::function<void(const Block2D&)>& emit) {
  Merger m(emit);
  const size_t rank = region.rank();
  if (rank == 0) {
    if (src.flat_begin <= 0 && 0 < src.flat_end && dst.flat_begin <= 0 && 0 < dst.flat_end) {
      m.Push(Block2D{-src.flat_begin, -dst.flat_begin, 1, 1, 1, 1});
    }
    m.Flush();
    return m.total();
  }
  for (size_t i = 0; i < rank; ++i) {
    if (region.shape[i] <= 0) return 0;
  }
  // Trailing axes whole in region, src and dst fold into one run (axes
  // k..rank-1); axis k-1 is the row axis of the 2-D blocks; axes 0..k-2 are
  // walked.
  int64_t run = 0;
  const size_t k = ckpt::FoldTrailingAxes(src, dst, region, &run);
  std::vector<int64_t> ss(rank), ds(rank);
  int64_t sacc = 1, dacc = 1;
  for (size_t i = rank; i-- > 0;) {
    ss[i] = sacc;
    ds[i] = dacc;
    sacc *= src.box.shape[i];
    dacc *= dst.box.shape[i];
  }
  int64_t s = 0, d = 0;  // flat indices (in each box) of the current block's first element
  for (size_t i = 0; i < rank; ++i) {
    s += (region.offset[i] - src.box.offset[i]) * ss[i];
    d += (region.offset[i] - dst.box.offset[i]) * ds[i];
  }
  const bool clip = src.flat_begin > 0 || dst.flat_begin > 0 || src.flat_end < sacc ||
                    dst.flat_end < dacc;
  const bool has_rows = k >= 1;
  const size_t walked = has_rows ? k - 1 : 0;
  const int64_t height = has_rows ? region.shape[k - 1] : 1;
  const int64_t sp = has_rows ? ss[k - 1] : run;
  const int64_t dp = has_rows ? ds[k - 1] : run;
  std::vector<int64_t> idx(walked, 0);
  while (true) {
    if (!clip) {
      m.Push(Block2D{s - src.flat_begin, d - dst.flat_begin, run, height, sp, dp});
    } else {
      for (int64_t j = 0; j < height; ++j) {
        const int64_t rs = s + j * sp, rd = d + j * dp;
        const int64_t lo = std::max<int64_t>({0, src.flat_begin - rs, dst.flat_begin - rd});
        const int64_t hi = std::min<int64_t>({run, src.flat_end - rs, dst.flat_end - rd});
        if (hi > lo) {
          m.Push(Block2D{rs + lo - src.flat_begin, rd + lo - dst.flat_begin, hi - lo, 1, 0, 0});
        }
      }
    }
    // Advance the odometer over the walked axes; done when it wraps.
    bool advanced = false;
    for (size_t a = walked; a-- > 0;) {
      if (++idx[a] < region.shape[a]) {
        s += ss[a];
        d += ds[a];
        advanced = true;
        break;
      }
      s -= (region.shape[a] - 1) * ss[a];
      d -= (region.shape[a] - 1) * ds[a];
      idx[a] = 0;
    }
    if (!advanced) break;
  }
  m.Flush();
  return m.total();
}

}  // namespace ckptd::gpu
