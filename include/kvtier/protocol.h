// The vocabulary libkvtier and kvtierd share about their connection: the protocol version
// (proto/kvtier/v1/kvtier.proto) and how a session's data moves.
#ifndef KVTIER_PROTOCOL_H_
#define KVTIER_PROTOCOL_H_

#include <cstdint>
#include <string_view>

namespace kvtier {

inline constexpr uint32_t kProtocolVersion = 1;

// kShm: the engine maps its tenant's shared arena and runs the session's sequence in its
// own process (local engines). kGrpc: pages and steps travel over gRPC and the sequence runs
// in the daemon (remote engines).
enum class Transport : uint8_t { kShm = 0, kGrpc = 1 };
// "shm", "grpc".
std::string_view TransportName(Transport t);

}  // namespace kvtier

#endif  // KVTIER_PROTOCOL_H_
