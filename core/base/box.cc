#include "core/base/box.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ckpt {

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

std::string BoxString(const Box& box) {
  return absl::StrCat("(", absl::StrJoin(box.shape, ","), ")@(", absl::StrJoin(box.offset, ","),
                      ")");
}

absl::StatusOr<int64_t> CheckedNumElements(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeString(shape), " has a negative extent"));
    }
    if (d != 0 && n > INT64_MAX / d) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeString(shape), ": element count overflows int64"));
    }
    n *= d;
  }
  return n;
}

absl::StatusOr<int64_t> CheckedNumBytes(absl::Span<const int64_t> shape, size_t item_size) {
  auto n = CheckedNumElements(shape);
  if (!n.ok()) return n.status();
  if (*n != 0 && *n > INT64_MAX / static_cast<int64_t>(item_size)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape ", ShapeString(shape), ": byte size overflows int64"));
  }
  return *n * static_cast<int64_t>(item_size);
}

int64_t NumElements(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool Contains(const Box& outer, const Box& inner) {
  if (outer.rank() != inner.rank()) return false;
  for (size_t i = 0; i < outer.rank(); ++i) {
    if (inner.offset[i] < outer.offset[i]) return false;
    if (inner.offset[i] + inner.shape[i] > outer.offset[i] + outer.shape[i]) return false;
  }
  return true;
}

bool InBounds(const Box& box, absl::Span<const int64_t> global_shape) {
  if (box.rank() != global_shape.size() || box.offset.size() != box.shape.size()) return false;
  for (size_t i = 0; i < box.rank(); ++i) {
    if (box.offset[i] < 0 || box.shape[i] < 0) return false;
    if (box.offset[i] > global_shape[i] - box.shape[i]) return false;
  }
  return true;
}

std::optional<Box> Intersect(const Box& a, const Box& b) {
  if (a.rank() != b.rank()) return std::nullopt;
  Box r;
  r.offset.resize(a.rank());
  r.shape.resize(a.rank());
  for (size_t i = 0; i < a.rank(); ++i) {
    int64_t lo = std::max(a.offset[i], b.offset[i]);
    int64_t hi = std::min(a.offset[i] + a.shape[i], b.offset[i] + b.shape[i]);
    if (hi <= lo) return std::nullopt;
    r.offset[i] = lo;
    r.shape[i] = hi - lo;
  }
  return r;
}

int64_t Ravel(absl::Span<const int64_t> shape, absl::Span<const int64_t> index) {
  int64_t flat = 0;
  for (size_t i = 0; i < shape.size(); ++i) flat = flat * shape[i] + index[i];
  return flat;
}

Shape Unravel(absl::Span<const int64_t> shape, int64_t flat) {
  Shape index(shape.size());
  for (size_t i = shape.size(); i-- > 0;) {
    index[i] = flat % shape[i];
    flat /= shape[i];
  }
  return index;
}

Box CoveringBox(absl::Span<const int64_t> shape, int64_t begin, int64_t end) {
  Shape first = Unravel(shape, begin);
  Shape last = Unravel(shape, end - 1);
  Box box;
  box.offset.assign(shape.size(), 0);
  box.shape.assign(shape.begin(), shape.end());
  for (size_t i = 0; i < shape.size(); ++i) {
    box.offset[i] = first[i];
    box.shape[i] = last[i] - first[i] + 1;
    if (first[i] != last[i]) break;  // every later axis stays full
  }
  return box;
}

}  // namespace ckpt
