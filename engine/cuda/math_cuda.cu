// The CUDA Math (engine/math.h): the decoder's arithmetic on the sequences' compute stream.
// Matrices go to cuBLAS (fp32 sgemm, bound to that stream); everything else is a small
// kernel here. Semantics are the CPU Math's (math_cpu.cc), which is the reference:
//   - MatMul: one cublasSgemm (row-major y = x · wᵀ is column-major yᵀ = w · xᵀ, so w is
//     passed transposed and x as is), then a bias kernel. The handle's math mode is
//     CUBLAS_DEFAULT_MATH, so no TF32: results agree with OpenBLAS to fp32 rounding.
//   - RowDistance: one block per row, the sum of squares in double as the CPU.
//   - RmsNorm: one block per row; the sum of squares in double, as the CPU, then the same
//     float expression for the scale.
//   - Rope: one thread per (row, pair), angle and sin/cos in double as the CPU, the rotation
//     with explicitly rounded products (no FMA contraction) so it matches the CPU bit for bit
//     whenever the two libraries' sin/cos round to the same float.
//   - SiluMul, Add, Embed and the conversions: grid-stride elementwise kernels. Conversions
//     use kvtier/dtype.h's host/device FloatToHalf / FloatToBFloat16 (round to nearest even),
//     the functions the CPU Math and kvtier's kernels use, so the bit patterns are
//     identical, NaN payloads included (cuda_fp16's intrinsics canonicalise NaNs).
//   - CausalAttention: one block per (query row, query head); each warp runs an online
//     softmax over every kWarps-th visible key (kKeysPerStep keys at a time, for memory-level
//     parallelism), lanes owning head dims lane, lane + 32, ...; the warps' (max, sum, acc)
//     merge through shared memory in a fixed order, so results are deterministic. No global
//     scratch, no limit on the context length; head_dim ≤ kMaxHeadDim.
//
// Nothing here allocates or synchronises once the Math exists: cuBLAS gets a workspace of
// kCublasWorkspaceBytes allocated at creation (cublasSetWorkspace), so sgemm never falls
// back to cuBLAS's own pool, and every op is a launch on the stream. Every call makes the
// stream's device current for its duration (and restores the caller's), as the backend
// does, and checks its launch (cudaGetLastError) into a Status naming the op.
//
// kvtier is seen through its public headers only, as an engine outside the tree sees it: the
// stream's native handle and the device's ordinal come from kvtier/cuda.h, and the CUDA error
// conversion and the current-device guard below are the engine's own.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "core/status.h"
#include "engine/math.h"
#include "kvtier/cuda.h"
#include "kvtier/device.h"
#include "kvtier/dtype.h"

namespace kvtier::engine {
namespace {

constexpr int kThreads = 256;    // elementwise and RmsNorm blocks
constexpr int kBlocksPerSm = 8;  // grid-stride kernels: enough resident blocks
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kAttnWarps = 8;  // warps per attention block
constexpr int kMaxHeadDim = 256;
constexpr int kMaxLaneDims = kMaxHeadDim / kWarpSize;  // head dims per lane
constexpr int kKeysPerStep = 4;
// cuBLAS's recommended workspace on Hopper (4 MiB suffices before it); one per Math.
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

// ---- Errors and the current device ----------------------------------------------------------
// The engine's own, as any engine outside kvtier has them: kvtier's conversion is internal.

// OK for cudaSuccess, else a status naming `call` with CUDA's name and text: out of memory
// is RESOURCE_EXHAUSTED, an invalid value INVALID_ARGUMENT, anything else INTERNAL. Clears
// the thread's last error, so the next launch check does not report it again.
absl::Status CudaStatus(cudaError_t err, absl::string_view call) {
  if (err == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();
  absl::StatusCode code = absl::StatusCode::kInternal;
  if (err == cudaErrorMemoryAllocation) code = absl::StatusCode::kResourceExhausted;
  if (err == cudaErrorInvalidValue) code = absl::StatusCode::kInvalidArgument;
  return absl::Status(
      code, absl::StrFormat("%s: %s (%s)", call, cudaGetErrorName(err), cudaGetErrorString(err)));
}

// Makes `ordinal` current on the calling thread for its lifetime and restores the caller's
// device afterwards (engine threads keep the device they had). Check status() first.
class ScopedDevice {
 public:
  explicit ScopedDevice(int ordinal) : status_(MakeCurrent(ordinal, &previous_)) {}
  ~ScopedDevice() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

  const absl::Status& status() const { return status_; }

 private:
  // Makes `ordinal` current; sets *previous to the device to restore when it changed one.
  static absl::Status MakeCurrent(int ordinal, int* previous) {
    int current = -1;
    KVTIER_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&current), "cudaGetDevice"));
    if (current == ordinal) return absl::OkStatus();
    KVTIER_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice"));
    *previous = current;
    return absl::OkStatus();
  }

  int previous_ = -1;  // -1: nothing to restore
  absl::Status status_;
};

// OK for CUBLAS_STATUS_SUCCESS, else a status naming `call` with cuBLAS's name and text.
absl::Status CublasStatus(cublasStatus_t s, absl::string_view call) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  absl::StatusCode code = absl::StatusCode::kInternal;
  switch (s) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      code = absl::StatusCode::kResourceExhausted;
      break;
    case CUBLAS_STATUS_NOT_INITIALIZED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
      code = absl::StatusCode::kUnavailable;
      break;
    case CUBLAS_STATUS_INVALID_VALUE:
      code = absl::StatusCode::kInvalidArgument;
      break;
    default:  // execution failures, internal errors: faults
      break;
  }
  return absl::Status(
      code, absl::StrFormat("%s: %s (%s)", call, cublasGetStatusName(s), cublasGetStatusString(s)));
}

// The launch just made, as a Status naming the op.
absl::Status LaunchStatus(absl::string_view op) {
  return CudaStatus(cudaGetLastError(), absl::StrFormat("%s kernel launch", op));
}

// ---- Kernels ------------------------------------------------------------------------------

__global__ void AddBiasKernel(float* y, const float* bias, int64_t m, int64_t n) {
  const int64_t total = m * n;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    y[i] += bias[i % n];
  }
}

// One block per row. In place when y == x: each thread writes only the elements it read.
__global__ void RmsNormKernel(const float* x, const float* weight, float* y, int64_t d, float eps) {
  __shared__ double warp_sums[kThreads / kWarpSize];
  __shared__ float inv_shared;
  const float* row = x + blockIdx.x * d;
  float* out = y + blockIdx.x * d;
  double ss = 0;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    const float v = row[j];
    ss += static_cast<double>(v) * v;
  }
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    ss += __shfl_xor_sync(kFullMask, ss, offset);
  }
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (lane == 0) warp_sums[warp] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x) / kWarpSize; ++w) total += warp_sums[w];
    // The CPU's expression: 1 / sqrt(float(mean) + eps), all in float after the mean.
    inv_shared = 1.0f / sqrtf(static_cast<float>(total / static_cast<double>(d)) + eps);
  }
  __syncthreads();
  const float inv = inv_shared;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) out[j] = row[j] * inv * weight[j];
}

// One block per row: ‖a − b‖ with the sum of squares in double, as the CPU.
__global__ void RowDistanceKernel(const float* a, const float* b, float* out, int64_t d,
                                  int64_t out_stride) {
  __shared__ double warp_sums[kThreads / kWarpSize];
  const float* ra = a + blockIdx.x * d;
  const float* rb = b + blockIdx.x * d;
  double ss = 0;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    const double x = static_cast<double>(ra[j]) - rb[j];
    ss += x * x;
  }
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    ss += __shfl_xor_sync(kFullMask, ss, offset);
  }
  if (threadIdx.x % kWarpSize == 0) warp_sums[threadIdx.x / kWarpSize] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x) / kWarpSize; ++w) total += warp_sums[w];
    out[blockIdx.x * out_stride] = static_cast<float>(sqrt(total));
  }
}

// One thread per (row, pair): the angle's sin/cos once, applied to every head.
__global__ void RopeKernel(RopeArgs a) {
  const int32_t half = a.rot_dim / 2;
  const int64_t total = a.m * half;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total;
       t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = t / half;
    const int32_t p = static_cast<int32_t>(t % half);
    const double angle = static_cast<double>(a.positions[i]) * a.inv_freq[p];
    double sd;
    double cd;
    sincos(angle, &sd, &cd);
    const float c = static_cast<float>(cd);
    const float s = static_cast<float>(sd);
    const int32_t i0 = a.neox ? p : 2 * p;
    const int32_t i1 = a.neox ? p + half : 2 * p + 1;
    for (int32_t h = 0; h < a.heads; ++h) {
      float* row = a.x + (i * a.heads + h) * a.head_dim;
      const float x0 = row[i0];
      const float x1 = row[i1];
      // Rounded products, as the CPU's (no contraction into an FMA).
      row[i0] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
      row[i1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    }
  }
}

__global__ void SiluMulKernel(float* gate, const float* up, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float g = gate[i];
    gate[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

__global__ void AddKernel(float* y, const float* x, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    y[i] += x[i];
  }
}

__global__ void EmbedKernel(const int32_t* ids, const float* table, float* y, int64_t m,
                            int64_t d) {
  const int64_t total = m * d;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total;
       t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = t / d;
    y[t] = table[static_cast<int64_t>(ids[i]) * d + (t - i * d)];
  }
}

template <typename T>
__global__ void ToDTypeKernel(const float* x, T* y, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    y[i] = FromFloat<T>(x[i]);
  }
}

template <typename T>
__global__ void FromDTypeKernel(const T* x, float* y, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    y[i] = ToFloat(x[i]);
  }
}

// Grid (m, q_heads), kAttnWarps warps. Warp w takes keys w, w + kAttnWarps, ... of the
// row's visible prefix, kKeysPerStep of them per step (loads first, then the dot products'
// butterflies interleaved), and keeps an online softmax: its max, its sum of exp(s − max)
// and, per lane, the exp-weighted sums of V over the head dims it owns. Scores are
// scale · (q · k) as the CPU's sgemm computes them (alpha = scale).
__global__ void __launch_bounds__(kAttnWarps* kWarpSize)
    CausalAttentionKernel(CausalAttentionArgs a, int32_t group) {
  __shared__ float acc_shared[kAttnWarps][kMaxHeadDim];
  __shared__ float max_shared[kAttnWarps];
  __shared__ float sum_shared[kAttnWarps];

  const int64_t i = blockIdx.x;
  const int32_t h = static_cast<int32_t>(blockIdx.y);
  const int32_t d = a.head_dim;
  const int64_t q_stride = int64_t{a.q_heads} * d;
  const int64_t kv_stride = int64_t{a.kv_heads} * d;
  const int64_t kv_offset = int64_t{h / group} * d;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;

  float q[kMaxLaneDims];
  float acc[kMaxLaneDims];
  const float* q_row = a.q + i * q_stride + int64_t{h} * d;
#pragma unroll
  for (int c = 0; c < kMaxLaneDims; ++c) {
    const int e = lane + c * kWarpSize;
    q[c] = e < d ? q_row[e] : 0.0f;
    acc[c] = 0.0f;
  }

  float run_max = -INFINITY;
  float run_sum = 0.0f;
  const int64_t visible = a.first_pos + i + 1;
  for (int64_t j0 = warp; j0 < visible; j0 += int64_t{kAttnWarps} * kKeysPerStep) {
    float s[kKeysPerStep];
#pragma unroll
    for (int u = 0; u < kKeysPerStep; ++u) {
      const int64_t j = j0 + int64_t{u} * kAttnWarps;
      float part = 0.0f;
      if (j < visible) {
        const float* k_row = a.k + j * kv_stride + kv_offset;
#pragma unroll
        for (int c = 0; c < kMaxLaneDims; ++c) {
          const int e = lane + c * kWarpSize;
          if (e < d) part += q[c] * k_row[e];
        }
      }
      s[u] = part;
    }
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
#pragma unroll
      for (int u = 0; u < kKeysPerStep; ++u) s[u] += __shfl_xor_sync(kFullMask, s[u], offset);
    }
    float step_max = run_max;
#pragma unroll
    for (int u = 0; u < kKeysPerStep; ++u) {
      const bool valid = j0 + int64_t{u} * kAttnWarps < visible;
      s[u] = valid ? s[u] * a.scale : -INFINITY;
      step_max = fmaxf(step_max, s[u]);
    }
    // step_max is finite: key j0 is visible. exp(−inf) = 0 covers the first step and the
    // invalid keys.
    const float correction = expf(run_max - step_max);
    run_sum *= correction;
#pragma unroll
    for (int c = 0; c < kMaxLaneDims; ++c) acc[c] *= correction;
#pragma unroll
    for (int u = 0; u < kKeysPerStep; ++u) {
      const int64_t j = j0 + int64_t{u} * kAttnWarps;
      if (j >= visible) continue;
      const float p = expf(s[u] - step_max);
      run_sum += p;
      const float* v_row = a.v + j * kv_stride + kv_offset;
#pragma unroll
      for (int c = 0; c < kMaxLaneDims; ++c) {
        const int e = lane + c * kWarpSize;
        if (e < d) acc[c] += p * v_row[e];
      }
    }
    run_max = step_max;
  }

  // Merge the warps in a fixed order. A warp that saw no key has max −inf and weight 0;
  // warp 0 always saw key 0, so the overall max is finite.
#pragma unroll
  for (int c = 0; c < kMaxLaneDims; ++c) {
    const int e = lane + c * kWarpSize;
    if (e < d) acc_shared[warp][e] = acc[c];
  }
  if (lane == 0) {
    max_shared[warp] = run_max;
    sum_shared[warp] = run_sum;
  }
  __syncthreads();
  float total_max = -INFINITY;
  for (int w = 0; w < kAttnWarps; ++w) total_max = fmaxf(total_max, max_shared[w]);
  float total_sum = 0.0f;
  for (int w = 0; w < kAttnWarps; ++w) {
    total_sum += sum_shared[w] * expf(max_shared[w] - total_max);
  }
  const float inv_sum = 1.0f / total_sum;
  float* out_row = a.out + i * q_stride + int64_t{h} * d;
  for (int e = static_cast<int>(threadIdx.x); e < d; e += kAttnWarps * kWarpSize) {
    float o = 0.0f;
    for (int w = 0; w < kAttnWarps; ++w) o += acc_shared[w][e] * expf(max_shared[w] - total_max);
    out_row[e] = o * inv_sum;
  }
}

// ---- The Math -----------------------------------------------------------------------------

class CudaMath final : public Math {
 public:
  CudaMath(Device& device, int ordinal, cudaStream_t stream, int sms, cublasHandle_t cublas)
      : device_(device), ordinal_(ordinal), stream_(stream), sms_(sms), cublas_(cublas) {}

  ~CudaMath() override {
    ScopedDevice guard(ordinal_);
    (void)cublasDestroy(cublas_);  // nothing to report to; the workspace is freed after it
  }

  CudaMath(const CudaMath&) = delete;
  CudaMath& operator=(const CudaMath&) = delete;

  // Binds the handle to the stream, then gives it its own workspace (cublasSetStream resets
  // the workspace to cuBLAS's default pool, so the order matters). REQUIRES: the device is
  // current.
  absl::Status Init() {
    KVTIER_RETURN_IF_ERROR(CublasStatus(cublasSetStream(cublas_, stream_), "cublasSetStream"));
    KVTIER_ASSIGN_OR_RETURN(workspace_, device_.Allocate(kCublasWorkspaceBytes));
    KVTIER_RETURN_IF_ERROR(CublasStatus(
        cublasSetWorkspace(cublas_, workspace_.data(), workspace_.size()), "cublasSetWorkspace"));
    KVTIER_RETURN_IF_ERROR(CublasStatus(cublasSetPointerMode(cublas_, CUBLAS_POINTER_MODE_HOST),
                                        "cublasSetPointerMode"));
    return CublasStatus(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  }

  Device& device() override { return device_; }
  absl::Status Fence() override { return absl::OkStatus(); }  // ordered by the stream

  absl::Status MatMul(const float* x, const float* w, const float* bias, float* y, int64_t m,
                      int64_t n, int64_t k) override {
    KVTIER_RETURN_IF_ERROR(CheckCount("MatMul", "m", m, INT_MAX));
    KVTIER_RETURN_IF_ERROR(CheckCount("MatMul", "n", n, INT_MAX));
    KVTIER_RETURN_IF_ERROR(CheckCount("MatMul", "k", k, INT_MAX));
    if (m == 0 || n == 0) return absl::OkStatus();
    ScopedDevice guard(ordinal_);
    KVTIER_RETURN_IF_ERROR(guard.status());
    const float one = 1.0f;
    const float zero = 0.0f;
    const int ld = static_cast<int>(std::max<int64_t>(k, 1));
    KVTIER_RETURN_IF_ERROR(CublasStatus(
        cublasSgemm(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                    static_cast<int>(k), &one, w, ld, x, ld, &zero, y, static_cast<int>(n)),
        absl::StrFormat("MatMul: cublasSgemm(m=%d, n=%d, k=%d)", m, n, k)));
    if (bias == nullptr) return absl::OkStatus();
    AddBiasKernel<<<GridFor(m * n), kThreads, 0, stream_>>>(y, bias, m, n);
    return LaunchStatus("MatMul bias");
  }

  absl::Status RmsNorm(const float* x, const float* weight, float* y, int64_t m, int64_t d,
                       float eps) override {
    KVTIER_RETURN_IF_ERROR(CheckCount("RmsNorm", "m", m, INT_MAX));
    KVTIER_RETURN_IF_ERROR(CheckCount("RmsNorm", "d", d, INT64_MAX));
    if (m == 0 || d == 0) return absl::OkStatus();
    ScopedDevice guard(ordinal_);
    KVTIER_RETURN_IF_ERROR(guard.status());
    RmsNormKernel<<<static_cast<unsigned>(m), kThreads, 0, stream_>>>(x, weight, y, d, eps);
    return LaunchStatus("RmsNorm");
  }

  absl::Status Rope(const RopeArgs& a) override {
    KVTIER_RETURN_IF_ERROR(CheckCount("Rope", "m", a.m, INT64_MAX));
    if (a.heads < 0 || a.rot_dim < 0 || a.rot_dim % 2 != 0 || a.rot_dim > a.head_dim) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "Rope: need heads >= 0 and an even rot_dim in [0, head_dim] (heads %d, head_dim %d, "
          "rot_dim %d)",
          a.heads, a.head_dim, a.rot_dim));
    }
    const int64_t pairs = a.m * (a.rot_dim / 2);
    if (pairs == 0 || a.heads == 0) return absl::OkStatus();
    ScopedDevice guard(ordinal_);
    KVTIER_RETURN_IF_ERROR(guard.status());
    RopeKernel<<<GridFor(pairs), kThreads, 0, stream_>>>(a);
    return LaunchStatus("Rope");
  }

  absl::Status SiluMul(float* gate, const float* up, int64_t count) override {
    KVTIER_RETURN_IF_ERROR(CheckCount("SiluMul", "count", count, INT64_MAX));
    if (count == 0) return absl::OkStatus();
    ScopedDevice guard(ordinal_);
    KVTIER_RETURN_IF_ERROR(guard.status());
    SiluMulKernel<<<GridFor(count), kThreads, 0, stream_>>>(gate, up, count);
    return LaunchStatus("SiluMul");
  }

  absl::Status Add(float* y, const float* x, int64_t count) override {
    KVTIER_RETURN_IF_ERROR(CheckCount("Add", "count", count, INT64_MAX));
    if (count == 0) return absl::OkStatus();
    ScopedDevice guard(ordinal_);
    KVTIER_RETURN_IF_ERROR(guard.status());
    AddKernel<<<GridFor(count), kThreads, 0, stream_>>>(y, x, count);
    return LaunchStatus("Add");
  }

  absl::Status Copy(float* y, const float* x, int64_t count) override {
    KVTIER_RETURN_IF_ERROR(CheckCount("Copy", "count", count, INT64_MAX));
    if (count == 0) return absl::OkStatus();
    ScopedDevice guard(ordinal_);
    KVTIER_RETURN_IF_ERROR(guard.status());
    return CudaStatus(
        cudaMemcpyAsync(y, x, count * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
        "Copy: cudaMemcpyAsync");
  }

  absl::Status RowDistance(const float* a, const float* b, float* out, int64_t m, int64_t d,
                           int64_t out_stride) override {
    KVTIER_RETURN_IF_ERROR(CheckCount("RowDistance", "m", m, INT_MAX));
    KVTIER_RETURN_IF_ERROR(CheckCount("RowDistance", "d", d, INT64_MAX));
    if (m == 0) return absl::OkStatus();
    ScopedDevice guard(ordinal_);
    KVTIER_RETURN_IF_ERROR(guard.status());
    RowDistanceKernel<<<static_cast<unsigned>(m), kThreads, 0, stream_>>>(a, b, out, d, out_stride);
    return LaunchStatus("RowDistance");
  }

  absl::Status Embed(const int32_t* ids, const float* table, float* y, int64_t m,
                     int64_t d) override {
    KVTIER_RETURN_IF_ERROR(CheckCount("Embed", "m", m, INT64_MAX));
    KVTIER_RETURN_IF_ERROR(CheckCount("Embed", "d", d, INT64_MAX));
    if (m == 0 || d == 0) return absl::OkStatus();
    ScopedDevice guard(ordinal_);
    KVTIER_RETURN_IF_ERROR(guard.status());
    EmbedKernel<<<GridFor(m * d), kThreads, 0, stream_>>>(ids, table, y, m, d);
    return LaunchStatus("Embed");
  }

  absl::Status CausalAttention(const CausalAttentionArgs& a) override {
    KVTIER_RETURN_IF_ERROR(CheckCount("CausalAttention", "m", a.m, INT_MAX));
    KVTIER_RETURN_IF_ERROR(CheckCount("CausalAttention", "first_pos", a.first_pos, INT64_MAX));
    if (a.q_heads <= 0 || a.kv_heads <= 0 || a.q_heads % a.kv_heads != 0 || a.head_dim <= 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "CausalAttention: need q_heads a positive multiple of kv_heads > 0 and head_dim > 0 "
          "(q_heads %d, kv_heads %d, head_dim %d)",
          a.q_heads, a.kv_heads, a.head_dim));
    }
    if (a.head_dim > kMaxHeadDim || a.q_heads > 65535) {
      return absl::OutOfRangeError(absl::StrFormat(
          "CausalAttention: the CUDA kernel takes head_dim <= %d and q_heads <= 65535 "
          "(head_dim %d, q_heads %d)",
          kMaxHeadDim, a.head_dim, a.q_heads));
    }
    if (a.m == 0) return absl::OkStatus();
    ScopedDevice guard(ordinal_);
    KVTIER_RETURN_IF_ERROR(guard.status());
    const dim3 grid(static_cast<unsigned>(a.m), static_cast<unsigned>(a.q_heads));
    CausalAttentionKernel<<<grid, kAttnWarps * kWarpSize, 0, stream_>>>(a, a.q_heads / a.kv_heads);
    return LaunchStatus("CausalAttention");
  }

  absl::Status ToDType(const float* x, void* y, DType dtype, int64_t count) override {
    KVTIER_RETURN_IF_ERROR(CheckCount("ToDType", "count", count, INT64_MAX / 4));
    if (count == 0) return absl::OkStatus();
    ScopedDevice guard(ordinal_);
    KVTIER_RETURN_IF_ERROR(guard.status());
    switch (dtype) {
      case DType::kF32:
        return CudaStatus(cudaMemcpyAsync(y, x, static_cast<size_t>(count) * sizeof(float),
                                          cudaMemcpyDeviceToDevice, stream_),
                          "ToDType: cudaMemcpyAsync");
      case DType::kF16:
        ToDTypeKernel<Half>
            <<<GridFor(count), kThreads, 0, stream_>>>(x, static_cast<Half*>(y), count);
        return LaunchStatus("ToDType(fp16)");
      case DType::kBF16:
        ToDTypeKernel<BFloat16>
            <<<GridFor(count), kThreads, 0, stream_>>>(x, static_cast<BFloat16*>(y), count);
        return LaunchStatus("ToDType(bf16)");
    }
    return absl::InvalidArgumentError("ToDType: unknown dtype");
  }

  absl::Status FromDType(const void* x, DType dtype, float* y, int64_t count) override {
    KVTIER_RETURN_IF_ERROR(CheckCount("FromDType", "count", count, INT64_MAX / 4));
    if (count == 0) return absl::OkStatus();
    ScopedDevice guard(ordinal_);
    KVTIER_RETURN_IF_ERROR(guard.status());
    switch (dtype) {
      case DType::kF32:
        return CudaStatus(cudaMemcpyAsync(y, x, static_cast<size_t>(count) * sizeof(float),
                                          cudaMemcpyDeviceToDevice, stream_),
                          "FromDType: cudaMemcpyAsync");
      case DType::kF16:
        FromDTypeKernel<Half>
            <<<GridFor(count), kThreads, 0, stream_>>>(static_cast<const Half*>(x), y, count);
        return LaunchStatus("FromDType(fp16)");
      case DType::kBF16:
        FromDTypeKernel<BFloat16>
            <<<GridFor(count), kThreads, 0, stream_>>>(static_cast<const BFloat16*>(x), y, count);
        return LaunchStatus("FromDType(bf16)");
    }
    return absl::InvalidArgumentError("FromDType: unknown dtype");
  }

 private:
  // INVALID_ARGUMENT for a negative count, OUT_OF_RANGE above what the launch can express.
  static absl::Status CheckCount(absl::string_view op, absl::string_view name, int64_t value,
                                 int64_t limit) {
    if (value < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: %s must be >= 0 (got %d)", op, name, value));
    }
    if (value > limit) {
      return absl::OutOfRangeError(
          absl::StrFormat("%s: %s = %d exceeds the CUDA Math's limit %d", op, name, value, limit));
    }
    return absl::OkStatus();
  }

  // Blocks for a grid-stride kernel over `count` items: one item per thread up to about
  // kBlocksPerSm blocks per SM, then threads loop.
  unsigned GridFor(int64_t count) const {
    const int64_t blocks = (count + kThreads - 1) / kThreads;
    return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, int64_t{sms_} * kBlocksPerSm));
  }

  Device& device_;
  const int ordinal_;
  const cudaStream_t stream_;
  const int sms_;
  const cublasHandle_t cublas_;
  DeviceBuffer workspace_;  // cuBLAS's; freed after the handle is destroyed
};

// INVALID_ARGUMENT when `stream` runs on another GPU than `ordinal`. Checked from CUDA 12.8
// on; before, the runtime cannot say which device a stream belongs to.
absl::Status CheckStreamDevice(cudaStream_t stream, int ordinal) {
#if CUDART_VERSION >= 12080
  int stream_ordinal = -1;
  KVTIER_RETURN_IF_ERROR(
      CudaStatus(cudaStreamGetDevice(stream, &stream_ordinal), "engine math: cudaStreamGetDevice"));
  if (stream_ordinal != ordinal) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "engine math: the stream runs on cuda:%d, the device is cuda:%d", stream_ordinal, ordinal));
  }
#else
  (void)stream;
  (void)ordinal;
#endif
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Math>> NewCudaMath(Device& device, Stream& stream) {
  if (device.kind() != DeviceKind::kCuda) {
    return absl::InvalidArgumentError("engine math: NewCudaMath needs a cuda device");
  }
  // The public CUDA face of the device (kvtier/cuda.h): its ordinal and the stream's handle.
  KVTIER_ASSIGN_OR_RETURN(const int ordinal, CudaDeviceOrdinal(device));
  KVTIER_ASSIGN_OR_RETURN(const cudaStream_t handle, NativeCudaStream(stream));
  KVTIER_RETURN_IF_ERROR(CheckStreamDevice(handle, ordinal));
  ScopedDevice guard(ordinal);
  KVTIER_RETURN_IF_ERROR(guard.status());
  int sms = 0;
  KVTIER_RETURN_IF_ERROR(
      CudaStatus(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ordinal),
                 "engine math: cudaDeviceGetAttribute"));
  cublasHandle_t cublas = nullptr;
  KVTIER_RETURN_IF_ERROR(CublasStatus(cublasCreate(&cublas), "engine math: cublasCreate"));
  auto math = std::make_unique<CudaMath>(device, ordinal, handle, std::max(sms, 1), cublas);
  KVTIER_RETURN_IF_ERROR(math->Init());
  return std::unique_ptr<Math>(std::move(math));
}

}  // namespace kvtier::engine
