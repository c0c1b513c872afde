// Launchers of the CUDA arithmetic kernels: selection (select.cu: page scoring with group
// pooling, top-k, query cosine and drift flags, page-cache replacement; selection_loss.cu:
// the mass correction trigger), attention
// (attention.cu: sparse paged decode attention over per-KV-head slot tables, dense decode
// attention) and the policy ops (policy_ops.cu: INT8 quantisation of head-slots, head-slot
// moves).
//
// Framework-free, as copy_kernels.h: the op arguments of kernels/ops.h, whose
// pointers must already be device-accessible (device memory, or the device view of
// registered host memory), an error sink (device_error.h) for data-dependent errors (an
// index out of range: the item is skipped and the first such error is reported) and a
// stream. The launchers never allocate and never synchronise; each returns the launch's
// cudaError_t. The semantics, tie-breaking included, are the CPU reference's
// (kernels/cpu/), which the GPU tests compare against.
#ifndef KVTIER_KERNELS_CUDA_COMPUTE_KERNELS_H_
#define KVTIER_KERNELS_CUDA_COMPUTE_KERNELS_H_

#include <cuda_runtime_api.h>

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

// attention.cu. REQUIRES: ValidateArgs(a) is OK.
cudaError_t LaunchSparseAttention(const SparseAttentionArgs& a, const DeviceErrorSink& sink,
                                  cudaStream_t stream);
cudaError_t LaunchDenseAttention(const DenseAttentionArgs& a, const DeviceErrorSink& sink,
                                 cudaStream_t stream);

// policy_ops.cu. REQUIRES: ValidateArgs(a) is OK and a.num_items > 0.
cudaError_t LaunchQuantizeSlots(const QuantizeSlotsArgs& a, const DeviceErrorSink& sink,
                                cudaStream_t stream);
cudaError_t LaunchMoveHeadSlots(const MoveHeadSlotsArgs& a, const DeviceErrorSink& sink,
                                cudaStream_t stream);

}  // namespace kvtier::cuda

#endif  // KVTIER_KERNELS_CUDA_COMPUTE_KERNELS_H_
