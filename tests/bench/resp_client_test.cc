// The Redis baseline's client against a real redis-server (skipped when the binary is not
// installed): what SET stores, GET returns byte for byte, including binary values with CRLF
// and NUL bytes, across pipelined batches.
#include "bench/resp_client.h"

#include <string>
#include <vector>

#include "bench/redis_server.h"
#include "gtest/gtest.h"

namespace kvtier::bench {
namespace {

class RedisTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = RedisServer::Start();
    if (absl::IsNotFound(s.status())) GTEST_SKIP() << s.status();
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    auto c = RespClient::ConnectUnix(server_->socket_path());
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
  }
  std::unique_ptr<RedisServer> server_;
  std::unique_ptr<RespClient> client_;
};

TEST_F(RedisTest, SetThenGetReturnsTheSameBytes) {
  std::vector<std::string> keys, values;
  for (int i = 0; i < 40; ++i) {
    keys.push_back("page:" + std::to_string(i));
    std::string v(16384 + i, '\0');
    for (size_t j = 0; j < v.size(); ++j) v[j] = static_cast<char>((j * 31 + i) & 0xff);
    v[5] = '\r';
    v[6] = '\n';
    values.push_back(std::move(v));
  }
  std::vector<std::string_view> views(values.begin(), values.end());
  ASSERT_TRUE(client_->SetMany(keys, views).ok());
  std::vector<std::string> got;
  ASSERT_TRUE(client_->GetMany(keys, &got).ok());
  ASSERT_EQ(got.size(), values.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], values[i]) << keys[i];
}

TEST_F(RedisTest, MissingKeyIsNotFoundAndFlushAllEmpties) {
  ASSERT_TRUE(client_->SetMany({"x"}, {"1"}).ok());
  ASSERT_TRUE(client_->FlushAll().ok());
  std::vector<std::string> got;
  EXPECT_TRUE(absl::IsNotFound(client_->GetMany({"x"}, &got)));
  EXPECT_TRUE(client_->Ping().ok());
}

TEST(RespClientTest, NothingListeningIsUnavailable) {
  auto c = RespClient::ConnectUnix("/nonexistent-kvtier-dir/redis.sock");
  EXPECT_TRUE(absl::IsUnavailable(c.status())) << c.status();
}

}  // namespace
}  // namespace kvtier::bench
