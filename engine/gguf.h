// GGUF: the weights format of llama.cpp, read from a read-only memory mapping and validated
// field by field before anything trusts it.
//
// Layout (little-endian; versions 2 and 3):
//   "GGUF" | u32 version | u64 tensor_count | u64 metadata_kv_count
//   metadata_kv_count × { key: string | u32 value type | value }
//   tensor_count × { name: string | u32 n_dims | n_dims × u64 ne (innermost first)
//                    | u32 ggml type | u64 offset (relative to the data section) }
//   padding to general.alignment (default 32) | the data section
// where a string is a u64 length and that many bytes (no NUL), and a value is a scalar
// (u8 i8 u16 i16 u32 i32 f32 bool u64 i64 f64), a string, or an array (u32 element type,
// u64 count, the elements).
//
// The validation contract: Open() and FromBytes() accept a file only when every field is
// in range, so nothing downstream re-checks it. Every refusal is INVALID_ARGUMENT naming the
// field, its value and the limit; running out of bytes anywhere says "truncated" and where.
// Counts and lengths are checked against the bytes left before anything is allocated or
// looped over, so a hostile file costs at most a small multiple of its own size. Refused:
//   - another magic; versions other than 2 and 3 (a big-endian file is named as such);
//   - tensor_count or metadata_kv_count above kMaxTensors / kMaxMetadata or above what the
//     bytes left can hold; keys and tensor names over kMaxNameBytes, string values over
//     kMaxStringBytes; duplicate keys, duplicate tensor names;
//   - unknown value types, arrays of arrays (nested arrays are not supported), bools that
//     are not 0 or 1;
//   - general.alignment that is not a u32 power of two in [1, kMaxAlignment];
//   - n_dims outside [1, 4], a dim < 1, more than kMaxElements elements; tensor types other
//     than F32, F16, BF16 and Q8_0 (Q8_0 also needs ne[0] a multiple of 32); an offset that
//     is not a multiple of the alignment; data outside the file; tensors that overlap.
// Keys need not be valid UTF-8; string values are arbitrary bytes.
//
// A GgufFile is immutable once opened: thread-safe to read from many threads. The mapping
// lives as long as the GgufFile, and GgufTensor::data points into it. (Truncating the file
// on disk while it is mapped is outside the contract: reads would fault.)
#ifndef KVTIER_ENGINE_GGUF_H_
#define KVTIER_ENGINE_GGUF_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvtier::engine {

// The tensor types this reader supports (ggml's numbering).
enum class GgmlType : uint32_t { kF32 = 0, kF16 = 1, kQ8_0 = 8, kBF16 = 30 };

// ggml's name of a tensor type number: "F32", "Q4_K", ...; "unknown" for numbers it has none.
std::string_view GgmlTypeName(uint32_t type);

// GGUF metadata value types (the u32 before every value).
enum class GgufValueType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

// "u8", "string", "array", ...; "unknown" past f64.
std::string_view GgufValueTypeName(uint32_t type);

struct GgufTensor {
  std::string name;
  GgmlType type;
  // ne, innermost first (a row-major [rows][cols] matrix has dims {cols, rows}).
  std::vector<int64_t> dims;
  int64_t elements = 0;
  const uint8_t* data = nullptr;  // inside the file's mapping
  size_t bytes = 0;
};

class GgufFile {
 public:
  // Limits the parser enforces, beyond "fits in the file".
  static constexpr uint64_t kMaxTensors = uint64_t{1} << 20;
  static constexpr uint64_t kMaxMetadata = uint64_t{1} << 20;
  static constexpr uint64_t kMaxNameBytes = 65535;                // keys and tensor names
  static constexpr uint64_t kMaxStringBytes = uint64_t{1} << 20;  // string values
  static constexpr uint32_t kMaxDims = 4;
  static constexpr int64_t kMaxElements = int64_t{1} << 48;  // per tensor
  static constexpr uint64_t kMaxAlignment = uint64_t{1} << 16;
  static constexpr uint64_t kDefaultAlignment = 32;
  static constexpr int64_t kQ8_0BlockElements = 32;
  static constexpr size_t kQ8_0BlockBytes = 34;  // f16 scale + 32 int8

  // Memory-maps `path` read-only and validates it. NOT_FOUND / PERMISSION_DENIED etc. for
  // open errors (with the path and strerror), INVALID_ARGUMENT for a malformed file (the
  // message starts with the path).
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);
  // Parses an in-memory copy (tests, fuzzing).
  static absl::StatusOr<std::unique_ptr<GgufFile>> FromBytes(std::string bytes);
  ~GgufFile();  // unmaps

  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  uint32_t version() const { return version_; }
  size_t alignment() const { return alignment_; }
  // The whole file, and where its data section starts (every tensor's data lies inside).
  const uint8_t* file_data() const { return base_; }
  size_t file_size() const { return size_; }
  size_t data_offset() const { return data_offset_; }

  bool Has(std::string_view key) const;
  // The stored type of `key`: NOT_FOUND naming the key when absent. For arrays, also the
  // element type and count (nullptr to skip).
  absl::StatusOr<GgufValueType> TypeOf(std::string_view key, GgufValueType* element_type = nullptr,
                                       uint64_t* count = nullptr) const;

  // Typed getters. NOT_FOUND naming the key when absent; INVALID_ARGUMENT naming the key and
  // both types when the stored type does not fit (GetInt accepts any integer type and checks
  // the value fits int64; GetFloat accepts f32/f64 and integers; GetUint32 accepts any
  // integer type and checks the value fits uint32).
  absl::StatusOr<int64_t> GetInt(std::string_view key) const;
  absl::StatusOr<uint32_t> GetUint32(std::string_view key) const;
  absl::StatusOr<double> GetFloat(std::string_view key) const;
  absl::StatusOr<bool> GetBool(std::string_view key) const;
  absl::StatusOr<std::string> GetString(std::string_view key) const;
  absl::StatusOr<std::vector<std::string>> GetStringArray(std::string_view key) const;
  absl::StatusOr<std::vector<int64_t>> GetIntArray(
      std::string_view key) const;  // any integer element type
  absl::StatusOr<std::vector<double>> GetFloatArray(
      std::string_view key) const;  // f32/f64 elements
  // Convenience: the value, or `fallback` when the key is absent (errors other than
  // NOT_FOUND are returned).
  absl::StatusOr<int64_t> GetIntOr(std::string_view key, int64_t fallback) const;
  absl::StatusOr<double> GetFloatOr(std::string_view key, double fallback) const;

  std::vector<std::string> Keys() const;  // in file order
  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  const GgufTensor* FindTensor(std::string_view name) const;  // null when absent

  // Converts a tensor's data to F32 into out[0 .. t.elements). Works for every supported
  // type; exact for F32, F16 and BF16, d·q in float for Q8_0 (as ggml computes it).
  static void Dequantize(const GgufTensor& t, float* out);

 private:
  // One metadata value, parsed lazily from the buffer: `offset` is where the payload starts
  // (past the value type; for arrays past the element type and count).
  struct Value {
    std::string_view key;  // inside the buffer
    uint32_t type = 0;
    uint32_t element_type = 0;  // arrays only
    uint64_t count = 0;         // arrays: elements; strings: bytes
    size_t offset = 0;
  };
  class Parser;

  GgufFile() = default;
  absl::Status Parse();
  absl::StatusOr<const Value*> Find(std::string_view key) const;

  std::string owned_;  // FromBytes: the bytes; Open: empty
  void* mapping_ = nullptr;
  size_t mapping_size_ = 0;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;

  uint32_t version_ = 0;
  size_t alignment_ = kDefaultAlignment;
  size_t data_offset_ = 0;
  std::vector<Value> values_;  // file order
  std::unordered_map<std::string_view, size_t> value_index_;
  std::vector<GgufTensor> tensors_;
  std::unordered_map<std::string_view, size_t> tensor_index_;  // views into the buffer
};

}  // namespace kvtier::engine

#endif  // KVTIER_ENGINE_GGUF_H_
