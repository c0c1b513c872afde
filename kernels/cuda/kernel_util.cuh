// Device helpers shared by the copy kernels: the copy unit (the widest word that every row
// and base address allows), the batched slab copy, dispatch over units and element types,
// and error reporting.
// Included only by .cu files.
#ifndef KVTIER_KERNELS_CUDA_KERNEL_UTIL_CUH_
#define KVTIER_KERNELS_CUDA_KERNEL_UTIL_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "kernels/cuda/device_error.h"
#include "kernels/ops.h"
#include "kvtier/dtype.h"
#include "kvtier/layout.h"

namespace kvtier::cuda {

// The widest copy unit in bytes (16, 8, 4, 2 or 1) that divides `row_bytes` and every
// base address. Row starts of every kvtier layout are multiples of the row size, so this
// unit is aligned for every row of every page and slot.
inline int CopyUnitBytes(size_t row_bytes, std::initializer_list<const void*> bases) {
  uintptr_t bits = row_bytes;
  for (const void* base : bases) bits |= reinterpret_cast<uintptr_t>(base);
  for (int unit = 16; unit > 1; unit /= 2) {
    if (bits % static_cast<uintptr_t>(unit) == 0) return unit;
  }
  return 1;
}

// Slab copies (recall.cu, slabs.cu): one block per head-page slab, each thread holding
// kSlabUnroll copy units in registers at a time. A thread issues all its loads before its
// first store, so the loads are independent and a block keeps blockDim.x · kSlabUnroll
// units in flight at once (the whole 16 KiB slab at p = 32, d = 128, fp16: 256 threads of
// four 16-byte loads) instead of one load-store chain per thread. Over PCIe (zero-copy
// host pages) each round trip costs microseconds, so the number of rounds per slab is what
// the copy's latency is.
constexpr int kSlabUnroll = 4;
constexpr int kSlabMaxThreads = 1024;

// Threads per block for slabs of `units` copy units: one round of kSlabUnroll loads each
// when the slab allows it, a multiple of 32 in [32, kSlabMaxThreads].
inline int SlabCopyThreads(int64_t units) {
  const int64_t per_round = 32 * kSlabUnroll;
  const int64_t warps = (units + per_round - 1) / per_round;
  const int64_t threads = warps * 32;
  if (threads < 32) return 32;
  return threads > kSlabMaxThreads ? kSlabMaxThreads : static_cast<int>(threads);
}

// Where unit u of one head's contiguous K+V slab ([K|V][p][d] as units of U, units_per_row a
// row) lands in the NHD working set: token (row mod p) of the item's head in its destination
// slot, in K for rows below p and in V for the rest. Params: the copy kernels' parameters
// (working_set, cache[K|V], elem_bytes).
template <typename U>
struct NhdSlabTarget {
  char* k_row0;  // token 0 of the head in the destination slot, in K and in V
  char* v_row0;
  int64_t row_stride;  // bytes between tokens (Hkv·d elements)
  int32_t units_per_row;
  int32_t page_size;
  __device__ U* operator()(int32_t u) const {
    const int32_t row = u / units_per_row;
    const int32_t word = u - row * units_per_row;
    const bool value = row >= page_size;
    const int32_t token = value ? row - page_size : row;
    return reinterpret_cast<U*>((value ? v_row0 : k_row0) + token * row_stride) + word;
  }
};
template <typename U, typename Params>
__device__ NhdSlabTarget<U> SlabTarget(const Params& p, const RecallItem& it,
                                       int32_t units_per_row, int32_t page_size) {
  const int64_t row0 = p.working_set.Offset(int64_t{it.dst_slot}, 0, it.kv_head, 0) * p.elem_bytes;
  return NhdSlabTarget<U>{p.cache[kKey] + row0, p.cache[kValue] + row0,
                          p.working_set.token_stride() * p.elem_bytes, units_per_row, page_size};
}

// Copies units [0, n) of one slab, *dst_at(u) = *src_at(u), with the whole block. Thread t
// takes units t + j·blockDim.x of each round of blockDim.x · kSlabUnroll (consecutive threads,
// consecutive units: coalesced), loads all of them, then stores them. Units past n are
// neither loaded nor stored, so any n works.
template <typename U, typename SrcAt, typename DstAt>
__device__ __forceinline__ void CopySlabUnits(int32_t n, const SrcAt& src_at, const DstAt& dst_at) {
  const auto stride = static_cast<int32_t>(blockDim.x);
  for (int32_t base = static_cast<int32_t>(threadIdx.x); base < n; base += stride * kSlabUnroll) {
    U v[kSlabUnroll];
#pragma unroll
    for (int j = 0; j < kSlabUnroll; ++j) {
      const int32_t u = base + j * stride;
      if (u < n) v[j] = *src_at(u);
    }
#pragma unroll
    for (int j = 0; j < kSlabUnroll; ++j) {
      const int32_t u = base + j * stride;
      if (u < n) *dst_at(u) = v[j];
    }
  }
}

// A type as a value, for dispatching to generic lambdas:
//   fn(TypeTag<uint4>{}) → using U = typename decltype(tag)::type;
template <typename T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<U>{}) with U the unsigned word of `unit_bytes` bytes.
template <typename Fn>
cudaError_t DispatchCopyUnit(int unit_bytes, Fn&& fn) {
  switch (unit_bytes) {
    case 16:
      return fn(TypeTag<uint4>{});
    case 8:
      return fn(TypeTag<uint2>{});
    case 4:
      return fn(TypeTag<uint32_t>{});
    case 2:
      return fn(TypeTag<uint16_t>{});
    default:
      return fn(TypeTag<uint8_t>{});
  }
}

// Calls fn(TypeTag<T>{}) with T the storage type of `t`.
template <typename Fn>
cudaError_t DispatchElement(DType t, Fn&& fn) {
  switch (t) {
    case DType::kF16:
      return fn(TypeTag<Half>{});
    case DType::kBF16:
      return fn(TypeTag<BFloat16>{});
    case DType::kF32:
      return fn(TypeTag<float>{});
  }
  return cudaErrorInvalidValue;
}

__device__ inline bool InRange(int64_t value, int64_t limit) { return value >= 0 && value < limit; }

// Records the stream's first failure (device_error.h); later failures are dropped.
__device__ inline void ReportItemError(const DeviceErrorSink& sink, KernelOp op, ItemField field,
                                       int64_t item, int64_t value, int64_t limit) {
  if (atomicCAS(sink.claim, 0, 1) != 0) return;
  volatile DeviceErrorRecord* r = sink.record;
  r->op = static_cast<int32_t>(op);
  r->field = static_cast<int32_t>(field);
  r->item = item;
  r->value = value;
  r->limit = limit;
  __threadfence_system();  // the fields reach host memory before op_seq publishes them
  r->op_seq = sink.op_seq;
  __threadfence_system();
}

// True when `value` is in [0, limit); otherwise thread 0 of the block reports it.
__device__ inline bool CheckField(const DeviceErrorSink& sink, KernelOp op, int64_t item,
                                  ItemField field, int64_t value, int64_t limit) {
  if (InRange(value, limit)) return true;
  if (threadIdx.x == 0) ReportItemError(sink, op, field, item, value, limit);
  return false;
}

}  // namespace kvtier::cuda

#endif  // KVTIER_KERNELS_CUDA_KERNEL_UTIL_CUH_
