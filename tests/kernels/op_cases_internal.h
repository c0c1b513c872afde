// Internals of the op table (op_cases.h) shared by its sources: naming and seeding cases,
// input helpers, the working-set buffers of an op, the head shapes of the per-query-head
// ops, and each op family's cases (op_cases_<family>.cc).
#ifndef KVTIER_TESTS_KERNELS_OP_CASES_INTERNAL_H_
#define KVTIER_TESTS_KERNELS_OP_CASES_INTERNAL_H_

#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "tests/kernels/op_cases.h"
#include "tests/testutil/random_fill.h"

namespace kvtier::testing::op_cases_internal {

inline constexpr float kInf = std::numeric_limits<float>::infinity();
inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<int32_t> Iota(int32_t n);  // 0, 1, …, n − 1
float ScaleOf(int32_t head_dim);       // the softmax scale 1/√d

// A TypedBuffer of `n` elements, all `value` (outputs start as a sentinel, so entries an
// op must not write are compared too).
TypedBuffer Filled(DType t, int64_t n, float value);

// A cache of `slots` working-set slots of shape `s` with N(0, stddev²) contents from `seed`.
TypedBuffer RandomCache(const KvShape& s, int32_t slots, uint32_t seed, float stddev = 1.0f);

// A case is made by a maker from the case's seed; Add names the case and binds its seed (a
// hash of the name).
using Maker = std::function<OpRun(uint32_t seed)>;
void Add(std::vector<OpCase>& cases, std::string name, Maker make);

// A working set among an op's buffers: K and V caches of `slots` slots.
struct WorkingSetBuffers {
  int32_t slots = 0;
  int64_t elements = 0;  // of each cache
  int k = -1, v = -1;

  // Adds the caches, `offset` bytes off their alignment.
  WorkingSetBuffers(OpBuffers& in, int32_t num_slots, const TypedBuffer& k_cache,
                    const TypedBuffer& v_cache, size_t offset = 0);
  // The caches and num_slots at `p`.
  PagedKv At(const OpPtrs& p) const;
  // The caches bit for bit, elements of DTypeSize(t).
  void ExpectSameCaches(const OpResult& want, const OpResult& got, DType t) const;
  std::vector<int> Indices() const;  // of every buffer given
};

// The per-query-head ops (scoring, cosine, attention) sweep Hkv = 2 KV heads of `group`
// query heads each over `batch` sequences.
inline constexpr int32_t kHkv = 2;
struct HeadShape {
  DType dtype;
  int32_t group;
  int32_t head_dim;
  int32_t batch;
};
std::vector<HeadShape> HeadShapes();
std::string NameOf(const HeadShape& s);  // "f16_g4_d128_b3"
KvShape ShapeOf(const HeadShape& s, int32_t page_size = 0);
inline int32_t QueryHeads(const HeadShape& s) { return kHkv * s.group; }

// Each family's cases.
// ScorePages, TopK, QueryCosine, SelectionLoss, Replace
void AddSelectionCases(std::vector<OpCase>& cases);
void AddAttentionCases(std::vector<OpCase>& cases);  // SparseAttention, DenseAttention
void AddPageCases(std::vector<OpCase>& cases);       // Recall, the slab halves, Offload, slot ops
void AddErrorCases(std::vector<OpCase>& cases);      // data-dependent errors of every op
void AddDecodeCases(std::vector<OpCase>& cases);     // the hot ops at decode size
void AddPerfCases(std::vector<OpCase>& cases);       // PerfOpCases

}  // namespace kvtier::testing::op_cases_internal

#endif  // KVTIER_TESTS_KERNELS_OP_CASES_INTERNAL_H_
