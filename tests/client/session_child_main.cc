// A client process for the reattach test: opens an SHM session, appends the prefill of the
// synthetic trace, flushes, prints the session id on stdout and waits to be killed.
//
//   kvtier_session_child TARGET TENANT TOKEN PREFILL SEED
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "kvtier/client.h"
#include "tests/client/integration_options.h"
#include "tests/client/session_trace.h"

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s TARGET TENANT TOKEN PREFILL SEED\n", argv[0]);
    return 2;
  }
  kvtier::ClientOptions co;
  co.tenant = argv[2];
  co.token = argv[3];
  auto client = kvtier::Client::Connect(argv[1], co);
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  kvtier::testing::TraceOptions to = kvtier::testing::IntegrationTrace();
  to.prefill = std::atoi(argv[4]);
  to.seed = std::strtoull(argv[5], nullptr, 10);
  const kvtier::testing::SyntheticTrace trace(to);
  kvtier::SessionOptions so = kvtier::testing::IntegrationSessionOptions(kvtier::Transport::kShm);
  auto session = (*client)->OpenSession(so);
  if (!session.ok()) {
    std::fprintf(stderr, "open: %s\n", session.status().ToString().c_str());
    return 1;
  }
  absl::Status st = kvtier::testing::AppendTokens(**session, trace, 0, to.prefill);
  if (st.ok()) st = (*session)->Flush();
  if (!st.ok()) {
    std::fprintf(stderr, "append: %s\n", st.ToString().c_str());
    return 1;
  }
  std::printf("%s\n", (*session)->id().c_str());
  std::fflush(stdout);
  for (;;) pause();  // until SIGKILL
}
