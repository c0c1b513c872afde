// The policy ops on the GPU (Conf-KV INT8 storage, drop-mode compaction).
//
// QuantizeSlots: one thread block per (HeadSlot item, K|V); each thread owns channels of
// the head (threads across channels, so every token row is read coalesced), takes the
// channel's max |x| over the page's tokens, divides by 127 and rounds each value to the
// nearest INT8 (ties to even). The arithmetic is the CPU reference's (kernels/cpu/
// quantize.cc) operation for operation, IEEE fp32 division and rint included, so scales
// and INT8 values match it bit for bit. Items with an index out of range are skipped and
// reported; the others are still quantised.
//
// MoveHeadSlots: items must run in order (a later move may read a slot an earlier one
// wrote), and they are small (one head's p rows), so one thread block runs them all: it
// first checks every item (a failing call writes nothing, as on the CPU), then copies each
// item's K and V rows (and the INT8 rows and scales when given) as raw words, with a
// __syncthreads() between items so item i+1 reads what item i wrote. One launch, no
// conversion: bit-exact for every dtype.
#include <cuda_runtime.h>

#include <climits>

#include "kernels/cuda/compute_kernels.h"
#include "kernels/cuda/kernel_util.cuh"
#include "kvtier/layout.h"

namespace kvtier::cuda {
namespace {

constexpr int kQuantizeThreads = 128;
constexpr int kMoveThreads = 256;
constexpr float kInt8Max = 127.0f;

// ---- QuantizeSlots ----

struct QuantizeParams {
  const void* src[2];  // K, V: [num_slots][p][Hkv][d]
  int8_t* dst[2];      // same layout
  float* scale[2];     // [num_slots][Hkv][d]
  const HeadSlot* items;
  int32_t num_slots;
  WorkingSetLayout working_set;
  DeviceErrorSink sink;
};

// x / scale rounded to nearest even, clamped to ±127; 0 for a zero scale and for NaN.
__device__ inline int8_t QuantizeValue(float x, float scale) {
  if (scale == 0.0f) return 0;
  const float r = rintf(x / scale);  // IEEE division (no fast math), as on the CPU
  if (isnan(r)) return 0;
  return static_cast<int8_t>(static_cast<int32_t>(fminf(fmaxf(r, -kInt8Max), kInt8Max)));
}

template <typename T>
__global__ void __launch_bounds__(kQuantizeThreads) QuantizeKernel(const QuantizeParams p) {
  const int64_t index = blockIdx.x;
  const int32_t kind = static_cast<int32_t>(blockIdx.y);
  const HeadSlot it = p.items[index];
  const WorkingSetLayout& wl = p.working_set;
  constexpr KernelOp op = KernelOp::kQuantizeSlots;
  if (!CheckField(p.sink, op, index, ItemField::kKvHead, it.kv_head, wl.num_kv_heads) ||
      !CheckField(p.sink, op, index, ItemField::kSlot, it.slot, p.num_slots)) {
    return;
  }
  const T* src = static_cast<const T*>(p.src[kind]) + wl.Offset(int64_t{it.slot}, 0, it.kv_head, 0);
  int8_t* dst = p.dst[kind] + wl.Offset(int64_t{it.slot}, 0, it.kv_head, 0);
  float* scale = p.scale[kind] + (int64_t{it.slot} * wl.num_kv_heads + it.kv_head) * wl.head_dim;
  const int64_t stride = wl.token_stride();
  for (int32_t c = threadIdx.x; c < wl.head_dim; c += blockDim.x) {
    float mx = 0.0f;
    for (int32_t t = 0; t < wl.page_size; ++t) {
      const float a = fabsf(ToFloat(src[t * stride + c]));
      mx = mx < a ? a : mx;  // std::max(mx, a), as the CPU reference (NaN ignored)
    }
    const float s = mx / kInt8Max;
    scale[c] = s;
    for (int32_t t = 0; t < wl.page_size; ++t) {
      dst[t * stride + c] = QuantizeValue(ToFloat(src[t * stride + c]), s);
    }
  }
}

// ---- MoveHeadSlots ----

struct MoveParams {
  char* fp[2];     // K, V caches: [num_slots][p][Hkv][d] elements of elem_bytes
  char* q[2];      // K, V INT8 copies (same layout, 1 byte each), or null
  char* scale[2];  // K, V scales [num_slots][Hkv][d] floats, or null
  const HeadSlotMove* items;
  int32_t num_items;
  int32_t num_slots;
  int32_t elem_bytes;
  int32_t unit_bytes;  // sizeof(U), for the byte offsets below
  WorkingSetLayout working_set;
  DeviceErrorSink sink;
};

__device__ inline bool MoveItemOk(const MoveParams& p, const HeadSlotMove& it) {
  return InRange(it.kv_head, p.working_set.num_kv_heads) && InRange(it.src_slot, p.num_slots) &&
         InRange(it.dst_slot, p.num_slots);
}

// Copies `rows` rows of `units_per_row` words of U, row r at byte offsets src_row(r) /
// dst_row(r) of `base`, with the whole block.
template <typename U, typename SrcRow, typename DstRow>
__device__ inline void CopyRows(char* base, int32_t rows, int32_t units_per_row, SrcRow src_row,
                                DstRow dst_row) {
  const int32_t units = rows * units_per_row;
  for (int32_t u = threadIdx.x; u < units; u += blockDim.x) {
    const int32_t row = u / units_per_row;
    const int32_t word = u - row * units_per_row;
    const U* src = reinterpret_cast<const U*>(base + src_row(row));
    U* dst = reinterpret_cast<U*>(base + dst_row(row));
    dst[word] = src[word];
  }
}

// A single block: items in order, __syncthreads() between them.
template <typename U>
__global__ void __launch_bounds__(kMoveThreads) MoveHeadSlotsKernel(const MoveParams p) {
  // Check every item first: the lowest bad index is reported and nothing moves.
  __shared__ int32_t first_bad;
  if (threadIdx.x == 0) first_bad = INT_MAX;
  __syncthreads();
  for (int32_t i = threadIdx.x; i < p.num_items; i += blockDim.x) {
    if (!MoveItemOk(p, p.items[i])) atomicMin(&first_bad, i);
  }
  __syncthreads();
  if (first_bad != INT_MAX) {
    if (threadIdx.x == 0) {
      const int64_t i = first_bad;
      const HeadSlotMove it = p.items[i];
      constexpr KernelOp op = KernelOp::kMoveHeadSlots;
      // The first bad field, in the CPU reference's order.
      (void)(CheckField(p.sink, op, i, ItemField::kKvHead, it.kv_head,
                        p.working_set.num_kv_heads) &&
             CheckField(p.sink, op, i, ItemField::kSrcSlot, it.src_slot, p.num_slots) &&
             CheckField(p.sink, op, i, ItemField::kDstSlot, it.dst_slot, p.num_slots));
    }
    return;
  }
  const WorkingSetLayout& wl = p.working_set;
  const int32_t page_size = wl.page_size;
  const int32_t d = wl.head_dim;
  const int32_t fp_units = d * p.elem_bytes / p.unit_bytes;
  const int32_t q_units = d / p.unit_bytes;
  const int32_t scale_units = d * static_cast<int32_t>(sizeof(float)) / p.unit_bytes;
  const bool with_int8 = p.q[kKey] != nullptr;  // ValidateArgs: all four or none
  for (int32_t i = 0; i < p.num_items; ++i) {
    const HeadSlotMove it = p.items[i];
    // A move onto itself is the identity (the CPU reference rejects it up front; the
    // error record cannot express INVALID_ARGUMENT, and copying in place is harmless).
    if (it.src_slot != it.dst_slot) {
      for (int32_t kind = 0; kind < 2; ++kind) {
        const int64_t elem = p.elem_bytes;
        CopyRows<U>(
            p.fp[kind], page_size, fp_units,
            [&](int32_t t) { return wl.Offset(int64_t{it.src_slot}, t, it.kv_head, 0) * elem; },
            [&](int32_t t) { return wl.Offset(int64_t{it.dst_slot}, t, it.kv_head, 0) * elem; });
        if (with_int8) {
          CopyRows<U>(
              p.q[kind], page_size, q_units,
              [&](int32_t t) { return wl.Offset(int64_t{it.src_slot}, t, it.kv_head, 0); },
              [&](int32_t t) { return wl.Offset(int64_t{it.dst_slot}, t, it.kv_head, 0); });
          const int64_t src = (int64_t{it.src_slot} * wl.num_kv_heads + it.kv_head) * d;
          const int64_t dst = (int64_t{it.dst_slot} * wl.num_kv_heads + it.kv_head) * d;
          CopyRows<U>(
              p.scale[kind], 1, scale_units,
              [&](int32_t) { return src * static_cast<int64_t>(sizeof(float)); },
              [&](int32_t) { return dst * static_cast<int64_t>(sizeof(float)); });
        }
      }
    }
    __syncthreads();  // item i's writes are visible to the whole block before item i+1
  }
}

}  // namespace

cudaError_t LaunchQuantizeSlots(const QuantizeSlotsArgs& a, const DeviceErrorSink& sink,
                                cudaStream_t stream) {
  QuantizeParams p{};
  p.src[kKey] = a.kv.k_cache;
  p.src[kValue] = a.kv.v_cache;
  p.dst[kKey] = a.kv.k_int8;
  p.dst[kValue] = a.kv.v_int8;
  p.scale[kKey] = a.kv.k_scale;
  p.scale[kValue] = a.kv.v_scale;
  p.items = a.items;
  p.num_slots = a.kv.num_slots;
  // Global slot = item.slot; the slot count only bounds-checks, which the kernel does.
  p.working_set = WorkingSetLayout{1, a.shape.page_size, a.shape.num_kv_heads, a.shape.head_dim};
  p.sink = sink;
  const dim3 grid(static_cast<unsigned>(a.num_items), 2);
  return DispatchElement(a.shape.dtype, [&](auto element_tag) {
    using T = typename decltype(element_tag)::type;
    QuantizeKernel<T><<<grid, kQuantizeThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

cudaError_t LaunchMoveHeadSlots(const MoveHeadSlotsArgs& a, const DeviceErrorSink& sink,
                                cudaStream_t stream) {
  const int32_t elem_bytes = static_cast<int32_t>(DTypeSize(a.shape.dtype));
  const size_t row_bytes = static_cast<size_t>(a.shape.head_dim) * elem_bytes;
  const bool with_int8 = a.kv.k_int8 != nullptr;
  MoveParams p{};
  p.fp[kKey] = static_cast<char*>(a.kv.k_cache);
  p.fp[kValue] = static_cast<char*>(a.kv.v_cache);
  if (with_int8) {
    p.q[kKey] = reinterpret_cast<char*>(a.kv.k_int8);
    p.q[kValue] = reinterpret_cast<char*>(a.kv.v_int8);
    p.scale[kKey] = reinterpret_cast<char*>(a.kv.k_scale);
    p.scale[kValue] = reinterpret_cast<char*>(a.kv.v_scale);
  }
  p.items = a.items;
  p.num_items = a.num_items;
  p.num_slots = a.kv.num_slots;
  p.elem_bytes = elem_bytes;
  p.working_set = WorkingSetLayout{1, a.shape.page_size, a.shape.num_kv_heads, a.shape.head_dim};
  p.sink = sink;
  // One unit for every row copied: the fp rows (d·elem bytes), the INT8 rows (d bytes)
  // and the scale rows (4·d bytes) all start at multiples of their size, so a unit that
  // divides the three sizes and every base is aligned everywhere.
  const int unit = with_int8 ? CopyUnitBytes(row_bytes | static_cast<size_t>(a.shape.head_dim),
                                             {a.kv.k_cache, a.kv.v_cache, a.kv.k_int8, a.kv.v_int8,
                                              a.kv.k_scale, a.kv.v_scale})
                             : CopyUnitBytes(row_bytes, {a.kv.k_cache, a.kv.v_cache});
  return DispatchCopyUnit(unit, [&](auto unit_tag) {
    using U = typename decltype(unit_tag)::type;
    p.unit_bytes = static_cast<int32_t>(sizeof(U));
    MoveHeadSlotsKernel<U><<<1, kMoveThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace kvtier::cuda
