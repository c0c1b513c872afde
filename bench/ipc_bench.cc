#include "bench/ipc_bench.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/redis_server.h"
#include "bench/resp_client.h"
#include "client/shm_attach.h"
#include "core/status.h"
#include "daemon/config.h"
#include "daemon/daemon.h"
#include "daemon/logging.h"
#include "kvtier/v1/kvtier.grpc.pb.h"
#include "offload/session_region.h"

namespace kvtier::bench {
namespace {

namespace pb = ::kvtier::v1;
using Clock = std::chrono::steady_clock;

constexpr char kTenant[] = "bench";

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
double Gbps(int64_t bytes, double seconds) { return seconds > 0 ? bytes / seconds / 1e9 : 0; }

absl::Status FromGrpc(const grpc::Status& s, std::string_view what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(std::string(what), ": ", s.error_message()));
}

void Authorize(grpc::ClientContext* ctx) { ctx->AddMetadata("x-kvtier-tenant", kTenant); }

// The geometry whose host page is `page_bytes`: p = 32, d = 128, fp16, Hkv = bytes / 16 KiB.
pb::Geometry GeometryFor(int64_t page_bytes) {
  pb::Geometry g;
  const uint32_t hkv = static_cast<uint32_t>(page_bytes / 16384);
  g.set_num_layers(1);
  g.set_num_kv_heads(hkv);
  g.set_num_q_heads(hkv * 4);
  g.set_head_dim(128);
  g.set_page_size(32);
  g.set_dtype(pb::DTYPE_FP16);
  return g;
}

Geometry ToGeometry(const pb::Geometry& p) {
  Geometry g;
  g.num_layers = static_cast<int32_t>(p.num_layers());
  g.num_q_heads = static_cast<int32_t>(p.num_q_heads());
  g.num_kv_heads = static_cast<int32_t>(p.num_kv_heads());
  g.head_dim = static_cast<int32_t>(p.head_dim());
  g.page_size = static_cast<int32_t>(p.page_size());
  g.dtype = DType::kF16;
  return g;
}

absl::StatusOr<pb::SessionInfo> Open(pb::KvTier::Stub& stub, int64_t page_bytes, int64_t pages,
                                     pb::Transport transport) {
  grpc::ClientContext ctx;
  Authorize(&ctx);
  pb::OpenSessionRequest req;
  req.set_tenant(kTenant);
  *req.mutable_geometry() = GeometryFor(page_bytes);
  req.mutable_retrieval()->set_mode(pb::MODE_SPECULATIVE);
  req.mutable_retrieval()->set_budget_tokens(512);
  req.mutable_retrieval()->set_max_tokens(static_cast<uint32_t>(pages * 32));
  req.set_transport(transport);
  req.set_label("ipc-bench");
  pb::OpenSessionReply reply;
  KVTIER_RETURN_IF_ERROR(FromGrpc(stub.OpenSession(&ctx, req, &reply), "OpenSession"));
  return reply.session();
}

absl::Status Close(pb::KvTier::Stub& stub, const std::string& id) {
  grpc::ClientContext ctx;
  Authorize(&ctx);
  pb::CloseSessionRequest req;
  req.set_session_id(id);
  pb::CloseSessionReply reply;
  return FromGrpc(stub.CloseSession(&ctx, req, &reply), "CloseSession");
}

// Page-sized source data: a buffer larger than the caches, read round-robin.
struct Source {
  explicit Source(int64_t page_bytes) : page(page_bytes) {
    const int64_t n = std::max<int64_t>(1, (int64_t{64} << 20) / page_bytes);
    data.resize(static_cast<size_t>(n * page_bytes));
    std::mt19937_64 rng(7);
    for (size_t i = 0; i + 8 <= data.size(); i += 8) {
      const uint64_t x = rng();
      std::memcpy(&data[i], &x, 8);
    }
    count = n;
  }
  const char* Page(int64_t i) const { return data.data() + (i % count) * page; }
  int64_t page;
  int64_t count;
  std::string data;
};

// shm: copy each page into its slot of the session region, then commit its stamp.
// The arena is mapped once, as an engine maps it once for all its sessions.
absl::StatusOr<double> ShmWrite(pb::KvTier::Stub& stub, const AttachedArena& att,
                                int64_t page_bytes, int64_t pages, const Source& src) {
  KVTIER_ASSIGN_OR_RETURN(pb::SessionInfo info, Open(stub, page_bytes, pages, pb::TRANSPORT_SHM));
  char* base = static_cast<char*>(att.arena->data()) + info.region_offset();
  KVTIER_ASSIGN_OR_RETURN(
      SessionRegion region,
      SessionRegion::Open(base, info.region_bytes(), ToGeometry(info.geometry())));
  if (region.num_slots() < pages) {
    return absl::InternalError(absl::StrCat("region has ", region.num_slots(), " slots"));
  }
  const uint64_t epoch = region.epoch();
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < pages; ++i) {
    std::memcpy(const_cast<void*>(region.SlotData(i)), src.Page(i), static_cast<size_t>(page_bytes));
    KVTIER_RETURN_IF_ERROR(region.Commit(0, i, i, 1, epoch));
  }
  const double s = Seconds(Clock::now() - t0);
  if (region.CommittedPrefix(0) != pages) return absl::InternalError("shm: pages not committed");
  KVTIER_RETURN_IF_ERROR(Close(stub, info.session_id()));
  return Gbps(pages * page_bytes, s);
}

// The same bytes copied between two private buffers: the ceiling of any copy-in path.
double MemcpyPeak(int64_t page_bytes, int64_t pages, const Source& src) {
  std::string dst(static_cast<size_t>(pages * page_bytes), '\0');  // zero-filled: faulted in
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < pages; ++i) {
    std::memcpy(dst.data() + i * page_bytes, src.Page(i), static_cast<size_t>(page_bytes));
  }
  const double s = Seconds(Clock::now() - t0);
  if (dst[static_cast<size_t>(page_bytes) - 1] != src.Page(0)[page_bytes - 1]) return 0;
  return Gbps(pages * page_bytes, s);
}

struct GrpcRates {
  double offload_gbps = 0;
  double fetch_gbps = 0;
};

// gRPC: one Offload stream of `pages` one-page messages (K and V of p tokens), then one
// Fetch of all of them.
absl::StatusOr<GrpcRates> GrpcOffloadFetch(pb::KvTier::Stub& stub, int64_t page_bytes,
                                           int64_t pages, const Source& src) {
  KVTIER_ASSIGN_OR_RETURN(pb::SessionInfo info, Open(stub, page_bytes, pages, pb::TRANSPORT_GRPC));
  GrpcRates r;
  const int64_t half = page_bytes / 2;
  {
    grpc::ClientContext ctx;
    Authorize(&ctx);
    pb::OffloadReply reply;
    auto writer = stub.Offload(&ctx, &reply);
    pb::OffloadRequest msg;
    msg.set_session_id(info.session_id());
    msg.set_layer(0);
    msg.set_num_tokens(32);
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < pages; ++i) {
      msg.set_k(src.Page(i), static_cast<size_t>(half));
      msg.set_v(src.Page(i) + half, static_cast<size_t>(half));
      msg.set_commit(i + 1 == pages);
      if (!writer->Write(msg)) break;
    }
    writer->WritesDone();
    KVTIER_RETURN_IF_ERROR(FromGrpc(writer->Finish(), "Offload"));
    r.offload_gbps = Gbps(pages * page_bytes, Seconds(Clock::now() - t0));
    if (reply.committed_tokens() != static_cast<uint64_t>(pages * 32)) {
      return absl::InternalError(
          absl::StrCat("Offload committed ", reply.committed_tokens(), " tokens"));
    }
  }
  {
    grpc::ClientContext ctx;
    Authorize(&ctx);
    pb::FetchRequest req;
    req.set_session_id(info.session_id());
    req.set_layer(0);
    const auto t0 = Clock::now();
    auto reader = stub.Fetch(&ctx, req);
    pb::FetchReply reply;
    int64_t got = 0;
    while (reader->Read(&reply)) {
      for (const pb::Page& p : reply.pages()) got += static_cast<int64_t>(p.data().size());
    }
    KVTIER_RETURN_IF_ERROR(FromGrpc(reader->Finish(), "Fetch"));
    r.fetch_gbps = Gbps(got, Seconds(Clock::now() - t0));
    if (got != pages * page_bytes) {
      return absl::InternalError(absl::StrCat("Fetch returned ", got, " bytes"));
    }
  }
  KVTIER_RETURN_IF_ERROR(Close(stub, info.session_id()));
  return r;
}

struct RedisRates {
  double set_gbps = 0;
  double get_gbps = 0;
};

absl::StatusOr<RedisRates> RedisSetGet(RespClient& redis, int64_t page_bytes, int64_t pages,
                                       int32_t depth, const Source& src) {
  KVTIER_RETURN_IF_ERROR(redis.FlushAll());
  RedisRates r;
  std::vector<std::string> keys;
  std::vector<std::string_view> values;
  auto t0 = Clock::now();
  for (int64_t i = 0; i < pages; i += depth) {
    keys.clear();
    values.clear();
    for (int64_t j = i; j < std::min<int64_t>(pages, i + depth); ++j) {
      keys.push_back(absl::StrCat("kv:0:", j));
      values.emplace_back(src.Page(j), static_cast<size_t>(page_bytes));
    }
    KVTIER_RETURN_IF_ERROR(redis.SetMany(keys, values));
  }
  r.set_gbps = Gbps(pages * page_bytes, Seconds(Clock::now() - t0));
  std::vector<std::string> got;
  int64_t bytes = 0;
  t0 = Clock::now();
  for (int64_t i = 0; i < pages; i += depth) {
    keys.clear();
    for (int64_t j = i; j < std::min<int64_t>(pages, i + depth); ++j) {
      keys.push_back(absl::StrCat("kv:0:", j));
    }
    KVTIER_RETURN_IF_ERROR(redis.GetMany(keys, &got));
    for (const std::string& g : got) bytes += static_cast<int64_t>(g.size());
  }
  r.get_gbps = Gbps(bytes, Seconds(Clock::now() - t0));
  if (bytes != pages * page_bytes) return absl::InternalError("redis GET returned short values");
  return r;
}

struct Latency {
  double p50_us = 0;
  double p99_us = 0;
};

absl::StatusOr<Latency> UnaryRoundTrip(const std::string& target, int32_t calls) {
  grpc::ChannelArguments args;
  auto channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  auto stub = pb::KvTier::NewStub(channel);
  std::vector<double> us;
  us.reserve(static_cast<size_t>(calls));
  pb::HelloRequest req;
  req.set_protocol_version(1);
  req.set_client_name("kvtier-bench ipc");
  for (int32_t i = -calls / 10; i < calls; ++i) {  // the first tenth warms up, not counted
    grpc::ClientContext ctx;
    Authorize(&ctx);
    pb::HelloReply reply;
    const auto t0 = Clock::now();
    KVTIER_RETURN_IF_ERROR(FromGrpc(stub->Hello(&ctx, req, &reply), "Hello"));
    if (i >= 0) us.push_back(Seconds(Clock::now() - t0) * 1e6);
  }
  std::sort(us.begin(), us.end());
  Latency l;
  l.p50_us = us[us.size() / 2];
  l.p99_us = us[std::min(us.size() - 1, us.size() * 99 / 100)];
  return l;
}

template <typename F>
auto BestOf(int32_t repeats, F&& f) -> decltype(f()) {
  auto best = f();
  for (int32_t i = 1; i < repeats && best.ok(); ++i) {
    auto next = f();
    if (!next.ok()) return next;
    if (*next > *best) best = std::move(next);
  }
  return best;
}

}  // namespace

absl::StatusOr<JsonObject> RunIpcBench(const IpcBenchOptions& o, std::ostream& log) {
  if (o.bytes_per_run < (int64_t{1} << 20) || o.repeats < 1 || o.unary_calls < 10 ||
      o.redis_pipeline < 1) {
    return absl::InvalidArgumentError(
        "ipc: --bytes must be >= 1 MiB, --repeats >= 1, --unary-calls >= 10, "
        "--redis-pipeline >= 1");
  }
  char tmpl[] = "/tmp/kvtier-ipc-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp failed");
  const std::string dir = tmpl;
  daemon::DaemonConfig config = daemon::DefaultConfig();
  config.unix_socket = dir + "/kvtierd.sock";
  config.attach_socket = dir + "/kvtierd.attach";
  config.tcp_address = "127.0.0.1:0";
  config.max_message_bytes = 4 << 20;
  config.max_tokens_per_session =
      static_cast<uint32_t>(std::max<int64_t>(o.bytes_per_run / 16384 * 32, 131072));
  config.log_level = "warn";
  daemon::TenantConfig tenant;
  tenant.name = kTenant;
  // Two sessions of bytes_per_run may be open at once (shm, then grpc), plus directories.
  tenant.host_memory_bytes = static_cast<uint64_t>(2 * o.bytes_per_run + (int64_t{64} << 20));
  tenant.hugepages = "auto";
  tenant.lock = false;
  config.tenants = {tenant};
  KVTIER_RETURN_IF_ERROR(daemon::SetUpLogging(config));
  KVTIER_ASSIGN_OR_RETURN(auto daemon, daemon::Daemon::Start(config));
  const std::string uds = "unix:" + daemon->unix_socket();
  const std::string tcp = absl::StrCat("127.0.0.1:", daemon->tcp_port());
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(static_cast<int>(config.max_message_bytes));
  args.SetMaxReceiveMessageSize(static_cast<int>(config.max_message_bytes));
  auto stub = pb::KvTier::NewStub(
      grpc::CreateCustomChannel(uds, grpc::InsecureChannelCredentials(), args));

  std::unique_ptr<RedisServer> redis_server;
  std::unique_ptr<RespClient> redis;
  std::string redis_note;
  if (o.redis) {
    auto started = RedisServer::Start();
    if (started.ok()) {
      redis_server = std::move(*started);
      KVTIER_ASSIGN_OR_RETURN(redis, RespClient::ConnectUnix(redis_server->socket_path()));
    } else {
      redis_note = started.status().ToString();
    }
  }

  log << absl::StreamFormat(
      "kvtier-bench ipc: %d MiB per run, best of %d, GB/s; redis pipeline %d; commit %s\n",
      o.bytes_per_run >> 20, o.repeats, o.redis_pipeline, Commit());
  KVTIER_ASSIGN_OR_RETURN(AttachedArena arena,
                          AttachToArena(daemon->attach_socket(), kTenant, ""));
  log << absl::StreamFormat("%8s %8s %8s %9s %10s %9s %9s %9s\n", "page", "memcpy", "shm",
                            "grpc off", "grpc fetch", "redis SET", "redis GET", "shm/SET");
  JsonObject pages_json;
  double top_shm = 0, top_off = 0, top_fetch = 0, top_set = 0, top_get = 0;
  for (int64_t page_bytes : o.page_bytes) {
    const int64_t pages = o.bytes_per_run / page_bytes;
    const Source src(page_bytes);
    double memcpy_gbps = 0;
    for (int32_t i = 0; i < o.repeats; ++i) {
      memcpy_gbps = std::max(memcpy_gbps, MemcpyPeak(page_bytes, pages, src));
    }
    KVTIER_ASSIGN_OR_RETURN(double shm, BestOf(o.repeats, [&] {
                              return ShmWrite(*stub, arena, page_bytes, pages, src);
                            }));
    GrpcRates grpc_best;
    for (int32_t i = 0; i < o.repeats; ++i) {
      KVTIER_ASSIGN_OR_RETURN(GrpcRates g, GrpcOffloadFetch(*stub, page_bytes, pages, src));
      grpc_best.offload_gbps = std::max(grpc_best.offload_gbps, g.offload_gbps);
      grpc_best.fetch_gbps = std::max(grpc_best.fetch_gbps, g.fetch_gbps);
    }
    RedisRates redis_best;
    if (redis != nullptr) {
      for (int32_t i = 0; i < o.repeats; ++i) {
        KVTIER_ASSIGN_OR_RETURN(RedisRates r,
                                RedisSetGet(*redis, page_bytes, pages, o.redis_pipeline, src));
        redis_best.set_gbps = std::max(redis_best.set_gbps, r.set_gbps);
        redis_best.get_gbps = std::max(redis_best.get_gbps, r.get_gbps);
      }
    }
    const double ratio = redis_best.set_gbps > 0 ? shm / redis_best.set_gbps : 0;
    log << absl::StreamFormat("%7lldK %8.2f %8.2f %9.2f %10.2f %9.2f %9.2f %8.1fx\n",
                              page_bytes >> 10, memcpy_gbps, shm, grpc_best.offload_gbps,
                              grpc_best.fetch_gbps, redis_best.set_gbps, redis_best.get_gbps,
                              ratio);
    JsonObject p;
    p.Add("page_bytes", page_bytes)
        .Add("pages", pages)
        .Add("memcpy_gbps", memcpy_gbps)
        .Add("shm_gbps", shm)
        .Add("shm_fraction_of_memcpy", memcpy_gbps > 0 ? shm / memcpy_gbps : 0.0)
        .Add("grpc_offload_gbps", grpc_best.offload_gbps)
        .Add("grpc_fetch_gbps", grpc_best.fetch_gbps)
        .Add("redis_set_gbps", redis_best.set_gbps)
        .Add("redis_get_gbps", redis_best.get_gbps)
        .Add("shm_over_redis_set", ratio);
    pages_json.AddObject(absl::StrCat(page_bytes), p);
    if (page_bytes == o.page_bytes.back()) {
      top_shm = shm;
      top_off = grpc_best.offload_gbps;
      top_fetch = grpc_best.fetch_gbps;
      top_set = redis_best.set_gbps;
      top_get = redis_best.get_gbps;
    }
  }
  KVTIER_ASSIGN_OR_RETURN(Latency lu, UnaryRoundTrip(uds, o.unary_calls));
  KVTIER_ASSIGN_OR_RETURN(Latency lt, UnaryRoundTrip(tcp, o.unary_calls));
  log << absl::StreamFormat("unary Hello round trip: unix p50 %.1f us p99 %.1f us; "
                            "tcp p50 %.1f us p99 %.1f us\n",
                            lu.p50_us, lu.p99_us, lt.p50_us, lt.p99_us);
  if (!redis_note.empty()) log << "redis baseline skipped: " << redis_note << "\n";

  JsonObject out;
  out.Add("bench", "ipc")
      .Add("commit", Commit())
      .Add("host", HostCpu())
      .Add("time", UtcNow())
      .Add("bytes_per_run", o.bytes_per_run)
      .Add("repeats", static_cast<int64_t>(o.repeats))
      .Add("redis_pipeline", static_cast<int64_t>(o.redis_pipeline))
      .Add("redis_version", redis_server ? redis_server->version() : std::string("none"))
      .Add("page_bytes", o.page_bytes.back())
      .Add("shm_gbps", top_shm)
      .Add("grpc_offload_gbps", top_off)
      .Add("grpc_fetch_gbps", top_fetch)
      .Add("redis_set_gbps", top_set)
      .Add("redis_get_gbps", top_get)
      .Add("shm_over_redis_set", top_set > 0 ? top_shm / top_set : 0.0)
      .AddObject("pages", pages_json)
      .Add("unary_calls", static_cast<int64_t>(o.unary_calls))
      .Add("unary_p50_us_uds", lu.p50_us)
      .Add("unary_p99_us_uds", lu.p99_us)
      .Add("unary_p50_us_tcp", lt.p50_us)
      .Add("unary_p99_us_tcp", lt.p99_us);
  daemon->Shutdown();
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return out;
}

}  // namespace kvtier::bench
