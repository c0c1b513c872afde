// Test helpers shared by the SessionManager's tests: a configuration with three tenants on
// small arenas, a small fp32 geometry, NHD rows of K/V, Offload chunks of them, the HND page
// they make, and a fixture with a manager and open / offload / fetch helpers.
#ifndef KVTIER_TESTS_DAEMON_SESSION_MANAGER_TESTUTIL_H_
#define KVTIER_TESTS_DAEMON_SESSION_MANAGER_TESTUTIL_H_

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "daemon/session_manager.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "spdlog/spdlog.h"
#include "tests/testutil/random_fill.h"

namespace kvtier::daemon::session_manager_testing {

using ::kvtier::testing::TypedBuffer;

constexpr uint64_t kMiB = uint64_t{1} << 20;

inline TenantConfig MakeTenant(const std::string& name, const std::string& token, uint64_t bytes) {
  TenantConfig t;
  t.name = name;
  t.token = token;
  t.host_memory_bytes = bytes;
  t.hugepages = "off";
  t.lock = false;
  return t;
}

inline DaemonConfig TestConfig() {
  DaemonConfig c;
  c.admin_token = "admin-secret";
  c.cpu_threads = 2;
  c.max_sessions_per_tenant = 4;
  c.max_tokens_per_session = 1024;
  c.default_max_tokens = 256;
  c.max_layers = 8;
  c.max_tokens_per_offload = 256;
  c.tenants = {MakeTenant("a", "tok-a", 8 * kMiB), MakeTenant("b", "", 8 * kMiB),
               MakeTenant("small", "", 1 * kMiB)};
  return c;
}

inline Geometry SmallGeometry() {
  Geometry g;
  g.num_layers = 2;
  g.num_q_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 16;
  g.page_size = 8;
  g.dtype = DType::kF32;
  return g;
}

inline OpenSessionParams GrpcParams(const std::string& tenant) {
  OpenSessionParams p;
  p.tenant = tenant;
  p.geometry = SmallGeometry();
  p.max_tokens = 256;
  p.budget_tokens = 64;  // 2 sink + 4 selected + 2 recent pages
  p.transport = Transport::kGrpc;
  p.label = "test";
  return p;
}

inline OpenSessionParams ShmParams(const std::string& tenant) {
  OpenSessionParams p = GrpcParams(tenant);
  p.transport = Transport::kShm;
  return p;
}

inline std::string Bytes(const TypedBuffer& b) {
  return std::string(static_cast<const char*>(b.data()), b.bytes());
}

// K and V rows of one layer, NHD [n][Hkv][d].
struct Rows {
  Rows(const Geometry& g, int32_t n, uint64_t seed)
      : k(g.dtype, int64_t{n} * g.num_kv_heads * g.head_dim),
        v(g.dtype, int64_t{n} * g.num_kv_heads * g.head_dim) {
    k.FillNormal(seed);
    v.FillNormal(seed + 1);
  }
  TypedBuffer k, v;
};

inline OffloadChunk Chunk(const std::string& id, int32_t layer, const Rows& rows, int64_t first,
                          int64_t n, bool commit, const Geometry& g) {
  const size_t row = static_cast<size_t>(g.num_kv_heads) * g.head_dim * g.element_bytes();
  OffloadChunk c;
  c.session_id = id;
  c.layer = layer;
  c.num_tokens = n;
  c.k.assign(static_cast<const char*>(rows.k.data()) + first * row, n * row);
  c.v.assign(static_cast<const char*>(rows.v.data()) + first * row, n * row);
  c.commit = commit;
  return c;
}

class SessionManagerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::warn);
    manager_ = Make(TestConfig());
  }

  static std::unique_ptr<SessionManager> Make(const DaemonConfig& config) {
    absl::StatusOr<std::unique_ptr<SessionManager>> m = SessionManager::Create(config);
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? *std::move(m) : nullptr;
  }

  SessionRecord Open(const OpenSessionParams& p) {
    absl::StatusOr<SessionRecord> r = manager_->OpenSession(Caller{p.tenant}, p);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : SessionRecord{};
  }

  // Offloads `n` tokens of `rows` to every layer in chunks of `chunk`, committing at the end.
  OffloadResult OffloadAll(const std::string& tenant, const std::string& id,
                           const std::vector<Rows>& rows, int64_t first, int64_t n, int64_t chunk) {
    std::unique_ptr<OffloadStream> s = manager_->NewOffloadStream(Caller{tenant});
    const Geometry g = SmallGeometry();
    for (int32_t l = 0; l < g.num_layers; ++l) {
      for (int64_t t = first; t < first + n; t += chunk) {
        const int64_t m = std::min(chunk, first + n - t);
        EXPECT_TRUE(s->Add(Chunk(id, l, rows[l], t, m, false, g)).ok());
      }
    }
    absl::StatusOr<OffloadResult> r = s->Finish();
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : OffloadResult{};
  }

  std::vector<PageData> FetchAll(const Caller& caller, const std::string& id, int32_t layer,
                                 std::vector<int64_t> pages = {}) {
    absl::StatusOr<std::unique_ptr<FetchCursor>> c =
        manager_->StartFetch(caller, id, layer, std::move(pages));
    EXPECT_TRUE(c.ok()) << c.status();
    std::vector<PageData> out;
    while (c.ok() && !(*c)->done()) {
      absl::StatusOr<std::vector<PageData>> batch = (*c)->Next(uint64_t{1} << 20);
      EXPECT_TRUE(batch.ok()) << batch.status();
      if (!batch.ok()) break;
      for (PageData& p : *batch) out.push_back(std::move(p));
    }
    return out;
  }

  std::unique_ptr<SessionManager> manager_;
};

inline void ExpectError(const absl::Status& st, absl::StatusCode code,
                        const std::vector<std::string>& needles) {
  EXPECT_EQ(st.code(), code) << st;
  for (const std::string& n : needles)
    EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr(n));
}

// The HND host page `page` [Hkv][2][p][d] of NHD rows.
inline std::string ExpectedPage(const Geometry& g, const Rows& rows, int64_t page) {
  const int32_t p = g.page_size, d = g.head_dim, h_kv = g.num_kv_heads;
  const size_t e = g.element_bytes();
  std::string out(g.host_page_bytes(), '\0');
  for (int32_t h = 0; h < h_kv; ++h) {
    for (int32_t kv = 0; kv < 2; ++kv) {
      const auto* src = static_cast<const char*>(kv == 0 ? rows.k.data() : rows.v.data());
      for (int32_t t = 0; t < p; ++t) {
        const int64_t token = page * p + t;
        std::memcpy(&out[((static_cast<size_t>(h) * 2 + kv) * p + t) * d * e],
                    src + ((token * h_kv + h) * d) * e, d * e);
      }
    }
  }
  return out;
}

}  // namespace kvtier::daemon::session_manager_testing

#endif  // KVTIER_TESTS_DAEMON_SESSION_MANAGER_TESTUTIL_H_
