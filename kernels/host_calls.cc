#include "kernels/host_calls.h"

namespace kvtier {
namespace {

thread_local HostCalls this_thread_calls;

}  // namespace

HostCalls ThreadHostCalls() { return this_thread_calls; }

void CountHostCall(HostCall kind) {
  switch (kind) {
    case HostCall::kWait:
      ++this_thread_calls.waits;
      break;
    case HostCall::kSyncCopy:
      ++this_thread_calls.sync_copies;
      break;
    case HostCall::kAllocation:
      ++this_thread_calls.allocations;
      break;
    case HostCall::kFree:
      ++this_thread_calls.frees;
      break;
  }
}

}  // namespace kvtier
