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
#include "kernels/ops.h"
#include "kvtier/device.h"

namespace kvtier {

class Backend : public Device {
 public:
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
  absl::Status QuantizeSlots(Stream& s, const QuantizeSlotsArgs& a);
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
  virtual absl::Status DoQuantizeSlots(Stream& s, const QuantizeSlotsArgs& a) = 0;
  virtual absl::Status DoMoveHeadSlots(Stream& s, const MoveHeadSlotsArgs& a) = 0;
};

}  // namespace kvtier

#endif  // KVTIER_KERNELS_BACKEND_H_
