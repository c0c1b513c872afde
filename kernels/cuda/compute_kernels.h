// Launchers of the CUDA arithmetic kernels: selection (select.cu: page scoring with group
// pooling, top-k, query cosine and drift flags, page-cache replacement; selection_loss.cu:
// the mass correction trigger), attention
// (attention.cu: sparse paged decode attention over per-KV-head slot tables, dense decode
// attention) and the policy op (policy_ops.cu: head-slot moves).
//
// Framework-free, as copy_kernels.h: the op arguments of kernels/ops.h, whose
// pointers must already be device-accessible (device memory, or the device view of
// registered host memory), an error sink (device_error.h) for data-dependent errors (an
// index out of range: the item is skipped and the first such error is reported) and a
// stream. The launchers never synchronise and never allocate, except attention's own scratch
// when the caller passes no workspace (attention.cu); each returns the launch's
// cudaError_t. The semantics, tie-breaking included, are the CPU reference's
// (kernels/cpu/), which the GPU tests compare against.
#ifndef KVTIER_KERNELS_CUDA_COMPUTE_KERNELS_H_
#define KVTIER_KERNELS_CUDA_COMPUTE_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/device_error.h"
#include "kernels/ops.h"

namespace kvtier::cuda {

// select.cu. REQUIRES: ValidateArgs(a) is OK.
cudaError_t LaunchScorePages(const ScorePagesArgs& a, const DeviceErrorSink& sink,
                             cudaStream_t stream);
cudaError_t LaunchTopK(const TopKArgs& a, const DeviceErrorSink& sink, cudaStream_t stream);
cudaError_t LaunchQueryCosine(const QueryCosineArgs& a, const DeviceErrorSink& sink,
                              cudaStream_t stream);
cudaError_t LaunchReplace(const ReplaceArgs& a, const DeviceErrorSink& sink, cudaStream_t stream);

// selection_loss.cu. REQUIRES: ValidateArgs(a) is OK.
cudaError_t LaunchSelectionLoss(const SelectionLossArgs& a, const DeviceErrorSink& sink,
                                cudaStream_t stream);

// attention.cu. The sparse kernel reads K and V rows as 16-byte vectors only (the contract
// at the top of attention.cu): the caches must be kAttentionVectorBytes-aligned and the
// head dim a multiple of AttentionVectorElements(dtype). Every other pointer needs its
// element's alignment.
inline constexpr size_t kAttentionVectorBytes = 16;
// Elements of `t` per vector; 0 for an invalid dtype.
constexpr int32_t AttentionVectorElements(DType t) {
  return DTypeSize(t) == 0 ? 0 : static_cast<int32_t>(kAttentionVectorBytes / DTypeSize(t));
}
// Bytes of scratch LaunchSparseAttention needs for `a` on `device` (the split plan for the
// shape, a.batch, a.kv.num_slots, the device's SM count, and whether a.token_prob is set):
// the launch uses a.workspace when a.workspace_bytes is at least this, else its own
// per-stream buffer (a counted blocking allocation on first use and growth). 0 when it
// needs none, and for shapes it cannot launch (no pointer of `a` is read).
size_t SparseAttentionScratchBytes(const SparseAttentionArgs& a, int device);
// REQUIRES: ValidateArgs(a) is OK, and for the sparse op the alignment above.
cudaError_t LaunchSparseAttention(const SparseAttentionArgs& a, const DeviceErrorSink& sink,
                                  cudaStream_t stream);
cudaError_t LaunchDenseAttention(const DenseAttentionArgs& a, const DeviceErrorSink& sink,
                                 cudaStream_t stream);

// policy_ops.cu. REQUIRES: ValidateArgs(a) is OK and a.num_items > 0.
cudaError_t LaunchMoveHeadSlots(const MoveHeadSlotsArgs& a, const DeviceErrorSink& sink,
                                cudaStream_t stream);

}  // namespace kvtier::cuda

#endif  // KVTIER_KERNELS_CUDA_COMPUTE_KERNELS_H_
