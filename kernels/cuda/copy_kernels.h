// Launchers of the CUDA copy kernels: recall (HND host pages → NHD working set) in
// recall.cu, its two halves gather/scatter slabs (through a staging buffer) in slabs.cu,
// and offload (NHD → HND plus key summaries) in offload.cu.
//
// Framework-free: the op arguments of kernels/ops.h, whose pointers must
// already be device-accessible (device memory, or the device view of registered host
// memory), an error sink (device_error.h) and a stream. The launchers never allocate and
// never synchronise. Items out of range are skipped and reported through `sink`. Each
// returns the launch's cudaError_t, which the caller converts to a Status.
#ifndef KVTIER_KERNELS_CUDA_COPY_KERNELS_H_
#define KVTIER_KERNELS_CUDA_COPY_KERNELS_H_

#include <cuda_runtime_api.h>

#include "kernels/cuda/device_error.h"
#include "kernels/ops.h"

namespace kvtier::cuda {

// REQUIRES: ValidateArgs(a) is OK and a.num_items > 0.
cudaError_t LaunchRecall(const RecallArgs& a, const DeviceErrorSink& sink, cudaStream_t stream);

// The two halves of recall (slabs.cu). REQUIRES: ValidateArgs(a) is OK and a.num_items > 0.
cudaError_t LaunchGatherSlabs(const GatherSlabsArgs& a, const DeviceErrorSink& sink,
                              cudaStream_t stream);
cudaError_t LaunchScatterSlabs(const ScatterSlabsArgs& a, const DeviceErrorSink& sink,
                               cudaStream_t stream);

// REQUIRES: ValidateArgs(a) is OK and a.num_items > 0. Items must name distinct host and
// summary pages (as on the CPU, overlapping writes race).
cudaError_t LaunchOffload(const OffloadArgs& a, const DeviceErrorSink& sink, cudaStream_t stream);

}  // namespace kvtier::cuda

#endif  // KVTIER_KERNELS_CUDA_COPY_KERNELS_H_
