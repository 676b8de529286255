// N-dimensional boxes over row-major tensors.
//
// A Box is an origin (`offset`) plus an extent (`shape`) in global tensor
// coordinates. Rank 0 boxes are scalars (one element). All functions are pure
// and thread-safe.
//
//   Box a{{0, 0}, {4, 4}}, b{{2, 2}, {4, 4}};
//   std::optional<Box> c = Intersect(a, b);   // {{2, 2}, {2, 2}}
#ifndef CKPTD_CORE_BOX_H_
#define CKPTD_CORE_BOX_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/container/inlined_vector.h"
#include "absl/types/span.h"

namespace ckpt {

// Inline storage for up to 4 axes: plans hold millions of boxes, and a heap
// allocation per shape dominated their memory.
using Shape = absl::InlinedVector<int64_t, 4>;

struct Box {
  Shape offset;
  Shape shape;

  size_t rank() const { return shape.size(); }
  bool operator==(const Box& o) const { return offset == o.offset && shape == o.shape; }
  bool operator!=(const Box& o) const { return !(*this == o); }
};

// "[2,3]" style rendering for error messages.
std::string ShapeString(absl::Span<const int64_t> shape);
// "(2,3)@(0,4)": shape at offset.
std::string BoxString(const Box& box);

// Product of `shape`; an error if any extent is negative or the product (or
// the product times `item_size`) does not fit in int64.
absl::StatusOr<int64_t> CheckedNumElements(absl::Span<const int64_t> shape);
absl::StatusOr<int64_t> CheckedNumBytes(absl::Span<const int64_t> shape, size_t item_size);

// Product of a shape already validated by CheckedNumElements. 1 for rank 0.
int64_t NumElements(absl::Span<const int64_t> shape);

// Whether `inner` lies entirely inside `outer` (same rank required).
bool Contains(const Box& outer, const Box& inner);

// Whether `box` lies inside a tensor of `global_shape`.
bool InBounds(const Box& box, absl::Span<const int64_t> global_shape);

// Intersection of two boxes of the same rank; nullopt if empty. Two rank-0
// boxes intersect in the scalar.
std::optional<Box> Intersect(const Box& a, const Box& b);

// Row-major flat index of `index` within `shape`.
int64_t Ravel(absl::Span<const int64_t> shape, absl::Span<const int64_t> index);
// Inverse of Ravel.
Shape Unravel(absl::Span<const int64_t> shape, int64_t flat);

// The smallest box (in the local coordinates of `shape`) containing every
// element of flatten(shape)[begin, end). Requires 0 <= begin < end <= numel.
//
// Correct in any rank: axes before the first axis where the first and last
// index differ take [first, last]; that axis takes [first, last]; every later
// axis is full. (Paddle's rule narrows later axes and can miss elements in
// rank >= 3.)
//   CoveringBox({4, 6}, 0, 10)  -> (2,6)@(0,0)
//   CoveringBox({4, 6}, 10, 24) -> (3,6)@(1,0)
Box CoveringBox(absl::Span<const int64_t> shape, int64_t begin, int64_t end);

}  // namespace ckpt

#endif  // CKPTD_CORE_BOX_H_
