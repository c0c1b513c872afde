#include "kvtier/dtype.h"

namespace kvtier {

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF16:
      return "fp16";
    case DType::kBF16:
      return "bf16";
    case DType::kF32:
      return "fp32";
  }
  return "unknown";
}

bool ParseDType(std::string_view name, DType* out) {
  if (name == "fp16" || name == "float16" || name == "half") {
    *out = DType::kF16;
  } else if (name == "bf16" || name == "bfloat16") {
    *out = DType::kBF16;
  } else if (name == "fp32" || name == "float32" || name == "float") {
    *out = DType::kF32;
  } else {
    return false;
  }
  return true;
}

}  // namespace kvtier
