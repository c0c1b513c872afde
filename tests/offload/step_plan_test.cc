// The step plan (offload/step_plan.h) and its conformance table.
//
// 1. The plan functions over every combination of the configuration's axes: what each
//    accepted configuration plans (the properties every plan keeps), and that each refused
//    one breaks the rule its message names.
// 2. The conformance table (ggml's test-backend-ops is the model): every configuration the
//    plan accepts, made for real on the CPU backend — alone or as a member of a batch, over
//    a host tier with a cold tier behind it where it demotes — and run for a prefill and
//    several decode steps against the host model: every working set holds exactly the
//    tokens its slot tables name, sinks and the recent window are resident, and attention
//    equals attention over those tokens computed on the host. And every configuration the
//    plan refuses is refused by the Retriever or NewSequenceBatch with the plan's message.
#include "offload/step_plan.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kvtier/sequence.h"
#include "offload/retriever.h"
#include "tests/offload/retriever_harness.h"

namespace kvtier {
namespace {

using namespace retriever_test;  // NOLINT: the harness is this test's vocabulary
using plan::BeginWork;
using plan::RecallRoute;
using testing::TypedBuffer;

constexpr RetrievalMode kModes[] = {RetrievalMode::kSpeculative, RetrievalMode::kSync,
                                    RetrievalMode::kFull, RetrievalMode::kDrop};
constexpr RecallStrategy kRecalls[] = {RecallStrategy::kAuto, RecallStrategy::kBatchedDma,
                                       RecallStrategy::kZeroCopy};
constexpr policy::HostDropMode kDrops[] = {policy::HostDropMode::kRefuse,
                                           policy::HostDropMode::kEvict,
                                           policy::HostDropMode::kDemote};

std::string Name(const plan::SequenceConfig& c) {
  return absl::StrFormat("%s%s recall=%s host_drop=%s%s%s%s%s%s", RetrievalModeName(c.mode),
                         c.mode == RetrievalMode::kSpeculative
                             ? "/" + std::string(CorrectionTriggerName(c.trigger))
                             : std::string(),
                         RecallStrategyName(c.recall), policy::HostDropModeName(c.host_drop),
                         c.cold_tier ? " cold" : "", c.policies ? " policies" : "",
                         c.batch ? " batch" : "",
                         c.capture_graphs ? " graphs" : "",
                         c.backend_captures ? "" : " (no capture)");
}

// Every combination of the axes (the trigger only where it means something).
std::vector<plan::SequenceConfig> AllConfigs(bool backend_captures_both) {
  std::vector<plan::SequenceConfig> all;
  for (RetrievalMode mode : kModes)
    for (CorrectionTrigger trigger : {CorrectionTrigger::kCosine, CorrectionTrigger::kMass}) {
      if (trigger == CorrectionTrigger::kMass && mode != RetrievalMode::kSpeculative) continue;
      for (RecallStrategy recall : kRecalls)
        for (policy::HostDropMode drop : kDrops)
          for (bool cold : {false, true})
            for (bool policies : {false, true})
              for (bool batch : {false, true})
                for (bool graphs : {false, true})
                  for (bool captures : {true, false}) {
                    if (!captures && !backend_captures_both) continue;
                    plan::SequenceConfig c;
                    c.mode = mode;
                    c.trigger = trigger;
                    c.recall = recall;
                    c.host_drop = drop;
                    c.cold_tier = cold;
                    c.policies = policies || drop != policy::HostDropMode::kRefuse;
                    if (drop != policy::HostDropMode::kRefuse && !policies) continue;
                    c.batch = batch;
                    c.capture_graphs = graphs;
                    c.backend_captures = captures;
                    all.push_back(c);
                  }
    }
  return all;
}

bool IsDma(RecallStrategy s) { return s == RecallStrategy::kBatchedDma; }

// The properties every plan keeps: the exclusion rules seen from the accepted side.
void ExpectPlanProperties(const plan::SequenceConfig& c, const plan::SequencePlan& resolved) {
  const plan::SequencePlan& p = resolved;
  const bool speculative = c.mode == RetrievalMode::kSpeculative;
  EXPECT_EQ(p.host_tier, speculative || c.mode == RetrievalMode::kSync);
  EXPECT_EQ(p.dma, IsDma(p.strategy));
  // The strategy is the one given; auto is the gather unless the host must see the plan.
  if (c.recall != RecallStrategy::kAuto) {
    EXPECT_EQ(p.strategy, c.recall);
  } else {
    EXPECT_EQ(p.strategy, p.demote ? RecallStrategy::kBatchedDma : RecallStrategy::kZeroCopy);
  }
  // The host must see the plan of a DMA strategy and of a demoting sequence; a batch and a
  // captured graph keep it on the device.
  if (p.demote) {
    EXPECT_TRUE(p.dma && p.host_tier && c.cold_tier);
  }
  if (c.batch) {
    EXPECT_TRUE(p.strategy == RecallStrategy::kZeroCopy && !p.demote && !p.managed);
  }
  if (p.graphs) {
    EXPECT_TRUE(speculative && !p.dma && c.capture_graphs && c.backend_captures);
  }
  if (c.host_drop != policy::HostDropMode::kRefuse) {
    EXPECT_TRUE(p.host_tier);
  }
  EXPECT_EQ(p.managed, c.mode == RetrievalMode::kDrop && c.policies);
  EXPECT_EQ(p.mass_trigger, speculative && c.trigger == CorrectionTrigger::kMass);
  // The steps.
  for (int64_t step : {0, 1, 7})
    for (bool reselect : {false, true})
      for (bool profiling : {false, true}) {
        const plan::BeginPlan b =
            plan::PlanBegin(p, {.step = step, .reselect = reselect, .profiling = profiling});
        SCOPED_TRACE(absl::StrFormat("step %d reselect %d profiling %d: %s via %s", step,
                                     reselect, profiling, plan::BeginWorkName(b.work),
                                     plan::RecallRouteName(b.route)));
        switch (c.mode) {
          case RetrievalMode::kSync:
            EXPECT_EQ(b.work, BeginWork::kSelect);
            break;
          case RetrievalMode::kSpeculative:
            EXPECT_EQ(b.work, step == 0 || reselect ? BeginWork::kSelect : BeginWork::kCorrect);
            break;
          default:
            EXPECT_EQ(b.work, BeginWork::kNone);
        }
        EXPECT_EQ(b.checked, b.work == BeginWork::kCorrect);
        // A route that hands the plan to the host needs a strategy the host drives; one that
        // keeps it on the device is taken unless the host must promote demoted pages.
        if (b.work != BeginWork::kNone) {
          EXPECT_EQ(b.route == RecallRoute::kForeground,
                    p.dma && (c.mode == RetrievalMode::kSync || p.demote));
        }
        EXPECT_NE(b.route, RecallRoute::kBackground);
        if (b.captured) {
          EXPECT_TRUE(p.graphs && !profiling && b.work == BeginWork::kCorrect);
        }
        const plan::EndPlan e = plan::PlanEnd(p, profiling);
        EXPECT_EQ(e.background_select, speculative);
        if (e.background_select) {
          EXPECT_EQ(e.route, p.dma ? RecallRoute::kBackground : RecallRoute::kGather);
        }
        EXPECT_EQ(e.captured, e.background_select && p.graphs && !profiling);
      }
}

// The rules, each as the configurations it refuses and a word of the message that names it.
struct Rule {
  const char* says;
  bool (*refuses)(const plan::SequenceConfig&);
};
const Rule kRules[] = {
    {"has no host tier",
     [](const plan::SequenceConfig& c) {
       return c.host_drop != policy::HostDropMode::kRefuse &&
              (c.mode == RetrievalMode::kFull || c.mode == RetrievalMode::kDrop);
     }},
    {"no cold tier",
     [](const plan::SequenceConfig& c) {
       return c.host_drop == policy::HostDropMode::kDemote && !c.cold_tier;
     }},
    {"with recall = zero_copy",
     [](const plan::SequenceConfig& c) {
       return c.host_drop == policy::HostDropMode::kDemote && c.recall == RecallStrategy::kZeroCopy;
     }},
    {"drives one sequence's DMAs",
     [](const plan::SequenceConfig& c) { return c.batch && IsDma(c.recall); }},
    {"changes size",
     [](const plan::SequenceConfig& c) {
       return c.batch && c.mode == RetrievalMode::kDrop && c.policies;
     }},
    {"cannot share a batch",
     [](const plan::SequenceConfig& c) {
       return c.batch && c.host_drop == policy::HostDropMode::kDemote;
     }},
};

TEST(StepPlanTest, EveryConfigurationIsPlannedOrRefusedByItsRule) {
  int accepted = 0, refused = 0;
  std::set<std::string> messages;
  for (const plan::SequenceConfig& c : AllConfigs(/*backend_captures_both=*/true)) {
    SCOPED_TRACE(Name(c));
    int broken = 0;
    for (const Rule& r : kRules) broken += r.refuses(c);
    absl::StatusOr<plan::SequencePlan> p = plan::PlanSequence(c);
    if (broken == 0) {
      ASSERT_TRUE(p.ok()) << p.status();
      ++accepted;
      ExpectPlanProperties(c, *p);
      continue;
    }
    ASSERT_TRUE(absl::IsInvalidArgument(p.status())) << p.status();
    ++refused;
    messages.insert(std::string(p.status().message()));
    bool named = false;
    for (const Rule& r : kRules) {
      named |= r.refuses(c) && p.status().message().find(r.says) != std::string::npos;
    }
    EXPECT_TRUE(named) << "refused by a rule it does not break: " << p.status().message();
  }
  // Six rules, each with one message (the host-drop ones name their value).
  EXPECT_EQ(sizeof(kRules) / sizeof(kRules[0]), 6u);
  EXPECT_GT(accepted, 0);
  EXPECT_GT(refused, 0);
  std::printf("step plan: %d configurations planned, %d refused, %zu distinct messages\n",
              accepted, refused, messages.size());
}

TEST(StepPlanTest, RemovedAndUnknownRecallStrategiesAreRefusedByName) {
  plan::SequenceConfig c;
  c.recall = static_cast<RecallStrategy>(1);  // slab_dma, removed
  absl::StatusOr<plan::SequencePlan> p = plan::PlanSequence(c);
  ASSERT_TRUE(absl::IsInvalidArgument(p.status())) << p.status();
  EXPECT_NE(p.status().message().find("slab_dma was removed"), std::string::npos) << p.status();
  c.recall = static_cast<RecallStrategy>(9);
  p = plan::PlanSequence(c);
  ASSERT_TRUE(absl::IsInvalidArgument(p.status())) << p.status();
  EXPECT_NE(p.status().message().find("recall strategy 9: unknown"), std::string::npos)
      << p.status();
}

TEST(StepPlanTest, AutoIsTheGatherUnlessTheHostMustSeeThePlan) {
  plan::SequenceConfig c;
  c.recall = RecallStrategy::kAuto;
  EXPECT_EQ(plan::PlanSequence(c)->strategy, RecallStrategy::kZeroCopy);
  c.host_drop = policy::HostDropMode::kDemote;
  c.cold_tier = true;
  c.policies = true;
  EXPECT_EQ(plan::PlanSequence(c)->strategy, RecallStrategy::kBatchedDma);
  EXPECT_TRUE(plan::PlanSequence(c)->dma);
  c = {};
  c.batch = true;
  EXPECT_EQ(plan::PlanSequence(c)->strategy, RecallStrategy::kZeroCopy);
  c = {};
  c.recall = RecallStrategy::kBatchedDma;
  c.capture_graphs = true;
  c.backend_captures = true;
  const plan::SequencePlan d = *plan::PlanSequence(c);
  EXPECT_TRUE(d.dma);
  EXPECT_FALSE(d.graphs) << "a DMA strategy's plan goes to the host: nothing to capture";
}

// ---- The conformance table: every accepted configuration, run for real. ----------------

SequenceOptions OptionsOf(const plan::SequenceConfig& c) {
  SequenceOptions o = SmallOptions(c.mode);
  o.correction_trigger = c.trigger;
  o.recall = c.recall;
  o.capture_graphs = c.capture_graphs;
  if (c.policies) {
    // A residency policy reads attention and pins pages in every mode; in drop mode it makes
    // the working set managed.
    o.policy.residency = "h2o";
  }
  o.policy.host_drop = std::string(policy::HostDropModeName(c.host_drop));
  return o;
}

// The host pages of a lone sequence's tier: all it needs, or (when it drops pages) fewer
// than the sequence holds but no fewer than demotion's floor.
constexpr int32_t kPrompt = 150;
constexpr int32_t kSteps = 6;

// Checks one step's view and output against `model`.
void ExpectStepMatchesModel(const Geometry& g, const SequenceOptions& o, const HostModel& model,
                            const WorkingSetView& view, const TypedBuffer& q,
                            const std::vector<float>& out) {
  const std::vector<int32_t> table(view.slot_table,
                                   view.slot_table + g.num_kv_heads * view.num_slots);
  ExpectWorkingSetConsistent(g, o, model, view);
  const std::vector<float> want =
      AttentionOverTable(g, model, view.layer, q, table, view.num_slots, model.tokens());
  double err = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    err += (out[i] - want[i]) * (out[i] - want[i]);
    norm += want[i] * want[i];
  }
  EXPECT_LT(std::sqrt(err / norm), 1e-5) << "layer " << view.layer;
}

// A lone sequence of configuration c, through Retriever::Create over a host tier.
void RunLone(const plan::SequenceConfig& c, Backend& backend) {
  const Geometry g = SmallGeometry();
  const SequenceOptions o = OptionsOf(c);
  const int32_t pages_needed = g.num_layers * ((kPrompt + 3 * kSteps) / g.page_size + 2);
  const bool drops = c.host_drop != policy::HostDropMode::kRefuse;
  HostMemory mem(g, drops ? 24 : 2 * pages_needed);
  MemoryColdPages cold;
  std::unique_ptr<HostTier> tier;
  if (c.cold_tier) {
    tier = std::make_unique<ColdHostTier>(*mem.pool, cold);
  } else {
    tier = std::make_unique<CommitLog>(*mem.pool);
  }
  absl::StatusOr<std::unique_ptr<Retriever>> made = Retriever::Create(g, o, backend, std::move(tier));
  ASSERT_TRUE(made.ok()) << made.status();
  Retriever& r = **made;
  HostModel model(g, 5);
  std::vector<TypedBuffer> keep;
  const auto append = [&](int32_t n) {
    auto rows = model.Grow(n);
    for (int32_t l = 0; l < g.num_layers; ++l) {
      const absl::Status appended = r.Append(l, rows[l].first.data(), rows[l].second.data(), n);
      ASSERT_TRUE(appended.ok()) << appended;
    }
    for (auto& x : rows) keep.push_back(std::move(x.first)), keep.push_back(std::move(x.second));
  };
  append(kPrompt);
  for (int32_t step = 0; step < kSteps; ++step) {
    const TypedBuffer q = model.Query(40 + step);
    const int64_t n = int64_t{g.num_q_heads} * g.head_dim;
    for (int32_t l = 0; l < g.num_layers; ++l) {
      absl::StatusOr<WorkingSetView> view = r.BeginStep(l, q.data());
      ASSERT_TRUE(view.ok()) << "step " << step << ": " << view.status();
      TypedBuffer out(g.dtype, n);
      ASSERT_TRUE(r.Attend(l, q.data(), out.data(), nullptr).ok());
      const absl::Status waited = r.Wait();
      ASSERT_TRUE(waited.ok()) << "step " << step << " layer " << l << ": " << waited;
      ExpectStepMatchesModel(g, o, model, *view, q, out.ToFloats());
      ASSERT_TRUE(r.EndStep(l, q.data()).ok());
    }
    append(1 + step % 3);
  }
  const absl::Status drained = r.Wait();
  ASSERT_TRUE(drained.ok()) << drained;
  const SequenceStats st = r.Stats();
  EXPECT_EQ(st.steps, int64_t{kSteps} * g.num_layers);
  if (c.mode == RetrievalMode::kSpeculative) {
    EXPECT_GT(st.checked_heads, 0);
  }
  if (c.host_drop == policy::HostDropMode::kDemote) {
    EXPECT_GT(st.host_demoted_pages, 0);
  }
  if (c.host_drop == policy::HostDropMode::kEvict) {
    EXPECT_GT(st.host_dropped_pages, 0);
  }
  ASSERT_TRUE(r.Close().ok());
}

// Two members of a batch of configuration c, stepped together (NewSequenceBatch).
void RunBatch(const plan::SequenceConfig& c, Device& device) {
  const Geometry g = SmallGeometry();
  const SequenceOptions o = OptionsOf(c);
  absl::StatusOr<std::unique_ptr<SequenceBatch>> made = NewSequenceBatch(g, o, 2, device);
  ASSERT_TRUE(made.ok()) << made.status();
  SequenceBatch& batch = **made;
  std::vector<std::unique_ptr<LocalSequence>> members;
  std::vector<HostModel> models;
  for (int i = 0; i < 2; ++i) {
    members.push_back(batch.NewSequence().value());
    models.emplace_back(g, 17 + i);
  }
  std::vector<TypedBuffer> keep;
  const auto append = [&](int i, int32_t n) {
    auto rows = models[i].Grow(n);
    for (int32_t l = 0; l < g.num_layers; ++l) {
      ASSERT_TRUE(members[i]->Append(l, rows[l].first.data(), rows[l].second.data(), n).ok());
    }
    for (auto& x : rows) keep.push_back(std::move(x.first)), keep.push_back(std::move(x.second));
  };
  append(0, kPrompt);
  append(1, kPrompt - 37);  // ragged
  std::vector<LocalSequence*> both = {members[0].get(), members[1].get()};
  const int64_t n = int64_t{g.num_q_heads} * g.head_dim;
  for (int32_t step = 0; step < kSteps; ++step) {
    const TypedBuffer q0 = models[0].Query(60 + step), q1 = models[1].Query(80 + step);
    TypedBuffer q(g.dtype, 2 * n), out(g.dtype, 2 * n);
    std::memcpy(q.data(), q0.data(), q0.bytes());
    std::memcpy(static_cast<uint8_t*>(q.data()) + q0.bytes(), q1.data(), q1.bytes());
    for (int32_t l = 0; l < g.num_layers; ++l) {
      absl::StatusOr<std::vector<WorkingSetView>> views = batch.BeginStep(l, both, q.data());
      ASSERT_TRUE(views.ok()) << "step " << step << ": " << views.status();
      ASSERT_TRUE(batch.Attend(l, both, q.data(), out.data(), nullptr).ok());
      for (LocalSequence* m : both) ASSERT_TRUE(m->Wait().ok());
      const std::vector<float> all = out.ToFloats();
      for (int i = 0; i < 2; ++i) {
        SCOPED_TRACE(absl::StrCat("member ", i));
        const std::vector<float> mine(all.begin() + i * n, all.begin() + (i + 1) * n);
        ExpectStepMatchesModel(g, o, models[i], (*views)[i], i == 0 ? q0 : q1, mine);
      }
      ASSERT_TRUE(batch.EndStep(l, both, q.data()).ok());
    }
    append(0, 1);
    append(1, 1 + step % 2);
  }
  for (auto& m : members) ASSERT_TRUE(m->Close().ok());
}

TEST(StepPlanConformanceTest, EveryPlannedConfigurationMatchesTheHostModel) {
  std::unique_ptr<Backend> backend = NewCpuBackend(2);
  std::unique_ptr<Device> device = CreateDevice(DeviceKind::kCpu).value();
  ASSERT_TRUE(backend->SupportsCapture());
  int ran = 0, refused = 0;
  for (const plan::SequenceConfig& c : AllConfigs(/*backend_captures_both=*/false)) {
    SCOPED_TRACE(Name(c));
    absl::StatusOr<plan::SequencePlan> p = plan::PlanSequence(c);
    if (!p.ok()) {
      // Refused where the sequence is made, with the plan's message.
      ++refused;
      const Geometry g = SmallGeometry();
      const SequenceOptions o = OptionsOf(c);
      absl::Status made;
      if (c.batch) {
        // NewSequenceBatch assumes the members' host tiers may have a cold tier.
        if (c.host_drop == policy::HostDropMode::kDemote && !c.cold_tier) continue;
        made = NewSequenceBatch(g, o, 2, *device).status();
      } else {
        HostMemory mem(g, 64);
        MemoryColdPages cold;
        std::unique_ptr<HostTier> tier;
        if (c.cold_tier) tier = std::make_unique<ColdHostTier>(*mem.pool, cold);
        else tier = std::make_unique<CommitLog>(*mem.pool);
        made = Retriever::Create(g, o, *backend, std::move(tier)).status();
      }
      EXPECT_TRUE(absl::IsInvalidArgument(made)) << made;
      EXPECT_EQ(made.message(), p.status().message());
      continue;
    }
    ++ran;
    if (c.batch) {
      RunBatch(c, *device);
    } else {
      RunLone(c, *backend);
    }
    if (HasFatalFailure()) return;
  }
  std::printf("conformance: %d configurations run against the host model, %d refused\n", ran,
              refused);
  EXPECT_GT(ran, 0);
}

}  // namespace
}  // namespace kvtier
