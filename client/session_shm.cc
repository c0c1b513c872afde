#include "client/session_shm.h"

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/convert.h"
#include "client/rpc_util.h"
#include "kvtier/status.h"
#include "offload/page_pool.h"
#include "offload/session_region.h"

namespace kvtier {

namespace {

class ShmSession final : public Session {
 public:
  ShmSession(std::shared_ptr<Connection> conn, std::shared_ptr<ArenaMapping> mapping,
             const SessionInfo& info, const SessionOptions& options)
      : conn_(std::move(conn)),
        mapping_(std::move(mapping)),
        info_(info),
        options_(options),
        epoch_(info.epoch) {}

  // Detaches: commits what has been offloaded (bounded by the deadline) and leaves the
  // session to the daemon.
  ~ShmSession() override {
    if (!closed_ && retriever_ != nullptr && failed_.ok()) (void)CommitStored(/*wait=*/true);
  }

  absl::Status Init(bool restore);

  // Retriever.
  absl::Status Append(int32_t layer, const void* k, const void* v, int32_t n_tokens) override {
    KVTIER_RETURN_IF_ERROR(CheckUsable("Append"));
    KVTIER_RETURN_IF_ERROR(retriever_->Append(layer, k, v, n_tokens));
    return CommitStored(/*wait=*/false).status();
  }
  absl::StatusOr<WorkingSetView> BeginStep(int32_t layer, const void* q) override;
  absl::Status Attend(int32_t layer, const void* q, void* out, float* lse) override {
    KVTIER_RETURN_IF_ERROR(CheckUsable("Attend"));
    return retriever_->Attend(layer, q, out, lse);
  }
  absl::Status EndStep(int32_t layer, const void* q) override {
    KVTIER_RETURN_IF_ERROR(CheckUsable("EndStep"));
    KVTIER_RETURN_IF_ERROR(retriever_->EndStep(layer, q));
    return CommitStored(/*wait=*/false).status();
  }
  absl::Status Wait() override { return retriever_->Wait(); }
  absl::Status ReportSignals(const policy::StepSignals& signals) override {
    return retriever_->ReportSignals(signals);
  }
  absl::Status ObserveQueries(int32_t layer, const void* q, int32_t n,
                              int64_t first_position) override {
    return retriever_->ObserveQueries(layer, q, n, first_position);
  }
  absl::Status Close() override;
  RetrieverStats Stats() override { return retriever_->Stats(); }
  StepStats LastStep(int32_t layer) override { return retriever_->LastStep(layer); }
  void SetProfiling(bool on) override { retriever_->SetProfiling(on); }
  // The pages committed by this call (they are committed, not only handed out).
  absl::StatusOr<std::vector<StoredPage>> TakeStoredPages(bool wait) override {
    KVTIER_RETURN_IF_ERROR(CheckUsable("TakeStoredPages"));
    return CommitStored(wait);
  }
  absl::Status Restore(int32_t layer, std::vector<PageHandle> pages) override {
    KVTIER_RETURN_IF_ERROR(CheckUsable("Restore"));
    return retriever_->Restore(layer, std::move(pages));
  }
  Stream& compute_stream() override { return retriever_->compute_stream(); }
  const Geometry& geometry() const override { return retriever_->geometry(); }
  const RetrieverOptions& options() const override { return retriever_->options(); }
  int32_t num_tokens(int32_t layer) const override { return retriever_->num_tokens(layer); }

  // Session.
  const std::string& id() const override { return info_.id; }
  Transport transport() const override { return Transport::kShm; }
  uint64_t epoch() const override { return epoch_; }
  absl::Status Flush() override {
    KVTIER_RETURN_IF_ERROR(CheckUsable("Flush"));
    return CommitStored(/*wait=*/true).status();
  }
  absl::StatusOr<std::vector<FetchedPage>> FetchPages(int32_t layer,
                                                      const std::vector<int64_t>& pages) override;
  const std::vector<int32_t>& LastSlotTable(int32_t layer) const override;
  absl::StatusOr<SessionInfo> Info() override { return LookupSessionInfo(*conn_, info_.id); }

 private:
  // The host copy of one layer's slot table: enqueued at BeginStep, read lazily.
  struct SlotCopy {
    std::vector<int32_t> staging;  // written by the compute stream
    std::unique_ptr<Event> done;   // recorded after the copy
    bool fresh = false;            // a copy was enqueued since `table` was filled
    std::vector<int32_t> table;
  };

  absl::Status CheckUsable(std::string_view what) const {
    if (closed_) {
      return absl::FailedPreconditionError(
          absl::StrFormat("%s: session %s is closed", what, info_.id));
    }
    return failed_;
  }
  // Commits the pages whose offload has run (wait: every offload enqueued so far).
  absl::StatusOr<std::vector<StoredPage>> CommitStored(bool wait);
  absl::Status RestoreFromRegion();
  absl::StatusOr<FetchedPage> ReadPage(int32_t layer, int64_t page) const;

  std::shared_ptr<Connection> conn_;
  std::shared_ptr<ArenaMapping> mapping_;  // outlives everything below
  const SessionInfo info_;
  const SessionOptions options_;
  const uint64_t epoch_;
  mutable std::vector<SlotCopy> slots_;  // per layer; events of the mapping's backend
  std::optional<SessionRegion> region_;
  std::unique_ptr<PagePool> pool_;
  std::unique_ptr<Retriever> retriever_;  // destroyed first: it drains its streams
  absl::Status failed_;                   // a commit refused (the region was taken over): sticky
  bool closed_ = false;
};

absl::Status ShmSession::Init(bool restore) {
  const Geometry& g = info_.geometry;
  const HostArena& arena = *mapping_->arena;
  if (info_.region_bytes == 0 || info_.region_offset % kRegionAlignment != 0 ||
      info_.region_offset > arena.size() ||
      info_.region_bytes > arena.size() - info_.region_offset) {
    return absl::OutOfRangeError(absl::StrFormat(
        "session %s: region [%d, +%d) is not a %d-aligned range of the %d-byte tenant arena",
        info_.id, info_.region_offset, info_.region_bytes, kRegionAlignment, arena.size()));
  }
  char* base = static_cast<char*>(arena.data()) + info_.region_offset;
  KVTIER_ASSIGN_OR_RETURN(SessionRegion region, SessionRegion::Open(base, info_.region_bytes, g));
  region_.emplace(region);
  KVTIER_ASSIGN_OR_RETURN(
      pool_, PagePool::Create(region_->slots(), g.host_page_bytes(), region_->num_slots()));
  if (pool_->slot_stride() != region_->slot_stride()) {
    return absl::InternalError(absl::StrFormat("page pool stride %d != region slot stride %d",
                                               pool_->slot_stride(), region_->slot_stride()));
  }
  KVTIER_ASSIGN_OR_RETURN(const RetrieverOptions ro,
                          ResolveRetrieverOptions(options_.retriever, info_));
  Backend& backend = *mapping_->backend;
  KVTIER_ASSIGN_OR_RETURN(retriever_, Retriever::Create(g, ro, backend, pool_.get()));
  slots_.resize(static_cast<size_t>(g.num_layers));
  for (SlotCopy& c : slots_) {
    KVTIER_ASSIGN_OR_RETURN(c.done, backend.CreateEvent());
  }
  return restore ? RestoreFromRegion() : absl::OkStatus();
}

absl::Status ShmSession::RestoreFromRegion() {
  for (int32_t layer = 0; layer < info_.geometry.num_layers; ++layer) {
    const int64_t n = region_->CommittedPrefix(layer);
    // Entries past the prefix are stale: the engine appends those tokens again.
    if (n < region_->layout().max_pages_per_layer) {
      KVTIER_RETURN_IF_ERROR(region_->Uncommit(layer, n));
    }
    if (n == 0) continue;
    std::vector<PageHandle> handles;
    handles.reserve(static_cast<size_t>(n));
    for (int64_t page = 0; page < n; ++page) {
      KVTIER_ASSIGN_OR_RETURN(const CommittedPage c, region_->Lookup(layer, page));
      absl::StatusOr<PageHandle> h = pool_->Claim(c.slot, c.generation);
      if (!h.ok()) {
        return absl::DataLossError(
            absl::StrFormat("session %s: layer %d page %d: committed slot %d cannot be claimed: %s",
                            info_.id, layer, page, c.slot, h.status().message()));
      }
      handles.push_back(*std::move(h));
    }
    KVTIER_RETURN_IF_ERROR(retriever_->Restore(layer, std::move(handles)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<StoredPage>> ShmSession::CommitStored(bool wait) {
  KVTIER_ASSIGN_OR_RETURN(std::vector<StoredPage> pages, retriever_->TakeStoredPages(wait));
  for (const StoredPage& p : pages) {
    absl::Status st = region_->Commit(p.layer, p.page, p.slot, p.generation, epoch_);
    if (!st.ok()) {
      failed_ =
          absl::Status(st.code(), absl::StrFormat("session %s (epoch %d): commit of layer "
                                                  "%d page %d refused: %s",
                                                  info_.id, epoch_, p.layer, p.page, st.message()));
      return failed_;
    }
  }
  return pages;
}

absl::StatusOr<WorkingSetView> ShmSession::BeginStep(int32_t layer, const void* q) {
  KVTIER_RETURN_IF_ERROR(CheckUsable("BeginStep"));
  KVTIER_ASSIGN_OR_RETURN(WorkingSetView view, retriever_->BeginStep(layer, q));
  // Copy the table now, on the compute stream: EndStep's background recall rewrites it.
  SlotCopy& c = slots_[static_cast<size_t>(layer)];
  const size_t n = static_cast<size_t>(info_.geometry.num_kv_heads) * view.num_slots;
  c.staging.resize(n);  // S is fixed per layer: allocates on the first step only
  Stream& s = retriever_->compute_stream();
  KVTIER_RETURN_IF_ERROR(
      mapping_->backend->Copy(s, c.staging.data(), view.slot_table, n * sizeof(int32_t)));
  KVTIER_RETURN_IF_ERROR(s.Record(*c.done));
  c.fresh = true;
  return view;
}

const std::vector<int32_t>& ShmSession::LastSlotTable(int32_t layer) const {
  static const std::vector<int32_t> kEmpty;
  if (layer < 0 || static_cast<size_t>(layer) >= slots_.size()) return kEmpty;
  SlotCopy& c = slots_[static_cast<size_t>(layer)];
  if (c.fresh) {
    c.fresh = false;
    if (c.done->Wait(retriever_->options().deadline).ok()) {
      c.table = c.staging;
    } else {
      c.table.clear();
    }
  }
  return c.table;
}

absl::Status ShmSession::Close() {
  if (closed_) return absl::OkStatus();
  const absl::Status committed = failed_.ok() ? CommitStored(/*wait=*/true).status() : failed_;
  const absl::Status rc = retriever_->Close();
  closed_ = true;
  // A refused commit means another holder reattached: the session is theirs, not ours to
  // close. Work still in flight may write the region: leave it to the daemon then too
  // (CloseSession by id once the engine knows the work is gone).
  if (!failed_.ok()) return failed_;
  if (absl::IsDeadlineExceeded(rc)) return rc;
  const absl::Status rpc = CloseSessionById(*conn_, info_.id);
  if (!committed.ok()) return committed;
  return rc.ok() ? rpc : rc;
}

absl::StatusOr<FetchedPage> ShmSession::ReadPage(int32_t layer, int64_t page) const {
  const size_t bytes = info_.geometry.host_page_bytes();
  for (int attempt = 0; attempt < 2; ++attempt) {
    KVTIER_ASSIGN_OR_RETURN(const CommittedPage c, region_->Lookup(layer, page));
    const auto* data = static_cast<const uint8_t*>(region_->SlotData(c.slot));
    FetchedPage f;
    f.layer = layer;
    f.page = page;
    f.generation = c.generation;
    f.data.assign(data, data + bytes);
    // The entry may have been rewritten while we copied (a reattached writer): re-check.
    KVTIER_ASSIGN_OR_RETURN(const CommittedPage after, region_->Lookup(layer, page));
    if (after.slot == c.slot && after.generation == c.generation) return f;
  }
  return absl::AbortedError(
      absl::StrFormat("layer %d page %d changed while it was read twice", layer, page));
}

absl::StatusOr<std::vector<FetchedPage>> ShmSession::FetchPages(int32_t layer,
                                                                const std::vector<int64_t>& pages) {
  if (closed_) {
    return absl::FailedPreconditionError(
        absl::StrCat("FetchPages: session ", info_.id, " is closed"));
  }
  if (layer < 0 || layer >= info_.geometry.num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat("FetchPages: layer = %d must be in [0, %d)",
                                                      layer, info_.geometry.num_layers));
  }
  std::vector<FetchedPage> out;
  if (!pages.empty()) {
    for (int64_t page : pages) {
      KVTIER_ASSIGN_OR_RETURN(FetchedPage f, ReadPage(layer, page));
      out.push_back(std::move(f));
    }
    return out;
  }
  for (int64_t page = 0; page < region_->layout().max_pages_per_layer; ++page) {
    absl::StatusOr<FetchedPage> f = ReadPage(layer, page);
    if (absl::IsNotFound(f.status())) continue;
    if (!f.ok()) return f.status();
    out.push_back(*std::move(f));
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Session>> NewShmSession(std::shared_ptr<Connection> conn,
                                                       std::shared_ptr<ArenaMapping> mapping,
                                                       const SessionInfo& info,
                                                       const SessionOptions& options,
                                                       bool restore) {
  auto s = std::make_unique<ShmSession>(std::move(conn), std::move(mapping), info, options);
  KVTIER_RETURN_IF_ERROR(s->Init(restore));
  return std::unique_ptr<Session>(std::move(s));
}

}  // namespace kvtier
