#include "tests/client/raw_grpc.h"

#include <utility>

#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/channel_arguments.h"

namespace kvtier::testing {
namespace {

grpc::ByteBuffer ToBuffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

std::string FromBuffer(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  for (const grpc::Slice& s : slices) {
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return out;
}

// Waits for the one operation in flight: whether it succeeded.
bool Await(grpc::CompletionQueue& cq) {
  void* tag = nullptr;
  bool ok = false;
  return cq.Next(&tag, &ok) && ok;
}

}  // namespace

RawCallResult RawCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                      const std::vector<std::string>& requests, grpc::ClientContext& ctx) {
  RawCallResult result;
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call = stub.PrepareCall(&ctx, method, &cq);
  int tag = 0;
  call->StartCall(&tag);
  if (Await(cq)) {
    for (const std::string& r : requests) {
      call->Write(ToBuffer(r), &tag);
      if (!Await(cq)) break;  // the stream broke: Finish says why
      ++result.written;
    }
    call->WritesDone(&tag);
    (void)Await(cq);
    for (;;) {
      grpc::ByteBuffer reply;
      call->Read(&reply, &tag);
      if (!Await(cq)) break;
      result.replies.push_back(FromBuffer(reply));
    }
  }
  call->Finish(&result.status, &tag);
  (void)Await(cq);
  for (const auto& [k, v] : ctx.GetServerTrailingMetadata()) {
    result.trailers.emplace(std::string(k.data(), k.size()), std::string(v.data(), v.size()));
  }
  cq.Shutdown();
  void* ignored_tag = nullptr;
  bool ignored_ok = false;
  while (cq.Next(&ignored_tag, &ignored_ok)) {
  }
  return result;
}

std::shared_ptr<grpc::Channel> UnlimitedChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  args.SetMaxReceiveMessageSize(-1);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

int HealthCheck(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                absl::Duration timeout) {
  // HealthCheckRequest { string service = 1; }, by hand.
  std::string request;
  if (!service.empty()) {
    request.push_back('\x0a');
    request.push_back(static_cast<char>(service.size()));  // names here are < 128 bytes
    request += service;
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  RawCallResult r = RawCall(channel, "/grpc.health.v1.Health/Check", {request}, ctx);
  if (!r.status.ok() || r.replies.size() != 1) return -1;
  // HealthCheckResponse { ServingStatus status = 1; }: absent means 0 (UNKNOWN).
  const std::string& reply = r.replies[0];
  if (reply.empty()) return 0;
  if (reply.size() != 2 || reply[0] != '\x08') return -1;
  return static_cast<unsigned char>(reply[1]);
}

}  // namespace kvtier::testing
