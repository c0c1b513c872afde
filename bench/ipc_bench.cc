#include "bench/ipc_bench.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/kvtierd_child.h"
#include "bench/redis_server.h"
#include "bench/resp_client.h"
#include "core/status.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ops.h"
#include "kvtier/client.h"
#include "kvtier/device.h"
#include "kvtier/v1/kvtier.grpc.pb.h"

namespace kvtier::bench {
namespace {

namespace pb = ::kvtier::v1;
using Clock = std::chrono::steady_clock;

constexpr char kTenant[] = "bench";
constexpr uint64_t kMaxMessageBytes = 4 << 20;  // the daemon's, and the raw gRPC channel's
constexpr int32_t kBudgetTokens = 512;          // the sessions' working set, when they are longer
// Tokens per Append of the shm path: the pages arrive as a chunked prefill would send them.
constexpr int64_t kAppendTokens = 2048;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
double Gbps(int64_t bytes, double seconds) { return seconds > 0 ? bytes / seconds / 1e9 : 0; }

// Adds `key` (the median) and key_p10 / key_p90 to `j`.
void AddSpread(JsonObject& j, const std::string& key, const Spread& s) {
  j.Add(key, s.median).Add(key + "_p10", s.p10).Add(key + "_p90", s.p90);
}

// The daemon's configuration: its sockets in `dir`, TCP and (for the /metrics section)
// metrics on ephemeral loopback ports, one tenant with room for two sessions of
// bytes_per_run at once (plus their directories) or two of the /metrics section's replay,
// whichever is more (the sections run one after the other), and sessions long enough for
// bytes_per_run of the smallest page and for the replay.
std::string DaemonConfigToml(const std::string& dir, const IpcBenchOptions& o) {
  int64_t max_tokens = std::max<int64_t>(o.bytes_per_run / 16384 * 32, 131072);
  int64_t host_bytes = 2 * o.bytes_per_run + (int64_t{64} << 20);
  if (o.scrape) {
    max_tokens = std::max(max_tokens, IpcScrapeSessionTokens(o.scraping));
    host_bytes = std::max(host_bytes, IpcScrapeHostBytes(o.scraping));
  }
  return absl::StrFormat(
      "[server]\nunix_socket = \"%s/kvtierd.sock\"\ntcp_address = \"127.0.0.1:0\"\n"
      "max_message_bytes = %d\nshutdown_grace_ms = 5000\n"
      "[limits]\nmax_tokens_per_session = %d\n"
      "%s"
      "[log]\nlevel = \"info\"\n"
      "[[tenant]]\nname = \"%s\"\nhost_memory_bytes = %d\nhugepages = \"auto\"\nlock = false\n",
      dir, kMaxMessageBytes, max_tokens, o.scrape ? "[metrics]\naddress = \"127.0.0.1:0\"\n" : "",
      kTenant, host_bytes);
}

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

// The working set of a session of `pages` pages of 32 tokens: kBudgetTokens, or fewer for a
// short session (a whole number of 4 pages, the budget split's unit, and at least 4 pages).
int32_t BudgetTokens(int64_t pages) {
  return static_cast<int32_t>(std::clamp<int64_t>(pages / 4 * 4 * 32, 128, kBudgetTokens));
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
  req.mutable_retrieval()->set_budget_tokens(static_cast<uint32_t>(BudgetTokens(pages)));
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

// K and V of bytes_per_run / 2 each on the engine's device, random, for the shm path:
// [tokens][Hkv][d] at any of the page sizes (Hkv × tokens is the same for all of them).
struct DeviceKv {
  DeviceBuffer k, v;
};

absl::StatusOr<DeviceKv> MakeDeviceKv(Device& device, int64_t bytes_per_run) {
  const size_t half = static_cast<size_t>(bytes_per_run / 2);
  std::string host(half, '\0');
  std::mt19937_64 rng(11);
  DeviceKv kv;
  KVTIER_ASSIGN_OR_RETURN(kv.k, device.Allocate(half));
  KVTIER_ASSIGN_OR_RETURN(kv.v, device.Allocate(half));
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device.CreateStream());
  for (DeviceBuffer* b : {&kv.k, &kv.v}) {
    for (size_t i = 0; i + 8 <= host.size(); i += 8) {
      const uint64_t x = rng() & 0x3bff3bff3bff3bffULL;  // finite fp16 values
      std::memcpy(&host[i], &x, 8);
    }
    KVTIER_RETURN_IF_ERROR(device.Copy(*stream, b->data(), host.data(), half));
    KVTIER_RETURN_IF_ERROR(stream->Synchronize());
  }
  return kv;
}

struct ShmTimes {
  double open_s = 0;   // OpenSession: arena attach and mapping (the Client's first), region,
                       // sequence
  double data_s = 0;   // every page appended, through Flush
  double close_s = 0;  // Close through the session object's destruction
};

// shm through the client library against the daemon process: OpenSession (SHM), then the
// pages' tokens appended kAppendTokens per call and Flush, timed; then the daemon is asked
// how many tokens it sees committed (they must all be, untimed) and the session is closed
// (timed apart).
absl::StatusOr<ShmTimes> ShmWrite(Client& client, Device& device, const DeviceKv& kv,
                                  int64_t page_bytes, int64_t pages) {
  SessionOptions so;
  so.geometry = ToGeometry(GeometryFor(page_bytes));
  const Geometry& g = so.geometry;
  so.sequence.mode = RetrievalMode::kSpeculative;
  KVTIER_RETURN_IF_ERROR(so.sequence.SetBudgetTokens(BudgetTokens(pages), g.page_size));
  so.sequence.max_tokens = static_cast<int32_t>(pages * g.page_size);
  so.transport = Transport::kShm;
  so.device = &device;
  so.label = "ipc-bench";
  const int64_t tokens = pages * g.page_size;
  const size_t row = static_cast<size_t>(g.num_kv_heads) * g.head_dim * g.element_bytes();
  ShmTimes t;
  const auto t0 = Clock::now();
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Session> session, client.OpenSession(so));
  const auto t1 = Clock::now();
  Sequence& seq = session->sequence();
  for (int64_t first = 0; first < tokens; first += kAppendTokens) {
    const size_t at = static_cast<size_t>(first) * row;  // NHD: token-major
    const auto n = static_cast<int32_t>(std::min(kAppendTokens, tokens - first));
    KVTIER_RETURN_IF_ERROR(seq.Append(0, kv.k.as<uint8_t>() + at, kv.v.as<uint8_t>() + at, n));
  }
  KVTIER_RETURN_IF_ERROR(session->Flush());
  const auto t2 = Clock::now();
  t.open_s = Seconds(t1 - t0);
  t.data_s = Seconds(t2 - t1);
  KVTIER_ASSIGN_OR_RETURN(const SessionInfo info, session->Info());
  if (info.committed_tokens.empty() || info.committed_tokens[0] != tokens) {
    return absl::InternalError(absl::StrCat(
        "shm: the daemon sees ", info.committed_tokens.empty() ? 0 : info.committed_tokens[0],
        " tokens committed, want ", tokens));
  }
  const auto t3 = Clock::now();
  KVTIER_RETURN_IF_ERROR(session->Close());
  session.reset();
  t.close_s = Seconds(Clock::now() - t3);
  return t;
}

// The ceiling of the shm path's data on a cpu device: the offload op alone, as the session's
// stream runs it (on one thread, kBatchPages pages per op), from the engine's rows straight
// into host pages of a fresh (faulted-in) buffer: one read of K and V, one write of each HND
// page, the keys read again for their summaries. None of the rest: the working set's recent
// ring (which stays in the cache), the stream's hand-offs, the commits.
double OffloadFloor(const Geometry& g, const DeviceKv& kv, int64_t pages) {
  constexpr int64_t kBatchPages = 4;  // the sessions' recent ring (BudgetTokens)
  const size_t page_bytes = g.host_page_bytes();
  std::string host(static_cast<size_t>(pages) * page_bytes, '\0');
  std::string summaries(static_cast<size_t>(pages) * g.summary_bytes(), '\0');
  OffloadArgs a;
  a.shape = KvShapeOf(g);
  a.k_src = kv.k.data();  // NHD rows: slot i is page i
  a.v_src = kv.v.data();
  a.num_src_slots = pages;
  a.host_pages = host.data();
  a.num_host_pages = pages;
  a.summaries = summaries.data();
  a.num_summary_pages = pages;
  std::vector<OffloadItem> items(kBatchPages);
  const auto t0 = Clock::now();
  for (int64_t first = 0; first < pages; first += kBatchPages) {
    const int64_t n = std::min(kBatchPages, pages - first);
    for (int64_t i = 0; i < n; ++i) items[i] = OffloadItem{first + i, first + i, first + i};
    a.items = items.data();
    a.num_items = static_cast<int32_t>(n);
    if (!CpuOffload(a, /*pool=*/nullptr).ok()) return 0;
  }
  return Gbps(pages * static_cast<int64_t>(page_bytes), Seconds(Clock::now() - t0));
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

}  // namespace

absl::StatusOr<IpcBenchResult> RunIpcBench(const IpcBenchOptions& o, std::ostream& log) {
  if (o.bytes_per_run < (int64_t{1} << 20) || o.repeats < 1 || o.unary_calls < 10 ||
      o.redis_pipeline < 1) {
    return absl::InvalidArgumentError(
        "ipc: --bytes must be >= 1 MiB, --repeats >= 1, --unary-calls >= 10, "
        "--redis-pipeline >= 1");
  }
  if (o.scrape) KVTIER_RETURN_IF_ERROR(ValidateIpcScrapeOptions(o.scraping));
  KVTIER_ASSIGN_OR_RETURN(const std::string kvtierd, FindKvtierd(o.kvtierd));
  // The daemon first, before this process starts threads of its own (gRPC's, redis's): it is
  // forked, and the child only execs.
  KVTIER_ASSIGN_OR_RETURN(const TempDir dir, TempDir::Create("kvtier-ipc"));
  KVTIER_ASSIGN_OR_RETURN(
      std::unique_ptr<KvtierdProcess> daemon,
      KvtierdProcess::Start(kvtierd, dir.path(), DaemonConfigToml(dir.path(), o)));
  const std::string uds = "unix:" + daemon->unix_socket();
  const std::string tcp = absl::StrCat("127.0.0.1:", daemon->tcp_port());
  ClientOptions co;
  co.tenant = kTenant;
  co.client_name = "kvtier-bench ipc";
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Client> client,
                          Client::Connect("unix://" + daemon->unix_socket(), co));
  if (!client->capabilities().shm_available) {
    return absl::FailedPreconditionError("ipc: kvtierd offers no shared-memory attach");
  }
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(static_cast<int>(kMaxMessageBytes));
  args.SetMaxReceiveMessageSize(static_cast<int>(kMaxMessageBytes));
  auto stub =
      pb::KvTier::NewStub(grpc::CreateCustomChannel(uds, grpc::InsecureChannelCredentials(), args));

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
  // The engine's device of the shm path (the arena is registered with it at each attach).
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, CreateDevice(DeviceKind::kCpu));
  KVTIER_ASSIGN_OR_RETURN(const DeviceKv kv, MakeDeviceKv(*device, o.bytes_per_run));

  log << absl::StreamFormat(
      "kvtier-bench ipc: kvtierd %s as its own process (pid %d), %d MiB per run, median of %d "
      "(p10-p90 below it), GB/s; redis pipeline %d; commit %s\n",
      client->capabilities().server_version, daemon->pid(), o.bytes_per_run >> 20, o.repeats,
      o.redis_pipeline, Commit());
  log << absl::StreamFormat("%8s %11s %11s %11s %11s %11s %11s %11s %8s %9s %9s\n", "page",
                            "memcpy", "offload op", "shm", "grpc off", "grpc fetch", "redis SET",
                            "redis GET", "shm/SET", "shm open", "shm close");
  JsonObject pages_json;
  struct {
    Spread shm, off, fetch, set, get, open, close;
    double ratio = 0;
  } top;  // the last page size's
  for (int64_t page_bytes : o.page_bytes) {
    const int64_t pages = o.bytes_per_run / page_bytes;
    const int64_t bytes = pages * page_bytes;
    const Source src(page_bytes);
    std::vector<double> memcpy_s, floor_s, shm_s, open_ms, close_ms, off_s, fetch_s, set_s, get_s;
    for (int32_t i = 0; i < o.repeats; ++i) {
      memcpy_s.push_back(MemcpyPeak(page_bytes, pages, src));
      floor_s.push_back(OffloadFloor(ToGeometry(GeometryFor(page_bytes)), kv, pages));
      KVTIER_ASSIGN_OR_RETURN(const ShmTimes shm,
                              ShmWrite(*client, *device, kv, page_bytes, pages));
      shm_s.push_back(Gbps(bytes, shm.data_s));
      open_ms.push_back(shm.open_s * 1e3);
      close_ms.push_back(shm.close_s * 1e3);
      KVTIER_ASSIGN_OR_RETURN(const GrpcRates g, GrpcOffloadFetch(*stub, page_bytes, pages, src));
      off_s.push_back(g.offload_gbps);
      fetch_s.push_back(g.fetch_gbps);
      if (redis != nullptr) {
        KVTIER_ASSIGN_OR_RETURN(const RedisRates r,
                                RedisSetGet(*redis, page_bytes, pages, o.redis_pipeline, src));
        set_s.push_back(r.set_gbps);
        get_s.push_back(r.get_gbps);
      }
    }
    const Spread memcpy_gbps = SpreadOf(memcpy_s), floor = SpreadOf(floor_s), shm = SpreadOf(shm_s),
                 open = SpreadOf(open_ms),
                 close = SpreadOf(close_ms), off = SpreadOf(off_s), fetch = SpreadOf(fetch_s),
                 set = SpreadOf(set_s), get = SpreadOf(get_s);
    const double ratio = set.median > 0 ? shm.median / set.median : 0;
    const auto range = [](const Spread& s) { return absl::StrFormat("%.2f-%.2f", s.p10, s.p90); };
    log << absl::StreamFormat(
        "%7lldK %11.2f %11.2f %11.2f %11.2f %11.2f %11.2f %11.2f %7.1fx %6.2f ms %6.2f ms\n",
        page_bytes >> 10, memcpy_gbps.median, floor.median, shm.median, off.median, fetch.median,
        set.median, get.median, ratio, open.median, close.median);
    log << absl::StreamFormat("%8s %11s %11s %11s %11s %11s %11s %11s %8s %9s %9s\n", "",
                              range(memcpy_gbps), range(floor), range(shm), range(off),
                              range(fetch), range(set), range(get), "", range(open), range(close));
    JsonObject p;
    p.Add("page_bytes", page_bytes).Add("pages", pages);
    AddSpread(p, "memcpy_gbps", memcpy_gbps);
    AddSpread(p, "offload_floor_gbps", floor);
    AddSpread(p, "shm_gbps", shm);
    AddSpread(p, "shm_open_ms", open);
    AddSpread(p, "shm_close_ms", close);
    p.Add("shm_fraction_of_memcpy", memcpy_gbps.median > 0 ? shm.median / memcpy_gbps.median : 0.0)
        .Add("floor_fraction_of_memcpy",
             memcpy_gbps.median > 0 ? floor.median / memcpy_gbps.median : 0.0)
        .Add("shm_fraction_of_floor", floor.median > 0 ? shm.median / floor.median : 0.0);
    AddSpread(p, "grpc_offload_gbps", off);
    AddSpread(p, "grpc_fetch_gbps", fetch);
    AddSpread(p, "redis_set_gbps", set);
    AddSpread(p, "redis_get_gbps", get);
    p.Add("shm_over_redis_set", ratio);
    pages_json.AddObject(absl::StrCat(page_bytes), p);
    if (page_bytes == o.page_bytes.back()) top = {shm, off, fetch, set, get, open, close, ratio};
  }
  KVTIER_ASSIGN_OR_RETURN(Latency lu, UnaryRoundTrip(uds, o.unary_calls));
  KVTIER_ASSIGN_OR_RETURN(Latency lt, UnaryRoundTrip(tcp, o.unary_calls));
  log << absl::StreamFormat(
      "unary Hello round trip: unix p50 %.1f us p99 %.1f us; "
      "tcp p50 %.1f us p99 %.1f us\n",
      lu.p50_us, lu.p99_us, lt.p50_us, lt.p99_us);
  if (!redis_note.empty()) log << "redis baseline skipped: " << redis_note << "\n";
  const std::string server_version = client->capabilities().server_version;
  stub.reset();
  client.reset();
  std::optional<IpcScrapeResult> scraped;
  if (o.scrape) {
    KVTIER_ASSIGN_OR_RETURN(scraped, RunIpcScrape(o.scraping, daemon->unix_socket(), kTenant, log));
  }
  KVTIER_RETURN_IF_ERROR(daemon->Stop());

  JsonObject out;
  out.Add("bench", "ipc")
      .Add("commit", Commit())
      .Add("host", HostCpu())
      .Add("time", UtcNow())
      .Add("daemon", "kvtierd in its own process")
      .Add("kvtierd_version", server_version)
      .Add("shm_path",
           "client library: OpenSession (SHM, arena attached over the attach socket), Append "
           "2048 tokens per call on a cpu device, Flush")
      .Add("bytes_per_run", o.bytes_per_run)
      .Add("repeats", static_cast<int64_t>(o.repeats))
      .Add("statistic", "median over repeats, with p10/p90")
      .Add("redis_pipeline", static_cast<int64_t>(o.redis_pipeline))
      .Add("redis_version", redis_server ? redis_server->version() : std::string("none"))
      .Add("page_bytes", o.page_bytes.back());
  AddSpread(out, "shm_gbps", top.shm);
  AddSpread(out, "grpc_offload_gbps", top.off);
  AddSpread(out, "grpc_fetch_gbps", top.fetch);
  AddSpread(out, "redis_set_gbps", top.set);
  AddSpread(out, "redis_get_gbps", top.get);
  AddSpread(out, "shm_open_ms", top.open);
  AddSpread(out, "shm_close_ms", top.close);
  out.Add("shm_over_redis_set", top.ratio)
      .AddObject("pages", pages_json)
      .Add("unary_calls", static_cast<int64_t>(o.unary_calls))
      .Add("unary_p50_us_uds", lu.p50_us)
      .Add("unary_p99_us_uds", lu.p99_us)
      .Add("unary_p50_us_tcp", lt.p50_us)
      .Add("unary_p99_us_tcp", lt.p99_us);
  if (scraped.has_value()) out.AddObject("scrape", scraped->report);
  return IpcBenchResult{std::move(out), scraped.has_value() ? scraped->scrape_failures : 0};
}

}  // namespace kvtier::bench
