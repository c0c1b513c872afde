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
#include <cstdint>
#include <string>

#include "absl/strings/str_format.h"
#include "tests/engine/gguf_fuzz_one.h"
#include "tests/testutil/fuzz_driver.h"

int main(int argc, char** argv) {
  namespace t = kvtier::testing;
  t::FuzzTarget target;
  target.name = "gguf_fuzz";
  target.description = "GGUF reader fuzz target: mutated GGUF files through GgufFile::FromBytes";
  target.default_cases = 20000;
  target.progress_every = 1000000;
  target.one = [](const std::string& input, std::string* why) {
    return t::GgufFuzzOne(reinterpret_cast<const uint8_t*>(input.data()), input.size(), why);
  };
  target.corpus = [] { return t::GgufSeedCorpus(); };
  // Each mutated case starts from a seed, or (one in four) from the previous mutated case:
  // short chains reach states one mutation cannot.
  target.next = [](std::mt19937_64& rng, const std::string& last,
                   const std::vector<std::string>& corpus) {
    const std::string base = rng() % 4 == 0 ? last : corpus[rng() % corpus.size()];
    return t::GgufMutate(base, corpus, rng);
  };
  target.summary = [] {
    const t::GgufFuzzCounts& n = t::GgufFuzzCountsNow();
    return absl::StrFormat(
        "%d cases, %d accepted, %d refused, %d tensors dequantized, %d invariant failures",
        n.cases, n.accepted, n.refused, n.tensors_dequantized, n.invariant_failures);
  };
  return t::RunFuzzDriver(argc, argv, target);
}
