// The CPU implementations of the backend ops, callable directly (synchronously) as the
// reference the CUDA kernels are tested against. Each returns INVALID_ARGUMENT or
// OUT_OF_RANGE for data-dependent errors (an index out of range) and writes nothing
// useful then. `pool` splits the work; it may be null (run on the calling thread).
// Thread-safe: no shared state beyond the arguments.
#ifndef KVTIER_KERNELS_CPU_CPU_OPS_H_
#define KVTIER_KERNELS_CPU_CPU_OPS_H_

#include "absl/status/status.h"
#include "kernels/cpu/isa.h"
#include "kernels/ops.h"

namespace kvtier {

class ThreadPool;

absl::Status CpuScorePages(const ScorePagesArgs& a, ThreadPool* pool);
absl::Status CpuTopK(const TopKArgs& a, ThreadPool* pool);
absl::Status CpuQueryCosine(const QueryCosineArgs& a, ThreadPool* pool);
absl::Status CpuSelectionLoss(const SelectionLossArgs& a, ThreadPool* pool);
absl::Status CpuRecall(const RecallArgs& a, ThreadPool* pool);
absl::Status CpuGatherSlabs(const GatherSlabsArgs& a, ThreadPool* pool);
absl::Status CpuScatterSlabs(const ScatterSlabsArgs& a, ThreadPool* pool);
absl::Status CpuReplace(const ReplaceArgs& a, ThreadPool* pool);
absl::Status CpuOffload(const OffloadArgs& a, ThreadPool* pool);
absl::Status CpuSparseAttention(const SparseAttentionArgs& a, ThreadPool* pool);
absl::Status CpuDenseAttention(const DenseAttentionArgs& a, ThreadPool* pool);
absl::Status CpuMoveHeadSlots(const MoveHeadSlotsArgs& a, ThreadPool* pool);

// The hot ops with the instruction set named: cpu::Isa::kScalar runs the scalar reference
// (the loops every vectorised kernel is tested against, and the old speed the benchmarks
// compare with); a wider ISA runs the vectorised kernel, or the widest narrower one where
// the CPU lacks it or the shape does not suit it (AVX-512 needs head_dim % 16 == 0). The
// overloads above run cpu::ActiveIsa(). Same contract and errors for every ISA; results
// agree to float rounding (TopK: exactly).
absl::Status CpuScorePages(const ScorePagesArgs& a, ThreadPool* pool, cpu::Isa isa);
absl::Status CpuTopK(const TopKArgs& a, ThreadPool* pool, cpu::Isa isa);
absl::Status CpuSparseAttention(const SparseAttentionArgs& a, ThreadPool* pool, cpu::Isa isa);
absl::Status CpuDenseAttention(const DenseAttentionArgs& a, ThreadPool* pool, cpu::Isa isa);

}  // namespace kvtier

#endif  // KVTIER_KERNELS_CPU_CPU_OPS_H_
