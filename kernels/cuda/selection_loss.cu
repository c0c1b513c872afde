// SelectionLoss on the GPU: the estimated attention mass a KV head's stale selection loses
// against a fresh one (the mass correction trigger). The CPU reference
// (kernels/cpu/selection_loss.cc) defines the result; the sums are reduced in another order
// (fp32 block reductions here, fp64 in index order there), so the losses agree up to fp32
// rounding and a loss within that of the threshold may be flagged either way.
//
// One block per (sequence, KV head): the threads split the k entries of both selections;
// membership is a linear scan of the other selection (O(k²) per head, as Replace's), then
// three block sums.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/compute_kernels.h"
#include "kernels/cuda/kernel_util.cuh"
#include "kvtier/layout.h"

namespace kvtier::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kLossThreads = 128;
constexpr int kLossWarps = kLossThreads / kWarpSize;

struct SumOp {
  __device__ float operator()(float x, float y) const { return x + y; }
};

// `v` reduced over the block with `op`, returned to every thread. Every thread of the block
// must call it; `scratch` holds one value per warp.
template <typename Op>
__device__ float BlockReduce(float v, float* scratch, Op op) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v = op(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float r = scratch[0];
  for (int w = 1; w < kLossWarps; ++w) r = op(r, scratch[w]);
  __syncthreads();  // scratch may be reused by the next call
  return r;
}

__device__ __forceinline__ bool Contains(const int32_t* v, int32_t n, int32_t x) {
  for (int32_t i = 0; i < n; ++i) {
    if (v[i] == x) return true;
  }
  return false;
}

// The weight of `page`, as the CPU's Weight: its pooled probability, NaN as 0.
__device__ __forceinline__ float Weight(const float* pooled, int32_t page) {
  const float w = pooled[page];
  return isnan(w) ? 0.0f : w;
}

__global__ void __launch_bounds__(kLossThreads)
    SelectionLossKernel(const SelectionLossArgs a, const DeviceErrorSink sink) {
  __shared__ float scratch[kLossWarps];
  __shared__ int32_t bad;
  const int64_t bh = blockIdx.x;
  const int32_t k = a.k;
  const int32_t* cur = a.current + bh * k;
  const int32_t* fr = a.fresh + bh * k;
  const float* pooled = a.pooled + bh * a.max_pages;

  // Every entry is a page or empty; otherwise the head's outputs are left untouched.
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  for (int32_t i = threadIdx.x; i < k; i += blockDim.x) {
    if (cur[i] != kEmptySlot && !InRange(cur[i], a.max_pages)) {
      ReportItemError(sink, KernelOp::kSelectionLoss, ItemField::kCurrentPage, bh * k + i, cur[i],
                      a.max_pages);
      bad = 1;
    }
    if (fr[i] != kEmptySlot && !InRange(fr[i], a.max_pages)) {
      ReportItemError(sink, KernelOp::kSelectionLoss, ItemField::kFreshPage, bh * k + i, fr[i],
                      a.max_pages);
      bad = 1;
    }
  }
  __syncthreads();
  if (bad != 0) return;

  float total = 0.0f, gain = 0.0f, lost = 0.0f;
  for (int32_t i = threadIdx.x; i < k; i += blockDim.x) {
    if (fr[i] != kEmptySlot) {
      const float w = Weight(pooled, fr[i]);
      total += w;
      if (!Contains(cur, k, fr[i])) gain += w;
    }
    if (cur[i] != kEmptySlot && !Contains(fr, k, cur[i])) lost += Weight(pooled, cur[i]);
  }
  total = BlockReduce(total, scratch, SumOp{});
  gain = BlockReduce(gain, scratch, SumOp{});
  lost = BlockReduce(lost, scratch, SumOp{});
  if (threadIdx.x == 0) {
    float loss = 0.0f;
    if (total > 0.0f) {
      loss = (gain - lost) / total;
      loss = loss > 1.0f ? 1.0f : loss > 0.0f ? loss : 0.0f;  // NaN → 0
    }
    a.loss[bh] = loss;
    if (a.drifted != nullptr) a.drifted[bh] = loss > a.threshold ? 1 : 0;
  }
}

}  // namespace

cudaError_t LaunchSelectionLoss(const SelectionLossArgs& a, const DeviceErrorSink& sink,
                                cudaStream_t stream) {
  const auto heads = static_cast<unsigned>(int64_t{a.batch} * a.shape.num_kv_heads);
  SelectionLossKernel<<<heads, kLossThreads, 0, stream>>>(a, sink);
  return cudaGetLastError();
}

}  // namespace kvtier::cuda
