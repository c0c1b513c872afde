// The kvtierd fuzz target. Invariants of the harness: `sessions_` is what the daemon's OK
// replies say exists (each GRPC session with the K/V bytes its clients committed, per layer);
// every check compares the daemon against it through the public API only.
#include "tests/daemon/fuzz/kvtierd_fuzz.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/config.h"
#include "daemon/daemon.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/reflection.h"
#include "grpcpp/create_channel.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "spdlog/spdlog.h"
#include "tests/client/raw_attach.h"
#include "tests/client/raw_grpc.h"

namespace kvtier::fuzz {
namespace {

namespace pb = google::protobuf;

constexpr char kTokenA[] = "ta";
constexpr char kTokenB[] = "tb";
constexpr uint32_t kMaxSessions = 16;
constexpr uint32_t kMaxTokensPerOffload = 256;
constexpr size_t kTrackedBytes = size_t{32} << 20;  // per session: bigger ones are counted only
constexpr absl::Duration kLongDeadline = absl::Seconds(60);

const char* const kMethods[kNumTargets] = {
    "Hello",    "OpenSession", "CloseSession",   "ListSessions", "Reattach",
    "Offload",  "Fetch",       "Step",           "GetStats",     "Drain",
    "SuspendSession", "DemotePages", "PromotePages", "attach", "ReportSignals"};

// ---- the caller a case speaks as ---------------------------------------------------------

struct CallerChoice {
  std::string tenant;  // "a", "b" or "zz" (unknown)
  std::string token;
  bool authentic = false;  // a known tenant with its token
  absl::Duration deadline = kLongDeadline;
};

CallerChoice DecodeCaller(uint8_t options) {
  CallerChoice c;
  const int who = options & 3;
  c.tenant = who <= 1 ? "a" : who == 2 ? "b" : "zz";
  const bool wrong = (options & 4) != 0;
  c.token = wrong ? "nope" : c.tenant == "a" ? kTokenA : kTokenB;
  c.authentic = c.tenant != "zz" && !wrong;
  if (((options >> 3) & 3) == 3) c.deadline = absl::Milliseconds(2 + ((options >> 5) & 7));
  return c;
}

std::unique_ptr<grpc::ClientContext> Context(const CallerChoice& c, absl::Duration deadline) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->AddMetadata("x-kvtier-tenant", c.tenant);
  ctx->AddMetadata("x-kvtier-token", c.token);
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  return ctx;
}

// ---- Offload payloads: u16 length-prefixed messages ---------------------------------------

std::vector<std::string> SplitFrames(const std::string& payload) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i + 2 <= payload.size()) {
    const size_t n = static_cast<uint8_t>(payload[i]) | (static_cast<uint8_t>(payload[i + 1]) << 8);
    i += 2;
    if (i + n > payload.size()) break;
    out.push_back(payload.substr(i, n));
    i += n;
  }
  return out;
}

// ---- the model of a session ----------------------------------------------------------------

struct Layout {
  int32_t layers = 0, kv_heads = 0, head_dim = 0, page = 0, elem = 0;
  uint64_t max_tokens = 0;
  size_t token_bytes() const { return static_cast<size_t>(kv_heads) * head_dim * elem; }
};

struct SessionModel {
  std::string tenant;
  bool grpc = false;
  Layout layout;
  bool track_bytes = false;
  std::vector<uint64_t> tokens;   // per layer
  std::vector<std::string> k, v;  // per layer, NHD rows (when tracked)
};

int ElementBytes(v1::DType t) { return t == v1::DTYPE_FP32 ? 4 : 2; }

// The HND host page `page` [Hkv][2][p][d] of a model layer.
std::string HndPage(const SessionModel& m, int32_t layer, int64_t page) {
  const Layout& l = m.layout;
  const size_t row = static_cast<size_t>(l.head_dim) * l.elem;
  std::string out;
  out.reserve(static_cast<size_t>(l.kv_heads) * 2 * l.page * row);
  for (int32_t h = 0; h < l.kv_heads; ++h) {
    for (const std::string* src : {&m.k[layer], &m.v[layer]}) {
      for (int32_t t = 0; t < l.page; ++t) {
        const size_t token = static_cast<size_t>(page) * l.page + t;
        out.append(*src, token * l.token_bytes() + h * row, row);
      }
    }
  }
  return out;
}

// ---- the harness -------------------------------------------------------------------------

// One acceptable outcome of an Offload stream: the tokens per layer after the first `applied`
// messages (a commit boundary).
struct Boundary {
  size_t applied = 0;
  std::vector<uint64_t> tokens;
};

// The commit boundaries of `msgs` sent to session `m` when it held `start`: the daemon stops
// at one of them. Messages count up to the first one the daemon must refuse (`all_valid`
// says whether there was none and every frame parsed); the stream's clean end is a boundary
// only when the call answered OK.
std::vector<Boundary> Boundaries(const SessionModel& m, const std::vector<uint64_t>& start,
                                 const std::vector<v1::OffloadRequest>& msgs, bool ok,
                                 bool all_parsed, bool* all_valid) {
  std::vector<Boundary> out = {{0, start}};
  std::vector<uint64_t> cur = start, staged(m.layout.layers, 0);
  *all_valid = all_parsed;
  for (size_t i = 0; i < msgs.size(); ++i) {
    const v1::OffloadRequest& q = msgs[i];
    const uint64_t bytes = uint64_t{q.num_tokens()} * m.layout.token_bytes();
    const bool valid =
        q.session_id() == msgs[0].session_id() &&
        q.layer() < static_cast<uint32_t>(m.layout.layers) && q.num_tokens() >= 1 &&
        q.num_tokens() <= kMaxTokensPerOffload && q.k().size() == bytes && q.v().size() == bytes &&
        (!q.has_start_token() || q.start_token() == cur[q.layer()] + staged[q.layer()]) &&
        cur[q.layer()] + staged[q.layer()] + q.num_tokens() <= m.layout.max_tokens;
    if (!valid) {
      *all_valid = false;
      break;
    }
    staged[q.layer()] += q.num_tokens();
    if (q.commit() || (i + 1 == msgs.size() && ok)) {
      for (int32_t l = 0; l < m.layout.layers; ++l) cur[l] += staged[l];
      std::fill(staged.begin(), staged.end(), 0);
      out.push_back({i + 1, cur});
    }
  }
  return out;
}

class Harness {
 public:
  Harness() {
    spdlog::set_level(spdlog::level::off);  // the daemon's own lines: not the fuzzer's output
    char dir[] = "/tmp/kvtierd-fuzz-XXXXXX";
    if (mkdtemp(dir) == nullptr) abort();
    dir_ = dir;
    daemon::DaemonConfig c;
    c.unix_socket = dir_ + "/kvtierd.sock";
    c.attach_socket = dir_ + "/kvtierd.attach";
    c.admin_token = absl::StrCat("admin-", absl::ToUnixNanos(absl::Now()), "-never-in-an-input");
    c.cpu_threads = 1;
    c.work_threads = 2;
    c.max_message_bytes = 1 << 20;
    c.max_sessions_per_tenant = kMaxSessions;
    c.max_tokens_per_session = 4096;
    c.default_max_tokens = 256;
    c.max_layers = 16;
    c.max_tokens_per_offload = kMaxTokensPerOffload;
    c.shutdown_grace = absl::Seconds(5);
    for (const auto& [name, token] :
         {std::pair<const char*, const char*>{"a", kTokenA}, {"b", kTokenB}}) {
      daemon::TenantConfig t;
      t.name = name;
      t.token = token;
      t.host_memory_bytes = uint64_t{48} << 20;
      t.hugepages = "off";
      t.lock = false;
      c.tenants.push_back(t);
    }
    absl::StatusOr<std::unique_ptr<daemon::Daemon>> d = daemon::Daemon::Start(c);
    if (!d.ok()) {
      fprintf(stderr, "kvtierd_fuzz: the daemon did not start: %s\n",
              d.status().ToString().c_str());
      abort();
    }
    daemon_ = *std::move(d);
    channel_ = testing::UnlimitedChannel("unix:" + daemon_->unix_socket());
    stub_ = v1::KvTier::NewStub(channel_);
  }
  void Stop() {
    if (daemon_ != nullptr) daemon_->Shutdown();
    rmdir(dir_.c_str());
  }

  bool Run(const uint8_t* data, size_t size, std::string* why);
  const FuzzCounts& counts() const { return counts_; }

 private:
  // Placeholders → ids of the caller's live sessions.
  std::string Resolve(std::string bytes, const std::string& tenant) const;
  void Tally(const grpc::Status& st) { (st.ok() ? counts_.ok_replies : counts_.error_replies)++; }

  bool RunUnary(uint8_t target, const CallerChoice& caller, const std::string& payload,
                std::string* why);
  bool RunOffload(const CallerChoice& caller, const std::string& payload, std::string* why);
  bool RunAttach(const std::string& payload, std::string* why);

  void Add(const v1::SessionInfo& info);
  // The daemon's sessions of both tenants against the model (ids, committed tokens).
  bool CheckSessions(std::string* why);
  // Every committed page of a tracked session against the model's bytes.
  bool CheckPages(const std::string& id, std::string* why);
  // Closes a tenant's sessions when it nears the limit, so cases keep opening new ones.
  bool MakeRoom(std::string* why);

  std::string dir_;
  std::unique_ptr<daemon::Daemon> daemon_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvTier::Stub> stub_;
  // An Offload stream its client gave up on: a commit it started may still complete after
  // the client saw the error (docs/service.md, "Deadlines"), so its later commit boundaries
  // stay possible until a check settles them.
  struct LateStream {
    std::vector<v1::OffloadRequest> msgs;
    size_t seen = 0;           // messages applied when last seen
    std::vector<size_t> more;  // later commit boundaries (message counts), ascending
  };
  // One way the pending late streams of a session may have completed: per stream, the
  // messages applied; and the session's tokens then.
  struct Settlement {
    std::vector<size_t> upto;
    std::vector<uint64_t> tokens;
  };
  static constexpr size_t kMaxLateStreams = 4;  // per session, the latest
  std::vector<Settlement> Settlements(const std::string& id) const;
  void Settle(const std::string& id, const Settlement& s);
  void AdoptLateCommit(const std::string& id, const std::vector<uint64_t>& committed);
  static void Apply(SessionModel& m, const std::vector<v1::OffloadRequest>& msgs, size_t from,
                    size_t to);
  void Forget(const std::string& id);

  std::map<std::string, SessionModel> sessions_;
  std::map<std::string, std::vector<std::string>> order_;  // tenant → ids, oldest first
  std::set<std::string> late_closes_;
  std::map<std::string, std::vector<LateStream>> late_commits_;  // per session, oldest first
  FuzzCounts counts_;
};

void Harness::Apply(SessionModel& m, const std::vector<v1::OffloadRequest>& msgs, size_t from,
                    size_t to) {
  if (!m.track_bytes) return;
  for (size_t i = from; i < to; ++i) {
    m.k[msgs[i].layer()] += msgs[i].k();
    m.v[msgs[i].layer()] += msgs[i].v();
  }
}

std::vector<Harness::Settlement> Harness::Settlements(const std::string& id) const {
  const SessionModel& m = sessions_.at(id);
  std::vector<Settlement> out = {{{}, m.tokens}};
  auto late = late_commits_.find(id);
  if (late == late_commits_.end()) return out;
  for (const LateStream& ls : late->second) {
    std::vector<Settlement> next;
    for (const Settlement& base : out) {
      Settlement none = base;
      none.upto.push_back(ls.seen);
      next.push_back(none);
      std::vector<uint64_t> tokens = base.tokens;
      size_t applied = ls.seen;
      for (size_t b : ls.more) {
        for (; applied < b; ++applied)
          tokens[ls.msgs[applied].layer()] += ls.msgs[applied].num_tokens();
        Settlement some = base;
        some.upto.push_back(b);
        some.tokens = tokens;
        next.push_back(std::move(some));
      }
    }
    out = std::move(next);
  }
  return out;
}

void Harness::Settle(const std::string& id, const Settlement& s) {
  SessionModel& m = sessions_.at(id);
  m.tokens = s.tokens;
  auto late = late_commits_.find(id);
  if (late == late_commits_.end()) return;
  std::vector<LateStream> still;
  for (size_t i = 0; i < late->second.size() && i < s.upto.size(); ++i) {
    LateStream& ls = late->second[i];
    Apply(m, ls.msgs, ls.seen, s.upto[i]);
    ls.seen = s.upto[i];
    std::erase_if(ls.more, [&](size_t b) { return b <= ls.seen; });
    if (!ls.more.empty()) still.push_back(std::move(ls));
  }
  if (still.empty()) {
    late_commits_.erase(late);
  } else {
    late->second = std::move(still);
  }
}

void Harness::AdoptLateCommit(const std::string& id, const std::vector<uint64_t>& committed) {
  for (const Settlement& s : Settlements(id)) {
    if (s.tokens != committed) continue;
    Settle(id, s);
    return;
  }
}

void Harness::Forget(const std::string& id) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  auto& ids = order_[it->second.tenant];
  ids.erase(std::remove(ids.begin(), ids.end(), id), ids.end());
  sessions_.erase(it);
  late_closes_.erase(id);
  late_commits_.erase(id);
}

std::string Harness::Resolve(std::string bytes, const std::string& tenant) const {
  auto it = order_.find(tenant);
  for (int k = 0; k < 8; ++k) {
    const std::string ph = SessionPlaceholder(k);
    if (it == order_.end() || static_cast<size_t>(k) >= it->second.size()) continue;
    for (size_t at = bytes.find(ph); at != std::string::npos; at = bytes.find(ph, at + 1)) {
      bytes.replace(at, ph.size(), it->second[k]);
    }
  }
  return bytes;
}

void Harness::Add(const v1::SessionInfo& info) {
  if (sessions_.count(info.session_id()) != 0) return;  // a retry's answer: the same session
  SessionModel m;
  m.tenant = info.tenant();
  m.grpc = info.transport() == v1::TRANSPORT_GRPC;
  const v1::Geometry& g = info.geometry();
  m.layout = {static_cast<int32_t>(g.num_layers()),
              static_cast<int32_t>(g.num_kv_heads()),
              static_cast<int32_t>(g.head_dim()),
              static_cast<int32_t>(g.page_size()),
              ElementBytes(g.dtype()),
              info.retrieval().max_tokens()};
  m.tokens.assign(m.layout.layers, 0);
  // Only the selecting modes keep a host tier whose pages Fetch reads back; FULL and DROP
  // sessions hold their tokens in the daemon's working set alone.
  const bool host_tier =
      info.retrieval().mode() == v1::MODE_SPECULATIVE || info.retrieval().mode() == v1::MODE_SYNC;
  m.track_bytes =
      m.grpc && host_tier &&
      m.layout.max_tokens * m.layout.layers * m.layout.token_bytes() * 2 <= kTrackedBytes;
  if (m.track_bytes) {
    m.k.assign(m.layout.layers, "");
    m.v.assign(m.layout.layers, "");
  }
  sessions_.emplace(info.session_id(), std::move(m));
  order_[info.tenant()].push_back(info.session_id());
  ++counts_.sessions_opened;
}

bool Harness::CheckSessions(std::string* why) {
  for (const std::string tenant : {"a", "b"}) {
    CallerChoice c;
    c.tenant = tenant;
    c.token = tenant == "a" ? kTokenA : kTokenB;
    v1::ListSessionsReply reply;
    const grpc::Status st =
        stub_->ListSessions(Context(c, kLongDeadline).get(), v1::ListSessionsRequest(), &reply);
    if (!st.ok()) {
      *why = "ListSessions failed: " + st.error_message();
      return false;
    }
    std::set<std::string> listed;
    for (const v1::SessionInfo& s : reply.sessions()) {
      listed.insert(s.session_id());
      auto m = sessions_.find(s.session_id());
      if (m == sessions_.end() || m->second.tenant != tenant) {
        *why = absl::StrFormat("tenant %s has session %s that no OK reply opened", tenant,
                               s.session_id());
        return false;
      }
      const std::vector<uint64_t> committed(s.committed_tokens().begin(),
                                            s.committed_tokens().end());
      if (m->second.grpc && committed != m->second.tokens)
        AdoptLateCommit(s.session_id(), committed);
      if (m->second.grpc && committed != m->second.tokens) {
        *why = absl::StrFormat("session %s holds %s tokens per layer; its clients committed %s",
                               s.session_id(), absl::StrJoin(committed, ","),
                               absl::StrJoin(m->second.tokens, ","));
        return false;
      }
    }
    for (const std::string& id : std::vector<std::string>(order_[tenant])) {
      if (listed.count(id) == 0 && late_closes_.count(id) != 0) {  // a late close completed
        Forget(id);
        continue;
      }
      if (listed.count(id) == 0) {
        *why = absl::StrFormat("session %s of tenant %s was opened OK and is gone", id, tenant);
        return false;
      }
    }
  }
  return true;
}

bool Harness::CheckPages(const std::string& id, std::string* why) {
  const SessionModel& m = sessions_.at(id);
  if (!m.track_bytes) return true;
  CallerChoice c;
  c.tenant = m.tenant;
  c.token = m.tenant == "a" ? kTokenA : kTokenB;
  for (int32_t layer = 0; layer < m.layout.layers; ++layer) {
    v1::FetchRequest req;
    req.set_session_id(id);
    req.set_layer(static_cast<uint32_t>(layer));
    auto ctx = Context(c, kLongDeadline);
    auto reader = stub_->Fetch(ctx.get(), req);
    v1::FetchReply reply;
    int64_t next = 0;
    const int64_t full = static_cast<int64_t>(m.tokens[layer] / m.layout.page);
    bool same = true;
    while (reader->Read(&reply)) {
      for (const v1::Page& p : reply.pages()) {
        same = same && p.page() == next && next < full && p.data() == HndPage(m, layer, next);
        ++next;
      }
    }
    const grpc::Status st = reader->Finish();
    if (!st.ok() || !same || next != full) {
      *why = absl::StrFormat(
          "session %s layer %d: Fetch gave %d pages (%s)%s; the committed %d tokens make %d "
          "full pages",
          id, layer, next, st.ok() ? "OK" : st.error_message(),
          same ? "" : ", not the committed bytes", m.tokens[layer], full);
      return false;
    }
  }
  ++counts_.commits_checked;
  return true;
}

bool Harness::MakeRoom(std::string* why) {
  for (auto& [tenant, ids] : order_) {
    if (ids.size() + 2 < kMaxSessions) continue;
    CallerChoice c;
    c.tenant = tenant;
    c.token = tenant == "a" ? kTokenA : kTokenB;
    for (const std::string& id : ids) {
      v1::CloseSessionRequest req;
      req.set_session_id(id);
      v1::CloseSessionReply reply;
      const grpc::Status st = stub_->CloseSession(Context(c, kLongDeadline).get(), req, &reply);
      const bool closed_late =
          st.error_code() == grpc::StatusCode::NOT_FOUND && late_closes_.count(id) != 0;
      if (!st.ok() && !closed_late) {
        *why = absl::StrFormat("closing live session %s failed: %s", id, st.error_message());
        return false;
      }
    }
    for (const std::string& id : std::vector<std::string>(ids)) Forget(id);
  }
  return true;
}

bool Harness::RunUnary(uint8_t target, const CallerChoice& caller, const std::string& payload,
                       std::string* why) {
  std::optional<v1::OpenSessionRequest> open;
  if (target == kOpenSession) {
    open.emplace();
    if (!open->ParseFromString(payload)) open.reset();
  }
  // A short deadline only where a lost reply can be resolved the documented way.
  absl::Duration deadline = caller.deadline;
  if (target == kOpenSession && (!open.has_value() || open->request_id().empty())) {
    deadline = kLongDeadline;
  }
  const std::string method = absl::StrCat("/kvtier.v1.KvTier/", kMethods[target]);
  auto ctx = Context(caller, deadline);
  testing::RawCallResult r = testing::RawCall(channel_, method, {payload}, *ctx);
  Tally(r.status);
  switch (target) {
    case kOpenSession: {
      if (r.status.ok()) {
        v1::OpenSessionReply reply;
        if (r.replies.size() != 1 || !reply.ParseFromString(r.replies[0])) {
          *why = "OpenSession answered OK without a parseable reply";
          return false;
        }
        Add(reply.session());
      } else if (open.has_value() && !open->request_id().empty() &&
                 (r.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
                  r.status.error_code() == grpc::StatusCode::CANCELLED)) {
        // The reply may have been lost after the daemon committed: the retry tells (ABORTED
        // while the first call is still opening).
        testing::RawCallResult again;
        for (int attempt = 0; attempt < 1000; ++attempt) {
          auto again_ctx = Context(caller, kLongDeadline);
          again = testing::RawCall(channel_, method, {payload}, *again_ctx);
          if (again.status.error_code() != grpc::StatusCode::ABORTED) break;
          absl::SleepFor(absl::Milliseconds(1));
        }
        v1::OpenSessionReply reply;
        if (again.status.ok() && again.replies.size() == 1 &&
            reply.ParseFromString(again.replies[0])) {
          Add(reply.session());
        }
      }
      return CheckSessions(why) && MakeRoom(why);
    }
    case kCloseSession: {
      v1::CloseSessionRequest req;
      const bool late = r.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
                        r.status.error_code() == grpc::StatusCode::CANCELLED;
      if (late && caller.authentic && req.ParseFromString(payload) &&
          sessions_.count(req.session_id()) != 0) {
        // A close that completed after the client gave up: the session is gone, as
        // documented; a retry would answer NOT_FOUND.
        CallerChoice owner;
        owner.tenant = sessions_.at(req.session_id()).tenant;
        owner.token = owner.tenant == "a" ? kTokenA : kTokenB;
        v1::ListSessionsReply list;
        if (stub_
                ->ListSessions(Context(owner, kLongDeadline).get(), v1::ListSessionsRequest(),
                               &list)
                .ok() &&
            std::none_of(
                list.sessions().begin(), list.sessions().end(),
                [&](const v1::SessionInfo& s) { return s.session_id() == req.session_id(); })) {
          r.status = grpc::Status::OK;
        } else {
          late_closes_.insert(req.session_id());  // it may still complete
        }
      }
      if (r.status.ok() && req.ParseFromString(payload)) {
        auto it = sessions_.find(req.session_id());
        if (it == sessions_.end() || it->second.tenant != caller.tenant) {
          *why = "CloseSession answered OK for a session the caller does not have";
          return false;
        }
        Forget(req.session_id());
      }
      return CheckSessions(why);
    }
    default:
      if (r.status.ok() && !caller.authentic && target != kDrain) {
        *why = absl::StrFormat("%s answered OK for tenant '%s' with token '%s'", kMethods[target],
                               caller.tenant, caller.token);
        return false;
      }
      return true;
  }
}

bool Harness::RunOffload(const CallerChoice& caller, const std::string& payload, std::string* why) {
  const std::vector<std::string> frames = SplitFrames(payload);
  auto ctx = Context(caller, caller.deadline);
  testing::RawCallResult r = testing::RawCall(channel_, "/kvtier.v1.KvTier/Offload", frames, *ctx);
  Tally(r.status);
  // The session the stream is about: the first message's, if it is the caller's GRPC one.
  std::vector<v1::OffloadRequest> msgs;
  for (const std::string& f : frames) {
    v1::OffloadRequest m;
    if (!m.ParseFromString(f)) break;  // the daemon breaks the stream here
    msgs.push_back(std::move(m));
  }
  auto it = msgs.empty() ? sessions_.end() : sessions_.find(msgs[0].session_id());
  if (it == sessions_.end() || !caller.authentic || it->second.tenant != caller.tenant ||
      !it->second.grpc) {
    if (r.status.ok() && !frames.empty()) {
      *why =
          "an Offload stream answered OK though its first message names no session the "
          "caller may write";
      return false;
    }
    return CheckSessions(why);
  }
  // What the daemon holds now.
  v1::ListSessionsReply list;
  if (!stub_->ListSessions(Context(caller, kLongDeadline).get(), v1::ListSessionsRequest(), &list)
           .ok()) {
    *why = "ListSessions failed after an Offload stream";
    return false;
  }
  std::vector<uint64_t> now;
  for (const v1::SessionInfo& s : list.sessions()) {
    if (s.session_id() == it->first) {
      now.assign(s.committed_tokens().begin(), s.committed_tokens().end());
    }
  }
  // Where the stream started: the model, or later, where commits of earlier streams their
  // clients gave up on, started before and completed since, left it.
  const bool ok = r.status.ok();
  const bool gave_up = r.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
                       r.status.error_code() == grpc::StatusCode::CANCELLED;
  const SessionModel before = it->second;
  const auto late_before = late_commits_.find(it->first) == late_commits_.end()
                               ? std::vector<LateStream>()
                               : late_commits_.at(it->first);
  for (const Settlement& start : Settlements(it->first)) {
    bool all_valid = false;
    const std::vector<Boundary> boundaries =
        Boundaries(before, start.tokens, msgs, ok, msgs.size() == frames.size(), &all_valid);
    if (ok && !all_valid) continue;  // the daemon accepted what it must refuse, from here
    const Boundary* hit = nullptr;
    for (const Boundary& b : boundaries) {
      if (b.tokens == now) hit = &b;
    }
    if (hit == nullptr || (ok && hit != &boundaries.back())) continue;
    // Candidate found: the earlier late streams' messages, then this one's.
    it->second = before;
    if (late_before.empty()) {
      late_commits_.erase(it->first);
    } else {
      late_commits_[it->first] = late_before;
    }
    Settle(it->first, start);
    Apply(it->second, msgs, 0, hit->applied);
    it->second.tokens = hit->tokens;
    std::string page_why;
    if (it->second.tokens != before.tokens && !CheckPages(it->first, &page_why)) {
      *why = page_why;
      continue;  // another start may explain the same counts with the right bytes
    }
    if (gave_up) {
      LateStream pending;
      pending.msgs = msgs;
      pending.seen = hit->applied;
      for (const Boundary& b : boundaries) {
        if (b.applied > hit->applied) pending.more.push_back(b.applied);
      }
      if (!pending.more.empty()) {
        std::vector<LateStream>& pending_list = late_commits_[it->first];
        pending_list.push_back(std::move(pending));
        if (pending_list.size() > kMaxLateStreams) pending_list.erase(pending_list.begin());
      }
    }
    why->clear();
    return CheckSessions(why);
  }
  if (late_before.empty()) {
    late_commits_.erase(it->first);
  } else {
    late_commits_[it->first] = late_before;
  }
  it->second = before;
  *why = absl::StrFormat(
      "after an Offload stream (%s, %d messages) session %s holds %s tokens per layer: not a "
      "commit boundary of what the stream sent%s%s",
      ok ? "OK" : r.status.error_message(), frames.size(), it->first, absl::StrJoin(now, ","),
      why->empty() ? "" : "; ", *why);
  return false;
}

bool Harness::RunAttach(const std::string& payload, std::string* why) {
  // What the daemon must answer: a grant exactly for a valid request of a known tenant.
  bool grant = false;
  if (payload.size() >= 4) {
    uint32_t n = 0;
    for (int i = 0; i < 4; ++i) n |= uint32_t{static_cast<uint8_t>(payload[i])} << (8 * i);
    v1::AttachRequest req;
    if (n <= 4096 && payload.size() >= 4 + size_t{n} && req.ParseFromString(payload.substr(4, n))) {
      grant = req.protocol_version() == 1 && ((req.tenant() == "a" && req.token() == kTokenA) ||
                                              (req.tenant() == "b" && req.token() == kTokenB));
    }
  }
  const testing::RawAttachResult r =
      testing::RawAttachExchange(daemon_->attach_socket(), payload, absl::Seconds(10));
  if (!r.connected) {
    *why = "the attach socket refused a connection";
    return false;
  }
  const bool answered = r.reply.has_value();
  const bool granted = answered && r.reply->code() == 0;
  const int fds = r.descriptors;
  (granted ? counts_.ok_replies : counts_.error_replies)++;
  if (granted != grant || (granted ? fds != 1 : fds != 0)) {
    *why = absl::StrFormat("attach: expected %s, got code %d (%s) with %d descriptors",
                           grant ? "a grant" : "a refusal", answered ? r.reply->code() : -1,
                           answered ? r.reply->message() : "no reply", fds);
    return false;
  }
  return true;
}

bool Harness::Run(const uint8_t* data, size_t size, std::string* why) {
  if (size < 2) return true;
  ++counts_.cases;
  const uint8_t target = data[0] % kNumTargets;
  const CallerChoice caller = DecodeCaller(data[1]);
  std::string payload(reinterpret_cast<const char*>(data) + 2, size - 2);
  bool ok = true;
  if (target == kAttach) {
    ok = RunAttach(payload, why);
  } else if (target == kOffload) {
    ok = RunOffload(caller, Resolve(payload, caller.tenant), why);
  } else {
    ok = RunUnary(target, caller, Resolve(payload, caller.tenant), why);
  }
  // The daemon still serves, every so often and after every failure.
  if (!ok || counts_.cases % 16 == 0) {
    CallerChoice c;
    c.tenant = "a";
    c.token = kTokenA;
    v1::HelloRequest hello;
    hello.set_protocol_version(1);
    v1::HelloReply reply;
    const grpc::Status st = stub_->Hello(Context(c, kLongDeadline).get(), hello, &reply);
    if (!st.ok()) {
      *why +=
          absl::StrCat(ok ? "" : "; ", "the daemon no longer answers Hello: ", st.error_message());
      ok = false;
    }
  }
  if (ok && counts_.cases % 64 == 0) ok = CheckSessions(why);
  if (!ok) {
    ++counts_.invariant_failures;
    *why = absl::StrCat(TargetName(target), " case: ", *why);
  }
  return ok;
}

Harness* harness = nullptr;  // lives until exit: the daemon outlasts every case

Harness& TheHarness() {
  if (harness == nullptr) harness = new Harness();
  return *harness;
}

}  // namespace

const char* TargetName(uint8_t target) { return kMethods[target % kNumTargets]; }

std::string SessionPlaceholder(int k) {
  std::string s = absl::StrCat("@@live-session-", k % 8, "@@");
  s.resize(32, '@');
  return s;
}

bool FuzzOne(const uint8_t* data, size_t size, std::string* why) {
  return TheHarness().Run(data, size, why);
}

const FuzzCounts& Counts() { return TheHarness().counts(); }

void StopDaemon() {
  if (harness != nullptr) harness->Stop();
}

}  // namespace kvtier::fuzz
