// The pickle machine's byte reader (pickle.cc): private to core/pickle*.
#ifndef CKPTD_CORE_PICKLE_READER_H_
#define CKPTD_CORE_PICKLE_READER_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/io/file.h"
#include "core/base/status_macros.h"

namespace ckpt {
namespace pickle {
namespace internal {

constexpr size_t kWindow = 1 << 20;

inline uint64_t LoadLE(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Buffered positional reader over [begin, end) of a file, aware of pickle
// frames: no read may cross the end of the current frame.
class Reader {
 public:
  Reader(const RandomAccessFile& f, uint64_t begin, uint64_t end)
      : f_(f), pos_(begin), end_(end), win_start_(begin), win_end_(begin) {}

  uint64_t pos() const { return pos_; }
  uint64_t end() const { return end_; }
  const absl::Status& io_error() const { return io_error_; }
  // Why the last Take/Skip/ReadInto failed (when io_error is OK).
  const std::string& why() const { return why_; }

  // Makes `n` (<= kWindow) contiguous bytes available at *p and advances.
  bool Take(uint64_t n, const uint8_t** p) {
    if (!Span(n)) return false;
    if (pos_ < win_start_ || pos_ + n > win_end_) {
      if (!Fill(n)) return false;
    }
    *p = buf_.data() + (pos_ - win_start_);
    pos_ += n;
    return true;
  }

  bool Skip(uint64_t n) {
    if (!Span(n)) return false;
    pos_ += n;
    return true;
  }

  bool ReadInto(uint64_t n, std::string* out) {
    if (!Span(n)) return false;
    out->resize(n);
    uint64_t done = 0;
    // Bytes already in the window first, then straight from the file.
    if (pos_ >= win_start_ && pos_ < win_end_) {
      done = std::min<uint64_t>(n, win_end_ - pos_);
      std::memcpy(out->data(), buf_.data() + (pos_ - win_start_), done);
    }
    if (done < n) {
      absl::Status s = f_.Read(pos_ + done, n - done, out->data() + done);
      if (!s.ok()) {
        io_error_ = s;
        return false;
      }
    }
    pos_ += n;
    return true;
  }

  // FRAME: the next `n` bytes form a frame.
  bool BeginFrame(uint64_t n) {
    if (frame_end_ != 0 && pos_ < frame_end_) {
      why_ = absl::StrCat("FRAME inside an unfinished frame (which ends at byte ", frame_end_,
                          ")");
      return false;
    }
    if (n > end_ - pos_) {
      why_ = absl::StrCat("truncated frame: FRAME of ", n, " bytes but only ", end_ - pos_,
                          " bytes follow");
      return false;
    }
    frame_end_ = pos_ + n;
    return true;
  }

 private:
  bool Span(uint64_t n) {
    if (frame_end_ != 0) {
      if (pos_ == frame_end_) {
        frame_end_ = 0;  // the frame is used up; continue unframed
      } else if (n > frame_end_ - pos_) {
        why_ = absl::StrCat("a read of ", n, " bytes crosses the end of the frame at byte ",
                            frame_end_);
        return false;
      }
    }
    if (n > end_ - pos_) {
      why_ = absl::StrCat("truncated: ", n, " bytes needed but the pickle ends after ",
                          end_ - pos_);
      return false;
    }
    return true;
  }

  bool Fill(uint64_t n) {
    uint64_t len = std::min<uint64_t>(std::max<uint64_t>(kWindow, n), end_ - pos_);
    if (buf_.size() < len) buf_.resize(len);
    absl::Status s = f_.Read(pos_, len, buf_.data());
    if (!s.ok()) {
      io_error_ = s;
      return false;
    }
    win_start_ = pos_;
    win_end_ = pos_ + len;
    return true;
  }

  const RandomAccessFile& f_;
  uint64_t pos_, end_;
  uint64_t win_start_, win_end_;
  uint64_t frame_end_ = 0;
  std::vector<uint8_t> buf_;
  absl::Status io_error_;
  std::string why_;
};

// UTF-8 text whose code points are all < 256 -> latin-1 bytes.

}  // namespace internal
}  // namespace pickle
}  // namespace ckpt

#endif  // CKPTD_CORE_PICKLE_READER_H_
