// Decode attention on the CPU: sparse over a paged working set with per-KV-head slot tables,
// and dense over contiguous KV (the reference). Both stream blocks of tokens through one
// online-softmax accumulator per query head (fp32), convert each K/V row once per query
// group (GQA), and split long contexts into chunks merged afterwards (split-K) so a batch of
// few heads still uses every thread. Sparse attention also takes a causal limit and, on
// request, a second pass that writes every token's softmax probability.
//
// Two implementations share the sources (which tokens a block holds) and the checks: the
// scalar reference (GroupState below: the loops every other kernel is tested against, and
// the old speed kept reachable as cpu::Isa::kScalar), and the vectorised one
// (attention_simd.inc, compiled for AVX2 and AVX-512 and chosen at run time), written for
// the memory system: q converted and pre-scaled once, one task per (sequence, range of
// blocks) over every KV head so each thread streams a contiguous part of NHD K/V, all query
// heads of a group per pass over a row, a vectorised exp, and the next block prefetched.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_format.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/simd.h"
#include "kernels/cpu/thread_pool.h"
#include "kvtier/layout.h"

namespace kvtier {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int32_t kDenseBlock = 32;       // tokens per dense block
constexpr int64_t kMinBlocksPerChunk = 8;  // below this, splitting costs more than it gains

// Online-softmax state of one query group: per head the running max m, sum l, and acc[d].
struct GroupState {
  int32_t G, d;
  std::vector<float> m, l, acc;
  std::vector<float> qf, kf, vf, s;  // scratch: q[G][d], k[n][d], v[n][d], scores[G][n]

  GroupState(int32_t groups, int32_t dim) : G(groups), d(dim) {}

  void Reset() {
    m.assign(static_cast<size_t>(G), kNegInf);
    l.assign(static_cast<size_t>(G), 0.0f);
    acc.assign(static_cast<size_t>(G) * d, 0.0f);
  }

  // Folds in n tokens whose K and V rows start at k and v, `stride` elements apart.
  template <typename T>
  KVTIER_CPU_INLINE void AddBlock(const T* k, const T* v, int64_t stride, int32_t n, float scale) {
    LoadRows(k, stride, n, kf);
    LoadRows(v, stride, n, vf);
    Fold(n, scale);
  }

  // dst[t][i] = float(src[t·stride + i]) for n rows of d.
  template <typename T>
  KVTIER_CPU_INLINE void LoadRows(const T* src, int64_t stride, int32_t n,
                                  std::vector<float>& dst) const {
    dst.resize(static_cast<size_t>(n) * d);
    for (int32_t t = 0; t < n; ++t) cpu::LoadRow(src + t * stride, d, dst.data() + int64_t{t} * d);
  }

  // The scaled score of query g against loaded key t: the one formula both passes use, so
  // token_prob reproduces the weights of the output exactly.
  KVTIER_CPU_INLINE float Score(int32_t g, int32_t t, float scale) const {
    return scale * cpu::Dot(qf.data() + int64_t{g} * d, kf.data() + int64_t{t} * d, d);
  }

  // Folds the n tokens loaded in kf/vf into the running state.
  KVTIER_CPU_INLINE void Fold(int32_t n, float scale) {
    s.resize(static_cast<size_t>(G) * n);
    for (int32_t g = 0; g < G; ++g) {
      float* sg = s.data() + int64_t{g} * n;
      float bm = kNegInf;
      for (int32_t t = 0; t < n; ++t) {
        sg[t] = Score(g, t, scale);
        bm = std::max(bm, sg[t]);
      }
      const float new_m = std::max(m[g], bm);
      const float corr = std::exp(m[g] - new_m);  // 0 when m was -inf
      float* ag = acc.data() + int64_t{g} * d;
      float sum = l[g] * corr;
      for (int32_t i = 0; i < d; ++i) ag[i] *= corr;
      for (int32_t t = 0; t < n; ++t) {
        const float w = std::exp(sg[t] - new_m);
        sum += w;
        const float* vt = vf.data() + int64_t{t} * d;
        for (int32_t i = 0; i < d; ++i) ag[i] += w * vt[i];
      }
      l[g] = sum;
      m[g] = new_m;
    }
  }
};

// Where a chunk's partial result goes: m, l, then acc[d], per query head of the group.
inline float* PartialAt(std::vector<float>& partials, int64_t task, int32_t g, int32_t G,
                        int32_t d) {
  return partials.data() + (task * G + g) * (int64_t{d} + 2);
}

// Writes one query head's merged result: out = acc / l in the dtype, lse = m + log l, and
// (m, l) when final_ml is wanted; a head that attended nothing gets zeros and lse = -inf.
template <typename T>
void FinishHead(float m, float l, std::vector<float>& acc, T* out, float* lse, float* final_ml,
                int64_t i) {
  const float inv = l > 0 ? 1.0f / l : 0.0f;
  for (float& x : acc) x *= inv;
  cpu::StoreRow(acc.data(), static_cast<int32_t>(acc.size()), out);
  if (lse != nullptr) lse[i] = l > 0 ? m + std::log(l) : kNegInf;
  if (final_ml != nullptr) {
    final_ml[2 * i] = m;
    final_ml[2 * i + 1] = l;
  }
}

// Runs attention for every (batch, kv head) over `source`, which yields blocks of tokens:
//   int64_t NumBlocks(b) const;
//   void Fold(GroupState& st, b, h, blk, stride, scale) const;  // st.AddBlock*(its tokens)
// The source's rows are NHD, Hkv·d elements apart. When `final_ml` is not null it gets the
// final (max, sum) of every (batch, query head), [B][Hq][2]: the token_prob pass needs them.
template <typename T, typename Source>
void RunAttention(const Source& src, int32_t B, int32_t Hq, int32_t Hkv, int32_t d, float scale,
                  const void* q_ptr, void* out_ptr, float* lse, float* final_ml, ThreadPool* pool) {
  const int32_t G = Hq / Hkv;
  const HeadsLayout ql{Hq, d};
  int64_t max_blocks = 1;
  for (int32_t b = 0; b < B; ++b) max_blocks = std::max(max_blocks, src.NumBlocks(b));
  const int64_t threads = pool != nullptr ? pool->num_threads() : 1;
  const int64_t want = (2 * threads + int64_t{B} * Hkv - 1) / (int64_t{B} * Hkv);
  const int64_t chunks =
      std::clamp<int64_t>(want, 1, std::max<int64_t>(1, max_blocks / kMinBlocksPerChunk));
  const int64_t per_chunk = (max_blocks + chunks - 1) / chunks;
  const int64_t tasks = int64_t{B} * Hkv * chunks;
  std::vector<float> partials(static_cast<size_t>(tasks * G * (int64_t{d} + 2)));
  const T* q = static_cast<const T*>(q_ptr);
  const int64_t stride = int64_t{Hkv} * d;

  ParallelFor(pool, tasks, 1, [&](int64_t begin, int64_t end) {
    GroupState st(G, d);
    st.qf.resize(static_cast<size_t>(G) * d);
    for (int64_t task = begin; task < end; ++task) {
      const auto c = task % chunks;
      const auto h = static_cast<int32_t>((task / chunks) % Hkv);
      const auto b = static_cast<int32_t>(task / chunks / Hkv);
      for (int32_t g = 0; g < G; ++g) cpu::LoadRow(q + ql.Offset(b, h * G + g, 0), d, st.qf.data() + int64_t{g} * d);
      st.Reset();
      AttendChunk(src, st, b, h, c * per_chunk, std::min(src.NumBlocks(b), (c + 1) * per_chunk), stride, scale);
      for (int32_t g = 0; g < G; ++g) {
        float* part = PartialAt(partials, task, g, G, d);
        part[0] = st.m[g];
        part[1] = st.l[g];
        std::copy_n(st.acc.data() + int64_t{g} * d, d, part + 2);
      }
    }
  });

  // Merge the chunks of each (batch, query head): rescale to the common max and add.
  T* out = static_cast<T*>(out_ptr);
  ParallelFor(pool, int64_t{B} * Hq, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(d));
    for (int64_t i = begin; i < end; ++i) {
      const auto b = static_cast<int32_t>(i / Hq);
      const auto hq = static_cast<int32_t>(i % Hq);
      const int32_t h = KvHeadOfQueryHead(hq, G), g = hq % G;
      const int64_t first = (int64_t{b} * Hkv + h) * chunks;
      float m = kNegInf;
      for (int64_t c = 0; c < chunks; ++c) m = std::max(m, PartialAt(partials, first + c, g, G, d)[0]);
      float l = 0;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t c = 0; c < chunks && m != kNegInf; ++c) {
        const float* part = PartialAt(partials, first + c, g, G, d);
        if (part[1] == 0) continue;
        const float w = std::exp(part[0] - m);
        l += part[1] * w;
        for (int32_t j = 0; j < d; ++j) acc[static_cast<size_t>(j)] += part[2 + j] * w;
      }
      FinishHead(m, l, acc, out + ql.Offset(b, hq, 0), lse, final_ml, i);
    }
  });
}

// What the vectorised kernel needs of one block of one KV head: its n tokens' K and V rows
// (dtype T), `stride` elements apart, and
// where the raw scores go for token_prob (head g of the group at raw + g·raw_stride).
struct AttentionBlock {
  int32_t n = 0;
  int64_t stride = 0;
  const void* k = nullptr;
  const void* v = nullptr;
  float* raw = nullptr;
  int64_t raw_stride = 0;
};

// A block's K and V across every KV head: contiguous in NHD, `bytes` each. The vectorised
// kernel prefetches the next block's region while it computes this one.
struct BlockRegion {
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t bytes = 0;
};

// Blocks of a working set: block = slot; per KV head, only slots holding a page count, and
// of those only the tokens at or before the query position.
template <typename T>
struct SparseSource {
  const SparseAttentionArgs& a;
  WorkingSetLayout wl;
  SlotTableLayout tl;

  KVTIER_CPU_INLINE int64_t NumBlocks(int32_t) const { return a.kv.num_slots; }

  // Tokens of `slot` that (b, h) attends, a prefix of the slot: 0 for an empty slot.
  KVTIER_CPU_INLINE int32_t Tokens(int32_t b, int32_t h, int32_t slot) const {
    const int32_t page = a.kv.slot_table[tl.Offset(b, h, slot)];
    if (page < 0) return 0;
    int32_t n = page == a.kv.partial_page[b] ? a.kv.partial_len[b] : a.shape.page_size;
    if (a.query_position != nullptr) {
      const int64_t first = int64_t{page} * a.shape.page_size;  // position of token 0
      const int64_t qpos = a.query_position[b];
      if (qpos < first) return 0;
      if (qpos - first < n) n = static_cast<int32_t>(qpos - first + 1);
    }
    return n;
  }

  KVTIER_CPU_INLINE void Fold(GroupState& st, int32_t b, int32_t h, int64_t blk, int64_t stride,
                              float scale) const {
    const auto slot = static_cast<int32_t>(blk);
    const int32_t n = Tokens(b, h, slot);
    if (n <= 0) return;
    const int64_t off = wl.Offset(b, slot, 0, h, 0);
    st.AddBlock(static_cast<const T*>(a.kv.k_cache) + off,
                static_cast<const T*>(a.kv.v_cache) + off, stride, n, scale);
  }

  // The vectorised kernel's view (attention_simd.inc).
  int32_t num_kv_heads() const { return a.shape.num_kv_heads; }
  int32_t head_dim() const { return a.shape.head_dim; }
  int32_t group() const { return a.shape.num_q_heads / a.shape.num_kv_heads; }
  int32_t max_block_tokens() const { return a.shape.page_size; }
  AttentionBlock Block(int32_t b, int32_t h, int64_t blk) const {
    AttentionBlock bl;
    const auto slot = static_cast<int32_t>(blk);
    bl.n = Tokens(b, h, slot);
    if (bl.n <= 0) return bl;
    bl.stride = wl.token_stride();
    const int64_t off = wl.Offset(b, slot, 0, h, 0);
    bl.k = static_cast<const T*>(a.kv.k_cache) + off;
    bl.v = static_cast<const T*>(a.kv.v_cache) + off;
    if (a.token_prob != nullptr) {
      const int32_t G = group(), p = a.shape.page_size;
      const int64_t hq = int64_t{b} * a.shape.num_q_heads + int64_t{h} * G;
      bl.raw = a.token_prob + (hq * a.kv.num_slots + slot) * p;
      bl.raw_stride = int64_t{a.kv.num_slots} * p;
    }
    return bl;
  }
  // The caches of the slot.
  BlockRegion Region(int32_t b, int64_t blk) const {
    const int64_t off = wl.Offset(b, static_cast<int32_t>(blk), 0, 0, 0);
    return BlockRegion{static_cast<const T*>(a.kv.k_cache) + off,
                       static_cast<const T*>(a.kv.v_cache) + off,
                       wl.slot_elements() * static_cast<int64_t>(sizeof(T))};
  }

  // Loads the keys of the first n tokens of `slot` for (b, h) into st.kf.
  KVTIER_CPU_INLINE void LoadKeys(GroupState& st, int32_t b, int32_t h, int32_t slot, int32_t n,
                                  int64_t stride) const {
    const int64_t off = wl.Offset(b, slot, 0, h, 0);
    st.LoadRows(static_cast<const T*>(a.kv.k_cache) + off, stride, n, st.kf);
  }
};

// Blocks of contiguous KV: kDenseBlock tokens each, the last one partial.
template <typename T>
struct DenseSource {
  const DenseAttentionArgs& a;
  DenseKvLayout kl;

  KVTIER_CPU_INLINE int64_t NumBlocks(int32_t b) const { return (a.seq_len[b] + kDenseBlock - 1) / kDenseBlock; }
  KVTIER_CPU_INLINE void Fold(GroupState& st, int32_t b, int32_t h, int64_t blk, int64_t stride,
                              float scale) const {
    const auto first = static_cast<int32_t>(blk * kDenseBlock);
    const int32_t n = std::min(kDenseBlock, a.seq_len[b] - first);
    if (n <= 0) return;
    const int64_t off = kl.Offset(b, first, h, 0);
    st.AddBlock(static_cast<const T*>(a.k) + off, static_cast<const T*>(a.v) + off, stride, n,
                scale);
  }

  // The vectorised kernel's view (attention_simd.inc).
  int32_t num_kv_heads() const { return a.shape.num_kv_heads; }
  int32_t head_dim() const { return a.shape.head_dim; }
  int32_t group() const { return a.shape.num_q_heads / a.shape.num_kv_heads; }
  int32_t max_block_tokens() const { return kDenseBlock; }
  AttentionBlock Block(int32_t b, int32_t h, int64_t blk) const {
    AttentionBlock bl;
    const auto first = static_cast<int32_t>(blk * kDenseBlock);
    bl.n = std::min(kDenseBlock, a.seq_len[b] - first);
    if (bl.n <= 0) return bl;
    bl.stride = int64_t{a.shape.num_kv_heads} * a.shape.head_dim;
    const int64_t off = kl.Offset(b, first, h, 0);
    bl.k = static_cast<const T*>(a.k) + off;
    bl.v = static_cast<const T*>(a.v) + off;
    return bl;
  }
  BlockRegion Region(int32_t b, int64_t blk) const {
    const auto first = static_cast<int32_t>(blk * kDenseBlock);
    const int32_t n = std::max(0, std::min(kDenseBlock, a.seq_len[b] - first));
    const int64_t off = kl.Offset(b, first, 0, 0);
    return BlockRegion{static_cast<const T*>(a.k) + off, static_cast<const T*>(a.v) + off,
                       int64_t{n} * a.shape.num_kv_heads * a.shape.head_dim *
                           static_cast<int64_t>(sizeof(T))};
  }
};

// Folds blocks [first, last) of (b, h) into `st`: the hot loop of both attentions.
template <typename Source>
KVTIER_CPU_INLINE void AttendBlocks(const Source& src, GroupState& st, int32_t b, int32_t h,
                                    int64_t first, int64_t last, int64_t stride, float scale) {
  for (int64_t blk = first; blk < last; ++blk) src.Fold(st, b, h, blk, stride, scale);
}

// One multi-versioned entry per (source, dtype): AttendChunk overloads pick them.
#define KVTIER_ATTEND_CHUNK(Source, T)                                                           \
  KVTIER_CPU_CLONES void AttendChunk(const Source<T>& src, GroupState& st, int32_t b, int32_t h, \
                                     int64_t first, int64_t last, int64_t stride, float scale) { \
    AttendBlocks(src, st, b, h, first, last, stride, scale);                                     \
  }
KVTIER_ATTEND_CHUNK(SparseSource, Half)
KVTIER_ATTEND_CHUNK(SparseSource, BFloat16)
KVTIER_ATTEND_CHUNK(SparseSource, float)
KVTIER_ATTEND_CHUNK(DenseSource, Half)
KVTIER_ATTEND_CHUNK(DenseSource, BFloat16)
KVTIER_ATTEND_CHUNK(DenseSource, float)
#undef KVTIER_ATTEND_CHUNK

// token_prob of the (b, h, s) entries [begin, end) of [B][Hkv][S]: recomputes each attended
// token's score with Score (as Fold did) and normalises it by the final max and sum of its
// query head; unattended tokens get 0. `st.qf` holds the queries of `*loaded` (b·Hkv + h).
template <typename T>
KVTIER_CPU_INLINE void TokenProbRange(const SparseSource<T>& src, GroupState& st,
                                      const float* final_ml, int64_t begin, int64_t end,
                                      int64_t* loaded) {
  const SparseAttentionArgs& a = src.a;
  const int32_t G = st.G, d = st.d, S = a.kv.num_slots, p = a.shape.page_size,
                Hq = a.shape.num_q_heads;
  const int64_t stride = int64_t{a.shape.num_kv_heads} * d;
  const HeadsLayout ql{Hq, d};
  const T* q = static_cast<const T*>(a.q);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t bh = i / S;
    const auto s = static_cast<int32_t>(i % S);
    const auto b = static_cast<int32_t>(bh / a.shape.num_kv_heads);
    const auto h = static_cast<int32_t>(bh % a.shape.num_kv_heads);
    if (bh != *loaded) {
      for (int32_t g = 0; g < G; ++g) {
        cpu::LoadRow(q + ql.Offset(b, h * G + g, 0), d, st.qf.data() + int64_t{g} * d);
      }
      *loaded = bh;
    }
    const int32_t n = src.Tokens(b, h, s);
    if (n > 0) src.LoadKeys(st, b, h, s, n, stride);
    for (int32_t g = 0; g < G; ++g) {
      const int64_t hq = int64_t{b} * Hq + h * G + g;
      float* prob = a.token_prob + (hq * S + s) * p;
      const float m = final_ml[2 * hq], l = final_ml[2 * hq + 1];
      const float inv = l > 0 ? 1.0f / l : 0.0f;
      for (int32_t t = 0; t < n; ++t) prob[t] = std::exp(st.Score(g, t, a.softmax_scale) - m) * inv;
      std::fill(prob + n, prob + p, 0.0f);
    }
  }
}

#define KVTIER_TOKEN_PROBS(T)                                                          \
  KVTIER_CPU_CLONES void TokenProbs(const SparseSource<T>& src, GroupState& st,        \
                                    const float* final_ml, int64_t begin, int64_t end, \
                                    int64_t* loaded) {                                 \
    TokenProbRange(src, st, final_ml, begin, end, loaded);                             \
  }
KVTIER_TOKEN_PROBS(Half)
KVTIER_TOKEN_PROBS(BFloat16)
KVTIER_TOKEN_PROBS(float)
#undef KVTIER_TOKEN_PROBS

// The second pass of sparse attention when token_prob is wanted.
template <typename T>
void WriteTokenProbs(const SparseSource<T>& src, const float* final_ml, ThreadPool* pool) {
  const SparseAttentionArgs& a = src.a;
  const int32_t G = a.shape.num_q_heads / a.shape.num_kv_heads;
  ParallelFor(pool, int64_t{a.batch} * a.shape.num_kv_heads * a.kv.num_slots, 16,
              [&](int64_t begin, int64_t end) {
                GroupState st(G, a.shape.head_dim);
                st.qf.resize(static_cast<size_t>(G) * a.shape.head_dim);
                int64_t loaded = -1;
                TokenProbs(src, st, final_ml, begin, end, &loaded);
              });
}


#if KVTIER_CPU_SIMD
// The vectorised kernel, once per instruction set.
KVTIER_SIMD_BEGIN_AVX2
namespace simd_avx2 {
using V = cpu::Avx2;
#include "kernels/cpu/attention_simd.inc"
}  // namespace simd_avx2
KVTIER_SIMD_END
KVTIER_SIMD_BEGIN_AVX512
namespace simd_avx512 {
using V = cpu::Avx512;
#include "kernels/cpu/attention_simd.inc"
}  // namespace simd_avx512
KVTIER_SIMD_END
#endif

// The vectorised attention over `src` (isa kAvx2 or kAvx512): one task per (sequence, chunk
// of blocks) covering every KV head, its state in `partials` (per task: (m, l) per query
// head, then acc[Hq][d]), merged per query head afterwards as RunAttention does.
template <typename T, typename Source>
void RunAttentionSimd(cpu::Isa isa, const Source& src, int32_t B, int32_t Hq, int32_t d,
                      float scale, const void* q_ptr, void* out_ptr, float* lse, float* final_ml,
                      ThreadPool* pool) {
  const int32_t G = src.group();
  const HeadsLayout ql{Hq, d};
  const T* q = static_cast<const T*>(q_ptr);
  std::vector<float> qf(static_cast<size_t>(B) * Hq * d);  // [B][Hq][d], times scale
  for (int64_t i = 0; i < int64_t{B} * Hq; ++i) {
    float* row = qf.data() + i * d;
    cpu::LoadRow(q + ql.Offset(static_cast<int32_t>(i / Hq), static_cast<int32_t>(i % Hq), 0), d,
                 row);
    for (int32_t j = 0; j < d; ++j) row[j] *= scale;
  }
  int64_t max_blocks = 1;
  for (int32_t b = 0; b < B; ++b) max_blocks = std::max(max_blocks, src.NumBlocks(b));
  const int64_t threads = pool != nullptr ? pool->num_threads() : 1;
  const int64_t chunks = std::clamp<int64_t>((2 * threads + B - 1) / B, 1,
                                             std::max<int64_t>(1, max_blocks / kMinBlocksPerChunk));
  const int64_t per_chunk = (max_blocks + chunks - 1) / chunks;
  const int64_t tasks = int64_t{B} * chunks;
  const int64_t task_floats = int64_t{Hq} * (d + 2);
  std::vector<float> partials(static_cast<size_t>(tasks * task_floats));
  const int64_t scratch_floats =
      int64_t{G} * ((src.max_block_tokens() + 15) / 16 * 16) + G;

  ParallelFor(pool, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(scratch_floats));
    for (int64_t task = begin; task < end; ++task) {
      const auto b = static_cast<int32_t>(task / chunks);
      const int64_t c = task % chunks;
      float* ml = partials.data() + task * task_floats;
      float* acc = ml + 2 * int64_t{Hq};
      for (int32_t i = 0; i < Hq; ++i) {
        ml[2 * i] = kNegInf;
        ml[2 * i + 1] = 0;
      }
      std::fill(acc, acc + int64_t{Hq} * d, 0.0f);
      const int64_t first = c * per_chunk, last = std::min(src.NumBlocks(b), first + per_chunk);
      if (first >= last) continue;
      const float* qb = qf.data() + int64_t{b} * Hq * d;
#if KVTIER_CPU_SIMD
      if (isa == cpu::Isa::kAvx512) {
        simd_avx512::AttendRange<T>(src, qb, b, first, last, ml, acc, scratch.data());
      } else {
        simd_avx2::AttendRange<T>(src, qb, b, first, last, ml, acc, scratch.data());
      }
#else
      (void)isa, (void)qb;
#endif
    }
  });

  T* out = static_cast<T*>(out_ptr);
  ParallelFor(pool, int64_t{B} * Hq, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(d));
    for (int64_t i = begin; i < end; ++i) {
      const auto b = static_cast<int32_t>(i / Hq);
      const auto hq = static_cast<int32_t>(i % Hq);
      const float* first = partials.data() + int64_t{b} * chunks * task_floats;
      float m = kNegInf;
      for (int64_t c = 0; c < chunks; ++c) m = std::max(m, first[c * task_floats + 2 * hq]);
      float l = 0;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t c = 0; c < chunks && m != kNegInf; ++c) {
        const float* ml = first + c * task_floats;
        if (ml[2 * hq + 1] == 0) continue;
        const float w = std::exp(ml[2 * hq] - m);
        l += ml[2 * hq + 1] * w;
        const float* part = ml + 2 * int64_t{Hq} + int64_t{hq} * d;
        for (int32_t j = 0; j < d; ++j) acc[static_cast<size_t>(j)] += part[j] * w;
      }
      FinishHead(m, l, acc, out + ql.Offset(b, hq, 0), lse, final_ml, i);
    }
  });
}

// The vectorised kernel's second token_prob pass: the main pass left each attended token's
// scaled score in token_prob; this turns it into exp(score − m)·(1/l) with the final (m, l)
// of its query head, and zeroes every token not attended.
template <typename T>
void NormaliseTokenProbs(cpu::Isa isa, const SparseSource<T>& src, const float* final_ml,
                         ThreadPool* pool) {
  const SparseAttentionArgs& a = src.a;
  const int32_t Hkv = a.shape.num_kv_heads, S = a.kv.num_slots, p = a.shape.page_size,
                Hq = a.shape.num_q_heads, G = Hq / Hkv;
  ParallelFor(pool, int64_t{a.batch} * Hkv * S, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto s = static_cast<int32_t>(i % S);
      const auto h = static_cast<int32_t>((i / S) % Hkv);
      const auto b = static_cast<int32_t>(i / S / Hkv);
      const int32_t n = src.Tokens(b, h, s);
      for (int32_t g = 0; g < G; ++g) {
        const int64_t hq = int64_t{b} * Hq + int64_t{h} * G + g;
        float* prob = a.token_prob + (hq * S + s) * p;
        const float m = final_ml[2 * hq], l = final_ml[2 * hq + 1];
        const float inv = l > 0 ? 1.0f / l : 0.0f;
        if (n > 0 && l > 0) {
#if KVTIER_CPU_SIMD
          if (isa == cpu::Isa::kAvx512) {
            simd_avx512::ExpShiftScale(prob, n, m, inv);
          } else {
            simd_avx2::ExpShiftScale(prob, n, m, inv);
          }
#else
          (void)isa;
#endif
          std::fill(prob + n, prob + p, 0.0f);
        } else {
          std::fill(prob, prob + p, 0.0f);
        }
      }
    }
  });
}

absl::Status CheckSparse(const SparseAttentionArgs& a) {
  for (int32_t b = 0; b < a.batch; ++b) {
    if (a.kv.partial_len[b] < 0 || a.kv.partial_len[b] > a.shape.page_size) {
      return absl::OutOfRangeError(
          absl::StrFormat("SparseAttention: partial_len[%d] = %d must be in [0, page_size = %d]", b,
                          a.kv.partial_len[b], a.shape.page_size));
    }
  }
  const int64_t entries = int64_t{a.batch} * a.shape.num_kv_heads * a.kv.num_slots;
  for (int64_t i = 0; i < entries; ++i) {
    if (a.kv.slot_table[i] < kEmptySlot) {
      return absl::OutOfRangeError(absl::StrFormat(
          "SparseAttention: slot_table[%d] = %d: entries are a page index ≥ 0 or -1 (empty)", i,
          a.kv.slot_table[i]));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CpuSparseAttention(const SparseAttentionArgs& a, ThreadPool* pool) {
  return CpuSparseAttention(a, pool, cpu::ActiveIsa());
}

absl::Status CpuSparseAttention(const SparseAttentionArgs& a, ThreadPool* pool, cpu::Isa isa) {
  if (absl::Status st = CheckSparse(a); !st.ok()) return st;
  isa = cpu::RunnableIsa(isa, a.shape.head_dim);
  return cpu::DispatchDType(a.shape.dtype, [&]<typename T>() {
    SparseSource<T> src{
        a,
        WorkingSetLayout{a.kv.num_slots, a.shape.page_size, a.shape.num_kv_heads, a.shape.head_dim},
        SlotTableLayout{a.shape.num_kv_heads, a.kv.num_slots}};
    std::vector<float> final_ml;  // only for token_prob: the default path pays nothing
    if (a.token_prob != nullptr) final_ml.resize(size_t{2} * a.batch * a.shape.num_q_heads);
    float* ml = final_ml.empty() ? nullptr : final_ml.data();
    if (isa == cpu::Isa::kScalar) {
      RunAttention<T>(src, a.batch, a.shape.num_q_heads, a.shape.num_kv_heads, a.shape.head_dim,
                      a.softmax_scale, a.q, a.out, a.lse, ml, pool);
      if (a.token_prob != nullptr) WriteTokenProbs(src, ml, pool);
    } else {
      RunAttentionSimd<T>(isa, src, a.batch, a.shape.num_q_heads, a.shape.head_dim,
                          a.softmax_scale, a.q, a.out, a.lse, ml, pool);
      if (a.token_prob != nullptr) NormaliseTokenProbs(isa, src, ml, pool);
    }
    return absl::OkStatus();
  });
}

absl::Status CpuDenseAttention(const DenseAttentionArgs& a, ThreadPool* pool) {
  return CpuDenseAttention(a, pool, cpu::ActiveIsa());
}

absl::Status CpuDenseAttention(const DenseAttentionArgs& a, ThreadPool* pool, cpu::Isa isa) {
  for (int32_t b = 0; b < a.batch; ++b) {
    if (a.seq_len[b] < 0 || a.seq_len[b] > a.max_tokens) {
      return absl::OutOfRangeError(absl::StrFormat(
          "DenseAttention: seq_len[%d] = %d must be in [0, max_tokens = %d]", b, a.seq_len[b],
          a.max_tokens));
    }
  }
  isa = cpu::RunnableIsa(isa, a.shape.head_dim);
  return cpu::DispatchDType(a.shape.dtype, [&]<typename T>() {
    DenseSource<T> src{a, DenseKvLayout{a.max_tokens, a.shape.num_kv_heads, a.shape.head_dim}};
    if (isa == cpu::Isa::kScalar) {
      RunAttention<T>(src, a.batch, a.shape.num_q_heads, a.shape.num_kv_heads, a.shape.head_dim,
                      a.softmax_scale, a.q, a.out, a.lse, nullptr, pool);
    } else {
      RunAttentionSimd<T>(isa, src, a.batch, a.shape.num_q_heads, a.shape.head_dim,
                          a.softmax_scale, a.q, a.out, a.lse, nullptr, pool);
    }
    return absl::OkStatus();
  });
}

}  // namespace kvtier
