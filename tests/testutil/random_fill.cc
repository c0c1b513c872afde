#include "tests/testutil/random_fill.h"

#include <cstring>
#include <random>

namespace kvtier::testing {

float LoadElement(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::kF16:
      return HalfToFloat(static_cast<const Half*>(base)[i]);
    case DType::kBF16:
      return BFloat16ToFloat(static_cast<const BFloat16*>(base)[i]);
    case DType::kF32:
      return static_cast<const float*>(base)[i];
  }
  return 0.0f;
}

void StoreElement(void* base, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kF16:
      static_cast<Half*>(base)[i] = FloatToHalf(v);
      return;
    case DType::kBF16:
      static_cast<BFloat16*>(base)[i] = FloatToBFloat16(v);
      return;
    case DType::kF32:
      static_cast<float*>(base)[i] = v;
      return;
  }
}

TypedBuffer::TypedBuffer(DType t, int64_t size)
    : dtype_(t), size_(size), storage_((static_cast<size_t>(size) * DTypeSize(t) + 7) / 8) {}

std::vector<float> TypedBuffer::ToFloats() const {
  std::vector<float> out(static_cast<size_t>(size_));
  for (int64_t i = 0; i < size_; ++i) out[static_cast<size_t>(i)] = Get(i);
  return out;
}

void TypedBuffer::FillNormal(uint64_t seed, float stddev) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  for (int64_t i = 0; i < size_; ++i) Set(i, dist(rng));
}

}  // namespace kvtier::testing
