// Internal makers of SequenceBatch (kvtier/sequence.h; offload/sequence_batch.cc) for tests
// and benchmarks that bring their own host page pool.
#ifndef KVTIER_OFFLOAD_SEQUENCE_BATCH_H_
#define KVTIER_OFFLOAD_SEQUENCE_BATCH_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kvtier/sequence.h"
#include "offload/page_pool.h"

namespace kvtier {

// As NewSequenceBatch, with every member's pages in `pool` (registered with `backend`, slot
// bytes = geometry.host_page_bytes(); it may be null in full and drop modes). REQUIRES: the
// pool outlives the batch and its members.
absl::StatusOr<std::unique_ptr<SequenceBatch>> NewSequenceBatchOverPool(
    const Geometry& geometry, const SequenceOptions& options, int32_t max_batch, Backend& backend,
    PagePool* pool);

}  // namespace kvtier

#endif  // KVTIER_OFFLOAD_SEQUENCE_BATCH_H_
