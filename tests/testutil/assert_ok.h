// ASSERT_OK(expr): a fatal test failure naming the expression and its status when `expr` (an
// absl::Status) is not OK.
#ifndef KVTIER_TESTS_TESTUTIL_ASSERT_OK_H_
#define KVTIER_TESTS_TESTUTIL_ASSERT_OK_H_

#include "absl/status/status.h"
#include "gtest/gtest.h"

#define ASSERT_OK(expr)                                                        \
  do {                                                                         \
    const absl::Status kvtier_assert_ok_ = (expr);                             \
    ASSERT_TRUE(kvtier_assert_ok_.ok()) << #expr << ": " << kvtier_assert_ok_; \
  } while (0)

#endif  // KVTIER_TESTS_TESTUTIL_ASSERT_OK_H_
