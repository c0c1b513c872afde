// Factory of the CPU backend: host memory plays device memory; each Stream is an ordered
// work queue on its own thread; ops split their work over a shared thread pool. It is the
// reference every CUDA kernel is tested against and the product path for remote sessions
// and machines without a GPU.
#ifndef KVTIER_KERNELS_CPU_CPU_BACKEND_H_
#define KVTIER_KERNELS_CPU_CPU_BACKEND_H_

#include <memory>

#include "kernels/backend.h"
#include "kernels/cpu/isa.h"

namespace kvtier {

// `num_threads` ≤ 0 means std::thread::hardware_concurrency().
std::unique_ptr<Backend> NewCpuBackend(int num_threads = 0);
// As above, with the ops that have kernels per instruction set (ScorePages, TopK,
// SparseAttention, DenseAttention; kernels/cpu/cpu_ops.h) running `isa` (or the widest
// narrower one that runs here) instead of cpu::ActiveIsa(): so that one process can time
// the scalar reference and the vectorised kernels side by side (`kvtier-bench ops`).
std::unique_ptr<Backend> NewCpuBackend(int num_threads, cpu::Isa isa);

}  // namespace kvtier

#endif  // KVTIER_KERNELS_CPU_CPU_BACKEND_H_
