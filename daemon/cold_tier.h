// ColdTier: committed host pages in a Redis Cluster (daemon/redis_cluster.h), the tier behind
// the host tier (docs/service.md#the-cold-tier). This is its storage format and its read and
// write paths; when pages move there (demotion) and back (promotion) is the SessionManager's.
//
// Keys: "<prefix>:<tenant>:{<session>:<layer>}:<page>". The tenant sits outside the hash tag
// and first, so a Redis ACL user per tenant can be limited to "~<prefix>:<tenant>:*"; the
// hash tag is (session, layer), so one layer's pages share a slot and travel in one pipeline
// to one node, while a session's layers spread over the cluster.
//
// Values: a 32-byte header, then the page (HND [Hkv][2][p][d], as the host tier holds it),
// little-endian. Version 2, written:
//   magic "KVTC" | version u16 = 2 | reserved u16 | generation u64 | identity u32 |
//   bytes u32 | crc32c u32 (of the page) | header crc32c u32 (of the 28 bytes before it)
// where identity is ColdIdentity(tenant, session, layer, page) of the key it was written
// under. Version 1 (read, never written) has no identity: bytes u64 in its place.
// The page's generation is its commit stamp: a reader asks for the generation it expects and
// refuses any other (a stale value of an earlier commit of that page). Generations repeat
// across pages, so the identity binds a value to its page: an intact value of another page
// found under a key (copied or renamed there) is refused like a damaged one. A value whose
// header or payload checksum or identity fails is read again from a replica of its slot, when
// there is one; when that fails too (or there is none) the page is DATA_LOSS, never wrong
// bytes.
//
// Thread-safe (RedisCluster is).
#ifndef KVTIER_DAEMON_COLD_TIER_H_
#define KVTIER_DAEMON_COLD_TIER_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/mutex.h"
#include "daemon/redis_cluster.h"

namespace kvtier::daemon {

// A page to write: `data` must stay valid until Put returns.
struct ColdPageRef {
  int32_t layer = 0;
  int64_t page = 0;
  uint64_t generation = 0;  // >= 1
  std::string_view data;
};

// A page read back.
struct ColdPage {
  int32_t layer = 0;
  int64_t page = 0;
  uint64_t generation = 0;
  std::string data;
};

// The key of a page: "<prefix>:<tenant>:{<session>:<layer>}:<page>".
std::string ColdKey(std::string_view prefix, std::string_view tenant, std::string_view session,
                    int32_t layer, int64_t page);

// The checksum of the value format: CRC-32C, with the SSE4.2 instruction when
// `allow_hardware` and the CPU has it, else a table (both give the same value).
uint32_t ColdChecksum(std::string_view data, bool allow_hardware = true);

// The value format (exposed for tests and the benchmark).
inline constexpr size_t kColdHeaderBytes = 32;
// The largest page a value holds (its header's bytes field is 32 bits; Redis allows 512 MiB).
inline constexpr size_t kColdMaxPageBytes = UINT32_MAX;
// What a value is bound to: a CRC-32C of (tenant, session, layer, page), each field
// length-prefixed.
uint32_t ColdIdentity(std::string_view tenant, std::string_view session, int32_t layer,
                      int64_t page);
// REQUIRES: data.size() <= kColdMaxPageBytes.
std::string EncodeColdValue(uint32_t identity, uint64_t generation, std::string_view data);
// The page of a value: DATA_LOSS naming what is wrong (magic, version, length, header or
// payload checksum, or "a value of another page" when its identity is not `identity`; a
// version 1 value has none to check); FAILED_PRECONDITION when it is intact but of another
// generation than `expected_generation` (0: any).
absl::StatusOr<ColdPage> DecodeColdValue(std::string_view value, uint32_t identity,
                                         uint64_t expected_generation);
// The same, taking the value's buffer for the page (no second buffer of a page's size).
absl::StatusOr<ColdPage> DecodeColdValueInPlace(std::string&& value, uint32_t identity,
                                                uint64_t expected_generation);

struct ColdTierStats {
  int64_t pages_written = 0;
  int64_t bytes_written = 0;
  int64_t pages_read = 0;
  int64_t bytes_read = 0;
  int64_t checksum_failures = 0;  // values that failed their checksum on the master
  int64_t replica_recoveries = 0;  // of which a replica held an intact copy
};

class ColdTier {
 public:
  // `cluster` must outlive the ColdTier. `prefix`: [A-Za-z0-9_.-]{1,32}.
  static absl::StatusOr<std::unique_ptr<ColdTier>> Create(RedisCluster* cluster,
                                                          std::string prefix = "kvtier");

  // ColdKey with this tier's prefix. REQUIRES: tenant and session as the daemon names them
  // (no braces).
  std::string Key(std::string_view tenant, std::string_view session, int32_t layer,
                  int64_t page) const {
    return ColdKey(prefix_, tenant, session, layer, page);
  }

  // Writes the pages (pipelined; a layer's pages go to one node). OK once every page is
  // stored on its master; the first error otherwise (pages written before it stay: a retry
  // overwrites them). INVALID_ARGUMENT for a generation of 0, a negative layer or page, or
  // an empty page or one over kColdMaxPageBytes. DEADLINE_EXCEEDED / UNAVAILABLE from the cluster.
  absl::Status Put(std::string_view tenant, std::string_view session,
                   std::span<const ColdPageRef> pages, absl::Time deadline);

  // Reads pages of one layer, each of the generation given (0: any), in the order asked.
  // Per page: the page; NOT_FOUND when the key is absent; FAILED_PRECONDITION when it holds
  // another generation; DATA_LOSS when its checksum or identity fails on the master and on a
  // replica (or there is no replica); the cluster's errors.
  std::vector<absl::StatusOr<ColdPage>> Get(std::string_view tenant, std::string_view session,
                                            int32_t layer, std::span<const int64_t> pages,
                                            std::span<const uint64_t> generations,
                                            absl::Time deadline);

  // Removes the pages (absent ones are fine).
  absl::Status Delete(std::string_view tenant, std::string_view session, int32_t layer,
                      std::span<const int64_t> pages, absl::Time deadline);

  ColdTierStats stats() const;

 private:
  ColdTier(RedisCluster* cluster, std::string prefix)
      : cluster_(cluster), prefix_(std::move(prefix)) {}
  RedisCluster* const cluster_;
  const std::string prefix_;
  mutable Mutex mu_;
  ColdTierStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_COLD_TIER_H_
