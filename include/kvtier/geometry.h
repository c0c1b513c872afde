// Geometry: the shape of one model's KV cache as kvtier stores it. Validated once, at the
// boundary (session open, benchmark flags); every other component trusts a validated one.
//
// A value type; thread-safe to share.
#ifndef KVTIER_GEOMETRY_H_
#define KVTIER_GEOMETRY_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "kvtier/dtype.h"

namespace kvtier {

struct Geometry {
  // Limits Validate() enforces. Wide enough for every public model; narrow enough that
  // every element offset of a working set or host page fits int64 with room to spare.
  static constexpr int32_t kMaxLayers = 1024;
  static constexpr int32_t kMaxQueryHeads = 1024;
  static constexpr int32_t kMaxGroupSize = 64;   // query heads per KV head
  static constexpr int32_t kMaxHeadDim = 512;    // elements
  static constexpr int32_t kHeadDimMultiple = 8; // 16-byte rows for fp16/bf16
  static constexpr int32_t kMaxPageSize = 1024;  // tokens, a power of two

  int32_t num_layers = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;    // elements
  int32_t page_size = 32;  // tokens per page
  DType dtype = DType::kF16;

  // OK, or INVALID_ARGUMENT naming the first field that is out of range and its limit,
  // e.g. "geometry.head_dim = 100: must be a multiple of 8 in [8, 512]".
  absl::Status Validate() const;

  // REQUIRES: Validate() is OK for everything below.
  int32_t group_size() const { return num_q_heads / num_kv_heads; }
  size_t element_bytes() const { return DTypeSize(dtype); }
  // Elements of one (page, kv_head) K+V slab in the host tier: 2·p·d.
  int64_t slab_elements() const { return int64_t{2} * page_size * head_dim; }
  // Bytes of one host page (all KV heads of one layer): Hkv·2·p·d·elem.
  size_t host_page_bytes() const {
    return static_cast<size_t>(num_kv_heads) * slab_elements() * element_bytes();
  }
  // Bytes of one page's summaries (hi and lo per KV head): Hkv·2·d·elem.
  size_t summary_bytes() const {
    return static_cast<size_t>(num_kv_heads) * 2 * head_dim * element_bytes();
  }
  // Bytes of one page's key codes (SummaryMode::kKeyCodes, KeyCodeLayout): Hkv·p·d/2.
  size_t key_code_bytes() const {
    return static_cast<size_t>(num_kv_heads) * page_size * (head_dim / 2);
  }

  // "L=32 Hq=32 Hkv=8 d=128 p=32 fp16".
  std::string ToString() const;

  friend bool operator==(const Geometry&, const Geometry&) = default;
};

// Llama-3.1-8B: 32 layers, 32 query heads, 8 KV heads, d = 128, p = 32, fp16.
Geometry Llama31_8B();

}  // namespace kvtier

#endif  // KVTIER_GEOMETRY_H_
