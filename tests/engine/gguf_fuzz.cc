// gguf_fuzz: the seeded mutation driver of the GGUF reader's fuzz target (gguf_fuzz_one.h;
// the same target also links with libFuzzer, gguf_libfuzzer.cc). Runs the seed corpus, then
// `--cases` mutated cases from a generator seeded by `--seed`, and prints the counts: cases,
// accepted and refused files, tensors dequantized, invariant failures (each with the case
// that broke it, hex-dumped and written to --crash-dir when given). Exit 0 when no invariant
// failed; a crash or a sanitizer report is the other failure.
//
//   gguf_fuzz --cases 20000 --seed 1          # what ctest runs (gguf_fuzz_smoke)
//   gguf_fuzz --cases 10000000 --seed 7       # a long run
//   gguf_fuzz --write-corpus DIR              # the seeds as files, for libFuzzer
//   gguf_fuzz --replay FILE...                # run saved cases
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "tests/engine/gguf_fuzz_one.h"

namespace {

using kvtier::testing::GgufFuzzOne;

bool RunCase(const std::string& input, const std::string& crash_dir, uint64_t index) {
  std::string why;
  if (GgufFuzzOne(reinterpret_cast<const uint8_t*>(input.data()), input.size(), &why)) {
    return true;
  }
  std::fprintf(stderr, "INVARIANT FAILURE in case %llu: %s\n  input (hex, first 512 bytes): %s\n",
               static_cast<unsigned long long>(index), why.c_str(),
               absl::BytesToHexString(input.substr(0, 512)).c_str());
  if (!crash_dir.empty()) {
    std::ofstream(absl::StrCat(crash_dir, "/case-", index), std::ios::binary) << input;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("GGUF reader fuzz target: mutated GGUF files through GgufFile::FromBytes");
  uint64_t cases = 20000;
  uint64_t seed = 1;
  bool stop = false;
  std::string crash_dir, corpus_dir;
  std::vector<std::string> replay;
  app.add_option("--cases", cases, "mutated cases after the seeds");
  app.add_option("--seed", seed, "seed of the mutation generator");
  app.add_flag("--stop-on-failure", stop, "stop at the first invariant failure");
  app.add_option("--crash-dir", crash_dir, "write every failing case here");
  app.add_option("--write-corpus", corpus_dir, "write the seed corpus here and exit");
  app.add_option("--replay", replay, "run these saved cases and exit");
  CLI11_PARSE(app, argc, argv);

  const std::vector<std::string> corpus = kvtier::testing::GgufSeedCorpus();
  if (!corpus_dir.empty()) {
    for (size_t i = 0; i < corpus.size(); ++i) {
      std::ofstream(absl::StrCat(corpus_dir, "/seed-", i), std::ios::binary) << corpus[i];
    }
    std::printf("wrote %zu seeds to %s\n", corpus.size(), corpus_dir.c_str());
    return 0;
  }
  const auto start = std::chrono::steady_clock::now();
  const auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  uint64_t index = 0;
  bool clean = true;
  if (!replay.empty()) {
    for (const std::string& path : replay) {
      std::ifstream in(path, std::ios::binary);
      std::stringstream bytes;
      bytes << in.rdbuf();
      clean = RunCase(bytes.str(), crash_dir, index++) && clean;
    }
  } else {
    std::mt19937_64 rng(seed);
    for (const std::string& c : corpus) clean = RunCase(c, crash_dir, index++) && clean;
    // Each mutated case starts from a seed, or (one in four) from the previous mutated case:
    // short chains reach states one mutation cannot.
    std::string last = corpus[0];
    for (uint64_t i = 0; i < cases && (clean || !stop); ++i) {
      const std::string base = rng() % 4 == 0 ? last : corpus[rng() % corpus.size()];
      last = kvtier::testing::GgufMutate(base, corpus, rng);
      clean = RunCase(last, crash_dir, index++) && clean;
      if (index % 1000000 == 0) {
        std::fprintf(stderr, "gguf_fuzz: %llu cases, %.0f s\n",
                     static_cast<unsigned long long>(index), seconds());
      }
    }
  }
  const kvtier::testing::GgufFuzzCounts& n = kvtier::testing::GgufFuzzCountsNow();
  std::printf(
      "gguf_fuzz: seed %llu: %llu cases, %llu accepted, %llu refused, %llu tensors dequantized, "
      "%llu invariant failures, %.1f s\n",
      static_cast<unsigned long long>(seed), static_cast<unsigned long long>(n.cases),
      static_cast<unsigned long long>(n.accepted), static_cast<unsigned long long>(n.refused),
      static_cast<unsigned long long>(n.tensors_dequantized),
      static_cast<unsigned long long>(n.invariant_failures), seconds());
  return clean ? 0 : 1;
}
