#include "client/session_shm.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/connection.h"
#include "client/convert.h"
#include "client/rpc_util.h"
#include "core/status.h"
#include "offload/cold_pages.h"
#include "offload/region_host_tier.h"
#include "offload/retriever.h"
#include "offload/session_region.h"

namespace kvtier {

namespace {

// policy.host_drop = demote over SHM: the cold tier behind the session's region, reached
// through the daemon (DemotePages, PromotePages), which reads and writes the region's slots
// itself, so no page crosses the RPC.
class DaemonColdPages final : public ColdPages {
 public:
  DaemonColdPages(std::shared_ptr<Connection> conn, std::string id, uint64_t epoch)
      : conn_(std::move(conn)), id_(std::move(id)), epoch_(epoch) {}
  // One RPC per kMaxPagesPerCall pages (the daemon reads the slots itself).
  absl::Status PutBatch(std::span<const StoredPage> pages,
                        std::span<const std::span<const uint8_t>> /*bytes*/) override {
    for (size_t at = 0; at < pages.size(); at += kMaxPagesPerCall) {
      v1::DemotePagesRequest req;
      req.set_session_id(id_);
      req.set_epoch(epoch_);
      for (const StoredPage& p : pages.subspan(at, std::min(kMaxPagesPerCall, pages.size() - at))) {
        *req.add_pages() = Slot(p.layer, p.page, p.slot, p.generation);
      }
      v1::DemotePagesReply reply;
      auto ctx = conn_->Context();
      KVTIER_RETURN_IF_ERROR(FromGrpcStatus(conn_->stub().DemotePages(ctx.get(), req, &reply)));
    }
    for (const StoredPage& p : pages) demoted_.insert({p.layer, p.page});
    return absl::OkStatus();
  }
  // One RPC per kMaxPagesPerCall pages (the daemon writes the slots itself).
  absl::Status GetBatch(std::span<const Read> reads) override {
    for (size_t at = 0; at < reads.size(); at += kMaxPagesPerCall) {
      v1::PromotePagesRequest req;
      req.set_session_id(id_);
      req.set_epoch(epoch_);
      for (const Read& r : reads.subspan(at, std::min(kMaxPagesPerCall, reads.size() - at))) {
        *req.add_pages() = Slot(r.layer, r.page, r.slot, 0);
      }
      v1::PromotePagesReply reply;
      auto ctx = conn_->Context();
      KVTIER_RETURN_IF_ERROR(FromGrpcStatus(conn_->stub().PromotePages(ctx.get(), req, &reply)));
    }
    return absl::OkStatus();
  }
  // Whether the page was ever demoted (the daemon then serves it when the region does not).
  bool demoted(int32_t layer, int64_t page) const { return demoted_.contains({layer, page}); }

 private:
  static v1::PageSlot Slot(int32_t layer, int64_t page, int64_t slot, uint64_t generation) {
    v1::PageSlot s;
    s.set_layer(static_cast<uint32_t>(layer));
    s.set_page(static_cast<uint32_t>(page));
    s.set_slot(static_cast<uint64_t>(slot));
    s.set_generation(generation);
    return s;
  }
  // The daemon's limit per DemotePages / PromotePages (kvtier.proto).
  static constexpr size_t kMaxPagesPerCall = 4096;
  std::shared_ptr<Connection> conn_;
  const std::string id_;
  const uint64_t epoch_;
  absl::flat_hash_set<std::pair<int32_t, int64_t>> demoted_;
};

class ShmSession final : public Session {
 public:
  ShmSession(std::shared_ptr<Connection> conn, std::shared_ptr<ArenaMapping> mapping,
             const SessionInfo& info, const SessionOptions& options)
      : conn_(std::move(conn)), mapping_(std::move(mapping)), info_(info), options_(options) {}

  // Detaches: commits what has been offloaded (bounded by the deadline) and leaves the
  // session to the daemon.
  ~ShmSession() override {
    if (!closed_ && !released_ && retriever_ != nullptr) (void)retriever_->Flush();
  }

  absl::Status Init(bool restore);
  // Reattach of a session that demotes pages: its sequence rebuilt by appending every full
  // page again (read through the daemon, the region's ones after copying them to the cold
  // tier), over a host tier that demotes as it fills.
  absl::Status RebuildDemoting();

  const std::string& id() const override { return info_.id; }
  Transport transport() const override { return Transport::kShm; }
  uint64_t epoch() const override { return info_.epoch; }
  Sequence& sequence() override { return *retriever_; }
  absl::Status Flush() override {
    KVTIER_RETURN_IF_ERROR(CheckOpen("Flush"));
    return retriever_->Flush();
  }
  absl::StatusOr<std::vector<FetchedPage>> FetchPages(int32_t layer,
                                                      const std::vector<int64_t>& pages) override;
  absl::StatusOr<SessionInfo> Info() override { return LookupSessionInfo(*conn_, info_.id); }
  absl::Status Close() override;
  absl::Status Suspend() override;

 private:
  absl::Status CheckOpen(std::string_view what) const {
    return CheckSessionOpen(closed_, released_, what, info_.id);
  }
  // Flushes and closes the local sequence, once (later calls return the first outcome).
  // Sets leave_ when the daemon's session must be left as it is: another holder
  // reattached (its refusal), or work in flight may still write the region
  // (DEADLINE_EXCEEDED).
  absl::Status Release();
  absl::StatusOr<FetchedPage> ReadPage(int32_t layer, int64_t page) const;

  std::shared_ptr<Connection> conn_;
  std::shared_ptr<ArenaMapping> mapping_;  // outlives everything below
  const SessionInfo info_;
  const SessionOptions options_;
  std::optional<SessionRegion> region_;   // the daemon's readers' view (FetchPages)
  std::unique_ptr<DaemonColdPages> cold_;  // host_drop = demote; outlives the Retriever
  std::unique_ptr<Retriever> retriever_;  // owns the region's host tier
  bool closed_ = false;
  bool released_ = false;   // the local sequence is flushed and closed (Release)
  bool leave_ = false;      // Release: the daemon's session is not ours to close or suspend
  bool suspended_ = false;  // the daemon suspended it (Suspend)
  absl::Status release_status_;
};

absl::Status ShmSession::Init(bool restore) {
  const HostArena& arena = *mapping_->arena;
  if (info_.region_bytes == 0 || info_.region_offset % kRegionAlignment != 0 ||
      info_.region_offset > arena.size() ||
      info_.region_bytes > arena.size() - info_.region_offset) {
    return absl::OutOfRangeError(absl::StrFormat(
        "session %s: region [%d, +%d) is not a %d-aligned range of the %d-byte tenant arena",
        info_.id, info_.region_offset, info_.region_bytes, kRegionAlignment, arena.size()));
  }
  char* base = static_cast<char*>(arena.data()) + info_.region_offset;
  KVTIER_ASSIGN_OR_RETURN(SessionRegion region,
                          SessionRegion::Open(base, info_.region_bytes, info_.geometry));
  region_.emplace(region);
  KVTIER_ASSIGN_OR_RETURN(const SequenceOptions so,
                          SequenceOptionsForSession(options_.sequence, info_));
  const bool demote = so.policy.host_drop == "demote";
  if (demote) cold_ = std::make_unique<DaemonColdPages>(conn_, info_.id, info_.epoch);
  // A session that demotes pages is rebuilt by appending its pages again (RebuildDemoting):
  // Restore would need them all in host slots at once.
  absl::StatusOr<std::unique_ptr<Retriever>> r = OpenRegionRetriever(
      region, info_.epoch, so, *mapping_->backend, restore && !demote, cold_.get());
  if (r.ok()) retriever_ = *std::move(r);
  absl::Status st = r.status();
  if (st.ok() && restore && demote) st = RebuildDemoting();
  if (!st.ok()) {
    return absl::Status(st.code(), absl::StrCat("session ", info_.id, ": ", st.message()));
  }
  return absl::OkStatus();
}

absl::Status ShmSession::RebuildDemoting() {
  const Geometry& g = info_.geometry;
  SessionRegion& region = *region_;
  const int64_t max_pages = region.layout().max_pages_per_layer;
  // 1. Every page the region holds goes to the cold tier too (the daemon copies it there,
  //    or finds it there already), and the region lets go of it: every page of the session
  //    is then read through the daemon, and every slot is free for the new sequence.
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    std::vector<StoredPage> held;
    for (int64_t page = 0; page < max_pages; ++page) {
      absl::StatusOr<CommittedPage> c = region.Lookup(layer, page);
      if (absl::IsNotFound(c.status())) continue;
      KVTIER_RETURN_IF_ERROR(c.status());
      held.push_back(StoredPage{layer, page, c->slot, c->generation});
    }
    // The daemon reads the slots: no bytes go with the pages.
    const std::vector<std::span<const uint8_t>> none(held.size());
    KVTIER_RETURN_IF_ERROR(cold_->PutBatch(held, none));
    KVTIER_RETURN_IF_ERROR(region.Uncommit(layer, 0));
  }
  // 2. Layer by layer, page by page from 0, as the engine first appended them
  //    (HostPageToRows): the sequence offloads, summarises and demotes exactly as it did
  //    then. The engine re-appends past the full pages.
  const int32_t p = g.page_size;
  std::vector<uint8_t> k(g.host_page_bytes() / 2), v(k.size());
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    KVTIER_ASSIGN_OR_RETURN(std::vector<FetchedPage> pages,
                            FetchPagesById(*conn_, info_.id, g, layer, {}));
    for (size_t i = 0; i < pages.size() && pages[i].page == static_cast<int64_t>(i); ++i) {
      HostPageToRows(g, pages[i].data.data(), k.data(), v.data());
      KVTIER_RETURN_IF_ERROR(retriever_->Append(layer, k.data(), v.data(), p));
    }
  }
  return retriever_->Flush();
}

absl::Status ShmSession::Release() {
  if (released_) return release_status_;
  released_ = true;
  absl::Status committed = retriever_->Flush();
  const absl::Status rc = retriever_->Close();
  // A refused commit means another holder reattached: the session is theirs, not ours to
  // close or suspend. Work still in flight may write the region: leave it to the daemon
  // then too (CloseSession by id once the engine knows the work is gone).
  const absl::Status& refused = static_cast<RegionHostTier*>(retriever_->host_tier())->refused();
  if (!refused.ok()) {
    leave_ = true;
    release_status_ = absl::Status(refused.code(), absl::StrFormat("session %s (epoch %d): %s",
                                                                   info_.id, info_.epoch,
                                                                   refused.message()));
  } else if (absl::IsDeadlineExceeded(rc)) {
    leave_ = true;
    release_status_ = rc;
  } else {
    // The engine may have closed the sequence itself (FAILED_PRECONDITION from Flush).
    if (absl::IsFailedPrecondition(committed)) committed = absl::OkStatus();
    release_status_ = committed.ok() ? rc : committed;
  }
  return release_status_;
}

absl::Status ShmSession::Close() {
  if (closed_) return absl::OkStatus();
  if (suspended_) {  // left for Client::Reattach
    closed_ = true;
    return absl::OkStatus();
  }
  const absl::Status local = Release();
  closed_ = true;
  if (leave_) return local;
  const absl::Status rpc = CloseSessionById(*conn_, info_.id);
  return local.ok() ? rpc : local;
}

absl::Status ShmSession::Suspend() {
  if (closed_) return CheckSessionOpen(closed_, "Suspend", info_.id);
  if (suspended_) return absl::OkStatus();
  // Nothing may write the region once the daemon may demote it: flush and close first.
  const absl::Status local = Release();
  if (leave_) {
    closed_ = true;
    return local;
  }
  KVTIER_RETURN_IF_ERROR(SuspendSessionById(*conn_, info_.id).status());
  suspended_ = true;
  return local;
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
  // A suspended session's region may be demoted and reused: read it no more.
  KVTIER_RETURN_IF_ERROR(CheckOpen("FetchPages"));
  if (layer < 0 || layer >= info_.geometry.num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat("FetchPages: layer = %d must be in [0, %d)",
                                                      layer, info_.geometry.num_layers));
  }
  std::vector<FetchedPage> out;
  // A demoted page is not in the region: the daemon reads it from the cold tier.
  const auto read = [&](int64_t page) -> absl::StatusOr<FetchedPage> {
    absl::StatusOr<FetchedPage> f = ReadPage(layer, page);
    if (!absl::IsNotFound(f.status()) || cold_ == nullptr || !cold_->demoted(layer, page)) {
      return f;
    }
    KVTIER_ASSIGN_OR_RETURN(std::vector<FetchedPage> got,
                            FetchPagesById(*conn_, info_.id, info_.geometry, layer, {page}));
    if (got.size() != 1) {
      return absl::DataLossError(absl::StrFormat(
          "FetchPages: the daemon sent %d pages for layer %d page %d", got.size(), layer, page));
    }
    return std::move(got[0]);
  };
  if (!pages.empty()) {
    for (int64_t page : pages) {
      KVTIER_ASSIGN_OR_RETURN(FetchedPage f, read(page));
      out.push_back(std::move(f));
    }
    return out;
  }
  for (int64_t page = 0; page < region_->layout().max_pages_per_layer; ++page) {
    absl::StatusOr<FetchedPage> f = read(page);
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
