// Writes a decode trace file, format version 1 of docs/trace-format.md: the engine's own
// writer (the engine does not link the benchmarks' code, so it does not share bench/trace.h's;
// tests read what it writes back with the benchmark's reader). Tensors come in as F32 and
// are stored in the trace's dtype; every record is written at its computed offset, so
// records may arrive in any order.
//
// Thread-compatible.
#ifndef KVTIER_ENGINE_TRACE_WRITER_H_
#define KVTIER_ENGINE_TRACE_WRITER_H_

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvtier/dtype.h"

namespace kvtier::engine {

struct TraceHeader {
  int32_t layers = 0, q_heads = 0, kv_heads = 0, head_dim = 0, page_size = 0;
  DType dtype = DType::kF16;
  int64_t prefill_tokens = 0;  // T
  int64_t steps = 0;           // N
};

class TraceWriter {
 public:
  // Creates (truncates) `path` at its full size. INVALID_ARGUMENT for a header the format
  // does not allow (naming the field and its range); the file system's error otherwise.
  static absl::StatusOr<std::unique_ptr<TraceWriter>> Create(const std::string& path,
                                                             const TraceHeader& header);
  ~TraceWriter();

  // Prefill K and V rows [n][Hkv][d] of `layer` at positions first .. first + n − 1 < T.
  absl::Status WritePrefill(int32_t layer, int64_t first, int64_t n, const float* k,
                            const float* v);
  // The record of (step, layer): q [Hq][d], k and v [Hkv][d].
  absl::Status WriteStep(int64_t step, int32_t layer, const float* q, const float* k,
                         const float* v);
  // Flushes and closes. DATA_LOSS when the file is shorter than the header says: the last
  // records were never written (a record missing in the middle reads back as zeros).
  absl::Status Close();

 private:
  TraceWriter(std::FILE* f, const TraceHeader& h) : file_(f), h_(h) {}
  absl::Status WriteAt(int64_t offset, const float* x, int64_t count);

  std::FILE* file_;
  TraceHeader h_;
  std::vector<uint8_t> buf_;
};

}  // namespace kvtier::engine

#endif  // KVTIER_ENGINE_TRACE_WRITER_H_
