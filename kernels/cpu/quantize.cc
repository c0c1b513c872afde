// INT8 head-slot storage on the CPU (Conf-KV): QuantizeSlots writes symmetric per-channel
// INT8 copies of (slot, KV head) parts of the working set, and MoveHeadSlots moves one KV
// head's part of a slot (and its INT8 copy) to another slot when drop mode compacts.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_format.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kvtier/layout.h"
#include "core/status.h"

namespace kvtier {
namespace {

constexpr float kInt8Max = 127.0f;

// OUT_OF_RANGE naming `op: items[i].field` when `value` is not in [0, limit).
absl::Status CheckItemField(const char* op, int32_t i, const char* field, int64_t value,
                            int64_t limit) {
  if (value >= 0 && value < limit) return absl::OkStatus();
  return absl::OutOfRangeError(
      absl::StrFormat("%s: items[%d].%s = %d must be in [0, %d)", op, i, field, value, limit));
}

// x / scale rounded to nearest, ties to even (the default rounding mode), clamped to
// ±127; 0 for a zero scale and for NaN (an fp cache holding NaN has no INT8 image).
inline int8_t QuantizeValue(float x, float scale) {
  if (scale == 0.0f) return 0;
  const float r = std::nearbyint(x / scale);
  if (std::isnan(r)) return 0;
  return static_cast<int8_t>(std::clamp(r, -kInt8Max, kInt8Max));
}

// Quantises the p rows of d elements at src (NHD rows, `stride` apart) into dst (same
// offsets) with per-channel scales `scale[d]`. `rows` is scratch of p·d floats.
template <typename T>
void QuantizeHeadSlot(const T* src, int8_t* dst, float* scale, int64_t stride, int32_t p, int32_t d,
                      std::vector<float>& rows) {
  rows.resize(static_cast<size_t>(p) * d);
  for (int32_t t = 0; t < p; ++t) cpu::LoadRow(src + t * stride, d, rows.data() + int64_t{t} * d);
  std::fill(scale, scale + d, 0.0f);
  for (int32_t t = 0; t < p; ++t) {
    const float* row = rows.data() + int64_t{t} * d;
    for (int32_t c = 0; c < d; ++c) scale[c] = std::max(scale[c], std::fabs(row[c]));
  }
  for (int32_t c = 0; c < d; ++c) scale[c] /= kInt8Max;
  for (int32_t t = 0; t < p; ++t) {
    const float* row = rows.data() + int64_t{t} * d;
    int8_t* out = dst + t * stride;
    for (int32_t c = 0; c < d; ++c) out[c] = QuantizeValue(row[c], scale[c]);
  }
}

}  // namespace

// Items run in parallel: two items naming the same (slot, head) must not be given.
absl::Status CpuQuantizeSlots(const QuantizeSlotsArgs& a, ThreadPool* pool) {
  if (a.num_items == 0) return absl::OkStatus();
  for (int32_t i = 0; i < a.num_items; ++i) {
    KVTIER_RETURN_IF_ERROR(
        CheckItemField("QuantizeSlots", i, "kv_head", a.items[i].kv_head, a.shape.num_kv_heads));
    KVTIER_RETURN_IF_ERROR(
        CheckItemField("QuantizeSlots", i, "slot", a.items[i].slot, a.kv.num_slots));
  }
  const WorkingSetLayout wl{a.kv.num_slots, a.shape.page_size, a.shape.num_kv_heads,
                            a.shape.head_dim};
  return cpu::DispatchDType(a.shape.dtype, [&]<typename T>() {
    const T* src[2] = {static_cast<const T*>(a.kv.k_cache), static_cast<const T*>(a.kv.v_cache)};
    int8_t* const dst[2] = {a.kv.k_int8, a.kv.v_int8};
    float* const scale[2] = {a.kv.k_scale, a.kv.v_scale};
    ParallelFor(pool, a.num_items, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> rows;
      for (int64_t i = begin; i < end; ++i) {
        const HeadSlot& it = a.items[i];
        const int64_t off = wl.Offset(it.slot, 0, it.kv_head, 0);
        const int64_t so =
            (int64_t{it.slot} * a.shape.num_kv_heads + it.kv_head) * a.shape.head_dim;
        for (int kind = 0; kind < 2; ++kind) {
          QuantizeHeadSlot(src[kind] + off, dst[kind] + off, scale[kind] + so, wl.token_stride(),
                           a.shape.page_size, a.shape.head_dim, rows);
        }
      }
    });
    return absl::OkStatus();
  });
}

// Every item is checked before anything moves, so a failing call writes nothing. Items run
// in order on the calling thread: a later item may read what an earlier one wrote.
absl::Status CpuMoveHeadSlots(const MoveHeadSlotsArgs& a, ThreadPool* /*pool*/) {
  if (a.num_items == 0) return absl::OkStatus();
  for (int32_t i = 0; i < a.num_items; ++i) {
    const HeadSlotMove& it = a.items[i];
    KVTIER_RETURN_IF_ERROR(
        CheckItemField("MoveHeadSlots", i, "kv_head", it.kv_head, a.shape.num_kv_heads));
    KVTIER_RETURN_IF_ERROR(
        CheckItemField("MoveHeadSlots", i, "src_slot", it.src_slot, a.kv.num_slots));
    KVTIER_RETURN_IF_ERROR(
        CheckItemField("MoveHeadSlots", i, "dst_slot", it.dst_slot, a.kv.num_slots));
    if (it.src_slot == it.dst_slot) {
      return absl::InvalidArgumentError(
          absl::StrFormat("MoveHeadSlots: items[%d] moves slot %d onto itself", i, it.src_slot));
    }
  }
  const WorkingSetLayout wl{a.kv.num_slots, a.shape.page_size, a.shape.num_kv_heads,
                            a.shape.head_dim};
  const size_t elem = DTypeSize(a.shape.dtype);
  const size_t row_bytes = static_cast<size_t>(a.shape.head_dim) * elem;
  unsigned char* const fp[2] = {static_cast<unsigned char*>(a.kv.k_cache),
                                static_cast<unsigned char*>(a.kv.v_cache)};
  int8_t* const q[2] = {a.kv.k_int8, a.kv.v_int8};
  float* const scale[2] = {a.kv.k_scale, a.kv.v_scale};
  const bool with_int8 = a.kv.k_int8 != nullptr;  // ValidateArgs: all four or none
  for (int32_t i = 0; i < a.num_items; ++i) {
    const HeadSlotMove& it = a.items[i];
    for (int kind = 0; kind < 2; ++kind) {
      for (int32_t t = 0; t < a.shape.page_size; ++t) {
        const int64_t src = wl.Offset(it.src_slot, t, it.kv_head, 0);
        const int64_t dst = wl.Offset(it.dst_slot, t, it.kv_head, 0);
        std::memcpy(fp[kind] + static_cast<size_t>(dst) * elem,
                    fp[kind] + static_cast<size_t>(src) * elem, row_bytes);
        if (with_int8) {
          std::memcpy(q[kind] + dst, q[kind] + src, static_cast<size_t>(a.shape.head_dim));
        }
      }
      if (with_int8) {
        const int64_t src =
            (int64_t{it.src_slot} * a.shape.num_kv_heads + it.kv_head) * a.shape.head_dim;
        const int64_t dst =
            (int64_t{it.dst_slot} * a.shape.num_kv_heads + it.kv_head) * a.shape.head_dim;
        std::memcpy(scale[kind] + dst, scale[kind] + src,
                    static_cast<size_t>(a.shape.head_dim) * sizeof(float));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvtier
