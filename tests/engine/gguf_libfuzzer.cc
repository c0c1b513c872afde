// libFuzzer's entry point for the GGUF reader's fuzz target (clang with -fsanitize=fuzzer;
// KVTIER_LIBFUZZER=ON). An invariant failure aborts, so libFuzzer saves the input. Seed it
// with `gguf_fuzz --write-corpus DIR`.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tests/engine/gguf_fuzz_one.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string why;
  if (!kvtier::testing::GgufFuzzOne(data, size, &why)) {
    std::fprintf(stderr, "INVARIANT FAILURE: %s\n", why.c_str());
    std::abort();
  }
  return 0;
}
