#include "daemon/tenant_session.h"

#include <cstring>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/status.h"
#include "kernels/budgeted_backend.h"
#include "offload/region_host_tier.h"
#include "spdlog/spdlog.h"

namespace kvtier::daemon {

namespace {

// `load(layer)`, checked: at most `pages` pages, page i of the layer at index i, each of
// `page_bytes`. OUT_OF_RANGE / INVALID_ARGUMENT naming the session otherwise.
absl::StatusOr<std::vector<ColdPage>> LoadLayerChecked(const TenantSession::LoadLayer& load,
                                                       const std::string& id, int32_t layer,
                                                       int32_t pages, size_t page_bytes) {
  KVTIER_ASSIGN_OR_RETURN(std::vector<ColdPage> loaded, load(layer));
  if (loaded.size() > static_cast<size_t>(pages)) {
    return absl::OutOfRangeError(absl::StrFormat(
        "session %s: layer %d has %d pages in the cold tier; the session holds %d", id, layer,
        loaded.size(), pages));
  }
  for (size_t i = 0; i < loaded.size(); ++i) {
    const ColdPage& p = loaded[i];
    if (p.data.size() != page_bytes || p.page != static_cast<int64_t>(i) || p.layer != layer) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "session %s: layer %d page %d came back as layer %d page %d of %d bytes (expected %d)",
          id, layer, i, p.layer, p.page, p.data.size(), page_bytes));
    }
  }
  return loaded;
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
    s->cold_pages_ =
        std::make_unique<SessionColdPages>(demote_to, s->id_, g.host_page_bytes(), cold_timeout);
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
    int64_t created_unix_ms, uint64_t epoch, bool suspended, const LoadLayer& load,
    ColdStore* demote_to, absl::Duration cold_timeout) {
  const Geometry& g = spec.geometry;
  const int32_t pages = spec.max_pages();
  KVTIER_ASSIGN_OR_RETURN(SessionRegion region,
                          SessionRegion::Format(lease.data(), lease.bytes(), g, pages,
                                                spec.host_slots()));
  const size_t page_bytes = g.host_page_bytes();
  if (spec.demotes_pages()) {
    if (demote_to == nullptr) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "session %s demotes pages: its tenant has no cold tier to rebuild it from", id));
    }
    if (spec.transport == Transport::kShm) {
      return RestoreDemotedShm(std::move(id), std::move(spec), std::move(lease), region,
                               backend, budget, created_unix_ms, epoch, suspended, load,
                               demote_to, cold_timeout);
    }
    return RebuildDemoting(std::move(id), std::move(spec), std::move(lease), region, backend,
                           budget, created_unix_ms, epoch, suspended, load, demote_to,
                           cold_timeout);
  }
  int64_t slot = 0;
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    KVTIER_ASSIGN_OR_RETURN(std::vector<ColdPage> loaded,
                            LoadLayerChecked(load, id, layer, pages, page_bytes));
    for (const ColdPage& p : loaded) {
      std::memcpy(static_cast<char*>(region.slots()) + slot * region.slot_stride(), p.data.data(),
                  page_bytes);
      // Epoch 1 is the fresh region's: the writer below is the daemon.
      KVTIER_RETURN_IF_ERROR(region.Commit(layer, p.page, slot, p.generation, /*epoch=*/1));
      ++slot;
    }
  }
  return FromCommitted(std::move(id), std::move(spec), std::move(lease), region, backend, budget,
                       created_unix_ms, epoch, suspended);
}

absl::StatusOr<std::shared_ptr<TenantSession>> TenantSession::RebuildDemoting(
    std::string id, SessionSpec spec, RegionLease lease, SessionRegion region, Backend* backend,
    MemoryBudget* budget, int64_t created_unix_ms, uint64_t epoch, bool suspended,
    const LoadLayer& load, ColdStore* demote_to, absl::Duration cold_timeout) {
  const Geometry g = spec.geometry;
  const int32_t pages = spec.max_pages();
  KVTIER_ASSIGN_OR_RETURN(const uint64_t now_epoch, region.BumpEpoch(epoch));
  std::shared_ptr<TenantSession> s(new TenantSession(std::move(id), std::move(spec),
                                                     std::move(lease), region,
                                                     NewBudgetedBackend(*backend, *budget),
                                                     created_unix_ms));
  MutexLock lock(&s->mu_);
  s->epoch_ = now_epoch;
  s->suspended_.store(suspended, std::memory_order_release);
  s->cold_pages_ =
      std::make_unique<SessionColdPages>(demote_to, s->id_, g.host_page_bytes(), cold_timeout);
  KVTIER_ASSIGN_OR_RETURN(
      s->retriever_, OpenRegionRetriever(region, std::nullopt, s->spec_.sequence, *s->backend_,
                                         /*restore=*/false, s->cold_pages_.get()));
  // Page by page, as the engine first appended them (HostPageToRows): the Retriever
  // offloads, summarises and demotes exactly as it did then.
  const size_t page_bytes = g.host_page_bytes();
  const int32_t p = g.page_size;
  std::vector<uint8_t> k(page_bytes / 2);
  std::vector<uint8_t> v(k.size());
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    KVTIER_ASSIGN_OR_RETURN(std::vector<ColdPage> loaded,
                            LoadLayerChecked(load, s->id_, layer, pages, page_bytes));
    for (const ColdPage& cp : loaded) {
      HostPageToRows(g, cp.data.data(), k.data(), v.data());
      KVTIER_RETURN_IF_ERROR(s->retriever_->Append(layer, k.data(), v.data(), p));
    }
  }
  KVTIER_RETURN_IF_ERROR(s->retriever_->Flush());
  s->PublishTokens();
  return s;
}

absl::StatusOr<std::shared_ptr<TenantSession>> TenantSession::RestoreDemotedShm(
    std::string id, SessionSpec spec, RegionLease lease, SessionRegion region, Backend* /*backend*/,
    MemoryBudget* /*budget*/, int64_t created_unix_ms, uint64_t epoch, bool suspended,
    const LoadLayer& load, ColdStore* demote_to, absl::Duration cold_timeout) {
  const size_t page_bytes = spec.geometry.host_page_bytes();
  const int32_t layers = spec.geometry.num_layers;
  const int32_t pages = spec.max_pages();
  KVTIER_ASSIGN_OR_RETURN(const uint64_t now_epoch, region.BumpEpoch(epoch));
  std::shared_ptr<TenantSession> s(new TenantSession(
      std::move(id), std::move(spec), std::move(lease), region, nullptr, created_unix_ms));
  MutexLock lock(&s->mu_);
  s->epoch_ = now_epoch;
  s->suspended_.store(suspended, std::memory_order_release);
  s->cold_pages_ = std::make_unique<SessionColdPages>(demote_to, s->id_, page_bytes, cold_timeout);
  // Every page goes back under the session's demoted keys and the region stays empty: the
  // engine's Reattach rebuilds its sequence from them (client.md#decisions).
  for (int32_t layer = 0; layer < layers; ++layer) {
    KVTIER_ASSIGN_OR_RETURN(std::vector<ColdPage> loaded,
                            LoadLayerChecked(load, s->id_, layer, pages, page_bytes));
    for (const ColdPage& cp : loaded) {
      KVTIER_RETURN_IF_ERROR(s->cold_pages_->Put(
          StoredPage{layer, cp.page, -1, cp.generation},
          std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(cp.data.data()),
                                   cp.data.size())));
    }
  }
  return s;
}

absl::StatusOr<std::shared_ptr<TenantSession>> TenantSession::Adopt(
    std::string id, SessionSpec spec, RegionLease lease, Backend* backend, MemoryBudget* budget,
    int64_t created_unix_ms, uint64_t epoch, bool suspended) {
  const Geometry& g = spec.geometry;
  const int32_t pages = spec.max_pages();
  KVTIER_ASSIGN_OR_RETURN(SessionRegion region,
                          SessionRegion::Open(lease.data(), lease.bytes(), g));
  if (region.layout().max_pages_per_layer != pages || region.num_slots() != spec.host_slots()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "session %s: its region holds %d pages per layer and %d slots; its parameters say %d "
        "and %d",
        id, region.layout().max_pages_per_layer, region.num_slots(), pages, spec.host_slots()));
  }
  return FromCommitted(std::move(id), std::move(spec), std::move(lease), region, backend, budget,
                       created_unix_ms, epoch, suspended);
}

absl::StatusOr<std::shared_ptr<TenantSession>> TenantSession::FromCommitted(
    std::string id, SessionSpec spec, RegionLease lease, SessionRegion region, Backend* backend,
    MemoryBudget* budget, int64_t created_unix_ms, uint64_t epoch, bool suspended) {
  KVTIER_ASSIGN_OR_RETURN(const uint64_t now_epoch, region.BumpEpoch(epoch));
  const bool grpc = spec.transport == Transport::kGrpc;
  std::shared_ptr<TenantSession> s(
      new TenantSession(std::move(id), std::move(spec), std::move(lease), region,
                        grpc ? NewBudgetedBackend(*backend, *budget) : nullptr, created_unix_ms));
  MutexLock lock(&s->mu_);
  s->epoch_ = now_epoch;
  s->suspended_.store(suspended, std::memory_order_release);
  if (grpc) {
    KVTIER_ASSIGN_OR_RETURN(
        s->retriever_, OpenRegionRetriever(region, std::nullopt, s->spec_.sequence, *s->backend_,
                                           /*restore=*/true));
    s->PublishTokens();
  }
  return s;
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
  SessionColdPages::CallScope cold_call(cold_pages_.get(), caller.deadline);
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
  SessionColdPages::CallScope cold_call(cold_pages_.get(), deadline);
  const size_t page_bytes = spec_.geometry.host_page_bytes();
  std::vector<PageData> out(count);
  for (size_t i = 0; i < count; ++i) {
    PageData& d = out[i];
    d.layer = layer;
    d.page = pages[i];
    absl::StatusOr<CommittedPage> c = region_.Lookup(layer, d.page);
    if (absl::IsNotFound(c.status()) && cold_pages_ != nullptr) {
      // Demoted: the cold tier holds it (a page the Retriever promoted again is committed).
      if (std::optional<uint64_t> gen = cold_pages_->Generation(layer, d.page); gen.has_value()) {
        d.generation = *gen;
        d.data.resize(page_bytes);
        KVTIER_RETURN_IF_ERROR(cold_pages_->Get(
            layer, d.page, /*slot=*/-1,
            std::span<uint8_t>(reinterpret_cast<uint8_t*>(d.data.data()), page_bytes)));
        continue;
      }
    }
    if (absl::IsNotFound(c.status())) {
      return absl::NotFoundError(absl::StrFormat(
          "session %s: layer %d page %d is no longer committed", id_, layer, d.page));
    }
    KVTIER_RETURN_IF_ERROR(c.status());
    d.generation = c->generation;
    d.data.resize(page_bytes);
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
    SessionColdPages::CallScope cold_call(cold_pages_.get(), caller.deadline);
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
    const std::function<absl::Status(const Image&)>& write, bool force) {
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
  Image image;
  image.epoch = epoch_;
  image.layers.resize(g.num_layers);
  std::vector<ColdPages::Read> demoted;  // into image.owned, read in one batch below
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    std::vector<ColdPageRef>& refs = image.layers[layer];
    for (int64_t page = 0; page < spec_.max_pages(); ++page) {
      absl::StatusOr<CommittedPage> c = region_.Lookup(layer, page);
      if (c.ok()) {
        refs.push_back(ColdPageRef{
            layer, page, c->generation,
            std::string_view(static_cast<const char*>(region_.SlotData(c->slot)), page_bytes)});
        continue;
      }
      if (!absl::IsNotFound(c.status())) return c.status();
      // Demoted (host_drop = demote): its bytes come back from the cold tier.
      const std::optional<uint64_t> gen =
          cold_pages_ != nullptr ? cold_pages_->Generation(layer, page) : std::nullopt;
      if (!gen.has_value()) break;  // the committed prefix ends here
      std::string& data = image.owned.emplace_back(page_bytes, '\0');
      demoted.push_back(
          {layer, page, -1, std::span<uint8_t>(reinterpret_cast<uint8_t*>(data.data()), page_bytes)});
      refs.push_back(ColdPageRef{layer, page, *gen, std::string_view(data)});
    }
  }
  if (!demoted.empty()) KVTIER_RETURN_IF_ERROR(cold_pages_->GetBatch(demoted));
  KVTIER_RETURN_IF_ERROR(write(image));
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
  std::vector<StoredPage> put;
  std::vector<std::span<const uint8_t>> bytes;
  std::vector<ColdPages::Read> reads;
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
      put.push_back(StoredPage{m.layer, m.page, m.slot, m.generation});
      bytes.emplace_back(slot, page_bytes);
    } else {
      reads.push_back({m.layer, m.page, m.slot, std::span<uint8_t>(slot, page_bytes)});
    }
  }
  if (demote) return cold_pages_->PutBatchUntil(put, bytes, caller.deadline);
  // Into buffers of our own first: the slots are written only while the call is live (the
  // copies take far less than the deadline's margin).
  KVTIER_ASSIGN_OR_RETURN(std::vector<std::string> got,
                          cold_pages_->ReadPages(reads, caller.deadline));
  KVTIER_RETURN_IF_ERROR(caller.CheckLive(what));
  for (size_t i = 0; i < reads.size(); ++i) {
    std::memcpy(reads[i].out.data(), got[i].data(), reads[i].out.size());
  }
  return absl::OkStatus();
}

uint64_t TenantSession::DemotedPageCount() const {
  if (cold_pages_ == nullptr) return 0;
  uint64_t n = 0;
  for (const auto& [layer, page] : cold_pages_->Held()) n += !region_.Lookup(layer, page).ok();
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
