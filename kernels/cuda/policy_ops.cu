// The policy ops on the GPU: drop-mode compaction.
//
// MoveHeadSlots: items must run in order (a later move may read a slot an earlier one
// wrote), and they are small (one head's p rows), so one thread block runs them all: it
// first checks every item (a failing call writes nothing, as on the CPU), then copies each
// item's K and V rows as raw words, with a __syncthreads() between items so item i+1 reads
// what item i wrote. One launch, no conversion: bit-exact for every dtype.
#include <cuda_runtime.h>

#include <climits>

#include "kernels/cuda/compute_kernels.h"
#include "kernels/cuda/kernel_util.cuh"
#include "kvtier/layout.h"

namespace kvtier::cuda {
namespace {

constexpr int kMoveThreads = 256;

// ---- MoveHeadSlots ----

struct MoveParams {
  char* fp[2];     // K, V caches: [num_slots][p][Hkv][d] elements of elem_bytes
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
      }
    }
    __syncthreads();  // item i's writes are visible to the whole block before item i+1
  }
}

}  // namespace

cudaError_t LaunchMoveHeadSlots(const MoveHeadSlotsArgs& a, const DeviceErrorSink& sink,
                                cudaStream_t stream) {
  const int32_t elem_bytes = static_cast<int32_t>(DTypeSize(a.shape.dtype));
  const size_t row_bytes = static_cast<size_t>(a.shape.head_dim) * elem_bytes;
  MoveParams p{};
  p.fp[kKey] = static_cast<char*>(a.kv.k_cache);
  p.fp[kValue] = static_cast<char*>(a.kv.v_cache);
  p.items = a.items;
  p.num_items = a.num_items;
  p.num_slots = a.kv.num_slots;
  p.elem_bytes = elem_bytes;
  p.working_set = WorkingSetLayout{1, a.shape.page_size, a.shape.num_kv_heads, a.shape.head_dim};
  p.sink = sink;
  // One unit for every row copied: rows (d·elem bytes) start at multiples of their size,
  // so a unit that divides the row size and both bases is aligned everywhere.
  const int unit = CopyUnitBytes(row_bytes, {a.kv.k_cache, a.kv.v_cache});
  return DispatchCopyUnit(unit, [&](auto unit_tag) {
    using U = typename decltype(unit_tag)::type;
    p.unit_bytes = static_cast<int32_t>(sizeof(U));
    MoveHeadSlotsKernel<U><<<1, kMoveThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace kvtier::cuda
