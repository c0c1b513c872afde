// Test helpers: dtype-tagged host buffers with deterministic random contents.
#ifndef KVTIER_TESTS_TESTUTIL_RANDOM_FILL_H_
#define KVTIER_TESTS_TESTUTIL_RANDOM_FILL_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvtier/dtype.h"

namespace kvtier::testing {

// Element i of a `t` array as float, and the reverse (rounded to nearest even).
float LoadElement(const void* base, DType t, int64_t i);
void StoreElement(void* base, DType t, int64_t i, float v);

// A host array of `size` elements of one dtype, 8-byte aligned, zero-initialised.
class TypedBuffer {
 public:
  TypedBuffer(DType t, int64_t size);
  DType dtype() const { return dtype_; }
  int64_t size() const { return size_; }
  size_t bytes() const { return static_cast<size_t>(size_) * DTypeSize(dtype_); }
  void* data() { return storage_.data(); }
  const void* data() const { return storage_.data(); }
  float Get(int64_t i) const { return LoadElement(data(), dtype_, i); }
  void Set(int64_t i, float v) { StoreElement(data(), dtype_, i, v); }
  std::vector<float> ToFloats() const;
  // Fills with N(0, stddev²) values (rounded to the dtype), reproducible from `seed`.
  void FillNormal(uint64_t seed, float stddev = 1.0f);

 private:
  DType dtype_;
  int64_t size_;
  std::vector<uint64_t> storage_;  // 8-byte units keep the data aligned
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_TESTUTIL_RANDOM_FILL_H_
