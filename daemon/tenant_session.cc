#include "daemon/tenant_session.h"

#include <cstring>
#include <deque>
#include <set>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/status.h"
#include "kernels/budgeted_backend.h"
#include "offload/region_host_tier.h"
#include "spdlog/spdlog.h"

namespace kvtier::daemon {

namespace {

// The pages `from` holds, by layer: each layer's committed prefix, pages 0..n-1 in order.
// OUT_OF_RANGE for more than `pages` pages in a layer, DATA_LOSS for a layer that is not a
// prefix (a record that does not match the session), naming the session.
absl::StatusOr<std::vector<std::vector<PageMover::Held>>> PrefixOf(const PageMover& from,
                                                                   const std::string& id,
                                                                   int32_t layers, int32_t pages) {
  std::vector<std::vector<PageMover::Held>> out(static_cast<size_t>(layers));
  for (const PageMover::Held& h : from.HeldPages()) {  // in (layer, page) order
    if (h.layer < 0 || h.layer >= layers) {
      return absl::DataLossError(absl::StrFormat(
          "session %s: the cold tier holds a page of layer %d; the session has %d layers", id,
          h.layer, layers));
    }
    std::vector<PageMover::Held>& l = out[static_cast<size_t>(h.layer)];
    if (h.page != static_cast<int64_t>(l.size())) {
      return absl::DataLossError(absl::StrFormat(
          "session %s: layer %d's pages in the cold tier skip from %d to page %d", id, h.layer,
          l.size(), h.page));
    }
    if (h.page >= pages) {
      return absl::OutOfRangeError(absl::StrFormat(
          "session %s: layer %d has more than %d pages in the cold tier; the session holds %d",
          id, h.layer, pages, pages));
    }
    l.push_back(h);
  }
  return out;
}

// The mover of a live session's demoted pages (policy.host_drop = demote).
std::unique_ptr<PageMover> LiveMover(ColdStore* store, const std::string& id, size_t page_bytes,
                                     absl::Duration timeout) {
  return std::make_unique<PageMover>(
      store, PageMoverOptions{PageMover::LiveKeys(id), page_bytes, timeout, /*live=*/true});
}

}  // namespace

absl::StatusOr<std::shared_ptr<TenantSession>> TenantSession::Create(
    std::string id, SessionSpec spec, RegionLease lease, Backend* backend, MemoryBudget* budget,
    ColdStore* demote_to, absl::Duration cold_timeout) {
  const Geometry& g = spec.geometry;
  KVTIER_ASSIGN_OR_RETURN(SessionRegion region,
                          SessionRegion::Format(lease.data(), lease.bytes(), g, spec.max_pages(),
                                                spec.host_slots()));
  const int64_t now_ms = absl::ToUnixMillis(absl::Now());
  const bool grpc = spec.transport == Transport::kGrpc;
  std::shared_ptr<TenantSession> s(
      new TenantSession(std::move(id), std::move(spec), std::move(lease), region,
                        grpc ? NewBudgetedBackend(*backend, *budget) : nullptr, now_ms));
  if (demote_to != nullptr) {
    s->cold_pages_ = LiveMover(demote_to, s->id_, g.host_page_bytes(), cold_timeout);
  }
  if (grpc) {
    MutexLock lock(&s->mu_);
    // The daemon owns the region: its commits are never fenced (nullopt epoch).
    KVTIER_ASSIGN_OR_RETURN(
        s->retriever_, OpenRegionRetriever(region, std::nullopt, s->spec_.sequence, *s->backend_,
                                           /*restore=*/false, s->cold_pages_.get()));
  }
  return s;
}

absl::StatusOr<std::shared_ptr<TenantSession>> TenantSession::Restore(
    std::string id, SessionSpec spec, RegionLease lease, Backend* backend, MemoryBudget* budget,
    const Resume& resume, PageMover* from, ColdStore* demote_to, absl::Duration cold_timeout) {
  const Geometry g = spec.geometry;
  const int32_t pages = spec.max_pages();
  const bool demoting = spec.demotes_pages();
  if (demoting && (from == nullptr || demote_to == nullptr)) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "session %s demotes pages: %s", id,
        from == nullptr ? "no arena keeps such a session"
                        : "its tenant has no cold tier to rebuild it from"));
  }
  absl::StatusOr<SessionRegion> region =
      from == nullptr
          ? SessionRegion::Open(lease.data(), lease.bytes(), g)
          : SessionRegion::Format(lease.data(), lease.bytes(), g, pages, spec.host_slots());
  KVTIER_RETURN_IF_ERROR(region.status());
  if (region->layout().max_pages_per_layer != pages || region->num_slots() != spec.host_slots()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "session %s: its region holds %d pages per layer and %d slots; its parameters say %d "
        "and %d",
        id, region->layout().max_pages_per_layer, region->num_slots(), pages, spec.host_slots()));
  }
  if (from != nullptr && !demoting) {
    // Every layer's pages into the region's slots, one batch a layer, then committed with
    // their generations (epoch 1 is the fresh region's: the writer is the daemon).
    KVTIER_ASSIGN_OR_RETURN(auto held, PrefixOf(*from, id, g.num_layers, pages));
    const size_t page_bytes = g.host_page_bytes();
    int64_t slot = 0;
    for (int32_t layer = 0; layer < g.num_layers; ++layer) {
      std::vector<PageMover::In> in;
      for (const PageMover::Held& h : held[static_cast<size_t>(layer)]) {
        auto* data = static_cast<uint8_t*>(region->slots()) +
                     (slot + static_cast<int64_t>(in.size())) * region->slot_stride();
        in.push_back({layer, h.page, std::span<uint8_t>(data, page_bytes)});
      }
      KVTIER_RETURN_IF_ERROR(from->Promote(in, absl::InfiniteFuture()));
      for (const PageMover::Held& h : held[static_cast<size_t>(layer)]) {
        KVTIER_RETURN_IF_ERROR(region->Commit(layer, h.page, slot++, h.generation, /*epoch=*/1));
      }
    }
  }
  KVTIER_ASSIGN_OR_RETURN(const uint64_t now_epoch, region->BumpEpoch(resume.epoch));
  const bool grpc = spec.transport == Transport::kGrpc;
  std::shared_ptr<TenantSession> s(new TenantSession(
      std::move(id), std::move(spec), std::move(lease), *region,
      grpc ? NewBudgetedBackend(*backend, *budget) : nullptr, resume.created_unix_ms));
  MutexLock lock(&s->mu_);
  s->epoch_ = now_epoch;
  s->suspended_.store(resume.suspended, std::memory_order_release);
  if (demoting) {
    s->cold_pages_ = LiveMover(demote_to, s->id_, g.host_page_bytes(), cold_timeout);
    if (grpc) {
      KVTIER_ASSIGN_OR_RETURN(
          s->retriever_, OpenRegionRetriever(*region, std::nullopt, s->spec_.sequence,
                                             *s->backend_, /*restore=*/false,
                                             s->cold_pages_.get()));
    }
    // The record's pages stay charged until the promotion ends: the rebuilt session's own
    // demotions may pass the quota by their charge while both copies exist.
    s->cold_pages_->SetOverdraft(from->ChargedBytes());
    const absl::Status taken = s->TakeDemotingPages(*from);
    s->cold_pages_->SetOverdraft(0);
    KVTIER_RETURN_IF_ERROR(taken);
    return s;
  }
  if (grpc) {
    // The daemon owns the region: its commits are never fenced (nullopt epoch).
    KVTIER_ASSIGN_OR_RETURN(
        s->retriever_, OpenRegionRetriever(*region, std::nullopt, s->spec_.sequence,
                                           *s->backend_, /*restore=*/true));
    s->PublishTokens();
  }
  return s;
}

absl::Status TenantSession::TakeDemotingPages(PageMover& from) {
  const Geometry& g = spec_.geometry;
  const size_t page_bytes = g.host_page_bytes();
  KVTIER_ASSIGN_OR_RETURN(auto held, PrefixOf(from, id_, g.num_layers, spec_.max_pages()));
  std::vector<uint8_t> k(page_bytes / 2);
  std::vector<uint8_t> v(k.size());
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    const std::vector<PageMover::Held>& pages = held[static_cast<size_t>(layer)];
    std::vector<std::string> data(pages.size(), std::string(page_bytes, '\0'));
    std::vector<PageMover::In> in;
    for (size_t i = 0; i < pages.size(); ++i) {
      in.push_back({layer, pages[i].page,
                    std::span<uint8_t>(reinterpret_cast<uint8_t*>(data[i].data()), page_bytes)});
    }
    KVTIER_RETURN_IF_ERROR(from.Promote(in, absl::InfiniteFuture()));
    if (retriever_ == nullptr) {
      // SHM: every page under the session's live keys, the region empty: the engine's
      // Reattach rebuilds its sequence from them (client.md#decisions).
      std::vector<PageMover::Out> out;
      for (size_t i = 0; i < pages.size(); ++i) {
        out.push_back({layer, pages[i].page, pages[i].generation,
                       std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(data[i].data()),
                                                page_bytes)});
      }
      KVTIER_RETURN_IF_ERROR(cold_pages_->Demote(out, absl::InfiniteFuture()));
      continue;
    }
    // GRPC: page by page, as the engine first appended them (HostPageToRows): the Retriever
    // offloads, summarises and demotes exactly as it did then.
    for (const std::string& d : data) {
      HostPageToRows(g, d.data(), k.data(), v.data());
      KVTIER_RETURN_IF_ERROR(retriever_->Append(layer, k.data(), v.data(), g.page_size));
    }
  }
  if (retriever_ != nullptr) {
    KVTIER_RETURN_IF_ERROR(retriever_->Flush());
    PublishTokens();
  }
  return absl::OkStatus();
}

TenantSession::TenantSession(std::string id, SessionSpec spec, RegionLease lease,
                             SessionRegion region, std::unique_ptr<Backend> backend,
                             int64_t created_unix_ms)
    : id_(std::move(id)),
      spec_(std::move(spec)),
      created_unix_ms_(created_unix_ms),
      lease_(std::move(lease)),
      region_(region),
      backend_(std::move(backend)),
      steps_(spec_.geometry.num_layers),
      grpc_tokens_(spec_.geometry.num_layers, 0),
      steps_run_(spec_.geometry.num_layers, 0) {}

TenantSession::~TenantSession() {
  // The Retriever's pool lies in the region: drop it first.
  MutexLock lock(&mu_);
  retriever_.reset();
}

absl::Status TenantSession::CheckOpen() const {
  if (demoted()) {
    // The caller raced the demotion: the session is in the SessionManager's table, cold.
    return absl::UnavailableError(absl::StrFormat(
        "session %s was demoted to the cold tier meanwhile; retry to bring it back", id_));
  }
  if (closed_) return absl::NotFoundError(absl::StrFormat("session %s was closed", id_));
  return absl::OkStatus();
}

absl::Status TenantSession::CheckWritable(std::string_view what) const {
  KVTIER_RETURN_IF_ERROR(CheckOpen());
  if (suspended()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: session %s is suspended; Reattach resumes it", what, id_));
  }
  return absl::OkStatus();
}

SessionRecord TenantSession::Record() const {
  SessionRecord r;
  r.id = id_;
  r.spec = spec_;
  r.closing = closing();
  r.suspended = suspended();
  r.region_offset = lease_.offset();
  r.region_bytes = lease_.bytes();
  r.epoch = region_.epoch();
  r.created_unix_ms = created_unix_ms_;
  r.committed_tokens.resize(spec_.geometry.num_layers);
  for (int32_t l = 0; l < spec_.geometry.num_layers; ++l) r.committed_tokens[l] = LayerTokens(l);
  if (spec_.transport == Transport::kGrpc) {
    MutexLock lock(&info_mu_);
    r.steps_run = steps_run_;
  }
  return r;
}

uint64_t TenantSession::LayerTokens(int32_t layer) const {
  if (spec_.transport == Transport::kShm) {
    // The region's directory is written by the engine: CommittedPrefix range-checks it.
    int64_t n = region_.CommittedPrefix(layer);
    if (cold_pages_ != nullptr) {
      // Demoted pages count: the prefix runs on through pages the cold tier holds.
      while (n < spec_.max_pages() &&
             (region_.Lookup(layer, n).ok() || cold_pages_->Generation(layer, n).has_value())) {
        ++n;
      }
    }
    return static_cast<uint64_t>(n) * spec_.geometry.page_size;
  }
  MutexLock lock(&info_mu_);
  return grpc_tokens_[layer];
}

void TenantSession::PublishTokens() {
  std::vector<uint64_t> tokens(spec_.geometry.num_layers);
  for (int32_t l = 0; l < spec_.geometry.num_layers; ++l) tokens[l] = retriever_->num_tokens(l);
  MutexLock lock(&info_mu_);
  grpc_tokens_ = std::move(tokens);
}

absl::StatusOr<std::vector<uint64_t>> TenantSession::Apply(const std::vector<OffloadChunk>& chunks,
                                                           const Caller& caller,
                                                           std::string_view what) {
  MutexLock lock(&mu_);
  KVTIER_RETURN_IF_ERROR(CheckWritable(what));
  // Checked with the session held: waiting for it may have used up the deadline.
  KVTIER_RETURN_IF_ERROR(caller.CheckLive(what));
  // The demotions the appends need end by the call's deadline, not operation_timeout_ms.
  PageMover::CallScope cold_call(cold_pages_.get(), caller.deadline);
  absl::Status st;
  for (const OffloadChunk& c : chunks) {
    st = retriever_->Append(static_cast<int32_t>(c.layer), c.k.data(), c.v.data(),
                            static_cast<int32_t>(c.num_tokens));
    if (!st.ok()) break;
  }
  // The compute stream copies from the chunks' bytes: it must have run that work before
  // `chunks` goes away, even after an error (Synchronize has no deadline, unlike Wait).
  const absl::Status synced = retriever_->compute_stream().Synchronize();
  if (st.ok()) st = synced;
  if (st.ok()) st = retriever_->Flush();  // the host tier commits every stored page
  PublishTokens();
  KVTIER_RETURN_IF_ERROR(st);
  MutexLock info(&info_mu_);
  return grpc_tokens_;
}

absl::StatusOr<std::vector<int64_t>> TenantSession::CommittedPages(
    int32_t layer, const std::vector<int64_t>& pages) const {
  const int64_t max_pages = region_.layout().max_pages_per_layer;
  std::vector<int64_t> out;
  // A page the session demoted is committed too (it reads from the cold tier).
  const auto demoted = [&](int64_t p) {
    return cold_pages_ != nullptr && cold_pages_->Generation(layer, p).has_value();
  };
  if (pages.empty()) {
    for (int64_t p = 0; p < max_pages; ++p) {
      if (region_.Lookup(layer, p).ok() || demoted(p)) out.push_back(p);
    }
    return out;
  }
  for (int64_t p : pages) {
    if (p < 0 || p >= max_pages) {
      return absl::OutOfRangeError(absl::StrFormat(
          "pages: page %d is beyond the session's %d pages per layer (max_tokens = %d)", p,
          max_pages, spec_.sequence.max_tokens));
    }
    absl::StatusOr<CommittedPage> c = region_.Lookup(layer, p);
    if (absl::IsNotFound(c.status()) && demoted(p)) {
      out.push_back(p);
      continue;
    }
    if (absl::IsNotFound(c.status())) {
      return absl::NotFoundError(
          absl::StrFormat("session %s: layer %d page %d is not committed", id_, layer, p));
    }
    KVTIER_RETURN_IF_ERROR(c.status());
    out.push_back(p);
  }
  return out;
}

absl::StatusOr<std::vector<PageData>> TenantSession::ReadPages(int32_t layer, const int64_t* pages,
                                                               size_t count, absl::Time deadline) {
  MutexLock lock(&mu_);
  KVTIER_RETURN_IF_ERROR(CheckOpen());
  PageMover::CallScope cold_call(cold_pages_.get(), deadline);
  const size_t page_bytes = spec_.geometry.host_page_bytes();
  std::vector<PageData> out(count);
  std::vector<PageMover::In> demoted;  // read in one batch after the region's pages
  for (size_t i = 0; i < count; ++i) {
    PageData& d = out[i];
    d.layer = layer;
    d.page = pages[i];
    d.data.resize(page_bytes);
    absl::StatusOr<CommittedPage> c = region_.Lookup(layer, d.page);
    if (absl::IsNotFound(c.status()) && cold_pages_ != nullptr) {
      // Demoted: the cold tier holds it (a page the Retriever promoted again is committed).
      if (std::optional<uint64_t> gen = cold_pages_->Generation(layer, d.page); gen.has_value()) {
        d.generation = *gen;
        demoted.push_back(
            {layer, d.page, std::span<uint8_t>(reinterpret_cast<uint8_t*>(d.data.data()),
                                               page_bytes)});
        continue;
      }
    }
    if (absl::IsNotFound(c.status())) {
      return absl::NotFoundError(absl::StrFormat(
          "session %s: layer %d page %d is no longer committed", id_, layer, d.page));
    }
    KVTIER_RETURN_IF_ERROR(c.status());
    d.generation = c->generation;
    std::memcpy(d.data.data(), region_.SlotData(c->slot), page_bytes);
    // An SHM engine may re-commit the entry while it is copied: the copy is good only when
    // the entry is unchanged afterwards.
    absl::StatusOr<CommittedPage> after = region_.Lookup(layer, d.page);
    if (!after.ok() || after->slot != c->slot || after->generation != c->generation) {
      return absl::AbortedError(absl::StrFormat(
          "session %s: layer %d page %d was re-committed while it was read; fetch it again", id_,
          layer, d.page));
    }
  }
  if (!demoted.empty()) KVTIER_RETURN_IF_ERROR(cold_pages_->Promote(demoted, deadline));
  return out;
}

absl::StatusOr<StepResult> TenantSession::Step(int32_t layer, std::string_view q, bool want_output,
                                               uint64_t step, const Caller& caller) {
  MutexLock lock(&mu_);
  KVTIER_RETURN_IF_ERROR(CheckWritable("Step"));
  LayerSteps& done = steps_[layer];
  if (step != 0 && step != done.run + 1) {
    if (step == done.run && q == done.q && (done.want_output || !want_output)) {
      StepResult again = done.reply;
      again.replayed = true;
      if (!want_output) {
        again.output.clear();
        again.lse.clear();
      }
      return again;
    }
    absl::Status refused = absl::FailedPreconditionError(
        step == done.run
            ? absl::StrFormat("step = %d: layer %d ran step %d already with another q%s; send "
                              "step %d for a new step",
                              step, layer, step,
                              done.want_output || !want_output ? "" : " (and no output)",
                              done.run + 1)
            : absl::StrFormat("step = %d: layer %d has run %d steps, so the next is %d (or %d "
                              "again, with the same q, for its reply)",
                              step, layer, done.run, done.run + 1, done.run));
    SetTrailer(refused, kStepsRunTrailer, absl::StrCat(done.run));
    return refused;
  }
  // Checked with the session held: waiting for it may have used up the deadline.
  KVTIER_RETURN_IF_ERROR(
      caller.CheckLive(absl::StrFormat("step %d of layer %d", done.run + 1, layer)));
  bool advanced = false;
  absl::StatusOr<StepResult> r = [&] {
    // The promotions (and demotions) the step needs end by the call's deadline.
    PageMover::CallScope cold_call(cold_pages_.get(), caller.deadline);
    return RunStep(layer, q, want_output, &advanced);
  }();
  if (!advanced) return r;  // BeginStep refused: the layer did not move
  done.run += 1;  // the Retriever ran EndStep, even after an error
  {
    MutexLock info(&info_mu_);
    steps_run_[layer] = done.run;
  }
  if (!r.ok()) {
    done.q.clear();  // nothing to replay
    done.reply = StepResult{};
    return r;
  }
  r->step = done.run;
  done.q.assign(q.data(), q.size());
  done.want_output = want_output;
  done.reply = *r;
  return r;
}

absl::StatusOr<bool> TenantSession::ReportSignals(const EngineSignals& e, const Caller& caller) {
  MutexLock lock(&mu_);
  KVTIER_RETURN_IF_ERROR(CheckWritable("ReportSignals"));
  KVTIER_RETURN_IF_ERROR(caller.CheckLive("ReportSignals"));
  const bool signals_again = e.num_tokens > 0 && e.first_position + e.num_tokens <= signals_end_;
  const bool observed_again =
      !e.observe_q.empty() && observed_.contains({e.observe_layer, e.observe_first_position});
  if (e.num_tokens > 0 && !signals_again) {
    StepSignals s;
    s.first_position = e.first_position;
    s.num_tokens = e.num_tokens;
    s.logits = e.logits;
    s.logit_summary = e.logit_summary;
    if (!e.hidden_delta.empty()) {
      s.hidden_delta = e.hidden_delta;
      s.num_layers = e.num_layers;
    }
    KVTIER_RETURN_IF_ERROR(retriever_->ReportSignals(s));
    signals_end_ = e.first_position + e.num_tokens;
  }
  if (!e.observe_q.empty() && !observed_again) {
    const size_t row = static_cast<size_t>(spec_.geometry.num_q_heads) *
                       spec_.geometry.head_dim * spec_.geometry.element_bytes();
    KVTIER_RETURN_IF_ERROR(retriever_->ObserveQueries(
        e.observe_layer, e.observe_q.data(), static_cast<int32_t>(e.observe_q.size() / row),
        e.observe_first_position));
    observed_.insert({e.observe_layer, e.observe_first_position});
  }
  return (e.num_tokens == 0 || signals_again) && (e.observe_q.empty() || observed_again);
}

absl::StatusOr<StepResult> TenantSession::RunStep(int32_t layer, std::string_view q,
                                                  bool want_output, bool* advanced) {
  const Geometry& g = spec_.geometry;
  Stream& stream = retriever_->compute_stream();
  *advanced = false;
  absl::StatusOr<WorkingSetView> view = retriever_->BeginStep(layer, q.data());
  if (!view.ok()) {
    (void)stream.Synchronize();  // work enqueued before the error may still read q
    return view.status();
  }
  *advanced = true;  // EndStep runs below whatever happens
  StepResult r;
  r.layer = layer;
  r.num_tokens = view->num_tokens;
  r.num_slots = view->num_slots;
  absl::Status st;
  if (want_output) {
    r.output.resize(static_cast<size_t>(g.num_q_heads) * g.head_dim * g.element_bytes());
    r.lse.resize(g.num_q_heads);
    st = retriever_->Attend(layer, q.data(), r.output.data(), r.lse.data());
  }
  // The table as attention saw it: copied on the compute stream before EndStep lets the
  // background selection change it. Through the backend, so a device table works too.
  r.slot_table.resize(static_cast<size_t>(g.num_kv_heads) * view->num_slots);
  if (st.ok()) {
    st = backend_->Copy(stream, r.slot_table.data(), view->slot_table,
                        r.slot_table.size() * sizeof(int32_t));
  }
  // EndStep even after an error, so the layer is not left between BeginStep and EndStep.
  const absl::Status ended = retriever_->EndStep(layer, q.data());
  const int64_t step = static_cast<int64_t>(steps_[layer].run);
  if (st.ok()) st = ended;
  // q, the output and the table are host memory the compute stream reads and writes.
  const absl::Status synced = stream.Synchronize();
  if (st.ok()) st = synced;
  KVTIER_RETURN_IF_ERROR(st);
  // The step's statistics are collected in the order work was enqueued: another layer's
  // background recall still running can hold them back. Only then wait for all work.
  StepStats last = retriever_->LastStep(layer);
  if (last.step != step) {
    KVTIER_RETURN_IF_ERROR(retriever_->Wait());
    last = retriever_->LastStep(layer);
  }
  r.corrected_heads = last.step == step ? last.corrected_heads : 0;
  return r;
}

absl::StatusOr<SessionRecord> TenantSession::Reattach() {
  {
    MutexLock lock(&mu_);
    KVTIER_RETURN_IF_ERROR(CheckOpen());
    absl::StatusOr<uint64_t> epoch = region_.BumpEpoch(epoch_);
    if (!epoch.ok()) {
      return absl::Status(epoch.status().code(),
                          absl::StrFormat("session %s: %s", id_, epoch.status().message()));
    }
    epoch_ = *epoch;
    suspended_.store(false, std::memory_order_release);
  }
  return Record();
}

absl::StatusOr<SessionRecord> TenantSession::Suspend() {
  {
    MutexLock lock(&mu_);
    KVTIER_RETURN_IF_ERROR(CheckOpen());
    if (!suspended()) {
      absl::StatusOr<uint64_t> epoch = region_.BumpEpoch(epoch_);
      if (!epoch.ok()) {
        return absl::Status(epoch.status().code(),
                            absl::StrFormat("session %s: %s", id_, epoch.status().message()));
      }
      epoch_ = *epoch;
      suspended_.store(true, std::memory_order_release);
    }
  }
  return Record();
}

absl::StatusOr<CloseResult> TenantSession::Demote(
    PageMover& to, absl::Time deadline, bool force,
    const std::function<absl::Status(const Demoted&)>& record) {
  MutexLock lock(&mu_);
  KVTIER_RETURN_IF_ERROR(CheckOpen());
  if (!force && !suspended()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("session %s is not suspended: only suspended sessions are demoted", id_));
  }
  if (force && !suspended()) {
    // Shutdown: fence whoever still holds the session before its pages are read.
    KVTIER_ASSIGN_OR_RETURN(epoch_, region_.BumpEpoch(epoch_));
  }
  if (retriever_ != nullptr) {
    // GRPC: every stored page committed (Apply flushes; this is for safety).
    if (absl::Status st = retriever_->Flush(); !st.ok()) {
      spdlog::warn("session {}: flushing before demotion: {}", id_, st.ToString());
    }
  }
  const Geometry& g = spec_.geometry;
  const size_t page_bytes = g.host_page_bytes();
  Demoted demoted;
  demoted.epoch = epoch_;
  demoted.generations.resize(g.num_layers);
  // Every page of each layer's committed prefix: read in place from the region, or (pages
  // the session demoted itself) promoted from its live keys into `owned` first.
  std::vector<PageMover::Out> out;
  std::deque<std::string> owned;
  std::vector<PageMover::In> back;
  // Slot → the (layer, page) committed in it: a slot holds one page's bytes, so two entries
  // naming it mean its writer reused it without withdrawing the first (SessionRegion::
  // Withdraw), and one of them would be stored with the other's bytes.
  absl::flat_hash_map<int64_t, std::pair<int32_t, int64_t>> slot_of;
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    for (int64_t page = 0; page < spec_.max_pages(); ++page) {
      absl::StatusOr<CommittedPage> c = region_.Lookup(layer, page);
      uint64_t generation = 0;
      const uint8_t* data = nullptr;
      if (c.ok()) {
        if (auto [it, added] = slot_of.try_emplace(c->slot, layer, page); !added) {
          return absl::DataLossError(absl::StrFormat(
              "session %s: slot %d holds layer %d page %d and layer %d page %d: its writer "
              "reused the slot without withdrawing the first; not demoted",
              id_, c->slot, it->second.first, it->second.second, layer, page));
        }
        generation = c->generation;
        data = static_cast<const uint8_t*>(region_.SlotData(c->slot));
      } else if (!absl::IsNotFound(c.status())) {
        return c.status();
      } else {
        const std::optional<uint64_t> gen =
            cold_pages_ != nullptr ? cold_pages_->Generation(layer, page) : std::nullopt;
        if (!gen.has_value()) break;  // the committed prefix ends here
        generation = *gen;
        std::string& bytes = owned.emplace_back(page_bytes, '\0');
        back.push_back({layer, page,
                        std::span<uint8_t>(reinterpret_cast<uint8_t*>(bytes.data()), page_bytes)});
        data = reinterpret_cast<const uint8_t*>(bytes.data());
      }
      out.push_back({layer, page, generation, std::span<const uint8_t>(data, page_bytes)});
      demoted.generations[static_cast<size_t>(layer)].push_back(generation);
    }
  }
  if (!back.empty()) KVTIER_RETURN_IF_ERROR(cold_pages_->Promote(back, deadline));
  KVTIER_RETURN_IF_ERROR(to.Demote(out, deadline));
  KVTIER_RETURN_IF_ERROR(record(demoted));
  demoted_.store(true, std::memory_order_release);
  closing_.store(true, std::memory_order_release);
  return CloseLocked();
}

absl::StatusOr<SessionStatsRecord> TenantSession::Stats() {
  SessionStatsRecord r;
  r.session_id = id_;
  r.committed_pages = CommittedPageCount();
  MutexLock lock(&mu_);
  KVTIER_RETURN_IF_ERROR(CheckOpen());
  if (retriever_ != nullptr) r.sequence = retriever_->Stats();
  return r;
}

absl::StatusOr<CloseResult> TenantSession::Close() {
  closing_.store(true, std::memory_order_release);
  MutexLock lock(&mu_);
  KVTIER_RETURN_IF_ERROR(CheckOpen());
  return CloseLocked();
}

absl::Status TenantSession::MovePages(bool demote, uint64_t epoch,
                                      const std::vector<PageMove>& pages, const Caller& caller) {
  const char* what = demote ? "DemotePages" : "PromotePages";
  MutexLock lock(&mu_);
  KVTIER_RETURN_IF_ERROR(CheckWritable(what));
  if (cold_pages_ == nullptr || spec_.transport != Transport::kShm) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: session %s %s", what, id_,
        cold_pages_ == nullptr ? "does not demote pages (policy.host_drop = demote with "
                                 "retrieval.host_tokens below max_tokens)"
                               : "is a GRPC session: the daemon's Retriever moves its pages"));
  }
  if (const uint64_t now = region_.epoch(); now != epoch) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: session %s is at epoch %d, the caller holds epoch %d (another holder reattached)",
        what, id_, now, epoch));
  }
  const size_t page_bytes = spec_.geometry.host_page_bytes();
  std::vector<PageMover::Out> put;
  std::vector<PageMover::In> get;
  std::set<std::tuple<int32_t, int64_t, int64_t>> named;  // (layer, page, slot)
  for (const PageMove& m : pages) {
    if (m.layer < 0 || m.layer >= spec_.geometry.num_layers || m.page < 0 ||
        m.page >= spec_.max_pages() || m.slot < 0 || m.slot >= region_.num_slots()) {
      return absl::OutOfRangeError(absl::StrFormat(
          "%s: layer %d page %d slot %d: must be in [0, %d) × [0, %d) × [0, %d)", what, m.layer,
          m.page, m.slot, spec_.geometry.num_layers, spec_.max_pages(), region_.num_slots()));
    }
    if (!named.emplace(m.layer, m.page, m.slot).second) continue;  // moved once
    auto* slot = static_cast<uint8_t*>(region_.slots()) + m.slot * region_.slot_stride();
    if (demote) {
      absl::StatusOr<CommittedPage> c = region_.Lookup(m.layer, m.page);
      if (!c.ok() || c->slot != m.slot || c->generation != m.generation) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "DemotePages: session %s layer %d page %d is not committed in slot %d with "
            "generation %d",
            id_, m.layer, m.page, m.slot, m.generation));
      }
      put.push_back({m.layer, m.page, m.generation, std::span<const uint8_t>(slot, page_bytes)});
    } else {
      get.push_back({m.layer, m.page, std::span<uint8_t>(slot, page_bytes)});
    }
  }
  if (demote) return cold_pages_->Demote(put, caller.deadline);
  // The mover reads into buffers of its own first and writes the slots only while the call is
  // live (the copies take far less than the deadline's margin).
  return cold_pages_->Promote(get, caller.deadline, [&] { return caller.CheckLive(what); });
}

uint64_t TenantSession::DemotedPageCount() const {
  if (cold_pages_ == nullptr) return 0;
  uint64_t n = 0;
  for (const PageMover::Held& h : cold_pages_->HeldPages()) {
    n += !region_.Lookup(h.layer, h.page).ok();
  }
  return n;
}

CloseResult TenantSession::CloseLocked() {
  closed_ = true;
  CloseResult r;
  r.freed_bytes = lease_.bytes();
  r.committed_pages = static_cast<uint64_t>(region_.CommittedPages());
  if (retriever_ != nullptr) {
    if (absl::Status st = retriever_->Close(); !st.ok()) {
      spdlog::warn("session {}: closing its Retriever: {}", id_, st.ToString());
    }
  }
  retriever_.reset();
  if (cold_pages_ != nullptr) {
    // The demoted pages: counted, and their keys removed (a failure is logged there).
    r.committed_pages += DemotedPageCount();
    (void)cold_pages_->RemoveAll();
  }
  return r;
}

}  // namespace kvtier::daemon
