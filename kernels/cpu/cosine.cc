// Query cosine (FreeKV's correction signal) on the CPU.
#include <cmath>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kvtier/layout.h"

namespace kvtier {

absl::Status CpuQueryCosine(const QueryCosineArgs& a, ThreadPool* pool) {
  const int32_t d = a.shape.head_dim, G = a.shape.num_q_heads / a.shape.num_kv_heads;
  const HeadsLayout ql{a.shape.num_q_heads, d};
  return cpu::DispatchDType(a.shape.dtype, [&]<typename T>() {
    const T* q = static_cast<const T*>(a.q);
    const T* qp = static_cast<const T*>(a.q_prev);
    ParallelFor(pool, int64_t{a.batch} * a.shape.num_kv_heads, 8, [&](int64_t begin, int64_t end) {
      std::vector<float> x(static_cast<size_t>(d)), y(static_cast<size_t>(d));
      for (int64_t i = begin; i < end; ++i) {
        const auto b = static_cast<int32_t>(i / a.shape.num_kv_heads);
        const auto h = static_cast<int32_t>(i % a.shape.num_kv_heads);
        double sum = 0;
        for (int32_t g = 0; g < G; ++g) {
          const int32_t hq = h * G + g;
          cpu::LoadRow(q + ql.Offset(b, hq, 0), d, x.data());
          cpu::LoadRow(qp + ql.Offset(b, hq, 0), d, y.data());
          const float nx = cpu::Dot(x.data(), x.data(), d);
          const float ny = cpu::Dot(y.data(), y.data(), d);
          const float c = (nx > 0 && ny > 0)
                              ? cpu::Dot(x.data(), y.data(), d) / (std::sqrt(nx) * std::sqrt(ny))
                              : 0.0f;
          if (a.cosine != nullptr) a.cosine[int64_t{b} * a.shape.num_q_heads + hq] = c;
          sum += c;
        }
        const float mean = static_cast<float>(sum / G);
        a.group_mean[i] = mean;
        if (a.drifted != nullptr) a.drifted[i] = mean < a.threshold ? 1 : 0;
      }
    });
    return absl::OkStatus();
  });
}

}  // namespace kvtier
