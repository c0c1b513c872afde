#include "kernels/cpu/isa.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "kernels/cpu/simd.h"

namespace kvtier::cpu {

std::string_view IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "scalar";
}

Isa DetectedIsa() {
  static const Isa detected = [] {
#if KVTIER_CPU_SIMD
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (avx512) return Isa::kAvx512;
    if (avx2) return Isa::kAvx2;
#endif
    return Isa::kScalar;
  }();
  return detected;
}

Isa ActiveIsa() {
  static const Isa active = [] {
    Isa cap = Isa::kAvx512;
    if (const char* env = std::getenv("KVTIER_CPU_ISA"); env != nullptr && *env != '\0') {
      const std::string v(env);
      if (v == "scalar" || v == "reference") {
        cap = Isa::kScalar;
      } else if (v == "avx2") {
        cap = Isa::kAvx2;
      } else if (v == "avx512") {
        cap = Isa::kAvx512;
      } else {
        std::fprintf(stderr,
                     "kvtier: KVTIER_CPU_ISA=%s is not one of scalar, avx2, avx512: ignored\n",
                     env);
      }
    }
    const Isa best = DetectedIsa();
    return static_cast<int>(cap) < static_cast<int>(best) ? cap : best;
  }();
  return active;
}

Isa RunnableIsa(Isa isa, int32_t head_dim) {
  if (!IsaSupported(isa)) isa = DetectedIsa();
  if (isa == Isa::kAvx512 && head_dim % 16 != 0) isa = Isa::kAvx2;
  return isa;
}

}  // namespace kvtier::cpu
