// The vectorised page scoring (score_simd.cc), run by CpuScorePages (score.cc) for
// cpu::Isa::kAvx2 and kAvx512.
#ifndef KVTIER_KERNELS_CPU_SCORE_SIMD_H_
#define KVTIER_KERNELS_CPU_SCORE_SIMD_H_

#include <cstdint>

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

// Key codes (ScorePagesArgs::codes): the dots of one (page, KV head)'s `ps` tokens with G
// query heads' weights w[G][d], dots[g·ps + t] = Σ_i w[g·d + i]·(code(t, i) + 0.5), from the
// page's rows of KeyCodeLayout bytes — the same bits as score.cc's scalar loop (each sum in
// dimension order, each product rounded before it is added). `isa` kAvx2 or kAvx512,
// supported by this CPU; REQUIRES d % 8 == 0.
void KeyCodeDotsSimd(const uint8_t* rows, int32_t G, int32_t d, int32_t ps, const float* w,
                     float* dots, Isa isa);

}  // namespace cpu
}  // namespace kvtier

#endif  // KVTIER_KERNELS_CPU_SCORE_SIMD_H_
