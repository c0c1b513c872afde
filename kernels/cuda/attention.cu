// Decode attention on the GPU: sparse paged attention over per-KV-head slot tables and dense
// attention over contiguous KV, one split-K ("flash-decoding") design for both. Semantics
// are the CPU reference's (kernels/cpu/attention.cc): fp32 accumulation, online softmax,
// output rounded (nearest even) into the dtype, lse = m + log(l), -inf and zeros for a head
// that attends nothing.
//
// Alignment contract of the sparse op (compute_kernels.h; CudaBackend::DoSparseAttention
// refuses anything else with INVALID_ARGUMENT naming the field before launching): K and V
// rows are read only as 16-byte vectors, so kv.k_cache and kv.v_cache are 16-byte aligned
// and shape.head_dim is a multiple of 16 / sizeof(element) (8 for fp16/bf16, 4 for fp32);
// q, out, lse, token_prob, the int32 tables, query_position
// and the workspace to their element. kvtier's own buffers always qualify: cudaMalloc
// returns 256-byte aligned memory, Geometry makes d a multiple of 8, and every slot, row and
// head offset of the working set is a multiple of d elements. A misaligned view (a cache
// offset by a fraction of a row) is refused, never run on a slower path: the sparse op has
// no scalar path (which would read every K/V row once per query head, not once per group).
// Dense attention, the accuracy reference, keeps a scalar path for any d and alignment.
//
// Main kernel, grid (B · splits, Hkv · head blocks), kThreads threads. A block owns one
// (sequence, KV head), up to 8 query heads of its group (GQA: every K/V row is read once per
// group; a group of more than 8 heads takes ceil(G / 8) blocks) and one contiguous range of
// the sequence's token indices: the flattened [S][p] index of the working set (sparse) or
// the token (dense; the host does not know seq_len, so ranges cover max_tokens and empty
// ones exit early). Inside the block every "row group" of L lanes (8, 16 or 32: one 16-byte
// load per lane per row for d = 64 .. 256, fp16/bf16) is an independent online-softmax
// stream that takes U consecutive tokens per step (4, or 2 for the widest shapes): it loads
// their K and V rows first (memory-level parallelism), then computes the scores (per-lane
// partial dot products and a butterfly over the row group), and rescales its accumulators
// once per step. Sparse tokens are resolved per token (slot table, partial page, causal
// limit); a step where no token of the warp is attended is skipped.
// At the end the streams merge: within a warp by shuffles, across warps through shared
// memory in a fixed order, so results are deterministic. Dense attention over head dims that
// are not a multiple of the 16-byte vector (or misaligned buffers) takes a scalar path with
// the same structure, one query head per block.
//
// Splits: enough that Hkv · head blocks · splits ≈ kBlocksPerSm blocks per SM (the SM count
// is cached per device), with at least kMinTilesPerSplit tiles of tokens per split, so batch
// 1 fills the GPU; planned per sequence, not per batch, so that a sequence's result does not
// depend on the batch it is launched in. With one split the main kernel writes out and lse itself;
// otherwise it writes per-split partials (m, l, unnormalised acc) and a combine kernel
// merges them exactly as the CPU merges its chunks. One function (PlanLaunch) makes the
// plan for both the launch and SparseAttentionScratchBytes, so the two cannot disagree.
//
// token_prob (sparse only): the final (m, l) of every query head is kept (by the main
// kernel with one split, else by the combine), then a third kernel walks the same tokens
// with the same code, recomputes each score bit for bit and writes exp(s − m) · (1 / l), 0
// for tokens not attended, as the CPU's second pass.
//
// Scratch. Split partials and final (m, l) need memory that the op's buffers do not
// provide. The sparse op takes it from SparseAttentionArgs::workspace when that holds at
// least SparseAttentionScratchBytes: nothing is allocated and no lock is taken (the caller
// guarantees no other work in flight uses it). Otherwise, and always for dense attention,
// this file owns it: one grow-only device buffer per (device, stream) (per calling thread
// as well for cudaStreamPerThread), created lazily with cudaMalloc (counted as a blocking
// HostCall::kAllocation) and never freed before process exit. Keying by stream makes
// concurrent launches on different streams safe; each entry has its own mutex, held while
// an op enqueues its kernels, so two threads sharing one stream cannot interleave one op's
// kernels with another's. A buffer is never freed when it grows (the old one is kept), so a
// CUDA graph captured with it stays valid; growth during stream capture switches the thread
// to relaxed capture mode for the cudaMalloc. A graph captured with registry scratch uses
// the scratch of its capture stream: replaying it concurrently with direct launches on that
// stream is not supported (replays of one graph are serialised by CUDA); a graph captured
// with a workspace has no such limit beyond the workspace's own. With one split and no
// token_prob no scratch is used at all.
//
// Data-dependent errors (OUT_OF_RANGE on the CPU) are reported through the error sink:
// partial_len[b] outside [0, p] and seq_len[b] outside [0, T] skip sequence b entirely
// (its outputs are not written); a slot table entry below -1 is reported (limit INT32_MAX:
// entries are -1 or a page) and the slot is treated as empty.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <thread>
#include <tuple>

#include "kernels/cuda/compute_kernels.h"
#include "kernels/cuda/kernel_util.cuh"
#include "kernels/host_calls.h"
#include "kvtier/layout.h"
#include "core/mutex.h"

namespace kvtier::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxGroupBlock = 8;      // query heads per block
constexpr int kBlocksPerSm = 4;        // split target: about one wave of resident blocks
constexpr int64_t kMinTilesPerSplit = 2;
constexpr int64_t kMaxSplits = 1024;
constexpr int kCombineThreads = 128;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float NegInf() { return __uint_as_float(0xff800000u); }

// ---- Vector words ----

// The unsigned word of kBytes bytes: one load of W elements.
template <int kBytes>
struct WordOf;
template <>
struct WordOf<1> {
  using type = uint8_t;
};
template <>
struct WordOf<2> {
  using type = uint16_t;
};
template <>
struct WordOf<4> {
  using type = uint32_t;
};
template <>
struct WordOf<16> {
  using type = uint4;
};

// 32-bit word i of a loaded word (i is a compile-time constant after unrolling).
__device__ __forceinline__ uint32_t WordAt(uint16_t u, int) { return u; }
__device__ __forceinline__ uint32_t WordAt(uint32_t u, int) { return u; }
__device__ __forceinline__ uint32_t WordAt(const uint4& u, int i) {
  return i == 0 ? u.x : (i == 1 ? u.y : (i == 2 ? u.z : u.w));
}

// Exact widening of one element's bits (the low 16 bits for fp16/bf16).
template <typename T>
__device__ __forceinline__ float BitsToValue(uint32_t bits);
template <>
__device__ __forceinline__ float BitsToValue<Half>(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits & 0xffffu)));
}
template <>
__device__ __forceinline__ float BitsToValue<BFloat16>(uint32_t bits) {
  return __uint_as_float(bits << 16);
}
template <>
__device__ __forceinline__ float BitsToValue<float>(uint32_t bits) {
  return __uint_as_float(bits);
}

// Element e of a word holding W consecutive elements of T.
template <typename T, typename U>
__device__ __forceinline__ float ElementOf(const U& u, int e) {
  if constexpr (sizeof(T) == 2) {
    const uint32_t w = WordAt(u, e / 2);
    return BitsToValue<T>((e & 1) != 0 ? w >> 16 : w);
  } else {
    return BitsToValue<T>(WordAt(u, e));
  }
}

template <typename U>
__device__ __forceinline__ U LoadWord(const void* p) {
  return __ldg(static_cast<const U*>(p));
}

// ---- Shapes ----

// One kernel configuration: element T; W elements per vector load (16 bytes, or 1 for the
// scalar path); NV vectors per lane; L lanes per row group (a stream); GM query heads per
// block. A row of d ≤ NV·L·W elements is spread over the L lanes of a row group: lane r
// holds vectors j·L + r, j < NV, masked beyond d. A stream takes U consecutive tokens per
// step: 4, or 2 where q and the accumulators already take many registers.
template <typename T_, int kW, int kNV, int kL, int kGM>
struct Shape {
  using T = T_;
  static constexpr int W = kW;
  static constexpr int NV = kNV;
  static constexpr int L = kL;
  static constexpr int GM = kGM;
  static constexpr int kPerLane = NV * W;        // dims per lane
  static constexpr int U = GM * kPerLane >= 64 || kPerLane >= 16 ? 2 : 4;
  static constexpr int kSpw = 32 / L;            // streams per warp
  static constexpr int kTile = kThreads / L * U;  // tokens per block step
  static constexpr int kDimCap = NV * L * W;
  using Word = typename WordOf<W * static_cast<int>(sizeof(T))>::type;
  static_assert(L >= 1 && L <= 32 && (L & (L - 1)) == 0, "L: a power of two ≤ 32");
};

// ---- Parameters ----

struct AttnParams {
  const void* q;  // [B][Hq][d]
  const void* k;  // sparse: [B][S][p][Hkv][d]; dense: [B][T][Hkv][d]
  const void* v;
  void* out;      // [B][Hq][d]
  float* lse;     // [B][Hq]; optional
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t group;        // G = Hq / Hkv
  int32_t head_blocks;  // blocks per KV head: ceil(G / GM)
  int32_t splits;
  int64_t tokens;        // token indices per sequence: S·p (sparse) or T (dense)
  int64_t split_tokens;  // per split, a multiple of the tile
  float scale;
  float* part_ml;   // [B][Hq][splits][2] (m, l); null with one split
  float* part_acc;  // [B][Hq][splits][d] unnormalised
  float* final_ml;  // [B][Hq][2]; null unless token_prob is wanted
  // Sparse only.
  int32_t page_size;
  int32_t num_slots;
  const int32_t* slot_table;
  const int32_t* partial_page;
  const int32_t* partial_len;
  const int64_t* query_position;
  float* token_prob;
  // Dense only.
  int32_t max_tokens;
  const int32_t* seq_len;
  DeviceErrorSink sink;
};

// What one block works on.
struct BlockWork {
  int32_t b;
  int32_t split;
  int32_t h;        // KV head
  int32_t gb;       // head block within the group
  int32_t g0;       // first query head of the group this block owns
  int32_t gcount;   // query heads it owns, ≤ GM
  int64_t begin;    // first token index of the split
  int64_t stop;     // end of the attended range (exclusive)
  int32_t partial_page;
  int32_t partial_len;
  int64_t qpos;     // causal limit (INT64_MAX: none)
};

template <int GM>
__device__ __forceinline__ BlockWork WorkOf(const AttnParams& p) {
  BlockWork w;
  w.b = static_cast<int32_t>(blockIdx.x / static_cast<unsigned>(p.splits));
  w.split = static_cast<int32_t>(blockIdx.x) - w.b * p.splits;
  w.h = static_cast<int32_t>(blockIdx.y) / p.head_blocks;
  w.gb = static_cast<int32_t>(blockIdx.y) - w.h * p.head_blocks;
  w.g0 = w.gb * GM;
  w.gcount = min(GM, p.group - w.g0);
  w.begin = int64_t{w.split} * p.split_tokens;
  w.stop = min(p.tokens, w.begin + p.split_tokens);
  w.partial_page = -1;
  w.partial_len = 0;
  w.qpos = INT64_MAX;
  return w;
}

// Reads sequence b's bounds into `w`. False when its partial_len / seq_len is out of range:
// the sequence is skipped (and reported once, by its first block, when `report`).
template <bool kSparse>
__device__ __forceinline__ bool SequenceOk(const AttnParams& p, bool report, BlockWork* w) {
  if constexpr (kSparse) {
    const int32_t n = p.partial_len[w->b];
    if (n < 0 || n > p.page_size) {
      if (report) {
        ReportItemError(p.sink, KernelOp::kSparseAttention, ItemField::kPartialLen, w->b, n,
                        int64_t{p.page_size} + 1);
      }
      return false;
    }
    w->partial_len = n;
    w->partial_page = p.partial_page[w->b];
    if (p.query_position != nullptr) w->qpos = p.query_position[w->b];
  } else {
    const int32_t n = p.seq_len[w->b];
    if (n < 0 || n > p.max_tokens) {
      if (report) {
        ReportItemError(p.sink, KernelOp::kDenseAttention, ItemField::kSeqLen, w->b, n,
                        int64_t{p.max_tokens} + 1);
      }
      return false;
    }
    w->stop = min(w->stop, int64_t{n});
  }
  return true;
}

// q of the block's heads, this lane's dims, as float (0 beyond d and gcount).
template <class S>
__device__ __forceinline__ void LoadQuery(const AttnParams& p, const BlockWork& w, int r,
                                          float (&q)[S::GM][S::kPerLane]) {
  const int32_t d = p.head_dim;
  const auto* src = static_cast<const typename S::T*>(p.q) +
                    (int64_t{w.b} * p.num_q_heads + int64_t{w.h} * p.group + w.g0) * d;
#pragma unroll
  for (int g = 0; g < S::GM; ++g) {
#pragma unroll
    for (int j = 0; j < S::NV; ++j) {
#pragma unroll
      for (int e = 0; e < S::W; ++e) {
        const int dim = (j * S::L + r) * S::W + e;
        q[g][j * S::W + e] = g < w.gcount && dim < d ? ToFloat(src[int64_t{g} * d + dim]) : 0.0f;
      }
    }
  }
}

// ---- Token walk ----

// The U tokens of one stream step.
template <int U>
struct StepTokens {
  bool valid[U];   // attended
  int64_t row[U];  // element offset of the token's row of the KV head
};

// Position of a stream in the flattened [S][p] index: slot and token within it.
struct SlotCursor {
  int32_t slot;
  int32_t tok;
  int32_t step_slot;  // one block step (kTile tokens) = step_slot slots + step_tok tokens
  int32_t step_tok;

  __device__ void Init(int64_t t, int32_t page_size, int32_t tile) {
    slot = static_cast<int32_t>(t / page_size);
    tok = static_cast<int32_t>(t - int64_t{slot} * page_size);
    step_slot = tile / page_size;
    step_tok = tile - step_slot * page_size;
  }
  __device__ void Advance(int32_t page_size) {
    slot += step_slot;
    tok += step_tok;
    if (tok >= page_size) {
      tok -= page_size;
      ++slot;
    }
  }
};

// Sparse: tokens t0 .. t0 + U − 1, starting at slot/tok. Entries below -1 are reported
// (once per slot: by the lane that meets its token 0, when `report`).
template <int U>
__device__ __forceinline__ void ResolveSparse(const AttnParams& p, const BlockWork& w,
                                              int64_t t0, int32_t slot, int32_t tok,
                                              bool report, StepTokens<U>* st) {
  const int64_t table = (int64_t{w.b} * p.num_kv_heads + w.h) * p.num_slots;
  const int64_t row_stride = int64_t{p.num_kv_heads} * p.head_dim;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    st->valid[u] = false;
    st->row[u] = 0;
    if (t0 + u < w.stop) {
      const int64_t ti = table + slot;
      const int32_t page = __ldg(p.slot_table + ti);
      if (page < kEmptySlot && tok == 0 && report) {
        ReportItemError(p.sink, KernelOp::kSparseAttention, ItemField::kSlotTable, ti, page,
                        INT32_MAX);
      }
      if (page >= 0) {
        const int32_t n = page == w.partial_page ? w.partial_len : p.page_size;
        if (tok < n && int64_t{page} * p.page_size + tok <= w.qpos) {
          const int64_t gs = int64_t{w.b} * p.num_slots + slot;
          st->valid[u] = true;
          st->row[u] = (gs * p.page_size + tok) * row_stride + int64_t{w.h} * p.head_dim;
        }
      }
    }
    if (++tok == p.page_size) {
      tok = 0;
      ++slot;
    }
  }
}

// Dense: tokens t0 .. t0 + U − 1 of [B][T][Hkv][d].
template <int U>
__device__ __forceinline__ void ResolveDense(const AttnParams& p, const BlockWork& w, int64_t t0,
                                             StepTokens<U>* st) {
  const int64_t row_stride = int64_t{p.num_kv_heads} * p.head_dim;
  const int64_t first = (int64_t{w.b} * p.max_tokens + t0) * row_stride + int64_t{w.h} * p.head_dim;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    st->valid[u] = t0 + u < w.stop;
    st->row[u] = first + u * row_stride;
  }
}

// Raw vectors of the step's rows in `base` (zero where not attended or beyond d).
template <class S>
__device__ __forceinline__ void LoadRaw(const void* base, const StepTokens<S::U>& st, int r,
                                        const bool (&vok)[S::NV],
                                        typename S::Word (&out)[S::U][S::NV]) {
  const auto* src = static_cast<const typename S::T*>(base);
#pragma unroll
  for (int u = 0; u < S::U; ++u) {
#pragma unroll
    for (int j = 0; j < S::NV; ++j) {
      out[u][j] = typename S::Word{};
      if (st.valid[u] && vok[j]) {
        out[u][j] = LoadWord<typename S::Word>(src + st.row[u] + (j * S::L + r) * S::W);
      }
    }
  }
}

// ---- Arithmetic ----

// s[u][g] = scale · (q_g · k_u) for N rows, identical on every lane of the row group (the
// butterfly only adds, and addition commutes). kget(u, i): element i of this lane's part of
// row u. The one formula of both the output and token_prob, as on the CPU: each score is
// computed the same way whatever N is.
template <class S, int N, class KGet>
__device__ __forceinline__ void RowScores(const float (&q)[S::GM][S::kPerLane], KGet kget,
                                          float scale, float (&s)[N][S::GM]) {
#pragma unroll
  for (int u = 0; u < N; ++u) {
#pragma unroll
    for (int g = 0; g < S::GM; ++g) {
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < S::kPerLane; ++i) dot = fmaf(q[g][i], kget(u, i), dot);
      s[u][g] = dot;
    }
  }
#pragma unroll
  for (int off = S::L / 2; off > 0; off /= 2) {
#pragma unroll
    for (int u = 0; u < N; ++u) {
#pragma unroll
      for (int g = 0; g < S::GM; ++g) s[u][g] += __shfl_xor_sync(kFullMask, s[u][g], off);
    }
  }
#pragma unroll
  for (int u = 0; u < N; ++u) {
#pragma unroll
    for (int g = 0; g < S::GM; ++g) s[u][g] *= scale;
  }
}

// Online-softmax state of one stream: per query head the running max, sum and this lane's
// part of the unnormalised output.
template <class S>
struct StreamState {
  float m[S::GM];
  float l[S::GM];
  float acc[S::GM][S::kPerLane];
};

// Folds N rows (those with valid[u]) into `st`: one rescale per call.
template <class S, int N, class KGet, class VGet>
__device__ __forceinline__ void Fold(StreamState<S>& st, const float (&q)[S::GM][S::kPerLane],
                                     const bool (&valid)[N], float scale, KGet kget,
                                     VGet vget) {
  float s[N][S::GM];
  RowScores<S, N>(q, kget, scale, s);
#pragma unroll
  for (int g = 0; g < S::GM; ++g) {
    float block_max = NegInf();
#pragma unroll
    for (int u = 0; u < N; ++u) {
      if (valid[u]) block_max = fmaxf(block_max, s[u][g]);
    }
    const float new_m = fmaxf(st.m[g], block_max);
    if (new_m == NegInf()) continue;  // nothing attended yet
    const float corr = expf(st.m[g] - new_m);  // 0 when m was -inf
    float w[N];
    float sum = st.l[g] * corr;
#pragma unroll
    for (int u = 0; u < N; ++u) {
      w[u] = valid[u] ? expf(s[u][g] - new_m) : 0.0f;
      sum += w[u];
    }
    st.l[g] = sum;
    st.m[g] = new_m;
#pragma unroll
    for (int i = 0; i < S::kPerLane; ++i) {
      float a = st.acc[g][i] * corr;
#pragma unroll
      for (int u = 0; u < N; ++u) a = fmaf(w[u], vget(u, i), a);
      st.acc[g][i] = a;
    }
  }
}

// Merges the streams of the block and writes the result: out/lse (and final (m, l)) with
// one split, else this split's partial. Called by every thread.
template <class S>
__device__ __forceinline__ void FinishBlock(const AttnParams& p, const BlockWork& w,
                                            StreamState<S>& st) {
  constexpr int GM = S::GM;
  __shared__ float s_ml[kWarps][GM][2];
  __shared__ float s_final[GM][2];
  __shared__ float s_acc[GM][S::kDimCap];
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int r = lane & (S::L - 1);

  // Streams of a warp: a butterfly over the row groups (lanes r, r ± L, ... hold the same
  // dims). Afterwards lanes 0 .. L−1 hold the warp's state.
#pragma unroll
  for (int off = S::L; off < 32; off *= 2) {
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      const float om = __shfl_xor_sync(kFullMask, st.m[g], off);
      const float ol = __shfl_xor_sync(kFullMask, st.l[g], off);
      const float nm = fmaxf(st.m[g], om);
      const float ca = nm == NegInf() ? 0.0f : expf(st.m[g] - nm);
      const float cb = nm == NegInf() ? 0.0f : expf(om - nm);
      st.l[g] = st.l[g] * ca + ol * cb;
      st.m[g] = nm;
#pragma unroll
      for (int i = 0; i < S::kPerLane; ++i) {
        const float oa = __shfl_xor_sync(kFullMask, st.acc[g][i], off);
        st.acc[g][i] = st.acc[g][i] * ca + oa * cb;
      }
    }
  }

  // Across warps, in warp order.
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      s_ml[warp][g][0] = st.m[g];
      s_ml[warp][g][1] = st.l[g];
    }
  }
  __syncthreads();
  if (threadIdx.x < GM) {
    const int g = static_cast<int>(threadIdx.x);
    float mx = NegInf();
    for (int k = 0; k < kWarps; ++k) mx = fmaxf(mx, s_ml[k][g][0]);
    float sum = 0.0f;
    if (mx != NegInf()) {
      for (int k = 0; k < kWarps; ++k) sum += s_ml[k][g][1] * expf(s_ml[k][g][0] - mx);
    }
    s_final[g][0] = mx;
    s_final[g][1] = sum;
  }
  float coef[GM];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    float mx = NegInf();
    for (int k = 0; k < kWarps; ++k) mx = fmaxf(mx, s_ml[k][g][0]);
    coef[g] = mx == NegInf() ? 0.0f : expf(s_ml[warp][g][0] - mx);
  }
  for (int k = 0; k < kWarps; ++k) {
    if (warp == k && lane < S::L) {
#pragma unroll
      for (int g = 0; g < GM; ++g) {
#pragma unroll
        for (int j = 0; j < S::NV; ++j) {
#pragma unroll
          for (int e = 0; e < S::W; ++e) {
            const int dim = (j * S::L + r) * S::W + e;
            const float x = st.acc[g][j * S::W + e] * coef[g];
            s_acc[g][dim] = k == 0 ? x : s_acc[g][dim] + x;
          }
        }
      }
    }
    __syncthreads();
  }

  const int32_t d = p.head_dim;
  const int64_t bh0 = int64_t{w.b} * p.num_q_heads + int64_t{w.h} * p.group + w.g0;
  for (int idx = static_cast<int>(threadIdx.x); idx < w.gcount * d; idx += kThreads) {
    const int g = idx / d;
    const int dim = idx - g * d;
    const int64_t bh = bh0 + g;
    const float m = s_final[g][0];
    const float l = s_final[g][1];
    if (p.splits == 1) {
      const float inv = l > 0 ? 1.0f / l : 0.0f;
      static_cast<typename S::T*>(p.out)[bh * d + dim] =
          FromFloat<typename S::T>(s_acc[g][dim] * inv);
      if (dim == 0) {
        if (p.lse != nullptr) p.lse[bh] = l > 0 ? m + logf(l) : NegInf();
        if (p.final_ml != nullptr) {
          p.final_ml[2 * bh] = m;
          p.final_ml[2 * bh + 1] = l;
        }
      }
    } else {
      const int64_t pi = bh * p.splits + w.split;
      p.part_acc[pi * d + dim] = s_acc[g][dim];
      if (dim == 0) {
        p.part_ml[2 * pi] = m;
        p.part_ml[2 * pi + 1] = l;
      }
    }
  }
}

// ---- Kernels ----

// The main kernel (see the header): sparse or dense, the same walk over a token source.
template <class S, bool kSparse>
__global__ void __launch_bounds__(kThreads) AttentionKernel(const AttnParams p) {
  BlockWork w = WorkOf<S::GM>(p);
  const bool first_block = w.split == 0 && blockIdx.y == 0 && threadIdx.x == 0;
  if (!SequenceOk<kSparse>(p, first_block, &w)) return;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int r = lane & (S::L - 1);
  const int stream = static_cast<int>(threadIdx.x) / S::L;
  const int sub = lane / S::L;  // stream within the warp

  float q[S::GM][S::kPerLane];
  LoadQuery<S>(p, w, r, q);
  bool vok[S::NV];
#pragma unroll
  for (int j = 0; j < S::NV; ++j) vok[j] = (j * S::L + r) * S::W < p.head_dim;

  StreamState<S> st;
#pragma unroll
  for (int g = 0; g < S::GM; ++g) {
    st.m[g] = NegInf();
    st.l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < S::kPerLane; ++i) st.acc[g][i] = 0.0f;
  }

  SlotCursor cur{};
  if constexpr (kSparse) {
    cur.Init(w.begin + int64_t{stream} * S::U, p.page_size, S::kTile);
  }
  const bool report_slots = w.gb == 0 && r == 0;
  // The loop bound is the warp's first token, so shuffles see the whole warp.
  for (int64_t wt = w.begin + int64_t{warp} * S::kSpw * S::U; wt < w.stop; wt += S::kTile) {
    const int64_t t0 = wt + sub * S::U;
    StepTokens<S::U> tok;
    if constexpr (kSparse) {
      ResolveSparse<S::U>(p, w, t0, cur.slot, cur.tok, report_slots, &tok);
      cur.Advance(p.page_size);
    } else {
      ResolveDense<S::U>(p, w, t0, &tok);
    }
    bool any = false;
#pragma unroll
    for (int u = 0; u < S::U; ++u) any = any || tok.valid[u];
    if (!__any_sync(kFullMask, any)) continue;
    typename S::Word kr[S::U][S::NV];
    typename S::Word vr[S::U][S::NV];
    LoadRaw<S>(p.k, tok, r, vok, kr);
    LoadRaw<S>(p.v, tok, r, vok, vr);
    Fold<S, S::U>(
        st, q, tok.valid, p.scale,
        [&](int u, int i) { return ElementOf<typename S::T>(kr[u][i / S::W], i % S::W); },
        [&](int u, int i) { return ElementOf<typename S::T>(vr[u][i / S::W], i % S::W); });
  }
  FinishBlock<S>(p, w, st);
}

// The combine kernel's weights in shared memory: one per split, padded to whole groups of 4
// with the padding zeroed. ptxas may read the remainder of an unrolled loop over the weights
// as one vector load (compute-sanitizer on an H200 saw a 12-byte read of a 2-split launch's 8
// bytes), so every 16-byte group it can touch is allocated and reads as weight 0.
__host__ __device__ constexpr int32_t PaddedSplits(int32_t splits) { return (splits + 3) / 4 * 4; }

// Merges the splits of one (sequence, query head), as the CPU merges its chunks. Dynamic
// shared memory: one weight per split (PaddedSplits).
template <typename T, bool kSparse>
__global__ void __launch_bounds__(kCombineThreads) CombineKernel(const AttnParams p) {
  extern __shared__ float s_weight[];
  const int64_t bh = blockIdx.x;
  BlockWork w{};
  w.b = static_cast<int32_t>(bh / p.num_q_heads);
  w.stop = p.tokens;
  if (!SequenceOk<kSparse>(p, /*report=*/false, &w)) return;
  const int32_t splits = p.splits;
  const float* ml = p.part_ml + bh * splits * 2;
  float mx = NegInf();
  for (int32_t c = 0; c < splits; ++c) mx = fmaxf(mx, ml[2 * c]);
  for (int32_t c = static_cast<int32_t>(threadIdx.x); c < PaddedSplits(splits); c += kCombineThreads) {
    // A split that attended nothing (l = 0) is skipped: weight 0; so is the padding.
    s_weight[c] = c < splits && mx != NegInf() && ml[2 * c + 1] != 0 ? expf(ml[2 * c] - mx) : 0.0f;
  }
  __syncthreads();
  float l = 0.0f;
  for (int32_t c = 0; c < splits; ++c) {
    if (s_weight[c] != 0) l += ml[2 * c + 1] * s_weight[c];
  }
  const float inv = l > 0 ? 1.0f / l : 0.0f;
  const int32_t d = p.head_dim;
  const float* acc = p.part_acc + bh * splits * d;
  for (int32_t dim = static_cast<int32_t>(threadIdx.x); dim < d; dim += kCombineThreads) {
    float a = 0.0f;
    for (int32_t c = 0; c < splits; ++c) {
      if (s_weight[c] != 0) a += acc[int64_t{c} * d + dim] * s_weight[c];
    }
    static_cast<T*>(p.out)[bh * d + dim] = FromFloat<T>(a * inv);
  }
  if (threadIdx.x == 0) {
    if (p.lse != nullptr) p.lse[bh] = l > 0 ? mx + logf(l) : NegInf();
    if (p.final_ml != nullptr) {
      p.final_ml[2 * bh] = mx;
      p.final_ml[2 * bh + 1] = l;
    }
  }
}

// token_prob of every token index of the block's range: the main kernel's walk and score
// formula, normalised by the final (m, l) of each query head; 0 where not attended.
template <class S>
__global__ void __launch_bounds__(kThreads) TokenProbKernel(const AttnParams p) {
  BlockWork w = WorkOf<S::GM>(p);
  if (!SequenceOk<true>(p, /*report=*/false, &w)) return;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int r = lane & (S::L - 1);
  const int stream = static_cast<int>(threadIdx.x) / S::L;
  const int sub = lane / S::L;

  float q[S::GM][S::kPerLane];
  LoadQuery<S>(p, w, r, q);
  bool vok[S::NV];
#pragma unroll
  for (int j = 0; j < S::NV; ++j) vok[j] = (j * S::L + r) * S::W < p.head_dim;
  const int64_t bh0 = int64_t{w.b} * p.num_q_heads + int64_t{w.h} * p.group + w.g0;
  float fm[S::GM];
  float finv[S::GM];
#pragma unroll
  for (int g = 0; g < S::GM; ++g) {
    fm[g] = 0.0f;
    finv[g] = 0.0f;
    if (g < w.gcount) {
      fm[g] = p.final_ml[2 * (bh0 + g)];
      const float l = p.final_ml[2 * (bh0 + g) + 1];
      finv[g] = l > 0 ? 1.0f / l : 0.0f;
    }
  }

  SlotCursor cur{};
  cur.Init(w.begin + int64_t{stream} * S::U, p.page_size, S::kTile);
  for (int64_t wt = w.begin + int64_t{warp} * S::kSpw * S::U; wt < w.stop; wt += S::kTile) {
    const int64_t t0 = wt + sub * S::U;
    StepTokens<S::U> tok;
    ResolveSparse<S::U>(p, w, t0, cur.slot, cur.tok, /*report=*/false, &tok);
    cur.Advance(p.page_size);
    bool any = false;
#pragma unroll
    for (int u = 0; u < S::U; ++u) any = any || tok.valid[u];
    float s[S::U][S::GM];
#pragma unroll
    for (int u = 0; u < S::U; ++u) {
#pragma unroll
      for (int g = 0; g < S::GM; ++g) s[u][g] = 0.0f;
    }
    if (__any_sync(kFullMask, any)) {
      typename S::Word kr[S::U][S::NV];
      LoadRaw<S>(p.k, tok, r, vok, kr);
      RowScores<S, S::U>(
          q, [&](int u, int i) { return ElementOf<typename S::T>(kr[u][i / S::W], i % S::W); },
          p.scale, s);
    }
    // Every lane of the row group holds every score: lane r writes the (u, g) pairs ≡ r.
#pragma unroll
    for (int u = 0; u < S::U; ++u) {
#pragma unroll
      for (int g = 0; g < S::GM; ++g) {
        if ((u * S::GM + g) % S::L != r || g >= w.gcount || t0 + u >= w.stop) continue;
        const float prob = tok.valid[u] ? expf(s[u][g] - fm[g]) * finv[g] : 0.0f;
        p.token_prob[(bh0 + g) * p.tokens + t0 + u] = prob;
      }
    }
  }
}

// ---- Host side ----

// Calls fn(Shape<T, W, NV, L, GM>{}) with GM the smallest of 1, 2, 4, 8 that holds `group`
// (8 for larger groups, which take several blocks).
template <typename T, int W, int NV, int L, typename Fn>
cudaError_t DispatchGroup(int32_t group, Fn&& fn) {
  if (group <= 1) return fn(Shape<T, W, NV, L, 1>{});
  if (group <= 2) return fn(Shape<T, W, NV, L, 2>{});
  if (group <= 4) return fn(Shape<T, W, NV, L, 4>{});
  return fn(Shape<T, W, NV, L, kMaxGroupBlock>{});
}

// The shape for head dim d. With 16-byte vectors (`vector_ok`: d a multiple of a vector,
// buffers aligned), fp16/bf16 with d ≤ 128 (the hot path) get a group size fitted to G;
// larger d and fp32 (whose lanes hold few dims) use 8 (4 at d > 256, to bound registers).
// Otherwise, with kScalar (dense attention), the scalar path: any d ≤ 512, one query head
// per block; without it (the sparse op, whose contract rules this out) cudaErrorInvalidValue.
// Few shapes keep the number of kernels (and the compile time) down.
template <typename T, bool kScalar, typename Fn>
cudaError_t DispatchShape(int32_t d, bool vector_ok, int32_t group, Fn&& fn) {
  if (vector_ok) {
    if constexpr (sizeof(T) == 2) {
      if (d <= 64) return DispatchGroup<T, 8, 1, 8>(group, fn);
      if (d <= 128) return DispatchGroup<T, 8, 1, 16>(group, fn);
      if (d <= 256) return fn(Shape<T, 8, 1, 32, kMaxGroupBlock>{});
      return fn(Shape<T, 8, 2, 32, 4>{});
    } else {
      if (d <= 128) return fn(Shape<T, 4, 1, 32, kMaxGroupBlock>{});
      if (d <= 256) return fn(Shape<T, 4, 2, 32, kMaxGroupBlock>{});
      return fn(Shape<T, 4, 4, 32, 4>{});
    }
  }
  if constexpr (kScalar) {
    return fn(Shape<T, 1, 16, 32, 1>{});
  } else {
    return cudaErrorInvalidValue;
  }
}

bool Aligned(const void* ptr, size_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

struct SplitPlan {
  int32_t splits;
  int64_t split_tokens;
};

// Splits of `tokens` token indices in tiles of `tile`, for `blocks_per_split` blocks each.
SplitPlan PlanSplits(int64_t tokens, int tile, int64_t blocks_per_split, int sm_count) {
  const int64_t tiles = std::max<int64_t>(1, (tokens + tile - 1) / tile);
  const int64_t target = int64_t{kBlocksPerSm} * std::max(sm_count, 1);
  int64_t splits = (target + blocks_per_split - 1) / blocks_per_split;
  const int64_t most = std::min(kMaxSplits, std::max<int64_t>(1, tiles / kMinTilesPerSplit));
  splits = std::clamp<int64_t>(splits, 1, most);
  const int64_t per_split = (tiles + splits - 1) / splits;
  return SplitPlan{static_cast<int32_t>((tiles + per_split - 1) / per_split), per_split * tile};
}

// What a launch of shape S does: blocks per KV head, the splits, and the scratch it needs
// (floats: the final (m, l) when token_prob is wanted, then the split partials). The one
// plan of both the launch and SparseAttentionScratchBytes. `p` needs the head counts, d and
// the token count set.
struct LaunchPlan {
  int32_t head_blocks;
  int32_t splits;
  int64_t split_tokens;
  int64_t final_floats;
  int64_t part_floats;

  size_t ScratchBytes() const {
    return sizeof(float) * static_cast<size_t>(final_floats + part_floats);
  }
};

template <class S>
LaunchPlan PlanLaunch(const AttnParams& p, int32_t batch, bool want_prob, int sm_count) {
  LaunchPlan plan{};
  plan.head_blocks = (p.group + S::GM - 1) / S::GM;
  const int64_t y_blocks = int64_t{p.num_kv_heads} * plan.head_blocks;
  // Planned for one sequence, whatever the batch: a sequence's splits (and so its rounding)
  // do not depend on which sequences share its launch, so a batch gives each member the
  // bits it gets alone (docs/retriever.md#batches). A large batch gets more blocks than it
  // needs to fill the GPU, never fewer.
  const SplitPlan split = PlanSplits(p.tokens, S::kTile, y_blocks, sm_count);
  plan.splits = split.splits;
  plan.split_tokens = split.split_tokens;
  const int64_t heads = int64_t{batch} * p.num_q_heads;
  plan.final_floats = want_prob ? 2 * heads : 0;
  plan.part_floats = plan.splits > 1 ? heads * plan.splits * (int64_t{p.head_dim} + 2) : 0;
  return plan;
}

// The scratch of one (device, stream): see the header comment.
struct ScratchEntry {
  Mutex mu;  // held while an op enqueues its kernels
  void* ptr ABSL_GUARDED_BY(mu) = nullptr;
  size_t bytes ABSL_GUARDED_BY(mu) = 0;
};

class ScratchRegistry {
 public:
  // Multiprocessor count of `device`, cached.
  cudaError_t SmCount(int device, int* out) {
    MutexLock lock(&mu_);
    auto it = sm_count_.find(device);
    if (it == sm_count_.end()) {
      int n = 0;
      const cudaError_t err = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
      if (err != cudaSuccess) return err;
      it = sm_count_.emplace(device, n).first;
    }
    *out = it->second;
    return cudaSuccess;
  }

  // Runs fn(float* scratch) with at least `bytes` of the (device, stream) scratch, holding
  // its lock; grows it first when needed. Returns fn's result or the allocation's error.
  template <typename Fn>
  cudaError_t WithScratch(int device, cudaStream_t stream, size_t bytes, Fn&& fn) {
    ScratchEntry* entry = nullptr;
    {
      const std::thread::id thread =
          stream == cudaStreamPerThread ? std::this_thread::get_id() : std::thread::id();
      const Key key{device, reinterpret_cast<uintptr_t>(stream), thread};
      MutexLock lock(&mu_);
      std::unique_ptr<ScratchEntry>& slot = entries_[key];
      if (slot == nullptr) slot = std::make_unique<ScratchEntry>();
      entry = slot.get();  // entries live until process exit
    }
    MutexLock lock(&entry->mu);
    if (entry->bytes < bytes) {
      const size_t grown = std::max(bytes, 2 * entry->bytes);
      const size_t rounded = (grown + (size_t{1} << 20) - 1) & ~((size_t{1} << 20) - 1);
      void* ptr = nullptr;
      if (const cudaError_t err = Allocate(stream, rounded, &ptr); err != cudaSuccess) {
        return err;
      }
      // The old buffer stays allocated: work already enqueued (or a captured graph) may
      // still use it.
      entry->ptr = ptr;
      entry->bytes = rounded;
    }
    return fn(static_cast<float*>(entry->ptr));
  }

 private:
  using Key = std::tuple<int, uintptr_t, std::thread::id>;

  // cudaMalloc, in relaxed capture mode when `stream` is being captured (cudaMalloc is not
  // a stream operation; the default global mode would refuse it).
  static cudaError_t Allocate(cudaStream_t stream, size_t bytes, void** out) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    cudaError_t err = cudaStreamIsCapturing(stream, &capture);
    if (err != cudaSuccess) return err;
    const bool capturing = capture != cudaStreamCaptureStatusNone;
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    if (capturing) {
      err = cudaThreadExchangeStreamCaptureMode(&mode);
      if (err != cudaSuccess) return err;
    }
    CountHostCall(HostCall::kAllocation);  // may synchronise the device
    err = cudaMalloc(out, bytes);
    if (capturing) {
      const cudaError_t restore = cudaThreadExchangeStreamCaptureMode(&mode);
      if (err == cudaSuccess) err = restore;
    }
    return err;
  }

  Mutex mu_;
  std::map<int, int> sm_count_ ABSL_GUARDED_BY(mu_);
  std::map<Key, std::unique_ptr<ScratchEntry>> entries_ ABSL_GUARDED_BY(mu_);
};

ScratchRegistry& Registry() {
  static ScratchRegistry* const registry = new ScratchRegistry();  // never destroyed
  return *registry;
}

// Plans the splits, takes the scratch (`workspace` when it holds `workspace_bytes` ≥ what
// the plan needs, else the registry's) and enqueues the main kernel, the combine (more than
// one split) and the token_prob pass (sparse, when wanted). `p` has every argument field
// set; this fills the shape-dependent ones.
template <bool kSparse>
cudaError_t LaunchAttention(AttnParams p, DType dtype, int32_t batch, bool vector_ok,
                            void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  int sm_count = 0;
  if (const cudaError_t err = Registry().SmCount(device, &sm_count); err != cudaSuccess) {
    return err;
  }
  const bool want_prob = kSparse && p.token_prob != nullptr;
  return DispatchElement(dtype, [&](auto element_tag) {
    using T = typename decltype(element_tag)::type;
    return DispatchShape<T, !kSparse>(p.head_dim, vector_ok, p.group, [&](auto shape) {
      using S = decltype(shape);
      const LaunchPlan plan = PlanLaunch<S>(p, batch, want_prob, sm_count);
      p.head_blocks = plan.head_blocks;
      p.splits = plan.splits;
      p.split_tokens = plan.split_tokens;
      const int64_t heads = int64_t{batch} * p.num_q_heads;
      const dim3 grid(static_cast<unsigned>(int64_t{batch} * p.splits),
                      static_cast<unsigned>(int64_t{p.num_kv_heads} * p.head_blocks));
      auto enqueue = [&](float* scratch) -> cudaError_t {
        p.final_ml = want_prob ? scratch : nullptr;
        p.part_ml = p.splits > 1 ? scratch + plan.final_floats : nullptr;
        p.part_acc = p.splits > 1 ? p.part_ml + heads * p.splits * 2 : nullptr;
        AttentionKernel<S, kSparse><<<grid, kThreads, 0, stream>>>(p);
        if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
        if (p.splits > 1) {
          const size_t smem = sizeof(float) * static_cast<size_t>(PaddedSplits(p.splits));
          CombineKernel<T, kSparse>
              <<<static_cast<unsigned>(heads), kCombineThreads, smem, stream>>>(p);
          if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
        }
        if constexpr (kSparse) {
          if (want_prob) {
            TokenProbKernel<S><<<grid, kThreads, 0, stream>>>(p);
            if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
          }
        }
        return cudaSuccess;
      };
      const size_t bytes = plan.ScratchBytes();
      if (bytes == 0) return enqueue(nullptr);
      if (workspace != nullptr && workspace_bytes >= bytes) {
        return enqueue(static_cast<float*>(workspace));
      }
      return Registry().WithScratch(device, stream, bytes, enqueue);
    });
  });
}

AttnParams CommonParams(const void* q, const void* k, const void* v, void* out, float* lse,
                        int32_t hq, int32_t hkv, int32_t d, float scale,
                        const DeviceErrorSink& sink) {
  AttnParams p{};
  p.q = q;
  p.k = k;
  p.v = v;
  p.out = out;
  p.lse = lse;
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = d;
  p.group = hq / hkv;
  p.scale = scale;
  p.sink = sink;
  return p;
}

// The kernel parameters of a sparse attention (the shape-dependent ones left unset).
AttnParams SparseParams(const SparseAttentionArgs& a, const DeviceErrorSink& sink) {
  AttnParams p = CommonParams(a.q, a.kv.k_cache, a.kv.v_cache, a.out, a.lse, a.shape.num_q_heads,
                              a.shape.num_kv_heads, a.shape.head_dim, a.softmax_scale, sink);
  p.tokens = int64_t{a.kv.num_slots} * a.shape.page_size;
  p.page_size = a.shape.page_size;
  p.num_slots = a.kv.num_slots;
  p.slot_table = a.kv.slot_table;
  p.partial_page = a.kv.partial_page;
  p.partial_len = a.kv.partial_len;
  p.query_position = a.query_position;
  p.token_prob = a.token_prob;
  return p;
}

}  // namespace

size_t SparseAttentionScratchBytes(const SparseAttentionArgs& a, int device) {
  const KvShape& s = a.shape;
  const int32_t vec = AttentionVectorElements(s.dtype);
  if (vec == 0 || a.batch < 1 || a.kv.num_slots < 1 || s.page_size < 1 || s.num_kv_heads < 1 ||
      s.num_q_heads < s.num_kv_heads || s.num_q_heads % s.num_kv_heads != 0 ||
      s.head_dim < 1 || s.head_dim > Geometry::kMaxHeadDim || s.head_dim % vec != 0) {
    return 0;  // not launchable: ValidateArgs or the alignment contract refuses it
  }
  int sm_count = 0;
  if (Registry().SmCount(device, &sm_count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;  // the launch fails the same way
  }
  const AttnParams p = SparseParams(a, DeviceErrorSink{});
  size_t bytes = 0;
  (void)DispatchElement(s.dtype, [&](auto element_tag) {
    using T = typename decltype(element_tag)::type;
    return DispatchShape<T, false>(s.head_dim, /*vector_ok=*/true, p.group, [&](auto shape) {
      bytes = PlanLaunch<decltype(shape)>(p, a.batch, a.token_prob != nullptr, sm_count)
                  .ScratchBytes();
      return cudaSuccess;
    });
  });
  return bytes;
}

cudaError_t LaunchSparseAttention(const SparseAttentionArgs& a, const DeviceErrorSink& sink,
                                  cudaStream_t stream) {
  const int32_t vec = AttentionVectorElements(a.shape.dtype);
  if (vec == 0) return cudaErrorInvalidValue;
  // The contract (header); the backend has refused anything else, so this is a backstop.
  const bool vector_ok = a.shape.head_dim % vec == 0 &&
                         Aligned(a.kv.k_cache, kAttentionVectorBytes) &&
                         Aligned(a.kv.v_cache, kAttentionVectorBytes);
  if (!vector_ok) return cudaErrorInvalidValue;
  return LaunchAttention<true>(SparseParams(a, sink), a.shape.dtype, a.batch, vector_ok,
                               a.workspace, a.workspace_bytes, stream);
}

cudaError_t LaunchDenseAttention(const DenseAttentionArgs& a, const DeviceErrorSink& sink,
                                 cudaStream_t stream) {
  AttnParams p = CommonParams(a.q, a.k, a.v, a.out, a.lse, a.shape.num_q_heads,
                              a.shape.num_kv_heads, a.shape.head_dim, a.softmax_scale, sink);
  p.tokens = a.max_tokens;
  p.max_tokens = a.max_tokens;
  p.seq_len = a.seq_len;
  const int32_t vec = AttentionVectorElements(a.shape.dtype);
  if (vec == 0) return cudaErrorInvalidValue;
  const bool vector_ok = a.shape.head_dim % vec == 0 && Aligned(a.k, kAttentionVectorBytes) &&
                         Aligned(a.v, kAttentionVectorBytes);
  return LaunchAttention<false>(p, a.shape.dtype, a.batch, vector_ok, /*workspace=*/nullptr, 0,
                                stream);
}

}  // namespace kvtier::cuda
