// Synthetic decode-time KV with the structure real attention has, so sparse selection has
// something to find: per KV head, queries of a group share a direction; keys of an attention
// sink (page 0), of the recent pages and of a few "heavy" pages per head carry a component
// along it that adds about `heavy_logit` to their scaled logits; everything else is noise.
// Values are N(0, 1). Deterministic from the seed. Not a model: a stand-in until traces of
// real models are fed through the replay benchmark.
//
// The planted structure is generous by default: 24 heavy pages per head, fewer than the 32
// pages the benchmarks select, so a perfect selection captures all of it and the sparse
// output's error only measures the unplanted tail. That bounds what selection can reach; it
// is not a measure of real attention. HarderSyntheticKv() plants more heavy pages than
// there are selected slots, so any selection must leave planted mass behind; benchmarks
// report both.
#ifndef KVTIER_BENCH_SYNTHETIC_KV_H_
#define KVTIER_BENCH_SYNTHETIC_KV_H_

#include <cstdint>
#include <vector>

#include "kvtier/geometry.h"

namespace kvtier::bench {

// Element i of `data` (an array of dtype `t`) set to v, rounded to nearest even.
void StoreElement(std::vector<uint8_t>& data, DType t, int64_t i, float v);

struct SyntheticKvOptions {
  int32_t batch = 1;
  int32_t tokens = 32768;
  int32_t heavy_pages = 24;    // per KV head, among the non-sink, non-recent pages
  int32_t recent_pages = 2;    // trailing pages that get half the boost
  float heavy_logit = 8.0f;    // logit boost of heavy tokens (scaled by U(0.5, 1) per token)
  uint64_t seed = 1;
};

struct SyntheticKv {
  // All in geometry.dtype: q [B][Hq][d]; k, v dense NHD [B][T][Hkv][d].
  std::vector<uint8_t> q, k, v;
  // heavy[b][h] = the planted heavy pages of (sequence, KV head).
  std::vector<std::vector<std::vector<int32_t>>> heavy;
};

SyntheticKv MakeSyntheticKv(const Geometry& g, const SyntheticKvOptions& o);

// Element i of a `t` array as float.
float LoadAsFloat(const std::vector<uint8_t>& data, DType t, int64_t i);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_SYNTHETIC_KV_H_
