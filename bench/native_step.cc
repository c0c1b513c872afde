// libkvtier_native_step.so: one decode step of one layer timed from C++, for
// client/python/examples/step_overhead.py's baseline. The script calls it through ctypes in
// the same run and on the same sequence as the package's calls; the time is taken here, around
// the two C API calls the package makes for a decode on the CPU device, so that it holds none
// of Python's or ctypes' cost.
#include <chrono>
#include <cstdint>

#include "kvtier/c_api.h"

extern "C" __attribute__((visibility("default"))) int kvtier_native_decode_timed(
    kvtier_sequence* sequence, kvtier_batch* batch, int32_t layer, const void* q, void* out,
    double* microseconds) {
  const auto start = std::chrono::steady_clock::now();
  int rc = kvtier_sequence_decode(sequence, layer, q, out, nullptr);
  if (rc == 0) rc = kvtier_batch_synchronize(batch);
  const auto end = std::chrono::steady_clock::now();
  *microseconds = std::chrono::duration<double, std::micro>(end - start).count();
  return rc;
}
