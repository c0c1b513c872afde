// Trace files (docs/trace-format.md): the header codec, the pread-based reader and the writer.
//
// Invariants: a FileTrace only exists for a file whose header validated and whose size is
// exactly what the header implies, so every offset it computes lies inside the file.
#include "bench/trace.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_format.h"
#include "core/status.h"
#include "kvtier/dtype.h"

namespace kvtier::bench {
namespace {

// Tensors are copied between memory and file as they are: the format is little-endian.
static_assert(std::endian::native == std::endian::little,
              "trace files assume a little-endian host");

constexpr char kMagic[8] = {'K', 'V', 'T', 'R', 'A', 'C', 'E', '\0'};
constexpr uint32_t kVersion = 1;
constexpr uint32_t kFieldBytes = 48;   // magic .. num_steps
constexpr uint32_t kHeaderBytes = 64;  // what WriteTraceFile writes
constexpr uint32_t kMaxHeaderBytes = 1 << 20;

uint32_t GetU32(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}
void PutU32(uint8_t* p, uint32_t x) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(x >> (8 * i));
}

absl::Status Errno(const std::string& what, const std::string& path) {
  const int e = errno;
  const std::string msg = absl::StrFormat("%s %s: %s", what, path, std::strerror(e));
  if (e == ENOENT) return absl::NotFoundError(msg);
  if (e == EACCES || e == EPERM) return absl::PermissionDeniedError(msg);
  return absl::InternalError(msg);
}

// Sizes and offsets of one trace's sections, in bytes.
struct FileLayout {
  Geometry g;
  int32_t prefill_tokens = 0;
  int32_t num_steps = 0;
  uint64_t header_bytes = kHeaderBytes;

  uint64_t row_bytes(int32_t heads) const {
    return static_cast<uint64_t>(heads) * g.head_dim * g.element_bytes();
  }
  uint64_t prefill_tensor_bytes() const {  // K or V of one layer: [T][Hkv][d]
    return static_cast<uint64_t>(prefill_tokens) * row_bytes(g.num_kv_heads);
  }
  uint64_t step_record_bytes() const {  // q [Hq][d], k [Hkv][d], v [Hkv][d]
    return row_bytes(g.num_q_heads) + 2 * row_bytes(g.num_kv_heads);
  }
  uint64_t PrefillOffset(int32_t layer) const {
    return header_bytes + 2 * prefill_tensor_bytes() * static_cast<uint64_t>(layer);
  }
  uint64_t StepOffset(int32_t step, int32_t layer) const {
    const uint64_t record = static_cast<uint64_t>(step) * g.num_layers + layer;
    return PrefillOffset(g.num_layers) + record * step_record_bytes();
  }
  uint64_t total_bytes() const { return StepOffset(num_steps, 0); }
};

absl::Status CheckShape(const Geometry& g, int32_t prefill_tokens, int32_t num_steps) {
  KVTIER_RETURN_IF_ERROR(g.Validate());
  if (prefill_tokens < 1 || prefill_tokens > kMaxTracePrefillTokens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "trace prefill_tokens = %d: must be in [1, %d]", prefill_tokens, kMaxTracePrefillTokens));
  }
  if (num_steps < 0 || num_steps > kMaxTraceSteps) {
    return absl::InvalidArgumentError(
        absl::StrFormat("trace num_steps = %d: must be in [0, %d]", num_steps, kMaxTraceSteps));
  }
  return absl::OkStatus();
}

// An open file descriptor, closed on destruction.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }
  // Closes now, reporting the error close may return (for files written).
  bool Close() {
    const int fd = fd_;
    fd_ = -1;
    return close(fd) == 0;
  }

 private:
  int fd_;
};

// Reads up to `n` bytes at `offset`; returns how many (fewer only at end of file).
absl::StatusOr<size_t> PreadFull(int fd, uint64_t offset, size_t n, uint8_t* dst) {
  size_t done = 0;
  while (done < n) {
    const ssize_t r = pread(fd, dst + done, n - done, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return absl::InternalError(absl::StrFormat("pread: %s", std::strerror(errno)));
    if (r == 0) break;
    done += static_cast<size_t>(r);
  }
  return done;
}

absl::Status WriteFull(int fd, const uint8_t* src, size_t n) {
  while (n > 0) {
    const ssize_t r = write(fd, src, n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return absl::InternalError(absl::StrFormat("write: %s", std::strerror(errno)));
    src += r;
    n -= static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

// Parses and validates the header in `h` (the first min(file size, header_bytes) bytes).
absl::StatusOr<FileLayout> ParseHeader(const std::string& path, const std::vector<uint8_t>& h) {
  auto truncated = [&](uint64_t need) {
    return absl::DataLossError(
        absl::StrFormat("trace %s: truncated header (%d bytes, need %d)", path, h.size(), need));
  };
  if (h.size() < sizeof(kMagic)) return truncated(kFieldBytes);
  if (std::memcmp(h.data(), kMagic, sizeof(kMagic)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("trace %s: bad magic (not a kvtier trace file)", path));
  }
  if (h.size() < 16) return truncated(kFieldBytes);
  const uint32_t version = GetU32(&h[8]);
  if (version != kVersion) {
    return absl::UnimplementedError(absl::StrFormat(
        "trace %s: format version %d; this build reads version %d", path, version, kVersion));
  }
  FileLayout f;
  f.header_bytes = GetU32(&h[12]);
  if (f.header_bytes < kFieldBytes || f.header_bytes > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("trace %s: header_bytes = %d: must be in [%d, %d]", path, f.header_bytes,
                        kFieldBytes, kMaxHeaderBytes));
  }
  if (h.size() < f.header_bytes) return truncated(f.header_bytes);
  uint32_t fields[8];  // layers, Hq, Hkv, d, page size, dtype, prefill tokens, steps
  for (int i = 0; i < 8; ++i) {
    fields[i] = GetU32(&h[16 + 4 * static_cast<size_t>(i)]);
    if (fields[i] > static_cast<uint32_t>(INT32_MAX)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "trace %s: header field at byte %d = %d: out of range", path, 16 + 4 * i, fields[i]));
    }
  }
  if (fields[5] > 255) {
    return absl::InvalidArgumentError(
        absl::StrFormat("trace %s: geometry.dtype = %d: must be 0, 1 or 2", path, fields[5]));
  }
  f.g.num_layers = static_cast<int32_t>(fields[0]);
  f.g.num_q_heads = static_cast<int32_t>(fields[1]);
  f.g.num_kv_heads = static_cast<int32_t>(fields[2]);
  f.g.head_dim = static_cast<int32_t>(fields[3]);
  f.g.page_size = static_cast<int32_t>(fields[4]);
  f.g.dtype = static_cast<DType>(fields[5]);
  f.prefill_tokens = static_cast<int32_t>(fields[6]);
  f.num_steps = static_cast<int32_t>(fields[7]);
  if (absl::Status st = CheckShape(f.g, f.prefill_tokens, f.num_steps); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrFormat("trace %s: %s", path, st.message()));
  }
  for (size_t i = kFieldBytes; i < f.header_bytes; ++i) {
    if (h[i] != 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("trace %s: reserved header byte %d is not zero", path, i));
    }
  }
  return f;
}

class FileTrace final : public TraceSource {
 public:
  FileTrace(std::string path, std::unique_ptr<Fd> fd, const FileLayout& f)
      : path_(std::move(path)), fd_(std::move(fd)), f_(f) {}

  const Geometry& geometry() const override { return f_.g; }
  int32_t prefill_tokens() const override { return f_.prefill_tokens; }
  int32_t num_steps() const override { return f_.num_steps; }

  absl::Status Prefill(int32_t layer, std::vector<uint8_t>* k, std::vector<uint8_t>* v) override {
    KVTIER_RETURN_IF_ERROR(CheckIndex("layer", layer, f_.g.num_layers));
    const uint64_t at = f_.PrefillOffset(layer), n = f_.prefill_tensor_bytes();
    KVTIER_RETURN_IF_ERROR(Read(at, n, k));
    return Read(at + n, n, v);
  }

  absl::Status Step(int32_t step, int32_t layer, std::vector<uint8_t>* q, std::vector<uint8_t>* k,
                    std::vector<uint8_t>* v) override {
    KVTIER_RETURN_IF_ERROR(CheckIndex("step", step, f_.num_steps));
    KVTIER_RETURN_IF_ERROR(CheckIndex("layer", layer, f_.g.num_layers));
    const uint64_t at = f_.StepOffset(step, layer);
    const uint64_t nq = f_.row_bytes(f_.g.num_q_heads), nkv = f_.row_bytes(f_.g.num_kv_heads);
    KVTIER_RETURN_IF_ERROR(Read(at, nq, q));
    KVTIER_RETURN_IF_ERROR(Read(at + nq, nkv, k));
    return Read(at + nq + nkv, nkv, v);
  }

 private:
  absl::Status CheckIndex(const char* what, int32_t i, int32_t n) const {
    if (i >= 0 && i < n) return absl::OkStatus();
    return absl::OutOfRangeError(
        absl::StrFormat("trace %s: %s %d outside [0, %d)", path_, what, i, n));
  }
  absl::Status Read(uint64_t offset, uint64_t n, std::vector<uint8_t>* out) const {
    out->resize(n);
    KVTIER_ASSIGN_OR_RETURN(const size_t got, PreadFull(fd_->get(), offset, n, out->data()));
    if (got != n) {  // the file shrank after it was opened
      return absl::DataLossError(absl::StrFormat("trace %s: short read at byte %d: %d of %d bytes",
                                                 path_, offset, got, n));
    }
    return absl::OkStatus();
  }

  const std::string path_;
  const std::unique_ptr<Fd> fd_;
  const FileLayout f_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<TraceSource>> OpenTraceFile(const std::string& path) {
  auto fd = std::make_unique<Fd>(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd->get() < 0) return Errno("cannot open trace", path);
  const off_t size = lseek(fd->get(), 0, SEEK_END);
  if (size < 0) return Errno("cannot seek trace", path);
  // The fixed fields first, then the whole header once header_bytes is known.
  std::vector<uint8_t> header(std::min<uint64_t>(static_cast<uint64_t>(size), kFieldBytes));
  KVTIER_RETURN_IF_ERROR(PreadFull(fd->get(), 0, header.size(), header.data()).status());
  if (header.size() == kFieldBytes) {
    const uint32_t want = std::min(GetU32(&header[12]), kMaxHeaderBytes);
    if (want > kFieldBytes && std::memcmp(header.data(), kMagic, sizeof(kMagic)) == 0) {
      header.resize(std::min<uint64_t>(static_cast<uint64_t>(size), want));
      KVTIER_RETURN_IF_ERROR(PreadFull(fd->get(), 0, header.size(), header.data()).status());
    }
  }
  KVTIER_ASSIGN_OR_RETURN(const FileLayout f, ParseHeader(path, header));
  if (static_cast<uint64_t>(size) != f.total_bytes()) {
    return absl::DataLossError(absl::StrFormat(
        "trace %s: %d bytes, expected %d for %s, %d prefill tokens, %d steps (%s)", path, size,
        f.total_bytes(), f.g.ToString(), f.prefill_tokens, f.num_steps,
        static_cast<uint64_t>(size) < f.total_bytes() ? "truncated" : "trailing bytes"));
  }
  return std::make_unique<FileTrace>(path, std::move(fd), f);
}

absl::Status WriteTraceFile(TraceSource& src, const std::string& path) {
  FileLayout f;
  f.g = src.geometry();
  f.prefill_tokens = src.prefill_tokens();
  f.num_steps = src.num_steps();
  KVTIER_RETURN_IF_ERROR(CheckShape(f.g, f.prefill_tokens, f.num_steps));
  const std::string tmp = absl::StrFormat("%s.tmp.%d", path, getpid());
  Fd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return Errno("cannot create", tmp);
  auto write_all = [&]() -> absl::Status {
    std::vector<uint8_t> header(kHeaderBytes, 0);
    std::memcpy(header.data(), kMagic, sizeof(kMagic));
    const uint32_t fields[10] = {kVersion,
                                 kHeaderBytes,
                                 static_cast<uint32_t>(f.g.num_layers),
                                 static_cast<uint32_t>(f.g.num_q_heads),
                                 static_cast<uint32_t>(f.g.num_kv_heads),
                                 static_cast<uint32_t>(f.g.head_dim),
                                 static_cast<uint32_t>(f.g.page_size),
                                 static_cast<uint32_t>(f.g.dtype),
                                 static_cast<uint32_t>(f.prefill_tokens),
                                 static_cast<uint32_t>(f.num_steps)};
    for (size_t i = 0; i < 10; ++i) PutU32(&header[8 + 4 * i], fields[i]);
    KVTIER_RETURN_IF_ERROR(WriteFull(fd.get(), header.data(), header.size()));
    // Every tensor must have the size the geometry gives it, or offsets would shift.
    auto put = [&](const std::vector<uint8_t>& t, uint64_t want, const char* what) {
      if (t.size() != want) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "trace source returned %d bytes for %s; the geometry needs %d", t.size(), what, want));
      }
      return WriteFull(fd.get(), t.data(), t.size());
    };
    std::vector<uint8_t> q, k, v;
    for (int32_t l = 0; l < f.g.num_layers; ++l) {
      KVTIER_RETURN_IF_ERROR(src.Prefill(l, &k, &v));
      KVTIER_RETURN_IF_ERROR(put(k, f.prefill_tensor_bytes(), "a prefill K"));
      KVTIER_RETURN_IF_ERROR(put(v, f.prefill_tensor_bytes(), "a prefill V"));
    }
    const uint64_t nq = f.row_bytes(f.g.num_q_heads), nkv = f.row_bytes(f.g.num_kv_heads);
    for (int32_t s = 0; s < f.num_steps; ++s) {
      for (int32_t l = 0; l < f.g.num_layers; ++l) {
        KVTIER_RETURN_IF_ERROR(src.Step(s, l, &q, &k, &v));
        KVTIER_RETURN_IF_ERROR(put(q, nq, "a step's q"));
        KVTIER_RETURN_IF_ERROR(put(k, nkv, "a step's k"));
        KVTIER_RETURN_IF_ERROR(put(v, nkv, "a step's v"));
      }
    }
    if (!fd.Close()) return Errno("cannot close", tmp);
    if (std::rename(tmp.c_str(), path.c_str()) != 0) return Errno("cannot rename to", path);
    return absl::OkStatus();
  };
  absl::Status st = write_all();
  if (!st.ok()) unlink(tmp.c_str());
  return st;
}

}  // namespace kvtier::bench
