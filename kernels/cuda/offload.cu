// Offload on the GPU: one thread block per (OffloadItem, kv_head) transposes that head's K
// and V rows of an NHD source slot into the HND host page (bit-exact word copies; the
// destination may be registered host memory, written zero-copy) and writes the head's key
// summary. Summaries follow the CPU reference (kernels/cpu/offload.cc) operation for
// operation so they match it bit for bit: fp32 arithmetic, tokens summed in order, one
// rounding (nearest even) into the dtype at the end.
#include <cuda_runtime.h>

#include "kernels/cuda/copy_kernels.h"
#include "kernels/cuda/kernel_util.cuh"
#include "kvtier/layout.h"

namespace kvtier::cuda {
namespace {

constexpr int kOffloadThreads = 128;

struct OffloadParams {
  const char* src[2];  // K, V: [num_src_slots][p][Hkv][d]
  int64_t num_src_slots;
  char* host_pages;
  int64_t num_host_pages;
  char* summaries;
  int64_t num_summary_pages;
  uint8_t* codes;  // kKeyCodes: KeyCodeLayout pages
  const OffloadItem* items;
  SummaryMode summary;
  int32_t elem_bytes;
  int32_t units_per_row;  // row_bytes / sizeof(U)
  HostPageLayout host;
  WorkingSetLayout working_set;
  SummaryLayout summary_layout;
  DeviceErrorSink sink;
};

// True when every index of `it` is in range; otherwise reports the first bad one.
__device__ bool CheckItem(const OffloadParams& p, const OffloadItem& it, int64_t index) {
  const DeviceErrorSink& s = p.sink;
  constexpr KernelOp op = KernelOp::kOffload;
  return CheckField(s, op, index, ItemField::kSrcSlot, it.src_slot, p.num_src_slots) &&
         CheckField(s, op, index, ItemField::kHostPage, it.host_page, p.num_host_pages) &&
         CheckField(s, op, index, ItemField::kSummaryPage, it.summary_page, p.num_summary_pages);
}

// NHD rows of head `h` in slot it.src_slot → the head's HND slab; unit u is row
// u / units_per_row of [K|V][token], word u % units_per_row.
template <typename U>
__device__ void Transpose(const OffloadParams& p, const OffloadItem& it, int32_t h) {
  const int32_t page_size = p.host.page_size;
  char* page = p.host_pages + it.host_page * p.host.page_elements() * p.elem_bytes;
  const int32_t units = 2 * page_size * p.units_per_row;
  for (int32_t u = threadIdx.x; u < units; u += blockDim.x) {
    const int32_t row = u / p.units_per_row;
    const int32_t word = u - row * p.units_per_row;
    const int32_t kind = row < page_size ? kKey : kValue;
    const int32_t token = row - kind * page_size;
    const U* src = reinterpret_cast<const U*>(
        p.src[kind] + p.working_set.Offset(it.src_slot, token, h, 0) * p.elem_bytes);
    U* dst = reinterpret_cast<U*>(page + p.host.Offset(h, kind, token, 0) * p.elem_bytes);
    dst[word] = src[word];
  }
}

// hi/lo of one dimension over the page's keys k[t·stride] (see SummaryMode).
template <typename T>
__device__ void SummariseDim(const T* k, int64_t stride, int32_t page_size, SummaryMode mode,
                             float* hi, float* lo) {
  if (mode != SummaryMode::kCenterMad) {  // the bounds (kMinMax, kKeyCodes)
    float mx = ToFloat(k[0]);
    float mn = mx;
    for (int32_t t = 1; t < page_size; ++t) {
      const float x = ToFloat(k[t * stride]);
      mx = mx < x ? x : mx;  // std::max(mx, x), as the CPU reference
      mn = x < mn ? x : mn;  // std::min(mn, x)
    }
    *hi = mx;
    *lo = mn;
    return;
  }
  float sum = 0.0f;
  for (int32_t t = 0; t < page_size; ++t) sum += ToFloat(k[t * stride]);
  const float centre = sum / static_cast<float>(page_size);
  float dev = 0.0f;
  for (int32_t t = 0; t < page_size; ++t) dev += fabsf(ToFloat(k[t * stride]) - centre);
  const float mad = dev / static_cast<float>(page_size);
  *hi = centre + mad;
  *lo = centre - mad;
}

template <typename U, typename T>
__global__ void __launch_bounds__(kOffloadThreads) OffloadKernel(const OffloadParams p) {
  const int64_t index = blockIdx.x;
  const int32_t h = static_cast<int32_t>(blockIdx.y);
  const OffloadItem it = p.items[index];
  if (!CheckItem(p, it, index)) return;
  Transpose<U>(p, it, h);
  const T* keys = reinterpret_cast<const T*>(p.src[kKey]);
  T* summaries = reinterpret_cast<T*>(p.summaries);
  const SummaryLayout& sl = p.summary_layout;
  for (int32_t i = threadIdx.x; i < p.host.head_dim; i += blockDim.x) {
    float hi;
    float lo;
    SummariseDim(keys + p.working_set.Offset(it.src_slot, 0, h, i), p.working_set.token_stride(),
                 p.host.page_size, p.summary, &hi, &lo);
    summaries[sl.Offset(it.summary_page, h, kHi, i)] = FromFloat<T>(hi);
    summaries[sl.Offset(it.summary_page, h, kLo, i)] = FromFloat<T>(lo);
  }
  if (p.summary != SummaryMode::kKeyCodes) return;
  // The codes within the stored (rounded) bounds, as the CPU reference computes them: byte m
  // of a token's row holds dimensions 2m (low nibble) and 2m + 1.
  __syncthreads();  // this block's summaries are written
  const KeyCodeLayout cl{p.host.num_kv_heads, p.host.page_size, p.host.head_dim};
  uint8_t* rows = p.codes + cl.RowOffset(it.summary_page, h, 0);
  const int64_t bytes = int64_t{p.host.page_size} * cl.row_bytes();
  for (int64_t u = threadIdx.x; u < bytes; u += blockDim.x) {
    const auto t = static_cast<int32_t>(u / cl.row_bytes());
    const auto m = static_cast<int32_t>(u - t * cl.row_bytes());
    uint32_t byte = 0;
    for (int32_t half = 0; half < 2; ++half) {
      const int32_t i = 2 * m + half;
      const float l = ToFloat(summaries[sl.Offset(it.summary_page, h, kLo, i)]);
      const float hv = ToFloat(summaries[sl.Offset(it.summary_page, h, kHi, i)]);
      const float step = __fdiv_rn(__fsub_rn(hv, l), static_cast<float>(kKeyCodeLevels));
      uint32_t c = 0;
      if (step > 0.0f) {
        const float k = ToFloat(keys[p.working_set.Offset(it.src_slot, t, h, i)]);
        const float x = floorf(__fdiv_rn(__fsub_rn(k, l), step));
        c = !(x > 0.0f) ? 0u : (x >= kKeyCodeLevels - 1 ? kKeyCodeLevels - 1u : static_cast<uint32_t>(x));  // NaN: 0
      }
      byte |= c << (4 * half);
    }
    rows[u] = static_cast<uint8_t>(byte);
  }
}

}  // namespace

cudaError_t LaunchOffload(const OffloadArgs& a, const DeviceErrorSink& sink, cudaStream_t stream) {
  const int32_t elem_bytes = static_cast<int32_t>(DTypeSize(a.shape.dtype));
  const size_t row_bytes = static_cast<size_t>(a.shape.head_dim) * elem_bytes;
  OffloadParams p{};
  p.src[kKey] = static_cast<const char*>(a.k_src);
  p.src[kValue] = static_cast<const char*>(a.v_src);
  p.num_src_slots = a.num_src_slots;
  p.host_pages = static_cast<char*>(a.host_pages);
  p.num_host_pages = a.num_host_pages;
  p.summaries = static_cast<char*>(a.summaries);
  p.num_summary_pages = a.num_summary_pages;
  p.codes = a.codes;
  p.items = a.items;
  p.summary = a.summary;
  p.elem_bytes = elem_bytes;
  p.host = HostPageLayout{a.shape.num_kv_heads, a.shape.page_size, a.shape.head_dim};
  // Global slot = src_slot; the slot count only bounds-checks, which the kernel does.
  p.working_set = WorkingSetLayout{1, a.shape.page_size, a.shape.num_kv_heads, a.shape.head_dim};
  p.summary_layout = SummaryLayout{a.shape.num_kv_heads, a.shape.head_dim};
  p.sink = sink;
  const dim3 grid(static_cast<unsigned>(a.num_items), static_cast<unsigned>(a.shape.num_kv_heads));
  const int unit = CopyUnitBytes(row_bytes, {a.k_src, a.v_src, a.host_pages});
  return DispatchElement(a.shape.dtype, [&](auto element_tag) {
    using T = typename decltype(element_tag)::type;
    return DispatchCopyUnit(unit, [&](auto unit_tag) {
      using U = typename decltype(unit_tag)::type;
      p.units_per_row = static_cast<int32_t>(row_bytes / sizeof(U));
      OffloadKernel<U, T><<<grid, kOffloadThreads, 0, stream>>>(p);
      return cudaGetLastError();
    });
  });
}

}  // namespace kvtier::cuda
