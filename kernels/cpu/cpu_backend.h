// Factory of the CPU backend: host memory plays device memory; each Stream is an ordered
// work queue on its own thread; ops split their work over a shared thread pool. It is the
// reference every CUDA kernel is tested against and the product path for remote sessions
// and machines without a GPU.
#ifndef KVTIER_KERNELS_CPU_CPU_BACKEND_H_
#define KVTIER_KERNELS_CPU_CPU_BACKEND_H_

#include <memory>

#include "kernels/backend.h"

namespace kvtier {

// `num_threads` ≤ 0 means std::thread::hardware_concurrency().
std::unique_ptr<Backend> NewCpuBackend(int num_threads = 0);

}  // namespace kvtier

#endif  // KVTIER_KERNELS_CPU_CPU_BACKEND_H_
