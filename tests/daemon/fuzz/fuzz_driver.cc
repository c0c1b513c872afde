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
#include <cstdlib>
#include <string>

#include "absl/strings/str_format.h"
#include "tests/daemon/fuzz/kvtierd_fuzz.h"
#include "tests/testutil/fuzz_driver.h"

int main(int argc, char** argv) {
  using kvtier::fuzz::Counts;
  kvtier::testing::FuzzTarget target;
  target.name = "kvtierd_fuzz";
  target.description = "kvtierd fuzz target: mutated requests against an in-process kvtierd";
  target.default_cases = 2000;
  target.one = [](const std::string& input, std::string* why) {
    return kvtier::fuzz::FuzzOne(reinterpret_cast<const uint8_t*>(input.data()), input.size(),
                                 why);
  };
  target.corpus = [] { return kvtier::fuzz::SeedCorpus(); };
  // Each mutated case starts from a seed or from an earlier mutated case (a short chain);
  // some cases are plain seeds, so live sessions and valid streams keep coming.
  target.next = [](std::mt19937_64& rng, const std::string& last,
                   const std::vector<std::string>& corpus) {
    const uint64_t pick = rng() % 8;
    const std::string& base = pick == 0 ? last : corpus[rng() % corpus.size()];
    return pick == 1 ? base : kvtier::fuzz::Mutate(base, corpus, rng);
  };
  target.progress = [] {
    return absl::StrFormat("%d invariant failures", Counts().invariant_failures);
  };
  target.summary = [] {
    const kvtier::fuzz::FuzzCounts& n = Counts();
    return absl::StrFormat(
        "%d cases, %d OK replies, %d refused, %d sessions opened, %d Offload outcomes checked "
        "page by page, %d invariant failures",
        n.cases, n.ok_replies, n.error_replies, n.sessions_opened, n.commits_checked,
        n.invariant_failures);
  };
  const int rc = kvtier::testing::RunFuzzDriver(argc, argv, target);
  kvtier::fuzz::StopDaemon();
  // The daemon's objects stay: leave without running static destructors under its threads.
  std::_Exit(rc);
}
