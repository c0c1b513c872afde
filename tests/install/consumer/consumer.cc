// An engine outside kvtier's tree, built against an installed kvtier (kvtier::kvtier): it
// opens an SHM and a GRPC session of a running kvtierd with the same tiny geometry, feeds
// both the same tokens and queries, and checks that they attend alike.
//
//   consumer_cpp unix:///path/kvtierd.sock [tenant]
// Prints one line and exits 0, or prints the failing status and exits 1.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvtier/client.h"

namespace {

constexpr int32_t kLayers = 2;
constexpr int32_t kPrefillTokens = 100;
constexpr int32_t kSteps = 3;
constexpr float kTolerance = 1e-3f;

kvtier::Geometry TinyGeometry() {
  kvtier::Geometry g;
  g.num_layers = kLayers;
  g.num_q_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 64;
  g.page_size = 16;
  g.dtype = kvtier::DType::kF32;
  return g;
}

std::vector<float> Random(std::mt19937& rng, size_t n) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Both sessions see exactly these tokens and queries.
struct Inputs {
  std::vector<float> k[kLayers], v[kLayers];                            // [tokens][Hkv][d]
  std::vector<float> step_k[kSteps][kLayers], step_v[kSteps][kLayers];  // one token each
  std::vector<float> q[kSteps][kLayers];                                // [Hq][d]
};

Inputs MakeInputs(const kvtier::Geometry& g) {
  std::mt19937 rng(20240611);
  const size_t token = static_cast<size_t>(g.num_kv_heads) * g.head_dim;
  const size_t query = static_cast<size_t>(g.num_q_heads) * g.head_dim;
  Inputs in;
  for (int32_t l = 0; l < kLayers; ++l) {
    in.k[l] = Random(rng, kPrefillTokens * token);
    in.v[l] = Random(rng, kPrefillTokens * token);
  }
  for (int32_t s = 0; s < kSteps; ++s) {
    for (int32_t l = 0; l < kLayers; ++l) {
      in.step_k[s][l] = Random(rng, token);
      in.step_v[s][l] = Random(rng, token);
      in.q[s][l] = Random(rng, query);
    }
  }
  return in;
}

absl::Status Check(bool ok, const std::string& what) {
  return ok ? absl::OkStatus() : absl::InternalError(what);
}

struct Outcome {
  std::vector<float> out[kSteps][kLayers];  // [Hq][d]
  size_t fetched_pages = 0;                 // of layer 0
};

// Prefill, kSteps decode steps per layer, Flush, FetchPages(0), Close.
absl::StatusOr<Outcome> Run(kvtier::Client& client, kvtier::Transport transport, const Inputs& in) {
  const char* name = transport == kvtier::Transport::kShm ? "shm" : "grpc";
  kvtier::SessionOptions options;
  options.geometry = TinyGeometry();
  options.transport = transport;
  options.label = std::string("install-consumer-") + name;
  options.sequence.mode = kvtier::RetrievalMode::kSpeculative;
  options.sequence.max_tokens = 1024;
  if (absl::Status st = options.sequence.SetBudgetTokens(64, options.geometry.page_size);
      !st.ok()) {
    return st;
  }
  absl::StatusOr<std::unique_ptr<kvtier::Session>> session = client.OpenSession(options);
  if (!session.ok()) return session.status();
  kvtier::Sequence& seq = (*session)->sequence();

  for (int32_t l = 0; l < kLayers; ++l) {
    if (absl::Status st = seq.Append(l, in.k[l].data(), in.v[l].data(), kPrefillTokens); !st.ok()) {
      return st;
    }
  }
  Outcome outcome;
  const size_t query =
      static_cast<size_t>(options.geometry.num_q_heads) * options.geometry.head_dim;
  for (int32_t s = 0; s < kSteps; ++s) {
    for (int32_t l = 0; l < kLayers; ++l) {
      outcome.out[s][l].assign(query, NAN);
      if (absl::Status st = seq.Append(l, in.step_k[s][l].data(), in.step_v[s][l].data(), 1);
          !st.ok()) {
        return st;
      }
      if (absl::Status st = seq.Decode(l, in.q[s][l].data(), outcome.out[s][l].data(), nullptr);
          !st.ok()) {
        return st;
      }
    }
    if (absl::Status st = seq.Wait(); !st.ok()) return st;
  }
  for (int32_t l = 0; l < kLayers; ++l) {
    const int32_t expected = kPrefillTokens + kSteps;
    if (absl::Status st = Check(seq.num_tokens(l) == expected,
                                std::string(name) + ": num_tokens(" + std::to_string(l) +
                                    ") = " + std::to_string(seq.num_tokens(l)) + ", expected " +
                                    std::to_string(expected));
        !st.ok()) {
      return st;
    }
  }
  if (absl::Status st = (*session)->Flush(); !st.ok()) return st;
  absl::StatusOr<std::vector<kvtier::FetchedPage>> pages = (*session)->FetchPages(0, {});
  if (!pages.ok()) return pages.status();
  outcome.fetched_pages = pages->size();
  if (absl::Status st = Check(!pages->empty(), std::string(name) + ": FetchPages(0) is empty");
      !st.ok()) {
    return st;
  }
  if (absl::Status st = (*session)->Close(); !st.ok()) return st;
  return outcome;
}

absl::Status Main(const std::string& target, const std::string& tenant) {
  absl::StatusOr<std::unique_ptr<kvtier::Client>> client =
      kvtier::Client::Connect(target, kvtier::ClientOptions{.tenant = tenant});
  if (!client.ok()) return client.status();
  const Inputs in = MakeInputs(TinyGeometry());
  absl::StatusOr<Outcome> shm = Run(**client, kvtier::Transport::kShm, in);
  if (!shm.ok()) return shm.status();
  absl::StatusOr<Outcome> grpc = Run(**client, kvtier::Transport::kGrpc, in);
  if (!grpc.ok()) return grpc.status();

  double max_diff = 0;
  for (int32_t s = 0; s < kSteps; ++s) {
    for (int32_t l = 0; l < kLayers; ++l) {
      const std::vector<float>& a = shm->out[s][l];
      const std::vector<float>& b = grpc->out[s][l];
      for (size_t i = 0; i < a.size(); ++i) {
        if (!std::isfinite(a[i]) || !std::isfinite(b[i])) {
          return absl::InternalError("step " + std::to_string(s) + " layer " + std::to_string(l) +
                                     ": output " + std::to_string(i) + " is not finite (shm " +
                                     std::to_string(a[i]) + ", grpc " + std::to_string(b[i]) + ")");
        }
        const double diff = std::fabs(static_cast<double>(a[i]) - b[i]);
        if (diff > max_diff) max_diff = diff;
        if (diff > kTolerance) {
          return absl::InternalError("step " + std::to_string(s) + " layer " + std::to_string(l) +
                                     ": shm and grpc outputs differ at " + std::to_string(i) +
                                     " (" + std::to_string(a[i]) + " vs " + std::to_string(b[i]) +
                                     ")");
        }
      }
    }
  }
  std::printf(
      "consumer_cpp: OK: shm and grpc sessions, %d layers x (%d tokens + %d decode steps), "
      "max |shm - grpc| = %.3g, fetched %zu (shm) / %zu (grpc) pages of layer 0\n",
      kLayers, kPrefillTokens, kSteps, max_diff, shm->fetched_pages, grpc->fetched_pages);
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: %s TARGET [TENANT]\n", argv[0]);
    return 2;
  }
  const absl::Status st = Main(argv[1], argc == 3 ? argv[2] : "default");
  if (!st.ok()) {
    std::fprintf(stderr, "consumer_cpp: FAILED: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
