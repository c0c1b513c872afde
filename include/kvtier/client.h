// libkvtier's client: a connection to kvtierd and the sessions opened through it
// (docs/architecture.md#processes; protocol in proto/kvtier/v1/kvtier.proto;
// docs/service.md).
//
//   auto device = kvtier::CreateDevice(kvtier::DeviceKind::kAuto);
//   auto client = kvtier::Client::Connect("unix:///run/kvtier/kvtierd.sock", {.tenant = "a"});
//   kvtier::SessionOptions options{.geometry = g, .device = device->get()};
//   auto session = (*client)->OpenSession(options);
//   kvtier::Sequence& seq = (*session)->sequence();
//   seq.Append(layer, k, v, n);  seq.Decode(layer, q, out, lse);  ...
//   (*session)->Close();
//
// A Session is the daemon's record of a sequence whose host tier lives in the daemon, and
// owns the Sequence (kvtier/sequence.h) the engine drives:
//   - SHM (local engines): the client maps its tenant's arena (the fd comes over the attach
//     socket) and runs a LocalSequence in-process, on the engine's device, over the
//     session's region of the arena. The host tier commits each page into the region once
//     its offload has run, so it becomes visible to the daemon (Fetch, Reattach) without a
//     call; Flush() waits for the rest. Nothing per step crosses gRPC.
//   - GRPC (remote engines): a remote Sequence: Append streams tokens with Offload, Decode
//     runs Step in the daemon and returns the attention output; pointers are host memory.
//   Both give the same working sets and outputs for the same inputs on the CPU device.
//
// A Session destroyed without Close() detaches: the daemon keeps its committed pages, and
// Client::Reattach(id) takes it over again, in this or another process. What survives what
// is in docs/service.md.
//
// Thread-safety: Client is thread-safe; each Session is driven by one thread at a time.
#ifndef KVTIER_CLIENT_H_
#define KVTIER_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvtier/device.h"
#include "kvtier/geometry.h"
#include "kvtier/options.h"
#include "kvtier/protocol.h"
#include "kvtier/sequence.h"

namespace kvtier {

struct ClientOptions {
  std::string tenant = "default";
  std::string token;        // the tenant's token, when it has one
  std::string admin_token;  // Drain's token; empty: `token`
  std::string client_name = "libkvtier";
  absl::Duration rpc_timeout = absl::Seconds(30);  // deadline of every unary call
  // The shared-memory attach socket. Empty: the path Hello reports, or, where that path is
  // not there (the daemon's socket directory mounted elsewhere, as in an engine container),
  // the socket of the same name beside the one Connect was given.
  std::string attach_socket;
  uint64_t max_message_bytes = 0;                  // 0: the daemon's limit from Hello
};

// What the daemon said in Hello.
struct Capabilities {
  uint32_t protocol_version = 0;
  std::string server_version;
  std::vector<int32_t> page_sizes;
  std::vector<DType> dtypes;
  std::vector<std::string> layouts;
  std::vector<std::string> backends;
  std::vector<RetrievalMode> modes;
  uint64_t max_message_bytes = 0;
  uint32_t max_sessions_per_tenant = 0;
  uint32_t max_tokens_per_session = 0;
  uint32_t max_tokens_per_offload = 0;
  std::string tenant;
  bool shm_available = false;
  std::string attach_socket;
  uint64_t tenant_quota_bytes = 0;
};

struct SessionOptions {
  Geometry geometry;
  // mode, sink/selected/recent pages (any split the resolver accepts of a budget that is a
  // positive multiple of 4 pages, as SetBudgetTokens takes it), max_tokens (0 here means the daemon's default), τ; the rest (pool, summary, recall,
  // deadline, compute_stream, policy) apply to SHM sessions' local sequence.
  SequenceOptions sequence;
  Transport transport = Transport::kShm;
  // SHM: the engine's device (CreateDevice), which the arena is registered with; null: a
  // CPU device owned by the Client (shared by its sessions). GRPC: unused. REQUIRES: the
  // device outlives every Session opened with it (the arena stays registered with it until
  // the last of them is gone).
  Device* device = nullptr;
  std::string label;
  // Tokens per layer the session's host tier holds; 0 = max_tokens. Fewer needs
  // sequence.policy.host_drop = "demote" and a daemon with a cold tier: the session's
  // lowest-scoring pages past it move to the cold tier and come back when a step selects
  // them (docs/service.md#the-cold-tier). Reattach of an SHM session that demotes pages
  // rebuilds its sequence by appending every full page again (read through the daemon).
  int32_t host_tokens = 0;
  // OpenSession's idempotency key (at most 64 bytes of printable ASCII); empty: a random one
  // per call. An engine that retries an OpenSession that failed (say DEADLINE_EXCEEDED) with
  // the same key gets the session the first call opened, if it did, instead of a second.
  std::string request_id;
};

// A fetched host page: HND [Hkv][2][p][d] in the session dtype.
struct FetchedPage {
  int32_t layer = 0;
  int64_t page = 0;
  uint64_t generation = 0;
  std::vector<uint8_t> data;
};

// The daemon's view of a session (GetStats / ListSessions).
struct SessionInfo {
  std::string id;
  std::string tenant;
  std::string label;
  Transport transport = Transport::kShm;
  Geometry geometry;
  // Retrieval options as the daemon resolved them (defaults filled in).
  RetrievalMode mode = RetrievalMode::kSpeculative;
  int32_t budget_tokens = 0;
  int32_t sink_pages = 0;    // the budget's split (the rest of it is selected)
  int32_t recent_pages = 0;
  int32_t max_tokens = 0;  // per layer
  float correction_threshold = kDefaultCorrectionThreshold;
  CorrectionTrigger correction_trigger = CorrectionTrigger::kCosine;
  float correction_max_loss = kDefaultCorrectionMaxLoss;
  SummaryMode summary = SequenceOptions().summary;
  bool closing = false;  // CloseSession or Drain in progress
  // SuspendSession: no engine holds it; Client::Reattach resumes it. The daemon reports
  // one state: a suspended session that was demoted says cold instead (and a closing one
  // says closing).
  bool suspended = false;
  // Demoted to the daemon's cold tier: it holds no host memory; Client::Reattach brings its
  // pages back first.
  bool cold = false;
  uint64_t epoch = 0;
  std::vector<int64_t> committed_tokens;  // per layer
  std::vector<int64_t> steps_run;         // GRPC: per layer, Steps the daemon ran
  uint64_t region_offset = 0;             // bytes into the tenant arena
  uint64_t region_bytes = 0;
  int64_t created_unix_ms = 0;
};

// A session of kvtierd and the sequence it owns. Close() flushes (SHM), closes the sequence
// and then the session in the daemon. An SHM session whose commits were refused because
// another holder reattached fails FAILED_PRECONDITION from then on (its sequence too), and
// its Close() leaves the daemon's session to that holder. After Close(), calls fail
// FAILED_PRECONDITION. Closing only sequence() stops the engine's side and leaves the
// daemon's session open, as a detach does. Suspend() lets the session go for a later
// Client::Reattach (the daemon may move its pages to its cold tier meanwhile).
class Session {
 public:
  virtual ~Session() = default;
  virtual const std::string& id() const = 0;
  virtual Transport transport() const = 0;
  virtual uint64_t epoch() const = 0;
  // The sequence of this session: a LocalSequence for SHM (sequence().local() != null), a
  // remote one for GRPC. Valid until the Session is destroyed.
  virtual Sequence& sequence() = 0;
  // SHM: waits (bounded by the deadline) for every offload enqueued so far and commits the
  // pages; GRPC: OK (Offload commits before it returns).
  virtual absl::Status Flush() = 0;
  // Committed pages of `layer` read back (SHM: from the mapped arena; GRPC: Fetch). Empty
  // `pages`: all committed pages. NOT_FOUND for a page not committed.
  virtual absl::StatusOr<std::vector<FetchedPage>> FetchPages(
      int32_t layer, const std::vector<int64_t>& pages) = 0;
  // The daemon's record of the session.
  virtual absl::StatusOr<SessionInfo> Info() = 0;
  virtual absl::Status Close() = 0;
  // Lets the session go, to be resumed later by Client::Reattach (in this or another
  // process): flushes (SHM: waits for the offloads in flight and commits them), closes
  // sequence() without closing the daemon's session, then asks the daemon to suspend it
  // (SuspendSession: the epoch moves on and the daemon may demote its pages to the cold
  // tier). Afterwards Flush, FetchPages and sequence()'s calls fail FAILED_PRECONDITION
  // ("... is suspended; Client::Reattach resumes it"), Info() still reads the daemon's
  // record, Close() does not close the daemon's session, and Suspend() again is OK.
  // Reattach resumes where the committed pages end: num_tokens(layer) may be the full
  // pages × page size, and the engine re-appends the rest.
  // Errors: FAILED_PRECONDITION after Close(); SHM: the refusal when another holder
  // reattached, DEADLINE_EXCEEDED when offloads were still in flight at the deadline (in
  // both cases the daemon's session is left as it is and this object is closed); the
  // daemon's status of SuspendSession (the sequence is closed then, but Suspend() may be
  // called again, and Close() closes the daemon's session). A flush error is returned
  // after the session was suspended all the same (the pages it did not commit are
  // re-appended after Reattach).
  virtual absl::Status Suspend() = 0;
};

class Client {
 public:
  // Connects to "unix:///path", "unix:path" or "host:port", says Hello and checks the
  // protocol version. UNAVAILABLE when nothing answers within rpc_timeout;
  // FAILED_PRECONDITION for a daemon that does not speak kProtocolVersion;
  // PERMISSION_DENIED for an unknown tenant or a wrong token.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(std::string_view target,
                                                         const ClientOptions& options = {});
  virtual ~Client() = default;
  virtual const Capabilities& capabilities() const = 0;
  // Opens a session for this client's tenant. The daemon's status passes through
  // (INVALID_ARGUMENT, RESOURCE_EXHAUSTED for the quota, ...); SHM also maps the arena
  // (PERMISSION_DENIED when this uid may not).
  virtual absl::StatusOr<std::unique_ptr<Session>> OpenSession(const SessionOptions& options) = 0;
  // Takes over session `id` after a restart: SHM sessions get their committed pages back
  // (num_tokens(layer) = committed pages × page size; the engine re-appends the rest);
  // GRPC sessions continue where the daemon is. `options` must match the session's geometry
  // (FAILED_PRECONDITION otherwise); its backend and local knobs apply.
  virtual absl::StatusOr<std::unique_ptr<Session>> Reattach(std::string_view id,
                                                            const SessionOptions& options) = 0;
  virtual absl::StatusOr<std::vector<SessionInfo>> ListSessions() = 0;
  // Closes a session by id (e.g. one whose holder died and will not come back).
  virtual absl::Status CloseSession(std::string_view id) = 0;
  // Admin: the daemon stops accepting sessions and waits up to `timeout` for the calls in
  // flight. Sent with ClientOptions.admin_token (or token when that is empty):
  // PERMISSION_DENIED unless it is the daemon's admin token; DEADLINE_EXCEEDED when calls
  // were still in flight at the timeout.
  virtual absl::Status Drain(absl::Duration timeout) = 0;
};

}  // namespace kvtier

#endif  // KVTIER_CLIENT_H_
