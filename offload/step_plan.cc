#include "offload/step_plan.h"

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "core/status.h"

namespace kvtier::plan {
namespace {

bool IsDma(RecallStrategy s) { return s == RecallStrategy::kBatchedDma; }

absl::Status Bad(std::string message) { return absl::InvalidArgumentError(std::move(message)); }

}  // namespace

SequenceConfig ConfigOf(const SequenceOptions& o, bool batch, bool cold_tier,
                        bool backend_captures) {
  SequenceConfig c;
  c.mode = o.mode;
  c.trigger = o.correction_trigger;
  c.recall = o.recall;
  (void)policy::ParseHostDropMode(o.policy.host_drop, &c.host_drop);
  c.cold_tier = cold_tier;
  c.policies = !o.policy.is_default();
  c.batch = batch;
  c.capture_graphs = o.capture_graphs;
  c.backend_captures = backend_captures;
  return c;
}

absl::StatusOr<SequencePlan> PlanSequence(const SequenceConfig& c) {
  SequencePlan p;
  p.mode = c.mode;
  p.host_tier = c.mode == RetrievalMode::kSpeculative || c.mode == RetrievalMode::kSync;
  p.managed = c.mode == RetrievalMode::kDrop && c.policies;
  p.demote = c.host_drop == policy::HostDropMode::kDemote;
  p.mass_trigger =
      c.mode == RetrievalMode::kSpeculative && c.trigger == CorrectionTrigger::kMass;

  if (c.recall != RecallStrategy::kAuto && c.recall != RecallStrategy::kBatchedDma &&
      c.recall != RecallStrategy::kZeroCopy) {
    if (static_cast<int>(c.recall) == 1) {
      return Bad(
          "recall strategy 1: slab_dma was removed (batched_dma makes the same copies, adjacent "
          "ones merged); use batched_dma, zero_copy or auto");
    }
    return Bad(absl::StrFormat(
        "recall strategy %d: unknown; one of auto (0), batched_dma (2), zero_copy (3)",
        static_cast<int>(c.recall)));
  }
  // Pages leave the host tier only from a host tier.
  if (c.host_drop != policy::HostDropMode::kRefuse && !p.host_tier) {
    return Bad(absl::StrFormat(
        "policy.host_drop = %s: mode %s has no host tier (speculative or sync only)",
        policy::HostDropModeName(c.host_drop), RetrievalModeName(c.mode)));
  }
  if (p.demote && !c.cold_tier) {
    return Bad(
        "policy.host_drop = demote: the host tier has no cold tier behind it (kvtierd: "
        "configure [cold_tier] and open the session with transport GRPC)");
  }
  // The host promotes a demoted page before its recall: it must see the plan.
  if (p.demote && c.recall == RecallStrategy::kZeroCopy) {
    return Bad(
        "policy.host_drop = demote with recall = zero_copy: the gather reads host pages on the "
        "device, so a demoted page could not be promoted before it; use batched_dma or auto");
  }
  if (c.batch) {
    // A batch recalls every member with one gather on the device: no member's plan reaches
    // the host, and one set of slots is shared by the run.
    if (IsDma(c.recall)) {
      return Bad(absl::StrFormat(
          "NewSequenceBatch: recall strategy %s drives one sequence's DMAs: a batch recalls "
          "zero_copy (or auto)",
          RecallStrategyName(c.recall)));
    }
    if (p.managed) {
      return Bad(
          "sequence: a drop-mode working set managed by policies changes size, so it cannot "
          "share a batch");
    }
    if (p.demote) {
      return Bad(
          "policy.host_drop = demote: a batch recalls with the zero-copy gather, which cannot "
          "promote a demoted page; such a sequence cannot share a batch");
    }
  }

  if (c.recall != RecallStrategy::kAuto) {
    p.strategy = c.recall;
  } else {
    p.strategy = p.demote ? RecallStrategy::kBatchedDma : RecallStrategy::kZeroCopy;
  }
  p.dma = IsDma(p.strategy);
  // Graph capture keeps the whole step on the device.
  p.graphs = c.capture_graphs && c.mode == RetrievalMode::kSpeculative && !p.dma &&
             c.backend_captures;
  return p;
}

BeginPlan PlanBegin(const SequencePlan& p, const BeginInputs& in) {
  BeginPlan b;
  const bool speculative = p.mode == RetrievalMode::kSpeculative;
  if (p.mode == RetrievalMode::kSync || (speculative && (in.step == 0 || in.reselect))) {
    b.work = BeginWork::kSelect;
    // Sync mode recalls with its strategy, the host waiting for the plan when the strategy
    // is a DMA one; speculative mode's selection on the critical path gathers, unless pages
    // may be demoted (then its strategy is a DMA one and the host promotes first).
    b.route = p.dma && (p.mode == RetrievalMode::kSync || p.demote) ? RecallRoute::kForeground
                                                                    : RecallRoute::kGather;
  } else if (speculative) {
    b.work = BeginWork::kCorrect;
    b.route = p.demote ? RecallRoute::kForeground : RecallRoute::kGather;
    b.captured = p.graphs && !in.profiling;
    b.checked = true;
  }
  return b;
}

EndPlan PlanEnd(const SequencePlan& p, bool profiling) {
  EndPlan e;
  if (p.mode != RetrievalMode::kSpeculative) return e;
  e.background_select = true;
  e.route = p.dma ? RecallRoute::kBackground : RecallRoute::kGather;
  e.captured = p.graphs && !profiling;
  return e;
}

std::string BeginWorkName(BeginWork w) {
  switch (w) {
    case BeginWork::kSelect:
      return "select";
    case BeginWork::kCorrect:
      return "correct";
    case BeginWork::kNone:
      return "none";
  }
  return "?";
}

std::string RecallRouteName(RecallRoute r) {
  switch (r) {
    case RecallRoute::kGather:
      return "gather";
    case RecallRoute::kBackground:
      return "background";
    case RecallRoute::kForeground:
      return "foreground";
  }
  return "?";
}

}  // namespace kvtier::plan
