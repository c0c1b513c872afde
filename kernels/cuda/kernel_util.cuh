// Device helpers shared by the copy kernels: the copy unit (the widest word that every row
// and base address allows), dispatch over units and element types, and error reporting.
// Included only by .cu files.
#ifndef KVTIER_KERNELS_CUDA_KERNEL_UTIL_CUH_
#define KVTIER_KERNELS_CUDA_KERNEL_UTIL_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "kernels/cuda/device_error.h"
#include "kvtier/dtype.h"

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
