// The retrieval telemetry block (offload/telemetry.h): what a writer publishes reads back
// word for word, a block that was never formatted (or was overwritten) reads as nothing, the
// host tier's commits are counted apart from Publish, a reattached writer continues the
// counts, and a region's block is formatted with the region.
#include "offload/telemetry.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "kvtier/geometry.h"
#include "kvtier/sequence.h"
#include "offload/session_region.h"

namespace kvtier {
namespace {

TelemetryValues Filled(uint64_t seed) {
  TelemetryValues v;
  uint64_t words[sizeof(TelemetryValues) / sizeof(uint64_t)];
  for (size_t i = 0; i < std::size(words); ++i) words[i] = seed * 1000 + i + 1;
  std::memcpy(&v, words, sizeof(v));
  return v;
}

TEST(TelemetryTest, PublishedValuesReadBackExceptTheCommitCountWhichOnlyAddCommittedWrites) {
  alignas(8) uint64_t words[kTelemetryWords] = {};
  TelemetryBlock block(words);
  EXPECT_FALSE(block.Read().has_value());  // zeros: never formatted
  block.Format();
  ASSERT_TRUE(block.Read().has_value());
  EXPECT_EQ(block.Read()->steps, 0u);

  const TelemetryValues v = Filled(3);
  block.Publish(v);
  TelemetryValues want = v;
  want.pages_committed = 0;  // Publish leaves it
  TelemetryValues got = *block.Read();
  EXPECT_EQ(std::memcmp(&got, &want, sizeof(got)), 0);

  block.AddCommitted(5);
  block.AddCommitted(2);
  block.Publish(v);
  EXPECT_EQ(block.Read()->pages_committed, 7u);
  EXPECT_EQ(block.Read()->steps, v.steps);
}

TEST(TelemetryTest, AnOverwrittenMagicOrVersionReadsAsNothing) {
  alignas(8) uint64_t words[kTelemetryWords] = {};
  TelemetryBlock block(words);
  block.Format();
  words[0] ^= 1;  // a hostile or buggy writer scribbled over the magic
  EXPECT_FALSE(block.Read().has_value());
  block.Format();
  words[1] = 99;  // a version this reader does not know
  EXPECT_FALSE(block.Read().has_value());
}

TEST(TelemetryTest, StepTimesLandInTheirBucketsWithSumAndCount) {
  TelemetryValues v;
  v.AddStepTime(10e-6);   // first bucket (<= 25 µs)
  v.AddStepTime(25e-6);   // upper bounds are inclusive
  v.AddStepTime(3e-3);    // (2.5 ms, 5 ms]
  v.AddStepTime(5.0);     // +Inf
  v.AddStepTime(-1.0);    // a clock step backwards counts as 0
  EXPECT_EQ(v.step_count, 5u);
  EXPECT_EQ(v.step_buckets[0], 3u);
  EXPECT_EQ(v.step_buckets[7], 1u);  // bounds[7] = 5 ms
  EXPECT_EQ(v.step_buckets[kLayerStepBuckets - 1], 1u);
  EXPECT_EQ(v.step_nanos, 10'000u + 25'000u + 3'000'000u + 5'000'000'000u);
}

TEST(TelemetryTest, AReattachedWriterContinuesCountsButNotGauges) {
  const TelemetryValues base = Filled(1);
  TelemetryValues mine;
  mine.steps = 4;
  mine.recalled_bytes = 100;
  mine.corrected_heads_by_class[1] = 2;
  mine.step_buckets[3] = 1;
  mine.resident_bytes = 77;
  mine.recall_strategy = 2;
  const TelemetryValues c = mine.ContinuedFrom(base);
  EXPECT_EQ(c.steps, base.steps + 4);
  EXPECT_EQ(c.recalled_bytes, base.recalled_bytes + 100);
  EXPECT_EQ(c.corrected_heads_by_class[1], base.corrected_heads_by_class[1] + 2);
  EXPECT_EQ(c.step_buckets[3], base.step_buckets[3] + 1);
  EXPECT_EQ(c.mass_recall_count, base.mass_recall_count);
  EXPECT_EQ(c.resident_bytes, 77u);  // gauges are the new writer's
  EXPECT_EQ(c.recall_strategy, 2u);
}

TEST(TelemetryTest, HeadClassesSplitTheLayersInThirds) {
  EXPECT_EQ(HeadClassOf(0, 1), 0);
  EXPECT_EQ(HeadClassOf(0, 32), 0);
  EXPECT_EQ(HeadClassOf(10, 32), 0);
  EXPECT_EQ(HeadClassOf(11, 32), 1);
  EXPECT_EQ(HeadClassOf(21, 32), 1);
  EXPECT_EQ(HeadClassOf(22, 32), 2);
  EXPECT_EQ(HeadClassOf(31, 32), 2);
  EXPECT_EQ(HeadClassOf(1, 2), 1);
}

TEST(TelemetryTest, ARegionIsFormattedWithAnEmptyBlockThatReadsBackThroughOpen) {
  Geometry g;
  g.num_layers = 2;
  g.num_q_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 16;
  g.page_size = 8;
  auto layout = ComputeRegionLayout(g, 4, 8);
  ASSERT_TRUE(layout.ok()) << layout.status();
  void* base = std::aligned_alloc(kRegionAlignment, layout->total_bytes);
  ASSERT_NE(base, nullptr);
  std::memset(base, 0xab, layout->total_bytes);  // garbage before Format
  auto region = SessionRegion::Format(base, layout->total_bytes, g, 4, 8);
  ASSERT_TRUE(region.ok()) << region.status();
  ASSERT_TRUE(region->telemetry().Read().has_value());
  EXPECT_EQ(region->telemetry().Read()->steps, 0u);
  TelemetryValues v;
  v.steps = 9;
  region->telemetry().Publish(v);
  auto opened = SessionRegion::Open(base, layout->total_bytes, g);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ(opened->telemetry().Read()->steps, 9u);
  // The block does not overlap the header fields Open checks, nor the directory.
  EXPECT_EQ(opened->epoch(), 1u);
  EXPECT_EQ(opened->CommittedPages(), 0);
  std::free(base);
}

// The block has a word for every counter of kvtier/counters.h, set from a sequence's stats.
TEST(TelemetryTest, EveryCounterHasAWord) {
  SequenceStats st;
  int64_t v = 11;
  for (const CounterInfo& c : SequenceCounters()) st.*c.field = v++;
  TelemetryValues t;
  t.SetCounters(st);
  alignas(8) uint64_t words[kTelemetryWords] = {};
  TelemetryBlock block(words);
  block.Format();
  block.Publish(t);
  const TelemetryValues back = *block.Read();
#define KVTIER_CHECK_WORD(name, kind, help) \
  EXPECT_EQ(back.name, static_cast<uint64_t>(st.name)) << #name;
  KVTIER_SEQUENCE_COUNTERS(KVTIER_CHECK_WORD)
#undef KVTIER_CHECK_WORD
}

}  // namespace
}  // namespace kvtier
