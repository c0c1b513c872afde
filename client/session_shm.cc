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
#include "core/status.h"
#include "offload/region_host_tier.h"
#include "offload/retriever.h"
#include "offload/session_region.h"

namespace kvtier {

namespace {

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
                          ResolveSequenceOptions(options_.sequence, info_));
  absl::StatusOr<std::unique_ptr<Retriever>> r =
      OpenRegionRetriever(region, info_.epoch, so, *mapping_->backend, restore);
  if (!r.ok()) {
    return absl::Status(r.status().code(),
                        absl::StrCat("session ", info_.id, ": ", r.status().message()));
  }
  retriever_ = *std::move(r);
  return absl::OkStatus();
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
