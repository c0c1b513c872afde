// Test helpers: the shm attach handshake by hand (daemon/attach_server.h's wire format), so
// tests and fuzzers can send any bytes a client could and see exactly what came back.
//
// Thread-compatible.
#ifndef KVTIER_TESTS_CLIENT_RAW_ATTACH_H_
#define KVTIER_TESTS_CLIENT_RAW_ATTACH_H_

#include <optional>
#include <string>

#include "absl/time/time.h"
#include "kvtier/v1/kvtier.pb.h"

namespace kvtier::testing {

// `request` with its 4-byte little-endian length prefix.
std::string FramedAttachRequest(const v1::AttachRequest& request);

struct RawAttachResult {
  bool connected = false;
  std::optional<v1::AttachReply> reply;  // absent when the daemon closed without one
  int descriptors = 0;                   // passed with the reply (each closed at once)
};

// Connects to the attach socket at `path`, sends `bytes`, half-closes (so a truncated request
// ends at once), and reads everything until the daemon closes, at most `timeout`.
RawAttachResult RawAttachExchange(const std::string& path, const std::string& bytes,
                                  absl::Duration timeout = absl::Seconds(30));

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_CLIENT_RAW_ATTACH_H_
