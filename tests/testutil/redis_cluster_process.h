// Test helper: a real Redis Cluster of redis-server processes on loopback (N masters, each
// with its replicas), in a private temporary directory, for the cold tier's client tests.
// Nodes can be killed (SIGKILL) or paused (SIGSTOP) and resumed by index; slots can be
// migrated by hand (CLUSTER SETSLOT + MIGRATE) to provoke ASK and MOVED.
//
// Waiting is bounded and polls the cluster's own state (CLUSTER INFO, CLUSTER SLOTS, INFO
// replication); nothing sleeps for correctness. The helper talks to the nodes with hiredis.
//
// Thread-compatible.
#ifndef KVTIER_TESTS_TESTUTIL_REDIS_CLUSTER_PROCESS_H_
#define KVTIER_TESTS_TESTUTIL_REDIS_CLUSTER_PROCESS_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvtier::testing {

struct RedisClusterProcessOptions {
  int masters = 3;
  int replicas_per_master = 1;
  int node_timeout_ms = 1000;  // cluster-node-timeout: failure detection (ms)
  absl::Duration start_timeout = absl::Seconds(60);
};

class RedisClusterProcess {
 public:
  // Starts the nodes, creates the cluster (redis-cli --cluster create) and waits until every
  // node reports cluster_state:ok and sees every slot with its replicas. NOT_FOUND when
  // redis-server or redis-cli is missing (Debian package redis-server).
  static absl::StatusOr<std::unique_ptr<RedisClusterProcess>> Start(
      const RedisClusterProcessOptions& options);
  RedisClusterProcess(const RedisClusterProcess&) = delete;
  RedisClusterProcess& operator=(const RedisClusterProcess&) = delete;
  // Kills every node and removes the directory.
  ~RedisClusterProcess();

  int size() const { return static_cast<int>(ports_.size()); }
  int port(int node) const { return ports_[static_cast<size_t>(node)]; }
  std::string address(int node) const;     // "127.0.0.1:port"
  std::vector<std::string> seeds() const;  // every node's address
  const std::string& dir() const { return dir_; }

  // One command on one node (its own short-lived connection, timeout 5 s): the reply as text
  // (arrays: elements joined by '\n'); an error reply as FAILED_PRECONDITION.
  absl::StatusOr<std::string> Command(int node, const std::vector<std::string>& argv);

  absl::Status Kill(int node);    // SIGKILL and reap
  absl::Status Pause(int node);   // SIGSTOP
  absl::Status Resume(int node);  // SIGCONT
  bool alive(int node) const { return pids_[static_cast<size_t>(node)] > 0; }

  // The node that is master of `slot` according to CLUSTER SLOTS of the first live node that
  // answers.
  absl::StatusOr<int> MasterOf(uint16_t slot);
  // Waits until a live node other than `dead` serves `slot` as master and every live node
  // reports cluster_state:ok (a replica has been promoted).
  absl::Status WaitForPromotion(int dead, uint16_t slot, absl::Duration timeout);
  // Waits until every live master's replicas have acknowledged its whole replication stream.
  absl::Status WaitForReplicas(absl::Duration timeout);

  // Starts a new node and makes it a replica of master `master` (CLUSTER MEET, CLUSTER
  // REPLICATE), then waits until every live node's CLUSTER SLOTS lists it and it has the
  // master's whole replication stream. Returns its index. For a cluster whose replicas join after a
  // client loaded its slot map.
  absl::StatusOr<int> AddReplica(int master, absl::Duration timeout);

  // Slot migration by hand: Begin marks `slot` MIGRATING on `from` and IMPORTING on `to`
  // (keys not yet moved answer ASK); Finish moves the keys still on `from` and assigns the
  // slot to `to` on every live master (clients with the old map get MOVED).
  absl::Status BeginMigration(uint16_t slot, int from, int to);
  absl::Status FinishMigration(uint16_t slot, int from, int to);

 private:
  RedisClusterProcess() = default;
  absl::Status WaitClusterOk(absl::Duration timeout);
  // Starts redis-server on a free port as a cluster node (not yet in the cluster).
  absl::Status SpawnNode(absl::Time deadline);
  absl::StatusOr<std::string> NodeId(int node);
  int IndexOfPort(int port) const;

  std::string dir_;
  std::string cli_;
  std::vector<int> ports_;
  std::vector<pid_t> pids_;  // -1 once killed
  int replicas_per_master_ = 1;
  int node_timeout_ms_ = 1000;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_TESTUTIL_REDIS_CLUSTER_PROCESS_H_
