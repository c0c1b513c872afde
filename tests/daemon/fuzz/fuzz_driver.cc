// kvtierd_fuzz: the seeded mutation driver of the kvtierd fuzz target (builds with g++; the
// same target also links with libFuzzer, libfuzzer_entry.cc). Runs the seed corpus, then
// `--cases` mutated cases from a generator seeded by `--seed`, and prints the counts: cases,
// OK and refused replies, invariant failures (each with the case that broke it, hex-dumped
// and written to --crash-dir when given). Exit 0 when no invariant failed.
//
//   kvtierd_fuzz --cases 2000 --seed 1          # what CI runs
//   kvtierd_fuzz --cases 1000000 --seed 7       # a long run
//   kvtierd_fuzz --write-corpus DIR             # the seeds as files, for libFuzzer
//   kvtierd_fuzz --replay FILE...               # run saved cases
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
#include "absl/time/clock.h"
#include "tests/daemon/fuzz/kvtierd_fuzz.h"

namespace {

using kvtier::fuzz::Counts;
using kvtier::fuzz::FuzzOne;

bool RunCase(const std::string& input, const std::string& crash_dir, uint64_t index) {
  std::string why;
  if (FuzzOne(reinterpret_cast<const uint8_t*>(input.data()), input.size(), &why)) return true;
  std::fprintf(stderr, "INVARIANT FAILURE in case %llu: %s\n  input (hex): %s\n",
               static_cast<unsigned long long>(index), why.c_str(),
               absl::BytesToHexString(input.substr(0, 512)).c_str());
  if (!crash_dir.empty()) {
    std::ofstream(absl::StrCat(crash_dir, "/case-", index)) << input;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("kvtierd fuzz target: mutated requests against an in-process kvtierd");
  uint64_t cases = 2000;
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

  const std::vector<std::string> corpus = kvtier::fuzz::SeedCorpus();
  if (!corpus_dir.empty()) {
    for (size_t i = 0; i < corpus.size(); ++i) {
      std::ofstream(absl::StrCat(corpus_dir, "/seed-", i)) << corpus[i];
    }
    std::printf("wrote %zu seeds to %s\n", corpus.size(), corpus_dir.c_str());
    return 0;
  }
  const absl::Time start = absl::Now();
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
    // Each mutated case starts from a seed or from an earlier mutated case (a short chain).
    std::string last = corpus[0];
    for (uint64_t i = 0; i < cases && (clean || !stop); ++i) {
      // Some cases are plain seeds, so live sessions and valid streams keep coming.
      const uint64_t pick = rng() % 8;
      const std::string& base = pick == 0 ? last : corpus[rng() % corpus.size()];
      last = pick == 1 ? base : kvtier::fuzz::Mutate(base, corpus, rng);
      clean = RunCase(last, crash_dir, index++) && clean;
      if (index % 100000 == 0) {
        std::fprintf(stderr, "kvtierd_fuzz: %llu cases, %llu invariant failures, %.0f s\n",
                     static_cast<unsigned long long>(index),
                     static_cast<unsigned long long>(Counts().invariant_failures),
                     absl::ToDoubleSeconds(absl::Now() - start));
      }
    }
  }
  const kvtier::fuzz::FuzzCounts& n = Counts();
  std::printf(
      "kvtierd_fuzz: seed %llu: %llu cases, %llu OK replies, %llu refused, %llu sessions opened, "
      "%llu Offload outcomes checked page by page, %llu invariant failures, %.1f s\n",
      static_cast<unsigned long long>(seed), static_cast<unsigned long long>(n.cases),
      static_cast<unsigned long long>(n.ok_replies),
      static_cast<unsigned long long>(n.error_replies),
      static_cast<unsigned long long>(n.sessions_opened),
      static_cast<unsigned long long>(n.commits_checked),
      static_cast<unsigned long long>(n.invariant_failures),
      absl::ToDoubleSeconds(absl::Now() - start));
  std::fflush(stdout);
  kvtier::fuzz::StopDaemon();
  // The daemon's objects stay: leave without running static destructors under its threads.
  std::_Exit(clean ? 0 : 1);
}
