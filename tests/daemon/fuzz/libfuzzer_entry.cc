// libFuzzer's entry point for the kvtierd fuzz target (clang with -fsanitize=fuzzer;
// KVTIER_LIBFUZZER=ON). An invariant failure aborts, so libFuzzer saves the input.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tests/daemon/fuzz/kvtierd_fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string why;
  if (!kvtier::fuzz::FuzzOne(data, size, &why)) {
    std::fprintf(stderr, "INVARIANT FAILURE: %s\n", why.c_str());
    std::abort();
  }
  return 0;
}
