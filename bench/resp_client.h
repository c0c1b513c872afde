// A minimal Redis client (RESP2 over a Unix or TCP socket) for the peer baseline of
// `kvtier-bench ipc`: SET and GET of binary values, pipelined to a chosen depth, as KV
// offload services use Redis. Not a general client: only the replies SET and GET give.
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
  explicit RespClient(int fd) : fd_(fd) {}
  absl::Status WriteAll(std::string_view bytes);
  absl::Status Fill();  // reads more bytes into buf_
  absl::StatusOr<std::string> ReadLine();
  absl::Status ReadExact(size_t n, std::string* out);
  // One reply: simple string / error / integer / bulk (nullopt-like: *is_nil for $-1).
  absl::StatusOr<std::string> ReadReply(bool* is_nil);

  int fd_;
  std::string buf_;
  size_t pos_ = 0;
};

// Encodes one command as a RESP array of bulk strings (exposed for tests).
std::string EncodeCommand(const std::vector<std::string_view>& args);

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_RESP_CLIENT_H_
