// The gRPC server reflection service, version 1 (grpc.reflection.v1.ServerReflection;
// proto/grpc/reflection/v1/reflection.proto), on the callback API. Debian's gRPC plugin
// serves only the older v1alpha, which current grpcurl and grpcui no longer try first;
// kvtierd serves both. The answers come from the process's generated descriptor pool:
// list_services names the services given at creation; file_by_filename and
// file_containing_symbol send the file with every file it depends on (each once);
// file_containing_extension and all_extension_numbers_of_type answer from the pool's
// extensions. What the pool does not know is an ErrorResponse with NOT_FOUND, as in v1alpha.
//
// Thread-safe; each stream is served one request at a time, in order.
#ifndef KVTIER_DAEMON_REFLECTION_V1_H_
#define KVTIER_DAEMON_REFLECTION_V1_H_

#include <memory>
#include <string>
#include <vector>

#include "grpcpp/impl/service_type.h"

namespace kvtier::daemon {

// `services`: the fully qualified names list_services reports, in that order.
std::unique_ptr<grpc::Service> NewReflectionV1Service(std::vector<std::string> services);

}  // namespace kvtier::daemon

#endif  // KVTIER_DAEMON_REFLECTION_V1_H_
