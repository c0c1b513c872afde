// A Redis client for the peer baseline of `kvtier-bench ipc`: SET and GET of binary values,
// pipelined to a chosen depth, as KV offload services use Redis. A thin layer over hiredis
// (the library kvtierd's cold tier already links), so the benchmark's client is the RESP
// implementation everyone uses, not one of its own.
//
// Thread-compatible: one thread per RespClient.
#ifndef KVTIER_BENCH_RESP_CLIENT_H_
#define KVTIER_BENCH_RESP_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

struct redisContext;  // hiredis

namespace kvtier::bench {

class RespClient {
 public:
  // Connects to a Unix socket path. UNAVAILABLE when nothing listens.
  static absl::StatusOr<std::unique_ptr<RespClient>> ConnectUnix(const std::string& path);
  ~RespClient();
  RespClient(const RespClient&) = delete;
  RespClient& operator=(const RespClient&) = delete;

  // SET keys[i] values[i] for every i, pipelined: all commands are written, then all replies
  // read. INTERNAL for an error reply (with Redis's message).
  absl::Status SetMany(const std::vector<std::string>& keys,
                       const std::vector<std::string_view>& values);
  // GET keys[i] into out[i] (resized), pipelined. NOT_FOUND for a missing key.
  absl::Status GetMany(const std::vector<std::string>& keys, std::vector<std::string>* out);
  // PING → PONG: OK when the server answers.
  absl::Status Ping();
  absl::Status FlushAll();

 private:
  explicit RespClient(redisContext* c) : c_(c) {}
  redisContext* c_;
};

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_RESP_CLIENT_H_
