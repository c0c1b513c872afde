// Conversions between kvtier's own types (geometry, dtype, retrieval mode, transport,
// status) and the kvtier.v1 protocol, shared by the daemon's service and the client library
// so both sides read the wire the same way. Status codes map one-to-one: absl's and gRPC's
// canonical codes have the same values (docs/architecture.md#errors-and-integrity).
//
// Thread-safe: pure functions.
#ifndef KVTIER_PROTO_CONVERT_H_
#define KVTIER_PROTO_CONVERT_H_

#include <grpcpp/support/status.h>

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvtier/geometry.h"
#include "kvtier/options.h"
#include "kvtier/protocol.h"
#include "kvtier/sequence.h"
#include "kvtier/v1/kvtier.pb.h"

namespace kvtier {

v1::DType DTypeToProto(DType t);
// INVALID_ARGUMENT for DTYPE_UNSPECIFIED or an unknown value (naming `field`).
absl::StatusOr<DType> DTypeFromProto(int t, std::string_view field = "geometry.dtype");

v1::Mode ModeToProto(RetrievalMode m);
// MODE_UNSPECIFIED means speculative (the protocol's default); unknown: INVALID_ARGUMENT.
absl::StatusOr<RetrievalMode> ModeFromProto(int m);

v1::Transport TransportToProto(Transport t);
// TRANSPORT_UNSPECIFIED means SHM; unknown: INVALID_ARGUMENT.
absl::StatusOr<Transport> TransportFromProto(int t);

v1::Geometry GeometryToProto(const Geometry& g);
// Converts without validating (Geometry::Validate does); page_size 0 becomes 32.
// INVALID_ARGUMENT for a bad dtype or a field beyond int32.
absl::StatusOr<Geometry> GeometryFromProto(const v1::Geometry& g);

// A protocol integer as an int32 field; INVALID_ARGUMENT naming `field` beyond INT32_MAX.
absl::StatusOr<int32_t> ToInt32(uint64_t v, std::string_view field);

// The counters of kvtier/counters.h into SessionStats.counters, and into the fields of the
// message that predate the map (by name: none is listed here).
void CountersToProto(const SequenceStats& stats, v1::SessionStats* p);
// The counters of `p` into `stats`: from the map, or, for a daemon that predates it, from the
// fields of the same name. Names this build does not know are left out.
void CountersFromProto(const v1::SessionStats& p, SequenceStats* stats);

absl::Status FromGrpcStatus(const grpc::Status& status);
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace kvtier

#endif  // KVTIER_PROTO_CONVERT_H_
