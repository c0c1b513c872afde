// ReflectionV1: a bidirectional reactor that reads one request, writes its answer, and reads
// the next; the stream ends when the client half-closes. Invariant: at most one read or one
// write is outstanding, so the reactor's state needs no lock.
#include "daemon/reflection_v1.h"

#include <set>
#include <utility>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"

namespace kvtier::daemon {
namespace {

namespace pb = google::protobuf;
namespace rv1 = grpc::reflection::v1;

void NotFound(rv1::ServerReflectionResponse* out, const std::string& what) {
  rv1::ErrorResponse* e = out->mutable_error_response();
  e->set_error_code(static_cast<int32_t>(grpc::StatusCode::NOT_FOUND));
  e->set_error_message(what);
}

// `file` and everything it imports, each file once, the requested one first.
void AddFileWithDeps(const pb::FileDescriptor* file, std::set<std::string>* sent,
                     rv1::FileDescriptorResponse* out) {
  if (!sent->insert(file->name()).second) return;
  pb::FileDescriptorProto proto;
  file->CopyTo(&proto);
  out->add_file_descriptor_proto(proto.SerializeAsString());
  for (int i = 0; i < file->dependency_count(); ++i)
    AddFileWithDeps(file->dependency(i), sent, out);
}

rv1::ServerReflectionResponse Answer(const rv1::ServerReflectionRequest& req,
                                     const std::vector<std::string>& services) {
  const pb::DescriptorPool* pool = pb::DescriptorPool::generated_pool();
  rv1::ServerReflectionResponse out;
  out.set_valid_host(req.host());
  *out.mutable_original_request() = req;
  std::set<std::string> sent;
  switch (req.message_request_case()) {
    case rv1::ServerReflectionRequest::kListServices:
      for (const std::string& s : services) {
        out.mutable_list_services_response()->add_service()->set_name(s);
      }
      break;
    case rv1::ServerReflectionRequest::kFileByFilename: {
      const pb::FileDescriptor* f = pool->FindFileByName(req.file_by_filename());
      if (f == nullptr) {
        NotFound(&out, "file not found: " + req.file_by_filename());
      } else {
        AddFileWithDeps(f, &sent, out.mutable_file_descriptor_response());
      }
      break;
    }
    case rv1::ServerReflectionRequest::kFileContainingSymbol: {
      const pb::FileDescriptor* f = pool->FindFileContainingSymbol(req.file_containing_symbol());
      if (f == nullptr) {
        NotFound(&out, "symbol not found: " + req.file_containing_symbol());
      } else {
        AddFileWithDeps(f, &sent, out.mutable_file_descriptor_response());
      }
      break;
    }
    case rv1::ServerReflectionRequest::kFileContainingExtension: {
      const rv1::ExtensionRequest& x = req.file_containing_extension();
      const pb::Descriptor* type = pool->FindMessageTypeByName(x.containing_type());
      const pb::FieldDescriptor* ext =
          type == nullptr ? nullptr : pool->FindExtensionByNumber(type, x.extension_number());
      if (ext == nullptr) {
        NotFound(&out, "extension not found");
      } else {
        AddFileWithDeps(ext->file(), &sent, out.mutable_file_descriptor_response());
      }
      break;
    }
    case rv1::ServerReflectionRequest::kAllExtensionNumbersOfType: {
      const pb::Descriptor* type = pool->FindMessageTypeByName(req.all_extension_numbers_of_type());
      if (type == nullptr) {
        NotFound(&out, "type not found: " + req.all_extension_numbers_of_type());
        break;
      }
      std::vector<const pb::FieldDescriptor*> exts;
      pool->FindAllExtensions(type, &exts);
      rv1::ExtensionNumberResponse* r = out.mutable_all_extension_numbers_response();
      r->set_base_type_name(type->full_name());
      for (const pb::FieldDescriptor* e : exts) r->add_extension_number(e->number());
      break;
    }
    case rv1::ServerReflectionRequest::MESSAGE_REQUEST_NOT_SET: {
      rv1::ErrorResponse* e = out.mutable_error_response();
      e->set_error_code(static_cast<int32_t>(grpc::StatusCode::UNIMPLEMENTED));
      e->set_error_message("the request names no message_request");
      break;
    }
  }
  return out;
}

class Stream final
    : public grpc::ServerBidiReactor<rv1::ServerReflectionRequest, rv1::ServerReflectionResponse> {
 public:
  explicit Stream(const std::vector<std::string>& services) : services_(services) {
    StartRead(&request_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) return Finish(grpc::Status::OK);  // half-closed, or gone
    response_ = Answer(request_, services_);
    StartWrite(&response_);
  }
  void OnWriteDone(bool ok) override {
    if (!ok) return Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
    StartRead(&request_);
  }
  void OnDone() override { delete this; }

 private:
  const std::vector<std::string>& services_;
  rv1::ServerReflectionRequest request_;
  rv1::ServerReflectionResponse response_;
};

class ReflectionV1 final : public rv1::ServerReflection::CallbackService {
 public:
  explicit ReflectionV1(std::vector<std::string> services) : services_(std::move(services)) {}
  using rv1::ServerReflection::CallbackService::ServerReflectionInfo;
  grpc::ServerBidiReactor<rv1::ServerReflectionRequest, rv1::ServerReflectionResponse>*
  ServerReflectionInfo(grpc::CallbackServerContext* /*ctx*/) override {
    return new Stream(services_);
  }

 private:
  const std::vector<std::string> services_;
};

}  // namespace

std::unique_ptr<grpc::Service> NewReflectionV1Service(std::vector<std::string> services) {
  return std::make_unique<ReflectionV1>(std::move(services));
}

}  // namespace kvtier::daemon
