// The seeded mutation driver shared by the project's fuzz targets (kvtierd_fuzz, gguf_fuzz):
// flags, the seed corpus, replay of saved cases, the mutation loop with progress, crash
// files. A target supplies its one-input check, its seeds, how the next case is made and
// its summary line. Header-only: each driver is one executable.
//
//   NAME --cases N --seed S [--stop-on-failure] [--crash-dir DIR]
//   NAME --write-corpus DIR          # the seeds as files, for libFuzzer
//   NAME --replay FILE...            # run saved cases
#ifndef KVTIER_TESTS_TESTUTIL_FUZZ_DRIVER_H_
#define KVTIER_TESTS_TESTUTIL_FUZZ_DRIVER_H_

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvtier::testing {

struct FuzzTarget {
  std::string name;         // "gguf_fuzz"
  std::string description;  // the --help line
  uint64_t default_cases = 1000;
  uint64_t progress_every = 100000;  // cases between progress lines on stderr
  // True when the input kept every invariant; otherwise `why` says which it broke.
  std::function<bool(const std::string& input, std::string* why)> one;
  std::function<std::vector<std::string>()> corpus;
  // The next mutated case from the previous one and the seeds.
  std::function<std::string(std::mt19937_64& rng, const std::string& last,
                            const std::vector<std::string>& corpus)>
      next;
  // The summary line's counts (after "NAME: seed S: "), and a line for progress reports.
  std::function<std::string()> summary;
  std::function<std::string()> progress;
};

// Parses the flags and runs the target: the exit status (0: no invariant failed; 1: one
// did; CLI11's status for bad flags).
inline int RunFuzzDriver(int argc, char** argv, const FuzzTarget& t) {
  CLI::App app(t.description);
  uint64_t cases = t.default_cases;
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

  const std::vector<std::string> corpus = t.corpus();
  if (!corpus_dir.empty()) {
    for (size_t i = 0; i < corpus.size(); ++i) {
      std::ofstream(absl::StrCat(corpus_dir, "/seed-", i), std::ios::binary) << corpus[i];
    }
    std::printf("wrote %zu seeds to %s\n", corpus.size(), corpus_dir.c_str());
    return 0;
  }
  const absl::Time start = absl::Now();
  uint64_t index = 0;
  auto run = [&](const std::string& input) {
    std::string why;
    const uint64_t i = index++;
    if (t.one(input, &why)) return true;
    std::fprintf(stderr, "INVARIANT FAILURE in case %llu: %s\n  input (hex, first 512 bytes): %s\n",
                 static_cast<unsigned long long>(i), why.c_str(),
                 absl::BytesToHexString(input.substr(0, 512)).c_str());
    if (!crash_dir.empty()) {
      std::ofstream(absl::StrCat(crash_dir, "/case-", i), std::ios::binary) << input;
    }
    return false;
  };
  bool clean = true;
  if (!replay.empty()) {
    for (const std::string& path : replay) {
      std::ifstream in(path, std::ios::binary);
      std::stringstream bytes;
      bytes << in.rdbuf();
      clean = run(bytes.str()) && clean;
    }
  } else {
    std::mt19937_64 rng(seed);
    for (const std::string& c : corpus) clean = run(c) && clean;
    std::string last = corpus[0];
    for (uint64_t i = 0; i < cases && (clean || !stop); ++i) {
      last = t.next(rng, last, corpus);
      clean = run(last) && clean;
      if (index % t.progress_every == 0) {
        std::fprintf(stderr, "%s: %llu cases, %s, %.0f s\n", t.name.c_str(),
                     static_cast<unsigned long long>(index),
                     t.progress ? t.progress().c_str() : "", absl::ToDoubleSeconds(absl::Now() - start));
      }
    }
  }
  std::printf("%s: seed %llu: %s, %.1f s\n", t.name.c_str(), static_cast<unsigned long long>(seed),
              t.summary().c_str(), absl::ToDoubleSeconds(absl::Now() - start));
  std::fflush(stdout);
  return clean ? 0 : 1;
}

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_TESTUTIL_FUZZ_DRIVER_H_
