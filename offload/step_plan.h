// The step plan (docs/retriever.md#the-step-plan): what a sequence's decode steps run, as
// values computed by pure functions, so that the Retriever (and a batch for its members)
// asks and then enqueues instead of deciding with flags of its own.
//
// Two levels, as FlashInfer splits plan() from run():
//   - PlanSequence, once per sequence: from the configuration (mode, trigger, recall
//     strategy, host drop, policies, batch, graph capture) to a SequencePlan — whether
//     there is a host tier, whether the host must see the recall plan, whether steps are
//     captured as graphs. The rules that exclude combinations of features are all here, and
//     each is one consequence of a single question: *is this step's recall plan visible to
//     the host?* The DMA strategies are driven from the host, and a demoted page is
//     promoted by the host, so both need the plan there; the zero-copy gather and a
//     captured graph keep it on the device; a batch recalls every member with one gather.
//   - PlanBegin and PlanEnd, per layer-step: which work runs before attention (a full
//     selection, the drift check and correction, or nothing), on which recall route, and
//     whether a background selection follows attention.
//
// Pure: no device, no I/O. Table-tested by tests/offload/step_plan_test.cc, which also runs
// every configuration it accepts against the host model.
#ifndef KVTIER_OFFLOAD_STEP_PLAN_H_
#define KVTIER_OFFLOAD_STEP_PLAN_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "kvtier/options.h"
#include "offload/policy/host_drop.h"

namespace kvtier::plan {

// What a sequence is made with, as far as the plan is concerned.
struct SequenceConfig {
  RetrievalMode mode = RetrievalMode::kSpeculative;
  CorrectionTrigger trigger = CorrectionTrigger::kCosine;
  RecallStrategy recall = RecallStrategy::kAuto;  // as given (kAuto: the plan chooses)
  policy::HostDropMode host_drop = policy::HostDropMode::kRefuse;
  bool cold_tier = false;   // its host tier has a cold tier behind it
  bool policies = false;    // a budget or residency policy other than the defaults
  bool batch = false;       // a member of a batch (NewSequenceBatch)
  bool capture_graphs = false;  // SequenceOptions::capture_graphs
  bool backend_captures = false;  // the backend can capture streams
};

// The configuration of a sequence made with `o`: mode, trigger, strategy and the policies
// as named there (a host-drop name the policy registry will refuse counts as the default
// here; the registry's message is the one the caller gets). The rest is the caller's:
// whether it joins a batch, has a cold tier, and what the backend can do.
SequenceConfig ConfigOf(const SequenceOptions& o, bool batch, bool cold_tier,
                        bool backend_captures);

// What follows from the configuration, for every step of the sequence.
struct SequencePlan {
  RetrievalMode mode = RetrievalMode::kSpeculative;
  bool host_tier = false;     // speculative and sync: every page in the host tier, selection
  bool managed = false;       // drop mode with policies: per-head slots that change size
  bool demote = false;        // a full host tier demotes pages to the cold tier
  bool mass_trigger = false;  // speculative with the mass trigger
  // The recall strategy: the one given, or for kAuto the zero-copy gather, unless pages may
  // be demoted (then batched_dma: the host must see the plan). Measured on an H200, the
  // gather moves scattered slabs 3.6–9.3 times faster than batched DMA at every budget and
  // churn (bench/results/gpu-2026-11-27-h200, kvtier-bench pcie [3]); on the CPU backend
  // both are memcpys.
  RecallStrategy strategy = RecallStrategy::kZeroCopy;
  bool dma = false;  // the strategy copies slabs with DMAs driven from the host
  // Steps are captured as graphs (before profiling switches them off): speculative mode,
  // the whole step on the device (the gather), a backend that captures.
  bool graphs = false;
};

// The plan of a sequence made with `c`, or INVALID_ARGUMENT naming the rule it breaks (one
// message per rule).
absl::StatusOr<SequencePlan> PlanSequence(const SequenceConfig& c);

// How a recall moves the selected pages.
enum class RecallRoute : uint8_t {
  kGather,      // the zero-copy gather op on the same stream, reading the device plan
  kBackground,  // the strategy: a DMA plan goes to the host, its DMAs are issued by Pump
  kForeground,  // the strategy, now: the host waits for the plan, then issues the DMAs
};

// What runs before attention.
enum class BeginWork : uint8_t {
  kSelect,   // select every head with q_t (sync; speculative's first step or re-selection)
  kCorrect,  // speculative: the drift check, and the correction of the drifted heads
  kNone,     // full and drop modes
};

struct BeginInputs {
  int64_t step = 0;       // the layer's step index
  bool reselect = false;  // the policies changed the layer's budget: select every head again
  bool profiling = false;
};

struct BeginPlan {
  BeginWork work = BeginWork::kNone;
  RecallRoute route = RecallRoute::kGather;  // of kSelect and of kCorrect's recall
  bool captured = false;  // kCorrect runs as a graph
  bool checked = false;   // the step's record counts checked (and corrected) heads
  bool operator==(const BeginPlan&) const = default;
};

struct EndPlan {
  // Speculative: after attention, select with q_t and recall in the background.
  bool background_select = false;
  RecallRoute route = RecallRoute::kGather;
  bool captured = false;  // the background selection runs as a graph
  bool operator==(const EndPlan&) const = default;
};

BeginPlan PlanBegin(const SequencePlan& p, const BeginInputs& in);
EndPlan PlanEnd(const SequencePlan& p, bool profiling);

// "select", "correct", "none" / "gather", "background", "foreground" (for test names and
// messages).
std::string BeginWorkName(BeginWork w);
std::string RecallRouteName(RecallRoute r);

}  // namespace kvtier::plan

#endif  // KVTIER_OFFLOAD_STEP_PLAN_H_
