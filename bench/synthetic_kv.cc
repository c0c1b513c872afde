#include "bench/synthetic_kv.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "kvtier/layout.h"

namespace kvtier::bench {

void StoreElement(std::vector<uint8_t>& data, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kF16:
      reinterpret_cast<Half*>(data.data())[i] = FloatToHalf(v);
      return;
    case DType::kBF16:
      reinterpret_cast<BFloat16*>(data.data())[i] = FloatToBFloat16(v);
      return;
    case DType::kF32:
      reinterpret_cast<float*>(data.data())[i] = v;
      return;
  }
}

namespace {}  // namespace

float LoadAsFloat(const std::vector<uint8_t>& data, DType t, int64_t i) {
  switch (t) {
    case DType::kF16:
      return HalfToFloat(reinterpret_cast<const Half*>(data.data())[i]);
    case DType::kBF16:
      return BFloat16ToFloat(reinterpret_cast<const BFloat16*>(data.data())[i]);
    case DType::kF32:
      return reinterpret_cast<const float*>(data.data())[i];
  }
  return 0;
}

SyntheticKv MakeSyntheticKv(const Geometry& g, const SyntheticKvOptions& o) {
  const int32_t B = o.batch, T = o.tokens, Hq = g.num_q_heads, Hkv = g.num_kv_heads;
  const int32_t d = g.head_dim, p = g.page_size, G = g.group_size();
  const size_t elem = g.element_bytes();
  SyntheticKv kv;
  kv.q.resize(static_cast<size_t>(B) * Hq * d * elem);
  kv.k.resize(static_cast<size_t>(B) * T * Hkv * d * elem);
  kv.v.resize(kv.k.size());
  kv.heavy.assign(static_cast<size_t>(B),
                  std::vector<std::vector<int32_t>>(static_cast<size_t>(Hkv)));
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.5f, 1.0f);
  const HeadsLayout ql{Hq, d};
  const DenseKvLayout kl{T, Hkv, d};
  const int32_t pages = (T + p - 1) / p;
  std::vector<float> dir(static_cast<size_t>(d)), boost(static_cast<size_t>(T));
  for (int32_t b = 0; b < B; ++b) {
    for (int32_t h = 0; h < Hkv; ++h) {
      float norm = 0;
      for (auto& x : dir) {
        x = normal(rng);
        norm += x * x;
      }
      norm = std::sqrt(norm);
      for (int32_t gq = 0; gq < G; ++gq) {
        for (int32_t i = 0; i < d; ++i) {
          StoreElement(kv.q, g.dtype, ql.Offset(b, h * G + gq, i),
                       dir[static_cast<size_t>(i)] + 0.5f * normal(rng));
        }
      }
      // Logit boost per token: sink page, recent pages, and the heavy pages.
      std::fill(boost.begin(), boost.end(), 0.0f);
      std::vector<int32_t> cand(static_cast<size_t>(std::max(0, pages - 1 - o.recent_pages)));
      std::iota(cand.begin(), cand.end(), 1);
      std::shuffle(cand.begin(), cand.end(), rng);
      cand.resize(std::min(cand.size(), static_cast<size_t>(o.heavy_pages)));
      std::sort(cand.begin(), cand.end());
      kv.heavy[static_cast<size_t>(b)][static_cast<size_t>(h)] = cand;
      for (int32_t t = 0; t < std::min(p, T); ++t) boost[static_cast<size_t>(t)] = o.heavy_logit;
      for (int32_t t = std::max(0, T - o.recent_pages * p); t < T; ++t)
        boost[static_cast<size_t>(t)] = o.heavy_logit / 2;
      for (int32_t page : cand) {
        for (int32_t t = page * p; t < std::min(T, (page + 1) * p); ++t)
          boost[static_cast<size_t>(t)] = o.heavy_logit * unit(rng);
      }
      // k = noise + boost·√d/|dir| · dir/|dir| adds ≈ boost to q·k/√d for the group's queries.
      const float gain = std::sqrt(static_cast<float>(d)) / (norm * norm);
      for (int32_t t = 0; t < T; ++t) {
        const float s = boost[static_cast<size_t>(t)] * gain;
        for (int32_t i = 0; i < d; ++i) {
          StoreElement(kv.k, g.dtype, kl.Offset(b, t, h, i),
                       normal(rng) + s * dir[static_cast<size_t>(i)]);
          StoreElement(kv.v, g.dtype, kl.Offset(b, t, h, i), normal(rng));
        }
      }
    }
  }
  return kv;
}

}  // namespace kvtier::bench
