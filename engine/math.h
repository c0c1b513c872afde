// The decoder's own arithmetic — everything of a transformer layer except decode attention,
// which kvtier's sequences do — on the host (OpenBLAS, multithreaded) or on a CUDA GPU
// (cuBLAS and a few kernels). docs/architecture.md#the-engine.
//
// Every pointer is in the memory of the Math's device (host memory for the CPU Math).
// Work is ordered on the stream the Math was made for — the sequences' compute stream, so
// the engine's matrices and kvtier's attention are ordered without host waits on a GPU.
// The CPU Math runs each call before it returns (on the calling thread and BLAS's), and
// Fence() waits for the compute stream's own work (kvtier's attention runs on the CPU
// stream's worker); the CUDA Math only enqueues, and Fence() is free.
//
// Shapes are row-major; a matrix w [n][k] is GGUF's tensor with dims {k, n}.
#ifndef KVTIER_ENGINE_MATH_H_
#define KVTIER_ENGINE_MATH_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvtier/device.h"
#include "kvtier/dtype.h"

namespace kvtier::engine {

// Rotary position embedding: dims [0, rot_dim) of each head rotate by position · inv_freq[i]
// for pair i; the rest pass through. GGUF's llama type rotates adjacent pairs (2i, 2i + 1);
// the NeoX type (Qwen2 and others) rotates (i, i + rot_dim / 2).
struct RopeArgs {
  float* x = nullptr;                  // [m][heads][head_dim], in place
  const int32_t* positions = nullptr;  // [m]
  const float* inv_freq = nullptr;     // [rot_dim / 2], scaling already applied
  int64_t m = 0;
  int32_t heads = 0;
  int32_t head_dim = 0;
  int32_t rot_dim = 0;
  bool neox = false;
};

// Causal attention of a prefill chunk: queries q [m][Hq][d] at positions first_pos ..
// first_pos + m − 1 over keys/values [n][Hkv][d] at positions 0 .. n − 1 (n = first_pos +
// m: the chunk's own K/V are the last m rows), grouped-query (query head h reads KV head
// h / (Hq / Hkv)). out [m][Hq][d].
struct CausalAttentionArgs {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  float* out = nullptr;
  int64_t m = 0;
  int64_t first_pos = 0;
  int32_t q_heads = 0;
  int32_t kv_heads = 0;
  int32_t head_dim = 0;
  float scale = 1.0f;
};

class Math {
 public:
  virtual ~Math() = default;

  virtual Device& device() = 0;
  // Waits until the compute stream's work so far has run when the host is about to read
  // what it wrote (CPU); nothing on a GPU, where the next op is ordered after it anyway.
  virtual absl::Status Fence() = 0;

  // y[m][n] = x[m][k] · w[n][k]ᵀ (+ bias[n] when non-null).
  virtual absl::Status MatMul(const float* x, const float* w, const float* bias, float* y,
                              int64_t m, int64_t n, int64_t k) = 0;
  // y[m][d] = x / sqrt(mean(x²) + eps) · weight[d]. y may be x.
  virtual absl::Status RmsNorm(const float* x, const float* weight, float* y, int64_t m,
                               int64_t d, float eps) = 0;
  virtual absl::Status Rope(const RopeArgs& a) = 0;
  // gate[i] = silu(gate[i]) · up[i] for i < count.
  virtual absl::Status SiluMul(float* gate, const float* up, int64_t count) = 0;
  // y[i] += x[i].
  virtual absl::Status Add(float* y, const float* x, int64_t count) = 0;
  // y[i] = x[i] for i < count (ordered with the other ops, unlike a Device copy on the CPU).
  virtual absl::Status Copy(float* y, const float* x, int64_t count) = 0;
  // out[i · out_stride] = ‖a[i] − b[i]‖₂ for rows i < m of d floats (the sum in double).
  // The engine's hidden-state change per token and layer (StepSignals::hidden_delta).
  virtual absl::Status RowDistance(const float* a, const float* b, float* out, int64_t m,
                                   int64_t d, int64_t out_stride) = 0;
  // y[i][:] = table[ids[i]][:], table [vocab][d]. REQUIRES: ids in range (the engine checks).
  virtual absl::Status Embed(const int32_t* ids, const float* table, float* y, int64_t m,
                             int64_t d) = 0;
  virtual absl::Status CausalAttention(const CausalAttentionArgs& a) = 0;
  // Conversions between F32 and a KV dtype (q, k, v handed to kvtier; attention out back).
  virtual absl::Status ToDType(const float* x, void* y, DType dtype, int64_t count) = 0;
  virtual absl::Status FromDType(const void* x, DType dtype, float* y, int64_t count) = 0;
};

// The Math for `device`, ordered on `stream` (both outlive it). CPU: BLAS with `threads`
// threads (0: its default). CUDA: cuBLAS on the stream; UNIMPLEMENTED when the CUDA part
// was not built.
absl::StatusOr<std::unique_ptr<Math>> CreateMath(Device& device, Stream& stream, int threads);

// Internal: the two implementations.
std::unique_ptr<Math> NewCpuMath(Device& device, Stream& stream, int threads);
absl::StatusOr<std::unique_ptr<Math>> NewCudaMath(Device& device, Stream& stream);

}  // namespace kvtier::engine

#endif  // KVTIER_ENGINE_MATH_H_
