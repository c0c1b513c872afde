#include "daemon/redis_cluster.h"

#include <hiredis/hiredis.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace kvtier::daemon {

// Invariant: `ctx` is either null or a connection with no replies outstanding (an exchange
// that fails half-way frees it), so the next exchange starts in step.
struct RedisCluster::Node {
  Node(std::string h, int p) : host(std::move(h)), port(p), address(absl::StrCat(host, ":", p)) {}
  ~Node() {
    if (ctx != nullptr) redisFree(ctx);
  }
  const std::string host;
  const int port;
  const std::string address;
  std::atomic<bool> healthy{true};  // the last exchange reached the server
  absl::Mutex mu;
  redisContext* ctx ABSL_GUARDED_BY(mu) = nullptr;
  bool readonly ABSL_GUARDED_BY(mu) = false;  // READONLY sent on ctx
};

struct RedisCluster::Op {
  const std::vector<std::string>* argv = nullptr;
  uint16_t slot = 0;
  Node* ask = nullptr;  // send ASKING + the command here, once
  int redirects = 0;
  bool done = false;
  absl::StatusOr<RedisReply> result = absl::UnknownError("not run");
  absl::Status last;       // why the last attempt failed (a retryable failure)
  bool dead_node = false;  // ... and it was a refused or dropped connection, not slowness
};

namespace {

constexpr absl::Duration kFirstBackOff = absl::Milliseconds(2);
constexpr absl::Duration kMaxBackOff = absl::Milliseconds(100);

constexpr std::array<uint16_t, 256> MakeCrc16Table() {
  std::array<uint16_t, 256> t{};
  for (int i = 0; i < 256; ++i) {
    uint16_t crc = static_cast<uint16_t>(i << 8);
    for (int b = 0; b < 8; ++b) {
      crc = static_cast<uint16_t>((crc & 0x8000) ? (crc << 1) ^ 0x1021 : crc << 1);
    }
    t[static_cast<size_t>(i)] = crc;
  }
  return t;
}
constexpr std::array<uint16_t, 256> kCrc16 = MakeCrc16Table();

// A request in one exchange: the command, after ASKING when `asking`.
struct Request {
  const std::vector<std::string>* argv;
  bool asking;
};
// A reply, or an error reply's message.
struct Answer {
  bool error = false;
  std::string message;
  RedisReply reply;
};
// answers.size() < requests unless link is OK; timed_out: the link failed by a timeout.
struct Exchanged {
  std::vector<Answer> answers;
  absl::Status link;
  bool timed_out = false;
};

// A socket timeout: what is left of the budget, at most `cap`, at least 1 ms (0 would mean
// "block forever" to the kernel).
timeval Timeout(absl::Duration budget, absl::Duration cap) {
  return absl::ToTimeval(std::max(std::min(budget, cap), absl::Milliseconds(1)));
}

RedisReply Convert(const redisReply* r) {
  RedisReply out;
  switch (r->type) {
    case REDIS_REPLY_STRING:
      out.type = RedisReply::Type::kString;
      out.str.assign(r->str, r->len);
      break;
    case REDIS_REPLY_STATUS:
      out.type = RedisReply::Type::kStatus;
      out.str.assign(r->str, r->len);
      break;
    case REDIS_REPLY_INTEGER:
      out.type = RedisReply::Type::kInteger;
      out.integer = r->integer;
      break;
    case REDIS_REPLY_ARRAY:
      out.type = RedisReply::Type::kArray;
      out.elements.reserve(r->elements);
      for (size_t i = 0; i < r->elements; ++i) out.elements.push_back(Convert(r->element[i]));
      break;
    default:
      out.type = RedisReply::Type::kNil;
      break;
  }
  return out;
}

bool IsTimeout(int err, const char* errstr) {
  return err == EAGAIN || err == EWOULDBLOCK || err == ETIMEDOUT || err == EINPROGRESS ||
         absl::StrContains(errstr, "timed out") ||
         absl::StrContains(errstr, "temporarily unavailable");
}

// The final Status of an error reply that is not a redirection or a retryable state.
absl::Status ErrorReplyStatus(const std::string& message) {
  for (absl::string_view p : {"ERR unknown command", "ERR wrong number of arguments",
                              "ERR syntax error", "ERR unknown subcommand"}) {
    if (absl::StartsWith(message, p)) return absl::InvalidArgumentError(message);
  }
  return absl::FailedPreconditionError(message);
}

bool IsRetryableReply(const std::string& message) {
  for (absl::string_view p : {"TRYAGAIN", "CLUSTERDOWN", "LOADING", "MASTERDOWN"}) {
    if (absl::StartsWith(message, p)) return true;
  }
  return false;
}

absl::StatusOr<std::pair<std::string, int>> ParseAddress(absl::string_view address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == absl::string_view::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("'", address, "' is not host:port"));
  }
  return std::make_pair(std::string(address.substr(0, colon)), port);
}

void Append(redisContext* ctx, const std::vector<std::string>& argv) {
  std::vector<const char*> ptrs;
  std::vector<size_t> lens;
  ptrs.reserve(argv.size());
  lens.reserve(argv.size());
  for (const std::string& a : argv) {
    ptrs.push_back(a.data());
    lens.push_back(a.size());
  }
  redisAppendCommandArgv(ctx, static_cast<int>(argv.size()), ptrs.data(), lens.data());
}

// One pipelined round trip on `node`'s connection (connecting first when needed): the
// prologue (AUTH on a new connection, READONLY when `readonly`), then every request.
class Exchange {
 public:
  // REQUIRES: node.mu held for the Exchange's lifetime.
  Exchange(RedisCluster::Node& node, const RedisClusterOptions& options, absl::Time deadline)
      : node_(node), options_(options), deadline_(deadline) {}

  Exchanged Run(std::span<const Request> requests, bool readonly) {
    node_.mu.AssertHeld();
    Exchanged out = RunInner(requests, readonly);
    // A deadline that passed before sending says nothing about the node.
    if (out.link.ok() || node_.ctx == nullptr) {
      node_.healthy.store(out.link.ok(), std::memory_order_relaxed);
    }
    return out;
  }

 private:
  Exchanged RunInner(std::span<const Request> requests, bool readonly)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(node_.mu) {
    Exchanged out;
    if (absl::Now() >= deadline_) {  // the connection stays: nothing was sent on it
      out.link = absl::DeadlineExceededError(
          absl::StrCat(node_.address, ": the deadline passed before sending"));
      out.timed_out = true;
      return out;
    }
    bool fresh = false;
    if (node_.ctx == nullptr) {
      if (!ConnectNode(out)) return out;
      fresh = true;
    }
    std::vector<std::vector<std::string>> prologue;
    if (fresh && !options_.password.empty()) {
      prologue.push_back(options_.user.empty()
                             ? std::vector<std::string>{"AUTH", options_.password}
                             : std::vector<std::string>{"AUTH", options_.user, options_.password});
    }
    if (readonly && !node_.readonly) prologue.push_back({"READONLY"});
    for (const auto& p : prologue) Append(node_.ctx, p);
    static const std::vector<std::string> kAsking = {"ASKING"};
    for (const Request& r : requests) {
      if (r.asking) Append(node_.ctx, kAsking);
      Append(node_.ctx, *r.argv);
    }
    if (!Flush(out)) return out;
    for (const auto& p : prologue) {
      Answer a;
      if (!Read(out, a)) return out;
      if (a.error) {
        FreeContext();
        out.link = absl::PermissionDeniedError(
            absl::StrCat(node_.address, ": ", p[0], " failed: ", a.message));
        return out;
      }
    }
    if (readonly) node_.readonly = true;
    for (const Request& r : requests) {
      Answer asking;
      if (r.asking && !Read(out, asking)) return out;
      Answer a;
      if (!Read(out, a)) return out;
      if (asking.error) a = std::move(asking);
      out.answers.push_back(std::move(a));
    }
    return out;
  }

  bool ConnectNode(Exchanged& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(node_.mu) {
    const timeval tv = Timeout(deadline_ - absl::Now(), options_.connect_timeout);
    redisContext* ctx = redisConnectWithTimeout(node_.host.c_str(), node_.port, tv);
    const int err = errno;
    if (ctx == nullptr || ctx->err != 0) {
      const std::string why = ctx == nullptr ? "out of memory" : ctx->errstr;
      const bool timeout = ctx != nullptr && IsTimeout(err, ctx->errstr);
      if (ctx != nullptr) redisFree(ctx);
      Fail(out, absl::StrCat("connect: ", why), timeout);
      return false;
    }
    node_.ctx = ctx;
    node_.readonly = false;
    return true;
  }

  // Sets the socket timeout to what is left of the deadline (capped); false when nothing is.
  bool ArmTimeout() ABSL_EXCLUSIVE_LOCKS_REQUIRED(node_.mu) {
    const absl::Duration left = deadline_ - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    redisSetTimeout(node_.ctx, Timeout(left, options_.command_timeout));
    return true;
  }

  bool Flush(Exchanged& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(node_.mu) {
    int done = 0;
    while (done == 0) {
      if (!ArmTimeout()) return Fail(out, "the deadline passed while sending", true);
      if (redisBufferWrite(node_.ctx, &done) != REDIS_OK) return FailIo(out, "send");
    }
    return true;
  }

  bool Read(Exchanged& out, Answer& answer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(node_.mu) {
    void* raw = nullptr;
    for (;;) {
      if (redisGetReplyFromReader(node_.ctx, &raw) != REDIS_OK) return FailIo(out, "parse");
      if (raw != nullptr) break;
      if (!ArmTimeout()) return Fail(out, "the deadline passed waiting for a reply", true);
      if (redisBufferRead(node_.ctx) != REDIS_OK) return FailIo(out, "receive");
    }
    const auto* reply = static_cast<const redisReply*>(raw);
    if (reply->type == REDIS_REPLY_ERROR) {
      answer.error = true;
      answer.message.assign(reply->str, reply->len);
    } else {
      answer.reply = Convert(reply);
    }
    freeReplyObject(raw);
    return true;
  }

  bool FailIo(Exchanged& out, absl::string_view what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(node_.mu) {
    const int err = errno;
    const bool timeout = node_.ctx->err == REDIS_ERR_IO && IsTimeout(err, node_.ctx->errstr);
    return Fail(out, absl::StrCat(what, ": ", node_.ctx->errstr), timeout);
  }

  bool Fail(Exchanged& out, absl::string_view why, bool timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(node_.mu) {
    FreeContext();
    out.timed_out = timeout;
    out.link = timeout ? absl::DeadlineExceededError(absl::StrCat(node_.address, ": ", why))
                       : absl::UnavailableError(absl::StrCat(node_.address, ": ", why));
    return false;
  }

  void FreeContext() ABSL_EXCLUSIVE_LOCKS_REQUIRED(node_.mu) {
    if (node_.ctx != nullptr) redisFree(node_.ctx);
    node_.ctx = nullptr;
    node_.readonly = false;
  }

  RedisCluster::Node& node_;
  const RedisClusterOptions& options_;
  const absl::Time deadline_;
};

Exchanged ExchangeWith(RedisCluster::Node& node, const RedisClusterOptions& options,
                       std::span<const Request> requests, bool readonly, absl::Time deadline) {
  absl::MutexLock lock(&node.mu);
  return Exchange(node, options, deadline).Run(requests, readonly);
}

}  // namespace

uint16_t RedisCluster::SlotOf(std::string_view key) {
  if (const size_t open = key.find('{'); open != std::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) {
      key = key.substr(open + 1, close - open - 1);
    }
  }
  uint16_t crc = 0;
  for (const char c : key) {
    crc = static_cast<uint16_t>((crc << 8) ^ kCrc16[((crc >> 8) ^ static_cast<uint8_t>(c)) & 0xff]);
  }
  return crc & 16383;
}

RedisCluster::RedisCluster(RedisClusterOptions options) : options_(std::move(options)) {}
RedisCluster::~RedisCluster() = default;

absl::StatusOr<std::unique_ptr<RedisCluster>> RedisCluster::Connect(RedisClusterOptions options) {
  if (options.seeds.empty()) return absl::InvalidArgumentError("Redis Cluster: no seeds");
  std::vector<std::pair<std::string, int>> seeds;
  for (const std::string& seed : options.seeds) {
    auto parsed = ParseAddress(seed);
    if (!parsed.ok())
      return absl::InvalidArgumentError(absl::StrCat("Redis seed ", parsed.status().message()));
    seeds.push_back(*std::move(parsed));
  }
  std::unique_ptr<RedisCluster> cluster(new RedisCluster(std::move(options)));
  std::vector<std::string> failures;
  for (const auto& [host, port] : seeds) {
    const absl::Time deadline =
        absl::Now() + cluster->options_.connect_timeout + cluster->options_.command_timeout;
    const absl::Status s = cluster->LoadSlotMapFrom(cluster->NodeFor(host, port), deadline);
    if (s.ok()) return cluster;
    failures.push_back(absl::StrCat(host, ":", port, " (", s.message(), ")"));
  }
  return absl::UnavailableError(absl::StrCat("no Redis Cluster seed answered CLUSTER SLOTS: ",
                                             absl::StrJoin(failures, "; ")));
}

RedisCluster::Node* RedisCluster::NodeFor(const std::string& host, int port) {
  absl::MutexLock lock(&map_mu_);
  return NodeForLocked(host, port);
}

RedisCluster::Node* RedisCluster::NodeForLocked(const std::string& host, int port) {
  const std::string address = absl::StrCat(host, ":", port);
  if (auto it = nodes_by_address_.find(address); it != nodes_by_address_.end()) return it->second;
  nodes_.push_back(std::make_unique<Node>(host, port));
  nodes_by_address_[address] = nodes_.back().get();
  return nodes_.back().get();
}

absl::Status RedisCluster::LoadSlotMapFrom(Node* node, absl::Time deadline) {
  static const std::vector<std::string> kSlots = {"CLUSTER", "SLOTS"};
  const Request request{&kSlots, false};
  Exchanged ex = ExchangeWith(*node, options_, {&request, 1}, false, deadline);
  if (!ex.link.ok()) return ex.link;
  const Answer& a = ex.answers[0];
  if (a.error) return absl::UnavailableError(absl::StrCat(node->address, ": ", a.message));
  if (a.reply.type != RedisReply::Type::kArray || a.reply.elements.empty()) {
    return absl::UnavailableError(absl::StrCat(node->address, ": CLUSTER SLOTS is empty"));
  }
  // Each entry: [first, last, [host, port, id...] (master), [host, port, ...] (replicas)...].
  auto endpoint = [&](const RedisReply& e) -> std::pair<std::string, int> {
    if (e.type != RedisReply::Type::kArray || e.elements.size() < 2) return {"", 0};
    std::string host = e.elements[0].str;
    if (host.empty() || host == "?") host = node->host;
    return {host, static_cast<int>(e.elements[1].integer)};
  };
  absl::MutexLock lock(&map_mu_);
  std::vector<SlotRange> ranges;
  for (const RedisReply& entry : a.reply.elements) {
    if (entry.type != RedisReply::Type::kArray || entry.elements.size() < 3) continue;
    SlotRange r;
    r.first = static_cast<uint16_t>(std::clamp<int64_t>(entry.elements[0].integer, 0, 16383));
    r.last = static_cast<uint16_t>(std::clamp<int64_t>(entry.elements[1].integer, 0, 16383));
    const auto [host, port] = endpoint(entry.elements[2]);
    if (port <= 0) continue;
    r.master = NodeForLocked(host, port);
    for (size_t i = 3; i < entry.elements.size(); ++i) {
      const auto [rhost, rport] = endpoint(entry.elements[i]);
      if (rport > 0) r.replicas.push_back(NodeForLocked(rhost, rport));
    }
    ranges.push_back(std::move(r));
  }
  if (ranges.empty()) {
    return absl::UnavailableError(absl::StrCat(node->address, ": CLUSTER SLOTS has no ranges"));
  }
  slot_master_.fill(nullptr);
  for (const SlotRange& r : ranges) {
    for (int s = r.first; s <= r.last; ++s) slot_master_[static_cast<size_t>(s)] = r.master;
  }
  ranges_ = std::move(ranges);
  refresh_wanted_ = false;
  loaded_at_ = absl::Now();
  refreshes_.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::Status RedisCluster::RefreshSlotMap(absl::Time deadline) {
  std::vector<Node*> candidates;
  {
    absl::MutexLock lock(&map_mu_);
    const size_t n = nodes_.size();
    for (size_t i = 0; i < n; ++i) candidates.push_back(nodes_[(refresh_cursor_ + i) % n].get());
    refresh_cursor_ = (refresh_cursor_ + 1) % std::max<size_t>(n, 1);
  }
  // Nodes that answered last time first: a hung node would eat the caller's deadline.
  std::stable_partition(candidates.begin(), candidates.end(),
                        [](Node* n) { return n->healthy.load(std::memory_order_relaxed); });
  absl::Status last = absl::UnavailableError("no known Redis node");
  for (Node* node : candidates) {
    if (absl::Now() >= deadline) break;
    last = LoadSlotMapFrom(node, std::min(deadline, absl::Now() + options_.command_timeout));
    if (last.ok()) return last;
  }
  return last;
}

void RedisCluster::SetFaultForTesting(Fault fault) {
  absl::MutexLock lock(&fault_mu_);
  fault_ = fault == nullptr ? nullptr : std::make_shared<const Fault>(std::move(fault));
}

std::vector<absl::StatusOr<RedisReply>> RedisCluster::Pipeline(
    std::span<const std::vector<std::string>> commands, absl::Time deadline,
    std::span<const std::string> route_keys) {
  std::vector<Op> ops(commands.size());
  const bool routed = !route_keys.empty();
  std::shared_ptr<const Fault> fault;
  {
    absl::MutexLock lock(&fault_mu_);
    fault = fault_;
  }
  for (size_t i = 0; i < commands.size(); ++i) {
    ops[i].argv = &commands[i];
    if (fault != nullptr) {
      if (std::optional<absl::Status> st = (*fault)(commands[i]); st.has_value()) {
        ops[i].done = true;
        ops[i].result = *st;
        continue;
      }
    }
    if (routed && route_keys.size() != commands.size()) {
      ops[i].done = true;
      ops[i].result = absl::InvalidArgumentError("route_keys must name one key per command");
      continue;
    }
    if (!routed && commands[i].size() < 2) {
      ops[i].done = true;
      ops[i].result = absl::InvalidArgumentError("a Redis Cluster command needs a key (args[1])");
      continue;
    }
    ops[i].slot = SlotOf(routed ? std::string_view(route_keys[i]) : commands[i][1]);
  }
  absl::Duration back_off = kFirstBackOff;
  for (;;) {
    bool refresh = false;
    {
      absl::MutexLock lock(&map_mu_);
      refresh = refresh_wanted_;
      const absl::Time now = absl::Now();
      if (options_.slot_map_refresh > absl::ZeroDuration() &&
          now - loaded_at_ >= options_.slot_map_refresh) {
        refresh = true;
        loaded_at_ = now;  // the other commands meanwhile keep the map they have
      }
    }
    if (refresh) RefreshSlotMap(deadline).IgnoreError();  // the old map still routes
    const bool wait = RunRound(ops, deadline);
    if (std::all_of(ops.begin(), ops.end(), [](const Op& op) { return op.done; })) break;
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    if (wait) {
      absl::SleepFor(std::min(back_off, left));
      back_off = std::min(back_off * 2, kMaxBackOff);
      absl::MutexLock lock(&map_mu_);
      refresh_wanted_ = true;
    }
  }
  std::vector<absl::StatusOr<RedisReply>> results;
  results.reserve(ops.size());
  for (Op& op : ops) {
    if (!op.done) {
      const std::string last = op.last.ok() ? "" : absl::StrCat("; last: ", op.last.message());
      op.result = op.dead_node ? absl::UnavailableError(absl::StrCat(
                                     "Redis node unreachable until the deadline", last))
                               : absl::DeadlineExceededError(absl::StrCat(
                                     "Redis command not answered before the deadline", last));
    }
    results.push_back(std::move(op.result));
  }
  return results;
}

bool RedisCluster::RunRound(std::vector<Op>& ops, absl::Time deadline) {
  // Group the pending ops by target node, in input order within a node.
  std::vector<Node*> targets;
  std::vector<std::vector<Op*>> groups;
  {
    absl::MutexLock lock(&map_mu_);
    for (Op& op : ops) {
      if (op.done) continue;
      Node* target = op.ask != nullptr ? op.ask : slot_master_[op.slot];
      if (target == nullptr) target = nodes_.front().get();  // unknown slot: it will redirect
      auto it = std::find(targets.begin(), targets.end(), target);
      if (it == targets.end()) {
        targets.push_back(target);
        groups.emplace_back();
        it = targets.end() - 1;
      }
      groups[static_cast<size_t>(it - targets.begin())].push_back(&op);
    }
  }
  std::vector<Exchanged> exchanged(targets.size());
  auto run_group = [&](size_t g) {
    std::vector<Request> requests;
    requests.reserve(groups[g].size());
    for (const Op* op : groups[g]) requests.push_back({op->argv, op->ask != nullptr});
    exchanged[g] = ExchangeWith(*targets[g], options_, requests, false, deadline);
  };
  if (targets.size() == 1) {
    run_group(0);
  } else {
    std::vector<std::thread> threads;
    for (size_t g = 0; g < targets.size(); ++g) threads.emplace_back(run_group, g);
    for (std::thread& t : threads) t.join();
  }
  bool back_off = false;
  for (size_t g = 0; g < targets.size(); ++g) {
    const Exchanged& ex = exchanged[g];
    for (size_t i = 0; i < groups[g].size(); ++i) {
      Op& op = *groups[g][i];
      op.ask = nullptr;
      if (i < ex.answers.size()) {
        const Answer& a = ex.answers[i];
        if (!a.error) {
          op.done = true;
          op.result = a.reply;
        } else {
          HandleError(op, a.message, back_off);
        }
      } else if (absl::IsUnavailable(ex.link) || absl::IsDeadlineExceeded(ex.link)) {
        op.last = ex.link;
        op.dead_node = !ex.timed_out;
        back_off = true;
      } else {
        op.done = true;
        op.result = ex.link;
      }
    }
  }
  return back_off;
}

void RedisCluster::HandleError(Op& op, const std::string& message, bool& back_off) {
  const bool moved = absl::StartsWith(message, "MOVED ");
  if (moved || absl::StartsWith(message, "ASK ")) {
    redirects_.fetch_add(1, std::memory_order_relaxed);
    const std::vector<absl::string_view> parts = absl::StrSplit(message, ' ');
    auto address = parts.size() == 3 ? ParseAddress(parts[2]) : absl::InvalidArgumentError("");
    if (++op.redirects > options_.max_redirects || !address.ok()) {
      op.done = true;
      op.result = absl::UnavailableError(
          absl::StrCat("Redis redirection not followed after ", op.redirects - 1, ": ", message));
      return;
    }
    absl::MutexLock lock(&map_mu_);
    Node* node = NodeForLocked(address->first, address->second);
    if (moved) {
      slot_master_[op.slot] = node;
      refresh_wanted_ = true;
    } else {
      op.ask = node;
    }
    return;
  }
  if (IsRetryableReply(message)) {
    op.last = absl::UnavailableError(message);
    op.dead_node = false;
    back_off = true;
    return;
  }
  op.done = true;
  op.result = ErrorReplyStatus(message);
}

absl::StatusOr<RedisReply> RedisCluster::Run(const std::vector<std::string>& command,
                                             absl::Time deadline) {
  return std::move(Pipeline({&command, 1}, deadline)[0]);
}

std::vector<RedisCluster::Node*> RedisCluster::ReplicasOf(uint16_t slot) {
  absl::MutexLock lock(&map_mu_);
  for (const SlotRange& r : ranges_) {
    if (r.first <= slot && slot <= r.last) return r.replicas;
  }
  return {};
}

absl::StatusOr<RedisReply> RedisCluster::RunOnReplica(const std::vector<std::string>& command,
                                                      absl::Time deadline) {
  if (command.size() < 2) {
    return absl::InvalidArgumentError("a Redis Cluster command needs a key (args[1])");
  }
  const uint16_t slot = SlotOf(command[1]);
  const Request request{&command, false};
  for (int attempt = 0;; ++attempt) {
    const std::vector<Node*> replicas = ReplicasOf(slot);
    absl::Status last = absl::NotFoundError(absl::StrCat("Redis slot ", slot, " has no replica"));
    for (Node* node : replicas) {
      Exchanged ex = ExchangeWith(*node, options_, {&request, 1}, true, deadline);
      if (!ex.link.ok()) {
        last = ex.link;
        continue;
      }
      if (!ex.answers[0].error) return std::move(ex.answers[0].reply);
      const absl::Status error = ErrorReplyStatus(ex.answers[0].message);
      last = absl::Status(error.code(), absl::StrCat(node->address, ": ", error.message()));
    }
    // No replica known, or none answered: the map may be older than the slot's replicas.
    if (attempt > 0 || absl::Now() >= deadline || !RefreshSlotMap(deadline).ok()) return last;
  }
}

size_t RedisCluster::node_count() const {
  absl::MutexLock lock(&map_mu_);
  std::vector<const Node*> seen;
  for (const SlotRange& r : ranges_) {
    seen.push_back(r.master);
    seen.insert(seen.end(), r.replicas.begin(), r.replicas.end());
  }
  std::sort(seen.begin(), seen.end());
  return static_cast<size_t>(std::unique(seen.begin(), seen.end()) - seen.begin());
}

}  // namespace kvtier::daemon
