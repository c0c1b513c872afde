#include "engine/trace_writer.h"

#include <cerrno>
#include <cstring>
#include <iterator>

#include <sys/types.h>

#include "absl/strings/str_format.h"
#include "core/status.h"

namespace kvtier::engine {
namespace {

constexpr int64_t kHeaderBytes = 64;
constexpr char kMagic[8] = {'K', 'V', 'T', 'R', 'A', 'C', 'E', '\0'};

void PutU32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

absl::Status CheckHeader(const TraceHeader& h) {
  auto bad = [](const char* field, int64_t v, const char* range) {
    return absl::InvalidArgumentError(
        absl::StrFormat("trace header: %s = %d must be %s", field, v, range));
  };
  if (h.layers < 1 || h.layers > 1024) return bad("num_layers", h.layers, "in [1, 1024]");
  if (h.q_heads < 1 || h.q_heads > 1024) return bad("num_q_heads", h.q_heads, "in [1, 1024]");
  if (h.kv_heads < 1 || h.q_heads % h.kv_heads != 0 || h.q_heads / h.kv_heads > 64) {
    return bad("num_kv_heads", h.kv_heads, "a divisor of num_q_heads, at most 64 times fewer");
  }
  if (h.head_dim < 8 || h.head_dim > 512 || h.head_dim % 8 != 0) {
    return bad("head_dim", h.head_dim, "a multiple of 8 in [8, 512]");
  }
  if (h.page_size < 1 || h.page_size > 1024 || (h.page_size & (h.page_size - 1)) != 0) {
    return bad("page_size", h.page_size, "a power of two in [1, 1024]");
  }
  if (h.prefill_tokens < 1 || h.prefill_tokens > (int64_t{1} << 24)) {
    return bad("prefill_tokens", h.prefill_tokens, "in [1, 2^24]");
  }
  if (h.steps < 0 || h.steps > (int64_t{1} << 24)) return bad("num_steps", h.steps, "in [0, 2^24]");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TraceWriter>> TraceWriter::Create(const std::string& path,
                                                                 const TraceHeader& h) {
  KVTIER_RETURN_IF_ERROR(CheckHeader(h));
  std::FILE* f = std::fopen(path.c_str(), "wb+");
  if (f == nullptr) {
    return absl::ErrnoToStatus(errno, absl::StrFormat("trace: cannot create %s", path));
  }
  std::unique_ptr<TraceWriter> w(new TraceWriter(f, h));
  uint8_t header[kHeaderBytes] = {};
  std::memcpy(header, kMagic, sizeof(kMagic));
  const uint32_t fields[] = {1,
                             static_cast<uint32_t>(kHeaderBytes),
                             static_cast<uint32_t>(h.layers),
                             static_cast<uint32_t>(h.q_heads),
                             static_cast<uint32_t>(h.kv_heads),
                             static_cast<uint32_t>(h.head_dim),
                             static_cast<uint32_t>(h.page_size),
                             static_cast<uint32_t>(h.dtype),
                             static_cast<uint32_t>(h.prefill_tokens),
                             static_cast<uint32_t>(h.steps)};
  for (size_t i = 0; i < std::size(fields); ++i) PutU32(header + 8 + 4 * i, fields[i]);
  if (std::fwrite(header, 1, sizeof(header), f) != sizeof(header)) {
    return absl::ErrnoToStatus(errno, absl::StrFormat("trace: writing %s", path));
  }
  return w;
}

TraceWriter::~TraceWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

absl::Status TraceWriter::WriteAt(int64_t offset, const float* x, int64_t count) {
  const size_t e = DTypeSize(h_.dtype);
  buf_.resize(count * e);
  for (int64_t i = 0; i < count; ++i) {
    uint8_t* p = buf_.data() + i * e;
    switch (h_.dtype) {
      case DType::kF16: {
        const Half v = FloatToHalf(x[i]);
        std::memcpy(p, &v, e);
        break;
      }
      case DType::kBF16: {
        const BFloat16 v = FloatToBFloat16(x[i]);
        std::memcpy(p, &v, e);
        break;
      }
      case DType::kF32:
        std::memcpy(p, &x[i], e);
        break;
    }
  }
  if (fseeko(file_, static_cast<off_t>(offset), SEEK_SET) != 0 ||
      std::fwrite(buf_.data(), 1, buf_.size(), file_) != buf_.size()) {
    return absl::ErrnoToStatus(errno, "trace: write failed");
  }
  return absl::OkStatus();
}

absl::Status TraceWriter::WritePrefill(int32_t layer, int64_t first, int64_t n, const float* k,
                                       const float* v) {
  if (layer < 0 || layer >= h_.layers || first < 0 || n < 0 || first + n > h_.prefill_tokens) {
    return absl::OutOfRangeError(absl::StrFormat(
        "trace: prefill layer %d positions [%d, %d) outside %d layers × %d tokens", layer, first,
        first + n, h_.layers, h_.prefill_tokens));
  }
  const int64_t row = int64_t{h_.kv_heads} * h_.head_dim;
  const int64_t e = static_cast<int64_t>(DTypeSize(h_.dtype));
  const int64_t p = h_.prefill_tokens * row * e;  // one prefill tensor
  const int64_t k_at = kHeaderBytes + 2 * p * layer + first * row * e;
  KVTIER_RETURN_IF_ERROR(WriteAt(k_at, k, n * row));
  return WriteAt(k_at + p, v, n * row);
}

absl::Status TraceWriter::WriteStep(int64_t step, int32_t layer, const float* q, const float* k,
                                    const float* v) {
  if (layer < 0 || layer >= h_.layers || step < 0 || step >= h_.steps) {
    return absl::OutOfRangeError(absl::StrFormat(
        "trace: step %d layer %d outside %d steps × %d layers", step, layer, h_.steps, h_.layers));
  }
  const int64_t e = static_cast<int64_t>(DTypeSize(h_.dtype));
  const int64_t qn = int64_t{h_.q_heads} * h_.head_dim, kn = int64_t{h_.kv_heads} * h_.head_dim;
  const int64_t p = h_.prefill_tokens * kn * e;
  const int64_t r = (qn + 2 * kn) * e;
  const int64_t at = kHeaderBytes + 2 * p * h_.layers + (step * h_.layers + layer) * r;
  KVTIER_RETURN_IF_ERROR(WriteAt(at, q, qn));
  KVTIER_RETURN_IF_ERROR(WriteAt(at + qn * e, k, kn));
  return WriteAt(at + (qn + kn) * e, v, kn);
}

absl::Status TraceWriter::Close() {
  if (file_ == nullptr) return absl::OkStatus();
  // The file's full size, even when the last record written was not the last in the file.
  const int64_t e = static_cast<int64_t>(DTypeSize(h_.dtype));
  const int64_t kn = int64_t{h_.kv_heads} * h_.head_dim;
  const int64_t end = kHeaderBytes + 2 * h_.prefill_tokens * kn * e * h_.layers +
                      h_.steps * h_.layers * (int64_t{h_.q_heads} * h_.head_dim + 2 * kn) * e;
  std::FILE* f = file_;
  file_ = nullptr;
  const bool sized = fseeko(f, 0, SEEK_END) == 0 && ftello(f) == end;
  const bool closed = std::fclose(f) == 0;
  if (!closed) return absl::ErrnoToStatus(errno, "trace: close failed");
  if (!sized) {
    return absl::DataLossError(
        absl::StrFormat("trace: the file is not %d bytes long: a record was not written", end));
  }
  return absl::OkStatus();
}

}  // namespace kvtier::engine
