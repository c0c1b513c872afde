// SequenceBatch (kvtier/sequence.h, docs/retriever.md#batches): the one step path of every
// local sequence. Every member's host phases in order, and the device work of BeginStep,
// Attend and EndStep once per run of members in consecutive batch slots (RetrieverImpl's
// phases with n ≥ 1 over the batch storage of offload/batch_shared.h). A member stepped alone
// is a run of one: the ops compute each sequence of a batch independently.
#include <algorithm>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "kernels/registry.h"
#include "offload/batch_shared.h"
#include "offload/host_tier.h"
#include "offload/retriever_impl.h"
#include "offload/sequence_batch.h"

namespace kvtier {
namespace retriever_internal {

class SequenceBatchImpl final : public SequenceBatch {
 public:
  // `owner`: the members' batch object (they name it as their batch while it exists).
  SequenceBatchImpl(const Geometry& g, const SequenceOptions& o, Backend& backend,
                    std::shared_ptr<BatchShared> shared, bool owner)
      : g_(g), o_(o), backend_(backend), shared_(std::move(shared)), owner_(owner) {
    if (owner_) shared_->set_owner(this);
  }
  // Members may outlive the batch object (they keep its storage): they step through their
  // own from then on.
  ~SequenceBatchImpl() override {
    if (owner_) shared_->set_owner(nullptr);
  }

  absl::StatusOr<std::unique_ptr<LocalSequence>> NewSequence() override {
    std::unique_ptr<HostTier> host;
    if (shared_->host() != nullptr) host = std::make_unique<PoolHostTier>(shared_->host()->pool());
    auto r = std::make_unique<RetrieverImpl>(g_, o_, backend_, std::move(host),
                                             /*policy_store=*/nullptr, shared_);
    KVTIER_RETURN_IF_ERROR(r->Init());
    return std::unique_ptr<LocalSequence>(std::move(r));
  }

  absl::StatusOr<std::vector<WorkingSetView>> BeginStep(int32_t layer,
                                                        std::span<LocalSequence* const> members,
                                                        const void* q) override {
    KVTIER_ASSIGN_OR_RETURN(std::vector<RetrieverImpl*> m, Members(members, "BeginStep"));
    for (RetrieverImpl* r : m) KVTIER_RETURN_IF_ERROR(r->CheckCall(layer, "BeginStep"));
    if (q == nullptr) return absl::InvalidArgumentError("BeginStep: q must be non-null");
    for (RetrieverImpl* r : m) {
      const LayerState& l = r->layers_[layer];
      if (l.tokens == 0 || l.in_step) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "BeginStep: layer %d%s %s", layer, Who(m, r),
            l.tokens == 0 ? "has no tokens: Append first" : "is in a step not yet ended"));
      }
    }
    const HostCalls start = ThreadHostCalls();
    const size_t qb = m[0]->q_bytes();
    const auto* qs = static_cast<const uint8_t*>(q);
    std::vector<RetrieverImpl::BeginPath> paths(m.size());
    absl::Status st;
    for (size_t i = 0; i < m.size() && st.ok(); ++i) {
      absl::StatusOr<RetrieverImpl::BeginPath> p = m[i]->BeginHost(layer);
      if (p.ok()) paths[i] = *p;
      st = p.status();
    }
    // Once per run of consecutive slots taking the same path: the queries, then the ops.
    ForRuns(m, &paths, [&](size_t i, int32_t n) -> absl::Status {
      RetrieverImpl& first = *m[i];
      KVTIER_RETURN_IF_ERROR(backend_.Copy(*first.compute_,
                                           first.layers_[layer].select.q_cur.data(), qs + i * qb,
                                           qb * n));
      return first.BeginDevice(layer, paths[i], n);
    }, &st);
    std::vector<WorkingSetView> views;
    for (size_t i = 0; i < m.size() && st.ok(); ++i) {
      absl::StatusOr<WorkingSetView> v = m[i]->BeginFinish(layer, paths[i]);
      if (v.ok()) views.push_back(*v);
      st = v.status();
    }
    Meter(m, layer, start);
    if (!st.ok()) return st;
    return views;
  }

  absl::Status Attend(int32_t layer, std::span<LocalSequence* const> members, const void* q,
                      void* out, float* lse) override {
    KVTIER_ASSIGN_OR_RETURN(std::vector<RetrieverImpl*> m, Members(members, "Attend"));
    for (RetrieverImpl* r : m) {
      KVTIER_RETURN_IF_ERROR(r->CheckCall(layer, "Attend"));
      if (!r->layers_[layer].in_step) {
        return absl::FailedPreconditionError(
            absl::StrFormat("Attend: layer %d%s: call BeginStep first", layer, Who(m, r)));
      }
    }
    const HostCalls start = ThreadHostCalls();
    const size_t qb = m[0]->q_bytes();
    const int32_t hq = g_.num_q_heads;
    absl::Status st;
    ForRuns(m, nullptr, [&](size_t i, int32_t n) -> absl::Status {
      RetrieverImpl& first = *m[i];
      SparseAttentionArgs a = first.AttentionArgs(
          first.layers_[layer], static_cast<const uint8_t*>(q) + i * qb,
          static_cast<uint8_t*>(out) + i * qb, lse == nullptr ? nullptr : lse + i * hq, n);
      absl::Time mark;
      KVTIER_RETURN_IF_ERROR(first.Lap(*first.compute_, &mark, nullptr));
      KVTIER_RETURN_IF_ERROR(first.AttendCaptured(first.layers_[layer], a));
      return first.Lap(*first.compute_, &mark, &first.stats_.attention_us);
    }, &st);
    for (size_t i = 0; i < m.size() && st.ok(); ++i) {
      RetrieverImpl& r = *m[i];
      if (r.reads_attention()) {
        const LayerState& l = r.layers_[layer];
        st = r.TakeProbe(layer, l.step, l.tokens - 1);
      }
    }
    Meter(m, layer, start);
    return st;
  }

  absl::Status EndStep(int32_t layer, std::span<LocalSequence* const> members,
                       const void* q) override {
    KVTIER_ASSIGN_OR_RETURN(std::vector<RetrieverImpl*> m, Members(members, "EndStep"));
    if (q == nullptr) return absl::InvalidArgumentError("EndStep: q must be non-null");
    for (RetrieverImpl* r : m) {
      KVTIER_RETURN_IF_ERROR(r->CheckCall(layer, "EndStep"));
      if (!r->layers_[layer].in_step) {
        return absl::FailedPreconditionError(
            absl::StrFormat("EndStep: layer %d%s: call BeginStep first", layer, Who(m, r)));
      }
    }
    const HostCalls start = ThreadHostCalls();
    const size_t qb = m[0]->q_bytes();
    absl::Status st;
    // Every member has the batch's options, so one plan: the last member's.
    plan::EndPlan end;
    for (size_t i = 0; i < m.size() && st.ok(); ++i) {
      absl::StatusOr<plan::EndPlan> e = m[i]->EndHost(layer);
      if (e.ok()) end = *e;
      st = e.status();
    }
    if (end.background_select) {
      ForRuns(m, nullptr, [&](size_t i, int32_t n) -> absl::Status {
        return m[i]->EndDevice(layer, end, qs(q) + i * qb, n);
      }, &st);
      for (size_t i = 0; i < m.size() && st.ok(); ++i) st = m[i]->EndFinish(layer);
    }
    for (size_t i = 0; i < m.size() && st.ok(); ++i) st = m[i]->CommitStored(/*wait=*/false);
    Meter(m, layer, start);
    if (st.ok()) {
      for (RetrieverImpl* r : m) r->CloseStepCalls(layer);
    }
    return st;
  }

  int32_t max_batch() const override { return shared_->max_batch(); }
  Stream& compute_stream() override { return shared_->compute(); }

 private:
  static const uint8_t* qs(const void* q) { return static_cast<const uint8_t*>(q); }
  // Names the member in a message when the step has more than one.
  static std::string Who(const std::vector<RetrieverImpl*>& m, const RetrieverImpl* r) {
    return m.size() > 1 ? absl::StrFormat(" of the member in slot %d", r->slot()) : "";
  }

  absl::StatusOr<std::vector<RetrieverImpl*>> Members(std::span<LocalSequence* const> members,
                                                      const char* what) const {
    if (members.empty() || members.size() > static_cast<size_t>(shared_->max_batch())) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %d members: must be in [1, %d] (max_batch)", what, members.size(),
          shared_->max_batch()));
    }
    std::vector<RetrieverImpl*> m;
    absl::flat_hash_set<RetrieverImpl*> seen;
    for (size_t i = 0; i < members.size(); ++i) {
      auto* r = members[i] == nullptr ? nullptr
                                      : dynamic_cast<RetrieverImpl*>(members[i]->stepped());
      if (r == nullptr || r->shared_.get() != shared_.get()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: members[%d] is not a sequence of this batch", what, i));
      }
      if (r->closed_ || r->slot() < 0) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "%s: %s is closed", what, members.size() > 1 ? absl::StrFormat("members[%d]", i)
                                                         : std::string("the sequence")));
      }
      if (members.size() > 1 && !seen.insert(r).second) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: members[%d] is given twice", what, i));
      }
      m.push_back(r);
    }
    return m;
  }

  // Calls fn(first index, length) for each maximal run of members in consecutive slots (and,
  // with `paths`, the same path); stops at the first error, into *st.
  template <typename Fn>
  static void ForRuns(const std::vector<RetrieverImpl*>& m,
                      const std::vector<RetrieverImpl::BeginPath>* paths, Fn fn,
                      absl::Status* st) {
    size_t i = 0;
    while (i < m.size() && st->ok()) {
      size_t j = i + 1;
      while (j < m.size() && m[j]->slot() == m[j - 1]->slot() + 1 &&
             (paths == nullptr || (*paths)[j] == (*paths)[i])) {
        ++j;
      }
      *st = fn(i, static_cast<int32_t>(j - i));
      i = j;
    }
  }

  // The batch call's blocking host calls count for every member's step.
  static void Meter(const std::vector<RetrieverImpl*>& m, int32_t layer, const HostCalls& start) {
    const HostCalls d = ThreadHostCalls() - start;
    for (RetrieverImpl* r : m) r->layers_[layer].calls += d;
  }

  const Geometry g_;
  const SequenceOptions o_;
  Backend& backend_;
  std::shared_ptr<BatchShared> shared_;
  const bool owner_;
};

std::unique_ptr<SequenceBatch> NewBatchObject(const Geometry& g, const SequenceOptions& o,
                                              Backend& backend, std::shared_ptr<BatchShared> shared,
                                              bool owner) {
  return std::make_unique<SequenceBatchImpl>(g, o, backend, std::move(shared), owner);
}

}  // namespace retriever_internal

namespace {

// The checks and the shared storage of both makers; `host` is the members' page source.
absl::StatusOr<std::unique_ptr<SequenceBatch>> MakeBatch(
    const Geometry& geometry, const SequenceOptions& options, int32_t max_batch, Backend& backend,
    const std::function<absl::StatusOr<std::unique_ptr<HostTier>>(const SequenceOptions&)>& host) {
  KVTIER_RETURN_IF_ERROR(geometry.Validate());
  if (max_batch < 1 || max_batch > 4096) {
    return absl::InvalidArgumentError(
        absl::StrFormat("NewSequenceBatch: max_batch = %d must be in [1, 4096]", max_batch));
  }
  SequenceOptions o = options;
  // What a batch cannot run is refused here, before any member (offload/step_plan.h). The
  // cold tier is the members' host tier's; assumed present, a demoting batch is still refused.
  KVTIER_ASSIGN_OR_RETURN(const plan::SequencePlan p,
                          plan::PlanSequence(plan::ConfigOf(o, /*batch=*/max_batch > 1,
                                                            /*cold_tier=*/true,
                                                            backend.SupportsCapture())));
  o.recall = p.strategy;  // the gather, in a batch of more than one
  if (o.max_tokens <= 0 || o.max_tokens > (1 << 30)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sequence.max_tokens = %d: must be in [1, 2^30]", o.max_tokens));
  }
  const size_t ring = retriever_internal::RetrieverImpl::RingBytes(geometry, o) * max_batch;
  KVTIER_ASSIGN_OR_RETURN(
      std::shared_ptr<retriever_internal::BatchShared> shared,
      retriever_internal::BatchShared::Create(geometry, o, backend, max_batch, ring));
  if (o.mode == RetrievalMode::kSpeculative || o.mode == RetrievalMode::kSync) {
    KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<HostTier> h, host(o));
    shared->set_host(std::move(h));
  }
  return retriever_internal::NewBatchObject(geometry, o, backend, std::move(shared),
                                            /*owner=*/true);
}

}  // namespace

absl::StatusOr<std::unique_ptr<SequenceBatch>> NewSequenceBatch(const Geometry& geometry,
                                                                const SequenceOptions& options,
                                                                int32_t max_batch,
                                                                Device& device) {
  KVTIER_ASSIGN_OR_RETURN(Backend * backend, BackendOf(device, "NewSequenceBatch"));
  return MakeBatch(geometry, options, max_batch, *backend,
                   [&](const SequenceOptions& o) -> absl::StatusOr<std::unique_ptr<HostTier>> {
                     const int64_t tokens = int64_t{o.max_tokens} * max_batch;
                     if (tokens > (int64_t{1} << 30)) {
                       return absl::InvalidArgumentError(absl::StrFormat(
                           "NewSequenceBatch: max_tokens × max_batch = %d exceeds 2^30", tokens));
                     }
                     return NewOwnedHostTier(geometry, static_cast<int32_t>(tokens), *backend);
                   });
}

absl::StatusOr<std::unique_ptr<SequenceBatch>> NewSequenceBatchOverPool(
    const Geometry& geometry, const SequenceOptions& options, int32_t max_batch, Backend& backend,
    PagePool* pool) {
  return MakeBatch(geometry, options, max_batch, backend,
                   [&](const SequenceOptions& o) -> absl::StatusOr<std::unique_ptr<HostTier>> {
                     if (pool == nullptr) {
                       return absl::InvalidArgumentError(absl::StrFormat(
                           "NewSequenceBatchOverPool: mode %s needs a host page pool",
                           RetrievalModeName(o.mode)));
                     }
                     return std::unique_ptr<HostTier>(std::make_unique<PoolHostTier>(*pool));
                   });
}

}  // namespace kvtier
