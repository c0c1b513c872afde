// Which vector instruction set the CPU kernels use: chosen once at run time from what the
// CPU supports (cpuid) and what the build compiled, and capped by KVTIER_CPU_ISA
// (scalar | avx2 | avx512), read once. `scalar` selects the reference kernels: the
// portable loops every vectorised kernel is tested against, kept reachable so the old
// speed can be measured next to the new one in the same run.
#ifndef KVTIER_KERNELS_CPU_ISA_H_
#define KVTIER_KERNELS_CPU_ISA_H_

#include <cstdint>
#include <string_view>

namespace kvtier::cpu {

enum class Isa {
  kScalar = 0,  // the reference loops (auto-vectorised where GCC manages)
  kAvx2 = 1,    // AVX2 + FMA + F16C, 8 fp32 lanes
  kAvx512 = 2,  // AVX-512 F/BW/VL/DQ + F16C, 16 fp32 lanes
};

std::string_view IsaName(Isa isa);

// The widest ISA this CPU and this build support.
Isa DetectedIsa();

// DetectedIsa() capped by KVTIER_CPU_ISA (an unknown value is ignored with a warning on
// stderr, once). The ops of cpu_ops.h run with this.
Isa ActiveIsa();

// True when `isa` can run here (≤ DetectedIsa()).
inline bool IsaSupported(Isa isa) { return static_cast<int>(isa) <= static_cast<int>(DetectedIsa()); }

// The kernel an op runs when asked for `isa`: `isa` where the CPU has it, else the widest it
// has; AVX-512 (16 fp32 lanes) only when head_dim is a multiple of 16, else AVX2 (head_dim is
// always a multiple of 8). head_dim 0: an op without a vector width constraint.
Isa RunnableIsa(Isa isa, int32_t head_dim = 0);

}  // namespace kvtier::cpu

#endif  // KVTIER_KERNELS_CPU_ISA_H_
