// A fuzz target for kvtierd: every RPC's request bytes and the attach handshake's bytes, sent
// to a real Daemon serving on a Unix socket in this process, with the daemon's invariants
// checked after each case — not only "no crash":
//   - the daemon still answers (Hello);
//   - each tenant's sessions are exactly those the OK replies opened and did not close (an
//     OpenSession that failed its deadline is resolved the documented way: a retry with its
//     request_id);
//   - a GRPC session's committed tokens per layer always lie on a commit boundary of what its
//     clients sent, and every committed page read back (Fetch) holds exactly the bytes those
//     commits carried: no half page, nothing uncommitted;
//   - an attach is granted (with a descriptor) exactly when the request is valid: protocol
//     version 1, a known tenant, its token.
//
// An input is one case: byte 0 picks the target (FuzzTarget), byte 1 the caller (tenant,
// wrong token, a short deadline), the rest is the payload: one request's bytes, a sequence of
// Offload messages (each a little-endian u16 length and that many bytes), or the raw bytes
// of an attach connection. Payloads may name live sessions through placeholders
// (SessionPlaceholder), replaced before sending. libFuzzer drives FuzzOne directly; the seeded
// mutation driver (fuzz_driver.cc, builds with g++) builds inputs from SeedCorpus and Mutate.
//
// Thread-compatible: one case at a time.
#ifndef KVTIER_TESTS_DAEMON_FUZZ_KVTIERD_FUZZ_H_
#define KVTIER_TESTS_DAEMON_FUZZ_KVTIERD_FUZZ_H_

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace kvtier::fuzz {

enum FuzzTarget : uint8_t {
  kHello = 0,
  kOpenSession,
  kCloseSession,
  kListSessions,
  kReattach,
  kOffload,
  kFetch,
  kStep,
  kGetStats,
  kDrain,
  kSuspendSession,
  kDemotePages,
  kPromotePages,
  kAttach,
  kReportSignals,
  kNumTargets
};
const char* TargetName(uint8_t target);

// 32 bytes, as long as a session id: "@@live-session-K@@...", K in 0..7, stands for the K-th
// live session of the calling tenant (left as is when there is none).
std::string SessionPlaceholder(int k);

struct FuzzCounts {
  uint64_t cases = 0;
  uint64_t ok_replies = 0;     // calls the daemon answered OK
  uint64_t error_replies = 0;  // calls it refused (any code)
  uint64_t invariant_failures = 0;
  uint64_t sessions_opened = 0;
  uint64_t commits_checked = 0;  // Offload cases whose outcome was checked page by page
};

// Starts the daemon on first use (a temporary directory, two tenants). Runs one case and
// checks the invariants: false (with `why`) when one broke.
bool FuzzOne(const uint8_t* data, size_t size, std::string* why);
const FuzzCounts& Counts();
// Stops the daemon (if it was started) and removes its directory.
void StopDaemon();

// Valid inputs of every target (they name sessions through placeholders; cases that open
// sessions come first).
std::vector<std::string> SeedCorpus();
// `input` changed by 1 to 4 random mutations: byte-level (flips, inserts, deletes, splices
// with `corpus`, interesting values) or, where the payload parses, field-level (a random field
// of the message set to a random or extreme value), and for Offload sequences, messages
// dropped, duplicated, swapped or replaced by garbage.
std::string Mutate(const std::string& input, const std::vector<std::string>& corpus,
                   std::mt19937_64& rng);

}  // namespace kvtier::fuzz

#endif  // KVTIER_TESTS_DAEMON_FUZZ_KVTIERD_FUZZ_H_
