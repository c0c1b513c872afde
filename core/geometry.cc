#include "kvtier/geometry.h"

#include "absl/strings/str_format.h"

namespace kvtier {
namespace {

absl::Status OutOfRange(const char* field, int64_t value, const char* rule) {
  return absl::InvalidArgumentError(absl::StrFormat("geometry.%s = %d: %s", field, value, rule));
}

bool IsPowerOfTwo(int32_t x) { return x > 0 && (x & (x - 1)) == 0; }

}  // namespace

absl::Status Geometry::Validate() const {
  if (num_layers < 1 || num_layers > kMaxLayers) {
    return OutOfRange("num_layers", num_layers, "must be in [1, 1024]");
  }
  if (num_q_heads < 1 || num_q_heads > kMaxQueryHeads) {
    return OutOfRange("num_q_heads", num_q_heads, "must be in [1, 1024]");
  }
  if (num_kv_heads < 1 || num_kv_heads > num_q_heads) {
    return OutOfRange("num_kv_heads", num_kv_heads,
                      absl::StrFormat("must be in [1, num_q_heads = %d]", num_q_heads).c_str());
  }
  if (num_q_heads % num_kv_heads != 0) {
    return OutOfRange("num_kv_heads", num_kv_heads,
                      absl::StrFormat("must divide num_q_heads = %d", num_q_heads).c_str());
  }
  if (num_q_heads / num_kv_heads > kMaxGroupSize) {
    return OutOfRange("num_kv_heads", num_kv_heads,
                      absl::StrFormat("gives a query group of %d heads; the limit is 64",
                                      num_q_heads / num_kv_heads)
                          .c_str());
  }
  if (head_dim < kHeadDimMultiple || head_dim > kMaxHeadDim || head_dim % kHeadDimMultiple) {
    return OutOfRange("head_dim", head_dim, "must be a multiple of 8 in [8, 512]");
  }
  if (!IsPowerOfTwo(page_size) || page_size > kMaxPageSize) {
    return OutOfRange("page_size", page_size, "must be a power of two in [1, 1024]");
  }
  switch (dtype) {
    case DType::kF16:
    case DType::kBF16:
    case DType::kF32:
      return absl::OkStatus();
  }
  return OutOfRange("dtype", static_cast<int>(dtype), "must be fp16, bf16 or fp32");
}

std::string Geometry::ToString() const {
  return absl::StrFormat("L=%d Hq=%d Hkv=%d d=%d p=%d %s", num_layers, num_q_heads, num_kv_heads,
                         head_dim, page_size, DTypeName(dtype));
}

Geometry Llama31_8B() {
  Geometry g;
  g.num_layers = 32;
  g.num_q_heads = 32;
  g.num_kv_heads = 8;
  g.head_dim = 128;
  g.page_size = 32;
  g.dtype = DType::kF16;
  return g;
}

}  // namespace kvtier
