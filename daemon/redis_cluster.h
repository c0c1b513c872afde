// A Redis Cluster client for the cold tier: routes binary-safe commands to the master that owns
// their key's hash slot, pipelines them per node, follows MOVED and ASK, rides out failovers,
// and never blocks past the caller's deadline.
//
// Why hiredis plus a router of our own: Debian 12 ships no cluster-capable C or C++ Redis
// client (hiredis is 0.14, without cluster support; there is no redis-plus-plus or
// hiredis-vip). hiredis does every byte of RESP: it formats the commands
// (redisAppendCommandArgv), does the socket I/O and parses the replies. This file only decides
// where a command goes (CLUSTER SLOTS, CRC16 hash slots, redirections) and when to give up.
//
// Routing and retries, per command (Pipeline, Run):
//   - MOVED <slot> <host:port>: the slot map entry is updated at once, the whole map is
//     refreshed (CLUSTER SLOTS) before the next round, and the command goes to the new owner.
//   - ASK <slot> <host:port>: the command is sent once as ASKING + command to the named node;
//     the slot map is not changed.
//   MOVED and ASK together are followed at most max_redirects times per command (more means a
//   misconfigured cluster): UNAVAILABLE after that.
//   - TRYAGAIN, CLUSTERDOWN, LOADING, MASTERDOWN and connection errors (refused, reset, a
//     socket timeout: a master that died or hangs, a failover in progress): back off (2 ms,
//     doubling up to 100 ms), refresh the slot map, retry, until the deadline.
//   A command still not answered when the deadline comes gets DEADLINE_EXCEEDED, or
//   UNAVAILABLE when its node refused or dropped every connection until then (dead, not slow).
//   A command retried after a lost connection may have run once already: send idempotent
//   commands (SET, GET, DEL), as the cold tier does.
//   - The slot map is also reloaded by the first command after it is
//     options.slot_map_refresh old (replicas that joined since), and by a replica read that
//     finds no replica or none that answers (see RunOnReplica).
//   - Any other error reply is the command's own result: INVALID_ARGUMENT for a malformed
//     command (unknown command, wrong arity, syntax), FAILED_PRECONDITION otherwise
//     (WRONGTYPE, "not an integer", ...), with Redis' message. Other commands in the same
//     pipeline are not affected.
//
// Deadlines: every socket operation runs with a timeout of min(command_timeout, time left to
// the deadline) (connect: connect_timeout instead of command_timeout), and the deadline is
// checked between reads, so no call returns later than the deadline plus scheduling noise.
//
// Thread-safe: any number of threads may call Pipeline, Run and RunOnReplica at once. Each
// node has one connection behind its own mutex, held for one pipeline round trip; the
// commands of one call that go to different nodes run in parallel, one thread per node. The
// slot map has its own mutex, never held together with a node's.
#ifndef KVTIER_DAEMON_REDIS_CLUSTER_H_
#define KVTIER_DAEMON_REDIS_CLUSTER_H_

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvtier::daemon {

struct RedisClusterOptions {
  std::vector<std::string> seeds;  // "host:port" of any cluster nodes; at least one
  // AUTH when `password` is set: "AUTH user password" (Redis ACL) or, with no user,
  // "AUTH password".
  std::string user, password;
  absl::Duration connect_timeout = absl::Seconds(1);  // per TCP connect
  absl::Duration command_timeout = absl::Seconds(2);  // per network round trip (socket timeout)
  int max_redirects = 5;  // MOVED/ASK followed per command (TRYAGAIN etc.: until the deadline)
  // The slot map is reloaded by the first command after it is this old, so replicas added
  // (or moved) since show up without a routing error; zero: only on errors and replica misses.
  absl::Duration slot_map_refresh = absl::Seconds(30);
};

// One reply of Redis (RESP2); error replies are Statuses instead.
struct RedisReply {
  enum class Type { kNil, kString, kInteger, kStatus, kArray };
  Type type = Type::kNil;
  std::string str;  // kString (binary-safe), kStatus ("OK")
  int64_t integer = 0;
  std::vector<RedisReply> elements;  // kArray
};

class RedisCluster {
 public:
  // Loads the slot map (CLUSTER SLOTS) from the first seed that answers, within
  // connect_timeout + command_timeout per seed. INVALID_ARGUMENT for no seeds or a seed that
  // is not host:port; UNAVAILABLE naming every seed tried and why it failed.
  static absl::StatusOr<std::unique_ptr<RedisCluster>> Connect(RedisClusterOptions options);
  RedisCluster(const RedisCluster&) = delete;
  RedisCluster& operator=(const RedisCluster&) = delete;
  ~RedisCluster();

  // Runs `commands` (each: args[0] the command name, args[1] the key that routes it;
  // REQUIRES: at least 2 args), grouped by the node owning each key's slot, one pipeline per
  // node, nodes in parallel. Replies come back in input order; each is the reply or that
  // command's error (see the header comment). Returns by `deadline`. `route_keys`, when not
  // empty (one per command), routes command i by route_keys[i] instead of args[1]: for a
  // keyless command that must reach the node of a key, such as WAIT after that key's write
  // (each node has one connection, so WAIT there covers every write sent to it before).
  std::vector<absl::StatusOr<RedisReply>> Pipeline(
      std::span<const std::vector<std::string>> commands, absl::Time deadline,
      std::span<const std::string> route_keys = {});
  absl::StatusOr<RedisReply> Run(const std::vector<std::string>& command, absl::Time deadline);

  // The same read on a replica of the key's slot (READONLY on that connection), for re-fetching
  // a value whose checksum failed: the replicas are tried in turn, once each, without
  // redirections. When the map names no replica for the slot, or none of them answers, the
  // slot map is reloaded (a replica may have joined or replaced them since it was loaded) and
  // the new map's replicas are tried once more. NOT_FOUND when the slot still has no replica;
  // otherwise the first reply, or the last replica's error.
  absl::StatusOr<RedisReply> RunOnReplica(const std::vector<std::string>& command,
                                          absl::Time deadline);

  // The key's hash slot: CRC16-CCITT (XMODEM) mod 16384 of the key, or of its hash tag (the
  // bytes between the first '{' and the next '}', when not empty), as the Redis Cluster
  // specification defines.
  static uint16_t SlotOf(std::string_view key);

  // Tests only (leveldb's fault-injection environments are the model): while set, every
  // command for which `fault` returns an error fails with it and is not sent — to the caller,
  // a command a node never answered. Null: none (the default).
  using Fault = std::function<std::optional<absl::Status>(const std::vector<std::string>& argv)>;
  void SetFaultForTesting(Fault fault) ABSL_LOCKS_EXCLUDED(fault_mu_);

  // For tests and metrics.
  size_t node_count() const;  // nodes (masters and replicas) in the current slot map
  int64_t redirects() const { return redirects_.load(std::memory_order_relaxed); }
  int64_t slot_map_refreshes() const { return refreshes_.load(std::memory_order_relaxed); }

  struct Node;  // one server and its connection (redis_cluster.cc)

 private:
  struct SlotRange {
    uint16_t first = 0, last = 0;  // inclusive
    Node* master = nullptr;
    std::vector<Node*> replicas;
  };
  struct Op;  // a command in flight (redis_cluster.cc)

  explicit RedisCluster(RedisClusterOptions options);

  // The node for "host:port", created on first use; never destroyed before *this.
  Node* NodeFor(const std::string& host, int port) ABSL_LOCKS_EXCLUDED(map_mu_);
  Node* NodeForLocked(const std::string& host, int port) ABSL_EXCLUSIVE_LOCKS_REQUIRED(map_mu_);
  // The replicas the map names for `slot`.
  std::vector<Node*> ReplicasOf(uint16_t slot) ABSL_LOCKS_EXCLUDED(map_mu_);
  // CLUSTER SLOTS from the known nodes (then the seeds), first answer wins.
  absl::Status RefreshSlotMap(absl::Time deadline) ABSL_LOCKS_EXCLUDED(map_mu_);
  absl::Status LoadSlotMapFrom(Node* node, absl::Time deadline) ABSL_LOCKS_EXCLUDED(map_mu_);
  // One round: sends every pending op to its node, classifies the answers. True when some op
  // needs a back-off before the next round.
  bool RunRound(std::vector<Op>& ops, absl::Time deadline) ABSL_LOCKS_EXCLUDED(map_mu_);
  void HandleError(Op& op, const std::string& message, bool& back_off) ABSL_LOCKS_EXCLUDED(map_mu_);

  const RedisClusterOptions options_;
  mutable absl::Mutex map_mu_;
  std::vector<std::unique_ptr<Node>> nodes_ ABSL_GUARDED_BY(map_mu_);
  absl::flat_hash_map<std::string, Node*> nodes_by_address_ ABSL_GUARDED_BY(map_mu_);
  std::vector<SlotRange> ranges_ ABSL_GUARDED_BY(map_mu_);
  std::array<Node*, 16384> slot_master_ ABSL_GUARDED_BY(map_mu_){};  // nullptr: unknown
  bool refresh_wanted_ ABSL_GUARDED_BY(map_mu_) = false;
  // When the map was last loaded, or a periodic reload last began (so that one command, not
  // every one, does it).
  absl::Time loaded_at_ ABSL_GUARDED_BY(map_mu_) = absl::InfinitePast();
  size_t refresh_cursor_ ABSL_GUARDED_BY(map_mu_) = 0;  // where the next refresh starts
  std::atomic<int64_t> redirects_{0};
  std::atomic<int64_t> refreshes_{0};
  mutable absl::Mutex fault_mu_;
  std::shared_ptr<const Fault> fault_ ABSL_GUARDED_BY(fault_mu_);
};

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_REDIS_CLUSTER_H_
