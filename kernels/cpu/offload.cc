// Offload on the CPU: NHD page → HND host page (bit-exact) plus key summaries.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_format.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kvtier/layout.h"

namespace kvtier {
namespace {

absl::Status CheckItems(const OffloadArgs& a) {
  for (int32_t i = 0; i < a.num_items; ++i) {
    const OffloadItem& it = a.items[i];
    if (it.src_slot < 0 || it.src_slot >= a.num_src_slots) {
      return absl::OutOfRangeError(absl::StrFormat(
          "Offload: items[%d].src_slot = %d must be in [0, %d)", i, it.src_slot, a.num_src_slots));
    }
    if (it.host_page < 0 || it.host_page >= a.num_host_pages) {
      return absl::OutOfRangeError(absl::StrFormat(
          "Offload: items[%d].host_page = %d must be in [0, %d)", i, it.host_page,
          a.num_host_pages));
    }
    if (it.summary_page < 0 || it.summary_page >= a.num_summary_pages) {
      return absl::OutOfRangeError(absl::StrFormat(
          "Offload: items[%d].summary_page = %d must be in [0, %d)", i, it.summary_page,
          a.num_summary_pages));
    }
  }
  return absl::OkStatus();
}

// Writes hi/lo of one (page, head) from the keys k[p][d] (already float): the bounds for
// kMinMax and kKeyCodes.
template <typename T>
void Summarise(const float* k, int32_t p, int32_t d, SummaryMode mode, T* hi, T* lo,
               std::vector<float>& acc) {
  acc.assign(static_cast<size_t>(2 * d), 0.0f);
  float* a0 = acc.data();
  float* a1 = a0 + d;
  if (mode != SummaryMode::kCenterMad) {
    for (int32_t i = 0; i < d; ++i) a0[i] = a1[i] = k[i];
    for (int32_t t = 1; t < p; ++t) {
      for (int32_t i = 0; i < d; ++i) {
        a0[i] = std::max(a0[i], k[int64_t{t} * d + i]);
        a1[i] = std::min(a1[i], k[int64_t{t} * d + i]);
      }
    }
  } else {
    for (int32_t t = 0; t < p; ++t)
      for (int32_t i = 0; i < d; ++i) a0[i] += k[int64_t{t} * d + i];
    for (int32_t i = 0; i < d; ++i) a0[i] /= static_cast<float>(p);  // centre
    for (int32_t t = 0; t < p; ++t)
      for (int32_t i = 0; i < d; ++i) a1[i] += std::fabs(k[int64_t{t} * d + i] - a0[i]);
    for (int32_t i = 0; i < d; ++i) {
      const float mad = a1[i] / static_cast<float>(p);
      const float c = a0[i];
      a0[i] = c + mad;
      a1[i] = c - mad;
    }
  }
  cpu::StoreRow(a0, d, hi);
  cpu::StoreRow(a1, d, lo);
}

// The 4-bit codes of one (page, head)'s keys k[p][d] within its stored bounds hi/lo
// (OffloadArgs::codes): rows of d/2 bytes, dimension 2m in the low nibble of byte m.
template <typename T>
void Encode(const float* k, int32_t p, int32_t d, const T* hi, const T* lo, uint8_t* rows,
            std::vector<float>& acc) {
  acc.resize(static_cast<size_t>(2 * d));
  float* l = acc.data();  // the stored bounds' lo and step of each dimension, once
  float* step = l + d;
  for (int32_t i = 0; i < d; ++i) {
    l[i] = ToFloat(lo[i]);
    step[i] = (ToFloat(hi[i]) - l[i]) / static_cast<float>(kKeyCodeLevels);
  }
  for (int32_t t = 0; t < p; ++t) {
    uint8_t* row = rows + int64_t{t} * (d / 2);
    for (int32_t i = 0; i < d; ++i) {
      int32_t c = 0;
      if (step[i] > 0.0f) {
        const float x = std::floor((k[int64_t{t} * d + i] - l[i]) / step[i]);
        c = !(x > 0.0f) ? 0 : (x >= kKeyCodeLevels - 1 ? kKeyCodeLevels - 1 : static_cast<int32_t>(x));  // NaN: 0
      }
      if (i % 2 == 0) {
        row[i / 2] = static_cast<uint8_t>(c);
      } else {
        row[i / 2] = static_cast<uint8_t>(row[i / 2] | (c << 4));
      }
    }
  }
}

template <typename T>
void OffloadOne(const OffloadArgs& a, const OffloadItem& it, std::vector<float>& keys,
                std::vector<float>& acc) {
  const int32_t p = a.shape.page_size, d = a.shape.head_dim, H = a.shape.num_kv_heads;
  const HostPageLayout hl{H, p, d};
  const WorkingSetLayout wl{1, p, H, d};  // global slot = src_slot
  const SummaryLayout sl{H, d};
  const T* src[2] = {static_cast<const T*>(a.k_src), static_cast<const T*>(a.v_src)};
  T* page = static_cast<T*>(a.host_pages) + it.host_page * hl.page_elements();
  T* sum = static_cast<T*>(a.summaries);
  keys.resize(static_cast<size_t>(p) * d);
  for (int32_t h = 0; h < H; ++h) {
    for (int32_t kind = 0; kind < 2; ++kind) {
      for (int32_t t = 0; t < p; ++t) {
        std::memcpy(page + hl.Offset(h, kind, t, 0), src[kind] + wl.Offset(it.src_slot, t, h, 0),
                    sizeof(T) * static_cast<size_t>(d));
      }
    }
    cpu::LoadRow(page + hl.Offset(h, kKey, 0, 0), p * d, keys.data());
    T* hi = sum + sl.Offset(it.summary_page, h, kHi, 0);
    T* lo = sum + sl.Offset(it.summary_page, h, kLo, 0);
    Summarise(keys.data(), p, d, a.summary, hi, lo, acc);
    if (a.summary == SummaryMode::kKeyCodes) {
      const KeyCodeLayout cl{H, p, d};
      Encode(keys.data(), p, d, hi, lo, a.codes + cl.RowOffset(it.summary_page, h, 0), acc);
    }
  }
}

}  // namespace

absl::Status CpuOffload(const OffloadArgs& a, ThreadPool* pool) {
  if (a.num_items == 0) return absl::OkStatus();
  if (absl::Status st = CheckItems(a); !st.ok()) return st;
  return cpu::DispatchDType(a.shape.dtype, [&]<typename T>() {
    ParallelFor(pool, a.num_items, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> keys, acc;
      for (int64_t i = begin; i < end; ++i) OffloadOne<T>(a, a.items[i], keys, acc);
    });
    return absl::OkStatus();
  });
}

}  // namespace kvtier
