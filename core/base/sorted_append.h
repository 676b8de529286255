// Lists appended one after another to one vector, kept sorted: each list is
// mostly in order already (a box walked row by row, a rank's runs in file
// order), so sorting a list only where it is out of order and merging it
// into what is there beats sorting the whole. Past `max_merges` lists that
// land among the earlier ones (many small lists out of order: small
// tensors, many ranks), merging stops and Finish sorts once.
#ifndef CKPTD_CORE_BASE_SORTED_APPEND_H_
#define CKPTD_CORE_BASE_SORTED_APPEND_H_

#include <algorithm>
#include <cstddef>
#include <limits>
#include <vector>

namespace ckpt {

template <typename T, typename Less>
class SortedAppend {
 public:
  // `v` must outlive this; it may hold a sorted prefix already.
  SortedAppend(std::vector<T>* v, Less less, int max_merges = 8)
      : v_(v), less_(less), max_merges_(max_merges) {}

  // Call once a list has been appended to *v (everything after what the
  // previous call left sorted is the new list).
  void Appended() {
    if (sorted_ == kUnsorted) return;
    const auto mid = v_->begin() + static_cast<std::ptrdiff_t>(sorted_);
    if (!std::is_sorted(mid, v_->end(), less_)) std::sort(mid, v_->end(), less_);
    if (mid != v_->begin() && mid != v_->end() && less_(*mid, *(mid - 1))) {
      if (++merges_ > max_merges_) {
        sorted_ = kUnsorted;
        return;
      }
      std::inplace_merge(v_->begin(), mid, v_->end(), less_);
    }
    sorted_ = v_->size();
  }

  // *v sorted, every list in.
  void Finish() {
    if (sorted_ == kUnsorted) std::sort(v_->begin(), v_->end(), less_);
    sorted_ = v_->size();
  }

 private:
  static constexpr size_t kUnsorted = std::numeric_limits<size_t>::max();
  std::vector<T>* v_;
  Less less_;
  const int max_merges_;
  int merges_ = 0;
  size_t sorted_ = 0;  // v_[0, sorted_) in order (kUnsorted: Finish sorts)
};

}  // namespace ckpt

#endif  // CKPTD_CORE_BASE_SORTED_APPEND_H_
