#include "daemon/cold_store.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "spdlog/spdlog.h"

namespace kvtier::daemon {
namespace {

constexpr uint32_t kRecordVersion = 1;

}  // namespace

ColdStore::ColdStore(RedisCluster* cluster, ColdTier* tier, std::string prefix,
                     ColdStoreOptions options)
    : cluster_(cluster),
      tier_(tier),
      prefix_(std::move(prefix)),
      options_(std::move(options)),
      wait_timeout_(std::max(absl::Milliseconds(1), options_.command_timeout * 3 / 4)) {}

std::string ColdStore::RecordKey(std::string_view session) const {
  std::string key = absl::StrCat(prefix_, ":", options_.tenant, ":{");
  key.append(session);
  return key + "}:meta";
}

std::string ColdStore::IndexKey() const {
  return absl::StrCat(prefix_, ":", options_.tenant, ":sessions");
}

uint64_t ColdStore::RecordBytes(const v1::ColdSessionRecord& record) {
  uint64_t pages = 0;
  for (const v1::ColdLayer& l : record.layers()) pages += static_cast<uint64_t>(l.generations_size());
  return ValueBytes(pages, record.page_bytes());
}

absl::Status ColdStore::Reserve(std::string_view session, uint64_t bytes, uint64_t overdraft) {
  const uint64_t limit = options_.quota_bytes > UINT64_MAX - overdraft
                             ? UINT64_MAX
                             : options_.quota_bytes + overdraft;
  uint64_t used = used_.load(std::memory_order_relaxed);
  do {
    if (bytes > limit || used > limit - bytes) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "tenant '%s': demoting session %s needs %d bytes of the cold tier, %d of %d bytes "
          "free (tenant.cold_quota_bytes)%s",
          options_.tenant, session, bytes,
          options_.quota_bytes > used ? options_.quota_bytes - used : 0, options_.quota_bytes,
          overdraft == 0 ? ""
                         : absl::StrFormat(", %d more while the copy this move replaces is kept",
                                           overdraft)));
    }
  } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
  return absl::OkStatus();
}

void ColdStore::Unreserve(uint64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }

absl::Status ColdStore::WaitForReplicas(const std::vector<std::string>& keys,
                                        absl::Time deadline) {
  if (options_.min_replicas == 0 || keys.empty()) return absl::OkStatus();
  // One WAIT per node: keys of the same slot need only one.
  std::vector<std::string> route;
  absl::flat_hash_set<uint16_t> slots;
  for (const std::string& k : keys) {
    if (slots.insert(RedisCluster::SlotOf(k)).second) route.push_back(k);
  }
  // WAIT blocks its connection: at most most of one round trip's timeout (the socket would
  // give up first), so a slot whose master has no replica left (after a failover) fails the
  // write in a bounded time instead of using the whole deadline.
  const absl::Duration left = deadline - absl::Now();
  const int64_t ms = std::max<int64_t>(1, absl::ToInt64Milliseconds(std::min(left, wait_timeout_)));
  std::vector<std::vector<std::string>> waits(
      route.size(), {"WAIT", absl::StrCat(options_.min_replicas), absl::StrCat(ms)});
  std::vector<absl::StatusOr<RedisReply>> replies = cluster_->Pipeline(waits, deadline, route);
  for (size_t i = 0; i < replies.size(); ++i) {
    KVTIER_RETURN_IF_ERROR(replies[i].status());
    if (replies[i]->type != RedisReply::Type::kInteger ||
        replies[i]->integer < static_cast<int64_t>(options_.min_replicas)) {
      // A WAIT the deadline cut short says nothing of the replicas: the call ran out of time.
      const std::string msg = absl::StrFormat(
          "WAIT %d: only %d replicas acknowledged the writes to the node of %s "
          "(cold_tier.min_replicas)",
          options_.min_replicas, replies[i]->integer, route[i]);
      if (left < wait_timeout_) {
        return absl::DeadlineExceededError(absl::StrCat(msg, " before the deadline"));
      }
      return absl::UnavailableError(msg);
    }
  }
  return absl::OkStatus();
}

absl::Status ColdStore::WriteRecord(v1::ColdSessionRecord& record, absl::Time deadline,
                                    bool* left_listed) {
  if (left_listed != nullptr) *left_listed = false;
  const std::string& session = record.session_id();
  record.set_version(kRecordVersion);
  uint64_t pages = 0;
  for (const v1::ColdLayer& l : record.layers()) {
    pages += static_cast<uint64_t>(l.generations_size());
  }
  std::string value;
  absl::Status st;
  if (!record.SerializeToString(&value)) {
    st = absl::InternalError("serializing the cold session record");
  }
  const std::string key = RecordKey(session);
  if (st.ok()) {
    std::vector<std::vector<std::string>> cmds = {{"SET", key, value},
                                                  {"SADD", IndexKey(), session}};
    for (absl::StatusOr<RedisReply>& r : cluster_->Pipeline(cmds, deadline)) {
      if (st.ok() && !r.ok()) st = r.status();
    }
  }
  if (st.ok()) st = WaitForReplicas({key, IndexKey()}, deadline);
  if (!st.ok()) {
    failures_.fetch_add(1, std::memory_order_relaxed);
    // Not demoted: no index entry or record may name its pages, which its mover removes.
    // Reverse order, with a round trip's time even when the deadline is spent.
    const absl::Time undo = std::max(deadline, absl::Now() + options_.command_timeout);
    std::vector<std::vector<std::string>> undo_cmds = {{"SREM", IndexKey(), session},
                                                       {"DEL", key}};
    // Listed at a restart only while both stay: an index entry without its record is skipped.
    bool undone = false;
    for (absl::StatusOr<RedisReply>& r : cluster_->Pipeline(undo_cmds, undo)) {
      if (r.ok()) {
        undone = true;
        continue;
      }
      spdlog::warn("tenant '{}': session {} was not demoted, and removing its record from "
                   "the cold tier failed: {} (index {}, record {})",
                   options_.tenant, session, r.status().ToString(), IndexKey(), key);
    }
    if (left_listed != nullptr) *left_listed = !undone;
    return absl::Status(st.code(), absl::StrFormat("demoting session %s to the cold tier: %s",
                                                    session, st.message()));
  }
  sessions_.fetch_add(1, std::memory_order_relaxed);
  demoted_sessions_.fetch_add(1, std::memory_order_relaxed);
  demoted_pages_.fetch_add(pages, std::memory_order_relaxed);
  demoted_bytes_.fetch_add(pages * record.page_bytes(), std::memory_order_relaxed);
  return absl::OkStatus();
}

void ColdStore::CountPromoted(const v1::ColdSessionRecord& record) {
  uint64_t pages = 0;
  for (const v1::ColdLayer& l : record.layers()) pages += static_cast<uint64_t>(l.generations_size());
  promoted_sessions_.fetch_add(1, std::memory_order_relaxed);
  promoted_pages_.fetch_add(pages, std::memory_order_relaxed);
  promoted_bytes_.fetch_add(pages * record.page_bytes(), std::memory_order_relaxed);
}

absl::Status ColdStore::Remove(const v1::ColdSessionRecord& record, absl::Time deadline,
                               bool keep_if_listed) {
  const std::string& session = record.session_id();
  absl::Status st;
  std::vector<std::vector<std::string>> cmds = {{"SREM", IndexKey(), session},
                                                {"DEL", RecordKey(session)}};
  for (absl::StatusOr<RedisReply>& r : cluster_->Pipeline(cmds, deadline)) {
    if (st.ok() && !r.ok()) st = r.status();
  }
  if (!st.ok() && keep_if_listed) {
    failures_.fetch_add(1, std::memory_order_relaxed);
    return st;
  }
  Unreserve(RecordBytes(record));
  sessions_.fetch_sub(1, std::memory_order_relaxed);
  for (int32_t l = 0; st.ok() && l < record.layers_size(); ++l) {
    const int n = record.layers(l).generations_size();
    if (n == 0) continue;
    std::vector<int64_t> pages(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) pages[static_cast<size_t>(i)] = i;
    st = tier_->Delete(options_.tenant, session, l, pages, deadline);
  }
  if (!st.ok()) {
    failures_.fetch_add(1, std::memory_order_relaxed);
    spdlog::warn("tenant '{}': removing session {} from the cold tier: {} (its keys stay until "
                 "removed by hand)",
                 options_.tenant, session, st.ToString());
  }
  return st;
}

absl::StatusOr<std::vector<v1::ColdSessionRecord>> ColdStore::LoadAll(absl::Time deadline) {
  KVTIER_ASSIGN_OR_RETURN(RedisReply ids, cluster_->Run({"SMEMBERS", IndexKey()}, deadline));
  std::vector<std::vector<std::string>> gets;
  for (const RedisReply& id : ids.elements) gets.push_back({"GET", RecordKey(id.str)});
  std::vector<absl::StatusOr<RedisReply>> values = cluster_->Pipeline(gets, deadline);
  std::vector<v1::ColdSessionRecord> out;
  for (size_t i = 0; i < values.size(); ++i) {
    const std::string& id = ids.elements[i].str;
    if (!values[i].ok()) return values[i].status();
    v1::ColdSessionRecord r;
    if (values[i]->type != RedisReply::Type::kString || !r.ParseFromString(values[i]->str) ||
        r.version() != kRecordVersion || r.session_id() != id) {
      spdlog::warn("tenant '{}': the cold tier lists session {} but its record at {} is {}; "
                   "skipped",
                   options_.tenant, id, RecordKey(id),
                   values[i]->type == RedisReply::Type::kNil ? "missing" : "not readable");
      continue;
    }
    used_.fetch_add(RecordBytes(r), std::memory_order_relaxed);
    sessions_.fetch_add(1, std::memory_order_relaxed);
    out.push_back(std::move(r));
  }
  return out;
}

absl::Status ColdStore::PutPages(std::string_view session, std::span<const ColdPageRef> pages,
                                 absl::Time deadline, bool live) {
  if (pages.empty()) return absl::OkStatus();
  uint64_t data_bytes = 0;
  for (const ColdPageRef& p : pages) data_bytes += p.data.size();
  // One pipeline per layer (its pages share a slot), then one WAIT per node.
  std::map<int32_t, std::vector<ColdPageRef>> by_layer;
  for (const ColdPageRef& p : pages) by_layer[p.layer].push_back(p);
  absl::Status st;
  std::vector<std::string> written;
  for (const auto& [layer, refs] : by_layer) {
    if (!st.ok()) break;
    st = tier_->Put(options_.tenant, session, refs, deadline);
    written.push_back(tier_->Key(options_.tenant, session, layer, refs.front().page));
  }
  if (st.ok()) st = WaitForReplicas(written, deadline);
  if (!st.ok()) {
    // The pages stay charged: what was written is the caller's to remove.
    failures_.fetch_add(1, std::memory_order_relaxed);
    return absl::Status(st.code(),
                        absl::StrFormat("session %s: %d pages to the cold tier: %s", session,
                                        pages.size(), st.message()));
  }
  if (live) {
    live_demoted_pages_.fetch_add(pages.size(), std::memory_order_relaxed);
    demoted_bytes_.fetch_add(data_bytes, std::memory_order_relaxed);
  }
  return absl::OkStatus();
}

std::vector<absl::StatusOr<ColdPage>> ColdStore::GetPages(std::string_view session, int32_t layer,
                                                          std::span<const int64_t> pages,
                                                          std::span<const uint64_t> generations,
                                                          absl::Time deadline, bool live) {
  std::vector<absl::StatusOr<ColdPage>> got =
      tier_->Get(options_.tenant, session, layer, pages, generations, deadline);
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i].ok()) {
      if (live) {
        live_promoted_pages_.fetch_add(1, std::memory_order_relaxed);
        promoted_bytes_.fetch_add(got[i]->data.size(), std::memory_order_relaxed);
      }
      continue;
    }
    const absl::Status e = got[i].status();
    failures_.fetch_add(1, std::memory_order_relaxed);
    // The page was acknowledged: missing or of another generation is lost data too.
    const bool lost = absl::IsDataLoss(e) || absl::IsNotFound(e) || absl::IsFailedPrecondition(e);
    if (lost) data_loss_.fetch_add(1, std::memory_order_relaxed);
    got[i] = absl::Status(lost ? absl::StatusCode::kDataLoss : e.code(),
                          absl::StrFormat("session %s layer %d page %d in the cold tier: %s",
                                          session, layer, pages[i], e.message()));
  }
  return got;
}

absl::Status ColdStore::RemovePages(std::string_view session, int32_t layer,
                                    std::span<const int64_t> pages, uint64_t page_bytes,
                                    absl::Time deadline) {
  if (pages.empty()) return absl::OkStatus();
  Unreserve(pages.size() * (page_bytes + kColdHeaderBytes));
  absl::Status st = tier_->Delete(options_.tenant, session, layer, pages, deadline);
  if (!st.ok()) {
    failures_.fetch_add(1, std::memory_order_relaxed);
    spdlog::warn("tenant '{}': removing {} demoted pages of session {} layer {} from the cold "
                 "tier: {} (their keys stay until removed by hand)",
                 options_.tenant, pages.size(), std::string(session), layer, st.ToString());
  }
  return st;
}

ColdStoreStats ColdStore::stats() const {
  ColdStoreStats s;
  s.used_bytes = used_.load(std::memory_order_relaxed);
  s.sessions = sessions_.load(std::memory_order_relaxed);
  s.demoted_sessions = demoted_sessions_.load(std::memory_order_relaxed);
  s.promoted_sessions = promoted_sessions_.load(std::memory_order_relaxed);
  s.demoted_pages = demoted_pages_.load(std::memory_order_relaxed);
  s.promoted_pages = promoted_pages_.load(std::memory_order_relaxed);
  s.demoted_bytes = demoted_bytes_.load(std::memory_order_relaxed);
  s.promoted_bytes = promoted_bytes_.load(std::memory_order_relaxed);
  s.failures = failures_.load(std::memory_order_relaxed);
  s.data_loss = data_loss_.load(std::memory_order_relaxed);
  s.live_demoted_pages = live_demoted_pages_.load(std::memory_order_relaxed);
  s.live_promoted_pages = live_promoted_pages_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace kvtier::daemon
