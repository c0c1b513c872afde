// One table of op cases that every backend runs against the CPU reference (as ggml's
// test-backend-ops): each case makes its inputs deterministically from a seed of its name,
// runs one op (or a short chain of ops) on a backend over identical copies of them, and
// judges that backend's outputs against the CPU backend's — bit for bit where no arithmetic
// differs (copies, gathers, layout transforms, selections, tables), within tolerances that
// allow another summation order where it does (scores, cosines, attention). Data-dependent
// errors are cases too: every backend must fail the stream with the same code and message.
//
// The runner is tests/kernels/backend_ops_test.cc; the helpers below (buffers placed on a
// backend, comparisons, random inputs) also serve the tests that check what a table cannot.
// The cases named `<Op>_decode_<size>` run the hot ops at the size of one decode step of a
// Llama-3.1-8B layer; `kvtier-bench ops` times them (and any other case) on every backend.
#ifndef KVTIER_TESTS_KERNELS_OP_CASES_H_
#define KVTIER_TESTS_KERNELS_OP_CASES_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/ops.h"
#include "tests/testutil/random_fill.h"

namespace kvtier::testing {

// ---- Host memory for zero-copy ----

// Page-aligned, zero-filled host memory, so that two registrations never share a page.
class AlignedHostBuffer {
 public:
  static constexpr size_t kPage = 4096;
  explicit AlignedHostBuffer(size_t bytes)
      : bytes_(bytes),
        data_(std::aligned_alloc(kPage, (bytes + kPage - 1) / kPage * kPage), &std::free) {
    std::memset(data_.get(), 0, bytes_);
  }
  void* data() const { return data_.get(); }
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_;
  std::unique_ptr<void, decltype(&std::free)> data_;
};

// Registers host memory with a backend for the lifetime of the object.
class ScopedRegistration {
 public:
  ScopedRegistration(Backend& backend, void* data, size_t bytes)
      : backend_(backend), data_(data), status_(backend.RegisterHost(data, bytes)) {}
  ~ScopedRegistration() {
    if (status_.ok()) (void)backend_.UnregisterHost(data_);
  }
  ScopedRegistration(const ScopedRegistration&) = delete;
  ScopedRegistration& operator=(const ScopedRegistration&) = delete;
  const absl::Status& status() const { return status_; }

 private:
  Backend& backend_;
  void* data_;
  absl::Status status_;
};

// ---- Running one op on a backend ----

// Where the backend under test finds one of an op's buffers.
enum class Placement {
  kDevice,          // backend memory
  kRegisteredHost,  // page-aligned host memory registered with the backend (zero-copy)
};

// Host images of an op's buffers (inputs and outputs alike), by index, each with its
// placement and its offset in bytes from an aligned start (a nonzero offset exercises the
// kernels' unaligned fallbacks).
class OpBuffers {
 public:
  template <typename T>
  int Add(const std::vector<T>& v, Placement where = Placement::kDevice, size_t offset = 0) {
    return AddBytes(v.data(), v.size() * sizeof(T), where, offset);
  }
  int Add(const TypedBuffer& b, Placement where = Placement::kDevice, size_t offset = 0) {
    return AddBytes(b.data(), b.bytes(), where, offset);
  }
  size_t size() const { return bufs_.size(); }
  const std::vector<unsigned char>& operator[](size_t i) const { return bufs_[i].bytes; }
  Placement placement(size_t i) const { return bufs_[i].where; }
  size_t offset(size_t i) const { return bufs_[i].offset; }

 private:
  struct Buffer {
    std::vector<unsigned char> bytes;
    Placement where;
    size_t offset;
  };
  int AddBytes(const void* data, size_t bytes, Placement where, size_t offset);
  std::vector<Buffer> bufs_;
};

// Backend addresses of the OpBuffers on one backend; index -1 (an optional buffer left
// out) is null.
class OpPtrs {
 public:
  explicit OpPtrs(std::vector<void*> ptrs) : ptrs_(std::move(ptrs)) {}
  template <typename T = void>
  T* get(int i) const {
    return i < 0 ? nullptr : static_cast<T*>(ptrs_[static_cast<size_t>(i)]);
  }

 private:
  std::vector<void*> ptrs_;
};

// What one backend made of the op: the status the op call returned, the stream's status
// after it ran, and every buffer as it was afterwards.
struct OpResult {
  absl::Status enqueue;
  absl::Status run;
  std::vector<std::vector<unsigned char>> bufs;

  template <typename T>
  std::vector<T> Get(int i) const {
    const std::vector<unsigned char>& b = bufs[static_cast<size_t>(i)];
    std::vector<T> out(b.size() / sizeof(T));
    if (!out.empty()) std::memcpy(out.data(), b.data(), out.size() * sizeof(T));
    return out;
  }
};

// Enqueues the op(s) of a case on `s` over the buffers at `p`.
using OpFn = std::function<absl::Status(Backend& be, Stream& s, const OpPtrs& p)>;

// A copy of every buffer of `in` placed on `backend` (backend memory, or page-aligned host
// memory registered with it), held until the object is gone: what RunOn runs an op over,
// and what `kvtier-bench ops` times it over.
class PlacedBuffers {
 public:
  static absl::StatusOr<std::unique_ptr<PlacedBuffers>> Place(Backend& backend,
                                                              const OpBuffers& in);
  const OpPtrs& ptrs() const { return ptrs_; }
  // Every buffer's bytes as they are now, on `io` (synchronised).
  absl::Status ReadBack(const OpBuffers& in, Stream& io,
                        std::vector<std::vector<unsigned char>>* out) const;

 private:
  explicit PlacedBuffers(Backend& backend) : backend_(backend), ptrs_({}) {}
  Backend& backend_;
  std::vector<DeviceBuffer> device_;
  std::vector<std::unique_ptr<AlignedHostBuffer>> host_;
  std::vector<std::unique_ptr<ScopedRegistration>> registrations_;
  OpPtrs ptrs_;
};

// Places a copy of every buffer on `backend`, runs `fn` on a fresh stream, synchronises
// it and reads every buffer back (over another stream: a failed stream skips later work
// on the cpu backend). An error here is the harness's, not the op's: the op's statuses are
// in the result.
absl::StatusOr<OpResult> RunOn(Backend& backend, const OpBuffers& in, const OpFn& fn);

// ---- The table ----

// One case made: inputs, the op over them, and the verdict on a backend's result.
struct OpRun {
  OpBuffers in;
  OpFn op;
  // What the stream must report after the op ran, on every backend (the message as a
  // substring; empty: any).
  absl::StatusCode run_code = absl::StatusCode::kOk;
  std::string run_message;
  // Judges `got` against `want`, the CPU backend's result on the same inputs `in`, with
  // gtest expectations. Runs only when both stream statuses were as expected.
  std::function<void(const OpBuffers& in, const OpResult& want, const OpResult& got)> check;
  // What the op must move (bytes read and written) and compute (floating-point operations),
  // stated by the decode-size cases for `kvtier-bench ops`; 0 where not stated.
  int64_t bytes = 0;
  double flops = 0;
};

struct OpCase {
  std::string name;  // "<Op>_<shape>_<variant>": unique, letters, digits and '_'
  std::function<OpRun()> make;
};

// Every case of every op, in a fixed order.
const std::vector<OpCase>& OpCases();
// Cases only `kvtier-bench ops` times, at sizes a unit test cannot hold (ggml's perf cases):
// decode-size ops at 128K tokens and the roofline set (op_cases_decode.cc). Their `check`
// may be empty.
const std::vector<OpCase>& PerfOpCases();

// ---- Comparisons (gtest expectations naming `what` and the first mismatches) ----

// Index of the first `elem_bytes`-sized element at which `a` and `b` differ, or -1.
int64_t FirstDifference(const void* a, const void* b, size_t bytes, size_t elem_bytes);

// Buffer `i` bit for bit, in elements of `elem` bytes.
void ExpectSameBytes(const OpResult& want, const OpResult& got, int i, size_t elem,
                     const std::string& what);

// fp32 values: |got − want| ≤ atol + rtol·|want|, non-finite values equal.
void ExpectFloatsNear(const std::vector<float>& want, const std::vector<float>& got, double rtol,
                      double atol, const std::string& what);
void ExpectFloatBufNear(const OpResult& want, const OpResult& got, int i, double rtol, double atol,
                        const std::string& what);

// Attention outputs in `t`: accumulated in fp32 in different orders and rounded once, so
// fp32 agrees within 2e-5 + 2e-5·|want|, and fp16/bf16 within 2 units in the last place of
// the dtype plus 2e-5.
void ExpectAttentionOutNear(DType t, const OpResult& want, const OpResult& got, int i,
                            const std::string& what);

// ---- Random inputs ----

int32_t Uniform(std::mt19937& rng, int32_t lo, int32_t hi);  // [lo, hi]
bool Chance(std::mt19937& rng, double p);
std::vector<float> RandomFloats(std::mt19937& rng, int64_t n, float lo, float hi);

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_KERNELS_OP_CASES_H_
