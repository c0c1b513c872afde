#include "bench/resp_client.h"

#include <hiredis/hiredis.h>

#include <string>

#include "absl/strings/str_format.h"
#include "core/status.h"

namespace kvtier::bench {
namespace {

// The reply to the next pipelined command: owned, freed with it.
struct Reply {
  redisReply* r = nullptr;
  ~Reply() {
    if (r != nullptr) freeReplyObject(r);
  }
};

absl::Status ContextError(redisContext* c, std::string_view what) {
  return absl::UnavailableError(absl::StrFormat("redis %s: %s", what, c->errstr));
}

absl::Status Next(redisContext* c, Reply* reply, std::string_view what) {
  void* r = nullptr;
  if (redisGetReply(c, &r) != REDIS_OK) return ContextError(c, what);
  reply->r = static_cast<redisReply*>(r);
  if (reply->r->type == REDIS_REPLY_ERROR) {
    return absl::InternalError(absl::StrFormat(
        "redis %s: %s", what, std::string_view(reply->r->str, reply->r->len)));
  }
  return absl::OkStatus();
}

absl::Status ExpectStatus(redisContext* c, std::string_view what, std::string_view want) {
  Reply reply;
  KVTIER_RETURN_IF_ERROR(Next(c, &reply, what));
  if (reply.r->type != REDIS_REPLY_STATUS || std::string_view(reply.r->str, reply.r->len) != want) {
    return absl::InternalError(
        absl::StrFormat("redis %s: unexpected reply (type %d)", what, reply.r->type));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<RespClient>> RespClient::ConnectUnix(const std::string& path) {
  redisContext* c = redisConnectUnix(path.c_str());
  if (c == nullptr) return absl::ResourceExhaustedError("redis: cannot allocate a context");
  if (c->err != 0) {
    absl::Status st =
        absl::UnavailableError(absl::StrFormat("redis at unix:%s: %s", path, c->errstr));
    redisFree(c);
    return st;
  }
  return std::unique_ptr<RespClient>(new RespClient(c));
}

RespClient::~RespClient() { redisFree(c_); }

absl::Status RespClient::SetMany(const std::vector<std::string>& keys,
                                 const std::vector<std::string_view>& values) {
  if (keys.size() != values.size()) {
    return absl::InvalidArgumentError("SetMany: as many keys as values");
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    if (redisAppendCommand(c_, "SET %b %b", keys[i].data(), keys[i].size(), values[i].data(),
                           values[i].size()) != REDIS_OK) {
      return ContextError(c_, "SET");
    }
  }
  for (size_t i = 0; i < keys.size(); ++i) KVTIER_RETURN_IF_ERROR(ExpectStatus(c_, "SET", "OK"));
  return absl::OkStatus();
}

absl::Status RespClient::GetMany(const std::vector<std::string>& keys,
                                 std::vector<std::string>* out) {
  out->resize(keys.size());
  for (const std::string& k : keys) {
    if (redisAppendCommand(c_, "GET %b", k.data(), k.size()) != REDIS_OK) {
      return ContextError(c_, "GET");
    }
  }
  absl::Status first;
  for (size_t i = 0; i < keys.size(); ++i) {  // every reply is read, whatever happens
    Reply reply;
    absl::Status st = Next(c_, &reply, "GET");
    if (st.ok() && reply.r->type == REDIS_REPLY_NIL) {
      st = absl::NotFoundError(absl::StrFormat("redis GET: no key '%s'", keys[i]));
    } else if (st.ok() && reply.r->type != REDIS_REPLY_STRING) {
      st = absl::InternalError(
          absl::StrFormat("redis GET: unexpected reply (type %d)", reply.r->type));
    } else if (st.ok()) {
      (*out)[i].assign(reply.r->str, reply.r->len);
    }
    if (first.ok()) first = st;
    if (absl::IsUnavailable(st)) return st;  // the connection is gone: no more replies
  }
  return first;
}

absl::Status RespClient::Ping() {
  if (redisAppendCommand(c_, "PING") != REDIS_OK) return ContextError(c_, "PING");
  return ExpectStatus(c_, "PING", "PONG");
}

absl::Status RespClient::FlushAll() {
  if (redisAppendCommand(c_, "FLUSHALL") != REDIS_OK) return ContextError(c_, "FLUSHALL");
  return ExpectStatus(c_, "FLUSHALL", "OK");
}

}  // namespace kvtier::bench
