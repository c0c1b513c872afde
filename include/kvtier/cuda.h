// The CUDA face of kvtier/device.h, for an engine that runs its own CUDA work beside kvtier's
// (cuBLAS, its own kernels, PyTorch): the native stream of a kvtier stream, a kvtier stream
// over the engine's native stream, and the ordinal of a kvtier CUDA device. This is the only
// native handle kvtier hands out; the compute ops and their kernels stay internal (as ggml
// keeps ggml-cuda.h beside ggml-backend.h).
//
// The header needs no CUDA header: it declares cudaStream_t exactly as the CUDA runtime's
// driver_types.h does (a pointer to the opaque struct CUstream_st), and C++ allows that
// typedef to be repeated, so it may be included before or after cuda_runtime.h, and by
// translation units that never see the toolkit.
//
// Built without CUDA, every function here returns UNIMPLEMENTED. Thread-safety: as
// kvtier/device.h (a Stream is used by one thread at a time, adopted ones included).
#ifndef KVTIER_CUDA_H_
#define KVTIER_CUDA_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kvtier/device.h"

// As the CUDA runtime declares it (driver_types.h).
typedef struct CUstream_st* cudaStream_t;

namespace kvtier {

// The cudaStream_t on which `stream` runs its work: every operation kvtier enqueues on
// `stream` (copies, memsets, its kernels, Record and Wait) is ordered on it, so work the
// engine enqueues there runs after what kvtier enqueued before and before what it enqueues
// after. The handle is kvtier's (or the engine's, for an adopted stream): valid while
// `stream` lives; never destroy it. INVALID_ARGUMENT when `stream` is not a stream of a
// kvtier CUDA device (a cpu stream, say).
absl::StatusOr<cudaStream_t> NativeCudaStream(Stream& stream);

// A kvtier Stream over the engine's `native` stream: kvtier enqueues its work on `native` in
// the engine's order, with the Stream semantics of kvtier/device.h (sticky errors, events,
// capture), so the Stream can be SequenceOptions::compute_stream. The Stream does not own
// `native`: its destructor waits for the work enqueued on `native` (the engine's too), then
// leaves it alive. The stream keeps the priority it was created with: background recall on
// kvtier's low-priority streams yields to it only if it was created above the least
// priority (Device::CreateStream's normal streams are). REQUIRES: `native` outlives the
// returned Stream and belongs to `device`'s GPU. INVALID_ARGUMENT when `device` is not a
// kvtier CUDA device (CreateDevice), when `native` is a default stream (0, cudaStreamLegacy,
// cudaStreamPerThread: create one, e.g. with cudaStreamCreateWithFlags) or belongs to
// another GPU; another CUDA failure as its status.
absl::StatusOr<std::unique_ptr<Stream>> AdoptCudaStream(Device& device, cudaStream_t native);

// The CUDA device ordinal of `device` (what cudaSetDevice takes). INVALID_ARGUMENT when
// `device` is not a kvtier CUDA device.
absl::StatusOr<int> CudaDeviceOrdinal(Device& device);

}  // namespace kvtier

#endif  // KVTIER_CUDA_H_
