// Small helpers for absl::Status plumbing used throughout ckptd.
//
//   CKPT_RETURN_IF_ERROR(DoThing());
//   CKPT_ASSIGN_OR_RETURN(auto file, OpenFile(path));
#ifndef CKPTD_CORE_STATUS_MACROS_H_
#define CKPTD_CORE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define CKPT_RETURN_IF_ERROR(expr)                 \
  do {                                             \
    ::absl::Status _ckpt_status = (expr);          \
    if (!_ckpt_status.ok()) return _ckpt_status;   \
  } while (0)

#define CKPT_STATUS_CONCAT_INNER(a, b) a##b
#define CKPT_STATUS_CONCAT(a, b) CKPT_STATUS_CONCAT_INNER(a, b)

#define CKPT_ASSIGN_OR_RETURN(lhs, expr) \
  CKPT_ASSIGN_OR_RETURN_IMPL(CKPT_STATUS_CONCAT(_ckpt_statusor_, __LINE__), lhs, expr)

#define CKPT_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return std::move(tmp).status();   \
  lhs = std::move(tmp).value()

namespace ckpt {

// Returns `status` with `context` prepended to its message ("context: message"),
// keeping the code. OK stays OK.
absl::Status Annotate(const absl::Status& status, absl::string_view context);

}  // namespace ckpt

#endif  // CKPTD_CORE_STATUS_MACROS_H_
