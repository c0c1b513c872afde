// kvtier's one error model: absl::Status / absl::StatusOr everywhere, with macros to
// propagate errors, and KVTIER_CHECK for broken internal invariants only (never for
// anything a caller or a client can get wrong: that is a Status).
//
// Canonical codes map one-to-one onto gRPC codes. Thread-safe: these are values.
#ifndef KVTIER_CORE_STATUS_H_
#define KVTIER_CORE_STATUS_H_

#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVTIER_STATUS_CONCAT_INNER_(a, b) a##b
#define KVTIER_STATUS_CONCAT_(a, b) KVTIER_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define KVTIER_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::absl::Status kvtier_status_ = (expr);          \
    if (!kvtier_status_.ok()) return kvtier_status_; \
  } while (0)

// `lhs = value of rexpr` when rexpr (an absl::StatusOr) is OK, else returns its status.
// `lhs` may declare a variable: KVTIER_ASSIGN_OR_RETURN(auto x, MakeX());
#define KVTIER_ASSIGN_OR_RETURN(lhs, rexpr) \
  KVTIER_ASSIGN_OR_RETURN_IMPL_(KVTIER_STATUS_CONCAT_(kvtier_statusor_, __LINE__), lhs, rexpr)
#define KVTIER_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                  \
  if (!statusor.ok()) return std::move(statusor).status();  \
  lhs = std::move(statusor).value()

// Aborts with file:line when an internal invariant is broken. Not for input validation.
#define KVTIER_CHECK(cond)                                                                 \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::fprintf(stderr, "%s:%d: KVTIER_CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                        \
    }                                                                                      \
  } while (0)

#endif  // KVTIER_CORE_STATUS_H_
