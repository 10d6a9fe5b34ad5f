// Two small macros for absl::Status plumbing (Debian's Abseil 20220623 has none).
//
//   KVPOOL_RETURN_IF_ERROR(DoThing());
//   KVPOOL_ASSIGN_OR_RETURN(auto value, ComputeValue());
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVPOOL_STATUS_CONCAT_INNER_(a, b) a##b
#define KVPOOL_STATUS_CONCAT_(a, b) KVPOOL_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status); returns it from the enclosing function when not OK.
#define KVPOOL_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    const ::absl::Status kvpool_status_ = (expr);    \
    if (!kvpool_status_.ok()) return kvpool_status_; \
  } while (false)

// Evaluates `rexpr` (an absl::StatusOr<T>); on error returns its status, else moves the value
// into `lhs` (which may be a declaration such as `auto x`).
#define KVPOOL_ASSIGN_OR_RETURN(lhs, rexpr) \
  KVPOOL_ASSIGN_OR_RETURN_IMPL_(KVPOOL_STATUS_CONCAT_(kvpool_statusor_, __LINE__), lhs, rexpr)

#define KVPOOL_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                  \
  if (!statusor.ok()) return std::move(statusor).status();  \
  lhs = std::move(statusor).value()
