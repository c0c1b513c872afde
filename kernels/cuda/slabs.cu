// Recall in two halves on the GPU, one thread block per RecallItem as in recall.cu:
// GatherSlabs copies the contiguous K+V slab of item.kv_head from its HND host page
// (registered host memory read zero-copy, or device memory) into staging slab j;
// ScatterSlabs copies staging slab j into p rows of the NHD working set (row stride
// Hkv·d). Both copy with CopySlabUnits (kernel_util.cuh): each thread loads its kSlabUnroll
// units before storing any, so a block has the whole slab in flight at once. Bit-exact: raw
// words are copied, never converted, so one kernel serves every dtype.
#include <cuda_runtime.h>

#include "kernels/cuda/copy_kernels.h"
#include "kernels/cuda/kernel_util.cuh"
#include "kvtier/layout.h"

namespace kvtier::cuda {
namespace {

struct GatherParams {
  const char* host_pages;
  int64_t num_host_pages;
  const RecallItem* items;
  char* staging;
  int32_t elem_bytes;
  int32_t units_per_slab;  // slab_bytes / sizeof(U)
  HostPageLayout host;
  DeviceErrorSink sink;
};

struct ScatterParams {
  const char* staging;
  const RecallItem* items;
  char* cache[2];  // K, V
  int32_t num_slots;
  int32_t elem_bytes;
  int32_t units_per_row;  // row_bytes / sizeof(U)
  HostPageLayout slab;    // one staged slab: a host page of one KV head
  WorkingSetLayout working_set;
  DeviceErrorSink sink;
};

// Slab `index` is one straight copy: no index arithmetic per unit beyond the base.
template <typename U>
__global__ void __launch_bounds__(kSlabMaxThreads) GatherSlabsKernel(const GatherParams p) {
  const int64_t index = blockIdx.x;
  const RecallItem it = p.items[index];
  if (it.host_page == kSkipItem) return;
  constexpr KernelOp op = KernelOp::kGatherSlabs;
  if (!CheckField(p.sink, op, index, ItemField::kHostPage, it.host_page, p.num_host_pages) ||
      !CheckField(p.sink, op, index, ItemField::kKvHead, it.kv_head, p.host.num_kv_heads)) {
    return;
  }
  const int64_t src = it.host_page * p.host.page_elements() + p.host.SlabOffset(it.kv_head);
  const U* from = reinterpret_cast<const U*>(p.host_pages + src * p.elem_bytes);
  U* to = reinterpret_cast<U*>(p.staging + index * p.host.slab_elements() * p.elem_bytes);
  CopySlabUnits<U>(
      p.units_per_slab, [from](int32_t u) { return from + u; }, [to](int32_t u) { return to + u; });
}

// Unit u of the slab is row u / units_per_row of [K|V][token], word u % units_per_row;
// the staged slab is contiguous, so it is also unit u of the source.
template <typename U>
__global__ void __launch_bounds__(kSlabMaxThreads) ScatterSlabsKernel(const ScatterParams p) {
  const int64_t index = blockIdx.x;
  const RecallItem it = p.items[index];
  if (it.host_page == kSkipItem) return;
  constexpr KernelOp op = KernelOp::kScatterSlabs;
  if (!CheckField(p.sink, op, index, ItemField::kKvHead, it.kv_head, p.working_set.num_kv_heads) ||
      !CheckField(p.sink, op, index, ItemField::kDstSlot, it.dst_slot, p.num_slots)) {
    return;
  }
  const int32_t page_size = p.slab.page_size;
  const int32_t units_per_row = p.units_per_row;
  const U* from =
      reinterpret_cast<const U*>(p.staging + index * p.slab.page_elements() * p.elem_bytes);
  const NhdSlabTarget<U> dst_at = SlabTarget<U>(p, it, units_per_row, page_size);
  CopySlabUnits<U>(
      2 * page_size * units_per_row, [from](int32_t u) { return from + u; }, dst_at);
}

}  // namespace

cudaError_t LaunchGatherSlabs(const GatherSlabsArgs& a, const DeviceErrorSink& sink,
                              cudaStream_t stream) {
  const int32_t elem_bytes = static_cast<int32_t>(DTypeSize(a.shape.dtype));
  GatherParams p{};
  p.host_pages = static_cast<const char*>(a.host_pages);
  p.num_host_pages = a.num_host_pages;
  p.items = a.items;
  p.staging = static_cast<char*>(a.staging);
  p.elem_bytes = elem_bytes;
  p.host = HostPageLayout{a.shape.num_kv_heads, a.shape.page_size, a.shape.head_dim};
  p.sink = sink;
  // Every slab starts at a multiple of the slab size in both buffers.
  const size_t slab_bytes = static_cast<size_t>(p.host.slab_elements()) * elem_bytes;
  const int unit = CopyUnitBytes(slab_bytes, {a.host_pages, a.staging});
  return DispatchCopyUnit(unit, [&](auto unit_tag) {
    using U = typename decltype(unit_tag)::type;
    p.units_per_slab = static_cast<int32_t>(slab_bytes / sizeof(U));
    GatherSlabsKernel<U><<<a.num_items, SlabCopyThreads(p.units_per_slab), 0, stream>>>(p);
    return cudaGetLastError();
  });
}

cudaError_t LaunchScatterSlabs(const ScatterSlabsArgs& a, const DeviceErrorSink& sink,
                               cudaStream_t stream) {
  const int32_t elem_bytes = static_cast<int32_t>(DTypeSize(a.shape.dtype));
  const size_t row_bytes = static_cast<size_t>(a.shape.head_dim) * elem_bytes;
  ScatterParams p{};
  p.staging = static_cast<const char*>(a.staging);
  p.items = a.items;
  p.cache[kKey] = static_cast<char*>(a.kv.k_cache);
  p.cache[kValue] = static_cast<char*>(a.kv.v_cache);
  p.num_slots = a.kv.num_slots;
  p.elem_bytes = elem_bytes;
  p.slab = HostPageLayout{1, a.shape.page_size, a.shape.head_dim};
  p.working_set =
      WorkingSetLayout{a.kv.num_slots, a.shape.page_size, a.shape.num_kv_heads, a.shape.head_dim};
  p.sink = sink;
  const int unit = CopyUnitBytes(row_bytes, {a.staging, a.kv.k_cache, a.kv.v_cache});
  return DispatchCopyUnit(unit, [&](auto unit_tag) {
    using U = typename decltype(unit_tag)::type;
    p.units_per_row = static_cast<int32_t>(row_bytes / sizeof(U));
    const int threads = SlabCopyThreads(int64_t{2} * a.shape.page_size * p.units_per_row);
    ScatterSlabsKernel<U><<<a.num_items, threads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace kvtier::cuda
