// Status propagation macros (Abseil 20220623 ships none).
#ifndef SHARDOPT_COMMON_STATUS_MACROS_H_
#define SHARDOPT_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define SHARDOPT_CONCAT_INNER_(a, b) a##b
#define SHARDOPT_CONCAT_(a, b) SHARDOPT_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define SHARDOPT_RETURN_IF_ERROR(expr)                   \
  do {                                                   \
    ::absl::Status shardopt_status_ = (expr);            \
    if (!shardopt_status_.ok()) return shardopt_status_; \
  } while (0)

// `lhs = value of expr` when the absl::StatusOr `expr` is OK; returns its status otherwise.
#define SHARDOPT_ASSIGN_OR_RETURN(lhs, expr) \
  SHARDOPT_ASSIGN_OR_RETURN_IMPL_(SHARDOPT_CONCAT_(shardopt_statusor_, __LINE__), lhs, expr)

#define SHARDOPT_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                    \
  if (!tmp.ok()) return tmp.status();                   \
  lhs = std::move(tmp).value()

#endif  // SHARDOPT_COMMON_STATUS_MACROS_H_
