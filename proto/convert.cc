#include "proto/convert.h"

#include <cstdint>
#include <limits>
#include <string>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"

namespace kvtier {
absl::StatusOr<int32_t> ToInt32(uint64_t v, std::string_view field) {
  if (v > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(absl::StrFormat("%s = %d: must be at most %d", field, v,
                                                      std::numeric_limits<int32_t>::max()));
  }
  return static_cast<int32_t>(v);
}

v1::DType DTypeToProto(DType t) {
  switch (t) {
    case DType::kF16:
      return v1::DTYPE_FP16;
    case DType::kBF16:
      return v1::DTYPE_BF16;
    case DType::kF32:
      return v1::DTYPE_FP32;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<DType> DTypeFromProto(int t, std::string_view field) {
  switch (t) {
    case v1::DTYPE_FP16:
      return DType::kF16;
    case v1::DTYPE_BF16:
      return DType::kBF16;
    case v1::DTYPE_FP32:
      return DType::kF32;
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("%s = %d: must be DTYPE_FP16, DTYPE_BF16 or DTYPE_FP32", field, t));
  }
}

v1::Mode ModeToProto(RetrievalMode m) {
  switch (m) {
    case RetrievalMode::kSpeculative:
      return v1::MODE_SPECULATIVE;
    case RetrievalMode::kSync:
      return v1::MODE_SYNC;
    case RetrievalMode::kFull:
      return v1::MODE_FULL;
    case RetrievalMode::kDrop:
      return v1::MODE_DROP;
  }
  return v1::MODE_UNSPECIFIED;
}

absl::StatusOr<RetrievalMode> ModeFromProto(int m) {
  switch (m) {
    case v1::MODE_UNSPECIFIED:
    case v1::MODE_SPECULATIVE:
      return RetrievalMode::kSpeculative;
    case v1::MODE_SYNC:
      return RetrievalMode::kSync;
    case v1::MODE_FULL:
      return RetrievalMode::kFull;
    case v1::MODE_DROP:
      return RetrievalMode::kDrop;
    default:
      return absl::InvalidArgumentError(absl::StrCat("retrieval.mode = ", m, ": unknown mode"));
  }
}

v1::Transport TransportToProto(Transport t) {
  switch (t) {
    case Transport::kShm:
      return v1::TRANSPORT_SHM;
    case Transport::kGrpc:
      return v1::TRANSPORT_GRPC;
  }
  return v1::TRANSPORT_UNSPECIFIED;
}

absl::StatusOr<Transport> TransportFromProto(int t) {
  switch (t) {
    case v1::TRANSPORT_UNSPECIFIED:
    case v1::TRANSPORT_SHM:
      return Transport::kShm;
    case v1::TRANSPORT_GRPC:
      return Transport::kGrpc;
    default:
      return absl::InvalidArgumentError(absl::StrCat("transport = ", t, ": unknown transport"));
  }
}

v1::Geometry GeometryToProto(const Geometry& g) {
  v1::Geometry p;
  p.set_num_layers(static_cast<uint32_t>(g.num_layers));
  p.set_num_q_heads(static_cast<uint32_t>(g.num_q_heads));
  p.set_num_kv_heads(static_cast<uint32_t>(g.num_kv_heads));
  p.set_head_dim(static_cast<uint32_t>(g.head_dim));
  p.set_page_size(static_cast<uint32_t>(g.page_size));
  p.set_dtype(DTypeToProto(g.dtype));
  return p;
}

absl::StatusOr<Geometry> GeometryFromProto(const v1::Geometry& p) {
  Geometry g;
  KVTIER_ASSIGN_OR_RETURN(g.num_layers, ToInt32(p.num_layers(), "geometry.num_layers"));
  KVTIER_ASSIGN_OR_RETURN(g.num_q_heads, ToInt32(p.num_q_heads(), "geometry.num_q_heads"));
  KVTIER_ASSIGN_OR_RETURN(g.num_kv_heads, ToInt32(p.num_kv_heads(), "geometry.num_kv_heads"));
  KVTIER_ASSIGN_OR_RETURN(g.head_dim, ToInt32(p.head_dim(), "geometry.head_dim"));
  KVTIER_ASSIGN_OR_RETURN(g.page_size, ToInt32(p.page_size(), "geometry.page_size"));
  if (g.page_size == 0) g.page_size = 32;
  KVTIER_ASSIGN_OR_RETURN(g.dtype, DTypeFromProto(p.dtype()));
  return g;
}

void CountersToProto(const SequenceStats& stats, v1::SessionStats* p) {
  const google::protobuf::Descriptor* d = p->GetDescriptor();
  const google::protobuf::Reflection* r = p->GetReflection();
  for (const CounterInfo& c : SequenceCounters()) {
    const std::string name(c.name);
    const int64_t value = stats.*c.field;
    (*p->mutable_counters())[name] = value;
    const google::protobuf::FieldDescriptor* f = d->FindFieldByName(name);
    if (f != nullptr && f->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_INT64 &&
        !f->is_repeated()) {
      r->SetInt64(p, f, value);
    }
  }
}

void CountersFromProto(const v1::SessionStats& p, SequenceStats* stats) {
  const google::protobuf::Descriptor* d = p.GetDescriptor();
  const google::protobuf::Reflection* r = p.GetReflection();
  for (const CounterInfo& c : SequenceCounters()) {
    const std::string name(c.name);
    if (auto it = p.counters().find(name); it != p.counters().end()) {
      stats->*c.field = it->second;
      continue;
    }
    const google::protobuf::FieldDescriptor* f = d->FindFieldByName(name);
    if (f != nullptr && f->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_INT64 &&
        !f->is_repeated()) {
      stats->*c.field = r->GetInt64(p, f);
    }
  }
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

}  // namespace kvtier
