// A backend decorator that charges every allocation to a memory budget: kvtierd runs each
// GRPC session's Retriever on one, so the session's daemon-side memory (working set,
// summaries, staging) counts against its tenant's quota like its host region does. Ops,
// copies, streams and events are the inner backend's; Allocate first charges the budget
// (refusing with the budget's RESOURCE_EXHAUSTED), and the charge is released when the
// buffer is freed.
//
// Thread-safe, as kernels/backend.h. The inner backend and the budget must outlive the
// decorator, and the decorator every buffer it handed out.
#ifndef KVTIER_KERNELS_BUDGETED_BACKEND_H_
#define KVTIER_KERNELS_BUDGETED_BACKEND_H_

#include <cstddef>
#include <memory>

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace kvtier {

// Bytes that may be taken and given back. Thread-safe.
class MemoryBudget {
 public:
  virtual ~MemoryBudget() = default;
  // Takes `bytes` from the budget: OK, or RESOURCE_EXHAUSTED saying what the budget holds.
  virtual absl::Status Charge(size_t bytes) = 0;
  // Gives back bytes an earlier Charge took.
  virtual void Release(size_t bytes) = 0;
};

std::unique_ptr<Backend> NewBudgetedBackend(Backend& inner, MemoryBudget& budget);

}  // namespace kvtier

#endif  // KVTIER_KERNELS_BUDGETED_BACKEND_H_
