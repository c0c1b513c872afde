// Recall transform on the GPU: one thread block per RecallItem copies the K and V slab of
// item.kv_head from its HND host page (registered host memory read zero-copy, or device
// memory) into p rows of the NHD working set (row stride Hkv·d). The slab is contiguous
// ([K|V][token][dim]), so unit u of it is unit u of the source; each thread loads its
// kSlabUnroll units before storing any (CopySlabUnits), so the whole slab is in flight over
// the link at once. Bit-exact: raw words are copied, never converted, so one kernel serves
// every dtype.
#include <cuda_runtime.h>

#include "kernels/cuda/copy_kernels.h"
#include "kernels/cuda/kernel_util.cuh"
#include "kvtier/layout.h"

namespace kvtier::cuda {
namespace {

struct RecallParams {
  const char* host_pages;
  int64_t num_host_pages;
  const RecallItem* items;
  char* cache[2];  // K, V
  int32_t num_slots;
  int32_t elem_bytes;
  int32_t units_per_row;  // row_bytes / sizeof(U)
  HostPageLayout host;
  WorkingSetLayout working_set;
  DeviceErrorSink sink;
};

// True when every index of `it` is in range; otherwise reports the first bad one.
__device__ bool CheckItem(const RecallParams& p, const RecallItem& it, int64_t index) {
  const DeviceErrorSink& s = p.sink;
  constexpr KernelOp op = KernelOp::kRecall;
  return CheckField(s, op, index, ItemField::kHostPage, it.host_page, p.num_host_pages) &&
         CheckField(s, op, index, ItemField::kKvHead, it.kv_head, p.host.num_kv_heads) &&
         CheckField(s, op, index, ItemField::kDstSlot, it.dst_slot, p.num_slots);
}

// Unit u of the slab is row u / units_per_row of [K|V][token], word u % units_per_row.
template <typename U>
__global__ void __launch_bounds__(kSlabMaxThreads) RecallKernel(const RecallParams p) {
  const int64_t index = blockIdx.x;
  const RecallItem it = p.items[index];
  if (it.host_page == kSkipItem || !CheckItem(p, it, index)) return;
  const int32_t page_size = p.host.page_size;
  const int32_t units_per_row = p.units_per_row;
  const U* slab = reinterpret_cast<const U*>(
      p.host_pages +
      (it.host_page * p.host.page_elements() + p.host.SlabOffset(it.kv_head)) * p.elem_bytes);
  const auto src_at = [slab](int32_t u) { return slab + u; };
  const NhdSlabTarget<U> dst_at = SlabTarget<U>(p, it, units_per_row, page_size);
  CopySlabUnits<U>(2 * page_size * units_per_row, src_at, dst_at);
}

}  // namespace

cudaError_t LaunchRecall(const RecallArgs& a, const DeviceErrorSink& sink, cudaStream_t stream) {
  const int32_t elem_bytes = static_cast<int32_t>(DTypeSize(a.shape.dtype));
  const size_t row_bytes = static_cast<size_t>(a.shape.head_dim) * elem_bytes;
  RecallParams p{};
  p.host_pages = static_cast<const char*>(a.host_pages);
  p.num_host_pages = a.num_host_pages;
  p.items = a.items;
  p.cache[kKey] = static_cast<char*>(a.kv.k_cache);
  p.cache[kValue] = static_cast<char*>(a.kv.v_cache);
  p.num_slots = a.kv.num_slots;
  p.elem_bytes = elem_bytes;
  p.host = HostPageLayout{a.shape.num_kv_heads, a.shape.page_size, a.shape.head_dim};
  p.working_set =
      WorkingSetLayout{a.kv.num_slots, a.shape.page_size, a.shape.num_kv_heads, a.shape.head_dim};
  p.sink = sink;
  const int unit = CopyUnitBytes(row_bytes, {a.host_pages, a.kv.k_cache, a.kv.v_cache});
  return DispatchCopyUnit(unit, [&](auto unit_tag) {
    using U = typename decltype(unit_tag)::type;
    p.units_per_row = static_cast<int32_t>(row_bytes / sizeof(U));
    const int threads = SlabCopyThreads(int64_t{2} * a.shape.page_size * p.units_per_row);
    RecallKernel<U><<<a.num_items, threads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace kvtier::cuda
