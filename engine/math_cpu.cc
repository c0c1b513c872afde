// The CPU Math (math.h): matrices on OpenBLAS's sgemm, prefill attention as two sgemms per
// query head with a causal softmax in between, the rest in plain loops.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include <cblas.h>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "engine/math.h"
#include "kvtier/dtype.h"

namespace kvtier::engine {
namespace {

class CpuMath final : public Math {
 public:
  CpuMath(Device& device, Stream& stream, int threads) : device_(device), stream_(stream) {
    if (threads > 0) openblas_set_num_threads(threads);
  }

  Device& device() override { return device_; }
  absl::Status Fence() override { return stream_.Synchronize(); }

  absl::Status MatMul(const float* x, const float* w, const float* bias, float* y, int64_t m,
                      int64_t n, int64_t k) override {
    if (m <= kRowsForLoops) {
      // Decode: row dot products on this thread. OpenBLAS's threads would spin between
      // the many small calls of a step and take the core kvtier's stream workers need.
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          y[i * n + j] = Dot(x + i * k, w + j * k, static_cast<int32_t>(k));
        }
      }
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m),
                  static_cast<int>(n), static_cast<int>(k), 1.0f, x, static_cast<int>(k), w,
                  static_cast<int>(k), 0.0f, y, static_cast<int>(n));
    }
    if (bias != nullptr) {
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) y[i * n + j] += bias[j];
      }
    }
    return absl::OkStatus();
  }

  absl::Status RmsNorm(const float* x, const float* weight, float* y, int64_t m, int64_t d,
                       float eps) override {
    for (int64_t i = 0; i < m; ++i) {
      const float* row = x + i * d;
      double ss = 0;
      for (int64_t j = 0; j < d; ++j) ss += static_cast<double>(row[j]) * row[j];
      const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(d)) + eps);
      for (int64_t j = 0; j < d; ++j) y[i * d + j] = row[j] * inv * weight[j];
    }
    return absl::OkStatus();
  }

  absl::Status Rope(const RopeArgs& a) override {
    const int32_t half = a.rot_dim / 2;
    for (int64_t i = 0; i < a.m; ++i) {
      const double pos = a.positions[i];
      for (int32_t p = 0; p < half; ++p) {
        const double angle = pos * a.inv_freq[p];
        const float c = static_cast<float>(std::cos(angle));
        const float s = static_cast<float>(std::sin(angle));
        for (int32_t h = 0; h < a.heads; ++h) {
          float* row = a.x + (i * a.heads + h) * a.head_dim;
          const int32_t i0 = a.neox ? p : 2 * p;
          const int32_t i1 = a.neox ? p + half : 2 * p + 1;
          const float x0 = row[i0];
          const float x1 = row[i1];
          row[i0] = x0 * c - x1 * s;
          row[i1] = x0 * s + x1 * c;
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status SiluMul(float* gate, const float* up, int64_t count) override {
    for (int64_t i = 0; i < count; ++i) {
      const float g = gate[i];
      gate[i] = g / (1.0f + std::exp(-g)) * up[i];
    }
    return absl::OkStatus();
  }

  absl::Status Add(float* y, const float* x, int64_t count) override {
    for (int64_t i = 0; i < count; ++i) y[i] += x[i];
    return absl::OkStatus();
  }

  absl::Status Copy(float* y, const float* x, int64_t count) override {
    if (count > 0) std::memmove(y, x, count * sizeof(float));
    return absl::OkStatus();
  }

  absl::Status RowDistance(const float* a, const float* b, float* out, int64_t m, int64_t d,
                           int64_t out_stride) override {
    for (int64_t i = 0; i < m; ++i) {
      double ss = 0;
      for (int64_t j = 0; j < d; ++j) {
        const double x = static_cast<double>(a[i * d + j]) - b[i * d + j];
        ss += x * x;
      }
      out[i * out_stride] = static_cast<float>(std::sqrt(ss));
    }
    return absl::OkStatus();
  }

  absl::Status Embed(const int32_t* ids, const float* table, float* y, int64_t m,
                     int64_t d) override {
    for (int64_t i = 0; i < m; ++i) {
      std::memcpy(y + i * d, table + static_cast<int64_t>(ids[i]) * d, d * sizeof(float));
    }
    return absl::OkStatus();
  }

  absl::Status CausalAttention(const CausalAttentionArgs& a) override {
    if (a.m <= kRowsForLoops) return CausalAttentionRows(a);
    const int64_t n = a.first_pos + a.m;
    const int32_t group = a.q_heads / a.kv_heads;
    const int qs = a.q_heads * a.head_dim;   // row stride of q and out
    const int kvs = a.kv_heads * a.head_dim;  // row stride of k and v
    scores_.resize(static_cast<size_t>(a.m * n));
    for (int32_t h = 0; h < a.q_heads; ++h) {
      const int32_t kvh = h / group;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(a.m),
                  static_cast<int>(n), a.head_dim, a.scale, a.q + h * a.head_dim, qs,
                  a.k + kvh * a.head_dim, kvs, 0.0f, scores_.data(), static_cast<int>(n));
      for (int64_t i = 0; i < a.m; ++i) {
        float* row = scores_.data() + i * n;
        const int64_t visible = a.first_pos + i + 1;
        Softmax(row, visible);
        std::fill(row + visible, row + n, 0.0f);
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(a.m), a.head_dim,
                  static_cast<int>(n), 1.0f, scores_.data(), static_cast<int>(n),
                  a.v + kvh * a.head_dim, kvs, 0.0f, a.out + h * a.head_dim, qs);
    }
    return absl::OkStatus();
  }

  absl::Status ToDType(const float* x, void* y, DType dtype, int64_t count) override {
    switch (dtype) {
      case DType::kF32:
        std::memcpy(y, x, count * sizeof(float));
        break;
      case DType::kF16:
        for (int64_t i = 0; i < count; ++i) static_cast<Half*>(y)[i] = FloatToHalf(x[i]);
        break;
      case DType::kBF16:
        for (int64_t i = 0; i < count; ++i) static_cast<BFloat16*>(y)[i] = FloatToBFloat16(x[i]);
        break;
    }
    return absl::OkStatus();
  }

  absl::Status FromDType(const void* x, DType dtype, float* y, int64_t count) override {
    switch (dtype) {
      case DType::kF32:
        std::memcpy(y, x, count * sizeof(float));
        break;
      case DType::kF16:
        for (int64_t i = 0; i < count; ++i) y[i] = HalfToFloat(static_cast<const Half*>(x)[i]);
        break;
      case DType::kBF16:
        for (int64_t i = 0; i < count; ++i) {
          y[i] = BFloat16ToFloat(static_cast<const BFloat16*>(x)[i]);
        }
        break;
    }
    return absl::OkStatus();
  }

 private:
  // Decode-sized calls (a row or two): BLAS's blocking and threads cost more than they save.
  static constexpr int64_t kRowsForLoops = 2;

  // The KV heads split over two threads (the CPU backend's attention uses its pool too, so
  // the dense baseline is not held to one core).
  absl::Status CausalAttentionRows(const CausalAttentionArgs& a) {
    const int64_t n = a.first_pos + a.m;
    const int32_t group = a.q_heads / a.kv_heads;
    rows_scores_[0].resize(static_cast<size_t>(group * n));
    rows_scores_[1].resize(static_cast<size_t>(group * n));
    const int32_t half = a.kv_heads / 2;
    if (half == 0 || n < 256) {
      AttendRows(a, 0, a.kv_heads, rows_scores_[0].data());
      return absl::OkStatus();
    }
    std::thread other([&] { AttendRows(a, half, a.kv_heads, rows_scores_[1].data()); });
    AttendRows(a, 0, half, rows_scores_[0].data());
    other.join();
    return absl::OkStatus();
  }

  // KV heads [kv_begin, kv_end) of the rows of `a`, with `scores` [group][n] as scratch.
  static void AttendRows(const CausalAttentionArgs& a, int32_t kv_begin, int32_t kv_end,
                         float* scores) {
    const int32_t group = a.q_heads / a.kv_heads;
    const int64_t qs = int64_t{a.q_heads} * a.head_dim;
    const int64_t kvs = int64_t{a.kv_heads} * a.head_dim;
    const int32_t d = a.head_dim;
    const int64_t n = a.first_pos + a.m;
    for (int64_t i = 0; i < a.m; ++i) {
      const int64_t visible = a.first_pos + i + 1;
      // The query heads of one KV head together, so each key and value row is read once.
      for (int32_t kvh = kv_begin; kvh < kv_end; ++kvh) {
        const float* q = a.q + i * qs + int64_t{kvh} * group * d;
        const float* k = a.k + int64_t{kvh} * d;
        const float* v = a.v + int64_t{kvh} * d;
        for (int64_t j = 0; j < visible; ++j) {
          for (int32_t g = 0; g < group; ++g) {
            scores[g * n + j] = Dot(q + g * d, k + j * kvs, d) * a.scale;
          }
        }
        for (int32_t g = 0; g < group; ++g) Softmax(scores + g * n, visible);
        float* out = a.out + i * qs + int64_t{kvh} * group * d;
        std::fill(out, out + int64_t{group} * d, 0.0f);
        for (int64_t j = 0; j < visible; ++j) {
          const float* vj = v + j * kvs;
          for (int32_t g = 0; g < group; ++g) {
            const float p = scores[g * n + j];
            float* o = out + g * d;
            for (int32_t c = 0; c < d; ++c) o[c] += p * vj[c];
          }
        }
      }
    }
  }

  // row[0, n) = softmax(row[0, n)), in place.
  static void Softmax(float* row, int64_t n) {
    const float mx = *std::max_element(row, row + n);
    float sum = 0;
    for (int64_t j = 0; j < n; ++j) {
      row[j] = std::exp(row[j] - mx);
      sum += row[j];
    }
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < n; ++j) row[j] *= inv;
  }

  // A dot product in eight independent partial sums (vectorises without reassociation).
  static float Dot(const float* a, const float* b, int32_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int32_t c = 0;
    for (; c + 8 <= n; c += 8) {
      for (int32_t l = 0; l < 8; ++l) acc[l] += a[c + l] * b[c + l];
    }
    float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; c < n; ++c) sum += a[c] * b[c];
    return sum;
  }

  Device& device_;
  Stream& stream_;
  std::vector<float> scores_;
  std::vector<float> rows_scores_[2];
};

}  // namespace

std::unique_ptr<Math> NewCpuMath(Device& device, Stream& stream, int threads) {
  return std::make_unique<CpuMath>(device, stream, threads);
}

absl::StatusOr<std::unique_ptr<Math>> CreateMath(Device& device, Stream& stream, int threads) {
  switch (device.kind()) {
    case DeviceKind::kCpu:
      return NewCpuMath(device, stream, threads);
    case DeviceKind::kCuda:
      return NewCudaMath(device, stream);
    case DeviceKind::kAuto:
      break;
  }
  return absl::InvalidArgumentError("CreateMath: the device has no kind");
}

}  // namespace kvtier::engine
