// The backend: a Device (kvtier/device.h: memory, streams, events, copies) plus the compute
// ops kvtier runs on it (kernels/ops.h). Internal: engines see only Device; everything in
// kvtier that computes takes a Backend. Two implementations: cpu (always built) and cuda
// (built when the toolkit is found; a stub returning UNIMPLEMENTED otherwise). Pick one with
// CreateBackend in kernels/registry.h; pass it in, never reach for a global.
//
// Every op validates its arguments when enqueued (INVALID_ARGUMENT at once) and then
// follows the stream semantics of kvtier/device.h. (The cpu backend skips later work on a
// failed stream; the cuda backend still runs it, so treat a failed stream's outputs as
// garbage.)
//
// Thread-safety: as Device.
#ifndef KVTIER_KERNELS_BACKEND_H_
#define KVTIER_KERNELS_BACKEND_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/host_calls.h"
#include "kernels/ops.h"
#include "kvtier/device.h"

namespace kvtier {

// Work captured from a stream (Backend::EndCapture), launched again as one unit: a CUDA graph
// on the cuda backend, the recorded task list on the cpu backend. Launching it enqueues
// exactly the captured work, with the captured arguments, on any stream of the same backend.
// The buffers it names must stay alive and keep their addresses. Destroy it only after its
// launches have run.
class Graph {
 public:
  virtual ~Graph() = default;
  virtual absl::Status Launch(Stream& s) = 0;
};

class Backend : public Device {
 public:
  // Stream capture (docs/retriever.md#graphs). Between BeginCapture and EndCapture, the ops,
  // copies and memsets enqueued on `s` are recorded instead of run; EndCapture returns them
  // as a Graph. Capture one stream only: Record, Wait and Synchronize on a capturing stream,
  // and copies from or into pageable host memory, fail with FAILED_PRECONDITION (the capture
  // is then abandoned by EndCapture's error). UNIMPLEMENTED where SupportsCapture() is false.
  virtual bool SupportsCapture() const { return false; }
  virtual absl::Status BeginCapture(Stream& s);
  virtual absl::StatusOr<std::unique_ptr<Graph>> EndCapture(Stream& s);

  // Bytes of SparseAttentionArgs::workspace the backend wants for an attention of this shape
  // (batch, kv.num_slots, token_prob set or not); 0 when it uses none.
  virtual size_t SparseAttentionWorkspaceBytes(const SparseAttentionArgs& a) const {
    (void)a;
    return 0;
  }

  // The compute ops (kernels/ops.h). Each validates shapes, then enqueues.
  absl::Status ScorePages(Stream& s, const ScorePagesArgs& a);
  absl::Status TopK(Stream& s, const TopKArgs& a);
  absl::Status QueryCosine(Stream& s, const QueryCosineArgs& a);
  absl::Status SelectionLoss(Stream& s, const SelectionLossArgs& a);
  absl::Status Recall(Stream& s, const RecallArgs& a);
  absl::Status GatherSlabs(Stream& s, const GatherSlabsArgs& a);
  absl::Status ScatterSlabs(Stream& s, const ScatterSlabsArgs& a);
  absl::Status Replace(Stream& s, const ReplaceArgs& a);
  absl::Status Offload(Stream& s, const OffloadArgs& a);
  absl::Status SparseAttention(Stream& s, const SparseAttentionArgs& a);
  absl::Status DenseAttention(Stream& s, const DenseAttentionArgs& a);
  absl::Status MoveHeadSlots(Stream& s, const MoveHeadSlotsArgs& a);

 protected:
  virtual absl::Status DoScorePages(Stream& s, const ScorePagesArgs& a) = 0;
  virtual absl::Status DoTopK(Stream& s, const TopKArgs& a) = 0;
  virtual absl::Status DoQueryCosine(Stream& s, const QueryCosineArgs& a) = 0;
  virtual absl::Status DoSelectionLoss(Stream& s, const SelectionLossArgs& a) = 0;
  virtual absl::Status DoRecall(Stream& s, const RecallArgs& a) = 0;
  virtual absl::Status DoGatherSlabs(Stream& s, const GatherSlabsArgs& a) = 0;
  virtual absl::Status DoScatterSlabs(Stream& s, const ScatterSlabsArgs& a) = 0;
  virtual absl::Status DoReplace(Stream& s, const ReplaceArgs& a) = 0;
  virtual absl::Status DoOffload(Stream& s, const OffloadArgs& a) = 0;
  virtual absl::Status DoSparseAttention(Stream& s, const SparseAttentionArgs& a) = 0;
  virtual absl::Status DoDenseAttention(Stream& s, const DenseAttentionArgs& a) = 0;
  virtual absl::Status DoMoveHeadSlots(Stream& s, const MoveHeadSlotsArgs& a) = 0;
};

}  // namespace kvtier

#endif  // KVTIER_KERNELS_BACKEND_H_
