// The vectorised page scoring (score_simd.cc), run by CpuScorePages (score.cc) for
// cpu::Isa::kAvx2 and kAvx512.
#ifndef KVTIER_KERNELS_CPU_SCORE_SIMD_H_
#define KVTIER_KERNELS_CPU_SCORE_SIMD_H_

#include "kernels/cpu/isa.h"
#include "kernels/ops.h"

namespace kvtier {

class ThreadPool;

namespace cpu {

// ScorePages with the kernel of `isa`, which must be kAvx2 or kAvx512, supported by this
// CPU (IsaSupported), and kAvx512 only when head_dim % 16 == 0; num_pages must have been
// range-checked. Results agree with the scalar reference to float rounding. Keeps its
// scratch (queries and raw scores, [B][Hq][d + P] floats) in buffers of the calling thread
// and of the pool's threads, reused by later calls.
void ScorePagesSimd(const ScorePagesArgs& a, ThreadPool* pool, Isa isa);

}  // namespace cpu
}  // namespace kvtier

#endif  // KVTIER_KERNELS_CPU_SCORE_SIMD_H_
