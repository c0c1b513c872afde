// GgufBuilder: writes GGUF files in memory for tests and fuzz seeds (engine/gguf.h describes
// the format). Metadata of every value type, arrays, tensors of every type the reader
// supports, a configurable alignment, and hooks that write wrong values on purpose: the
// magic, the version, the counts, raw values, a tensor's written n_dims / offset / type.
//
//   GgufBuilder b;
//   b.AddString("general.architecture", "llama");
//   b.AddU32("llama.block_count", 2);
//   b.AddTensorF32("w", {4, 2}, {1, 2, 3, 4, 5, 6, 7, 8});  // ne = {cols, rows}
//   std::string bytes = b.Build();
//
// Tensors are laid out in the order added, each at the next multiple of the alignment, like
// llama.cpp's writer. Header-only; no dependency beyond the kvtier dtype helpers.
#ifndef KVTIER_TESTS_ENGINE_GGUF_BUILDER_H_
#define KVTIER_TESTS_ENGINE_GGUF_BUILDER_H_

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvtier/dtype.h"

namespace kvtier::testing {

// GGUF value type codes (the u32 before every value).
enum GgufTypeCode : uint32_t {
  kGgufU8 = 0,
  kGgufI8 = 1,
  kGgufU16 = 2,
  kGgufI16 = 3,
  kGgufU32 = 4,
  kGgufI32 = 5,
  kGgufF32 = 6,
  kGgufBool = 7,
  kGgufString = 8,
  kGgufArray = 9,
  kGgufU64 = 10,
  kGgufI64 = 11,
  kGgufF64 = 12,
};

// ggml tensor type codes the builder writes data for (others through AddTensorRaw).
enum GgmlTypeCode : uint32_t {
  kGgmlF32 = 0,
  kGgmlF16 = 1,
  kGgmlQ8_0 = 8,
  kGgmlBF16 = 30,
};

// One Q8_0 block as stored: an fp16 scale d (bits) and 32 int8 quants; value = d·q.
struct Q8_0Block {
  uint16_t d = 0;
  std::array<int8_t, 32> q{};
};

// Where Build() put things, for tests that patch bytes afterwards.
struct GgufLayout {
  size_t kv_count_offset = 16;               // the u64 metadata_kv_count
  size_t tensor_count_offset = 8;            // the u64 tensor_count
  std::vector<size_t> kv_offsets;            // each kv's key length field
  std::vector<size_t> value_offsets;         // each kv's u32 value type
  std::vector<size_t> tensor_info_offsets;   // each tensor info's name length field
  std::vector<size_t> tensor_offset_fields;  // each tensor info's u64 offset field
  size_t header_end = 0;                     // end of the tensor infos (before the padding)
  size_t data_offset = 0;                    // start of the data section
  std::vector<size_t> tensor_data;           // each tensor's data, absolute
};

class GgufBuilder {
 public:
  struct Tensor {
    std::string name;
    std::vector<uint64_t> dims;  // ne, innermost first
    uint32_t type = kGgmlF32;
    std::string data;  // written at the next aligned position of the data section
    // Hooks: write these instead of the true values (the data still goes where it would).
    std::optional<uint64_t> offset;  // the offset field
    std::optional<uint32_t> n_dims;  // the n_dims field (dims are still all written)
  };

  // --- Header hooks.
  GgufBuilder& set_magic(std::string magic) {
    magic_ = std::move(magic);
    return *this;
  }
  GgufBuilder& set_version(uint32_t version) {
    version_ = version;
    return *this;
  }
  // Write these counts instead of the true ones.
  GgufBuilder& set_tensor_count(uint64_t n) {
    tensor_count_ = n;
    return *this;
  }
  GgufBuilder& set_kv_count(uint64_t n) {
    kv_count_ = n;
    return *this;
  }
  // Lays the file out with `alignment` (0 lays out as 1) and, when write_key, writes it as
  // the u32 general.alignment, the first kv.
  GgufBuilder& set_alignment(uint32_t alignment, bool write_key = true) {
    alignment_ = alignment;
    write_alignment_key_ = write_key;
    return *this;
  }
  // Pads the data section after the last tensor to the alignment (llama.cpp does; default).
  GgufBuilder& set_pad_end(bool pad) {
    pad_end_ = pad;
    return *this;
  }
  // Bytes appended after everything else.
  GgufBuilder& set_trailing(std::string bytes) {
    trailing_ = std::move(bytes);
    return *this;
  }

  // --- Metadata, in the order added.
  GgufBuilder& AddU8(std::string key, uint8_t v) { return AddScalar(std::move(key), kGgufU8, v); }
  GgufBuilder& AddI8(std::string key, int8_t v) { return AddScalar(std::move(key), kGgufI8, v); }
  GgufBuilder& AddU16(std::string key, uint16_t v) {
    return AddScalar(std::move(key), kGgufU16, v);
  }
  GgufBuilder& AddI16(std::string key, int16_t v) { return AddScalar(std::move(key), kGgufI16, v); }
  GgufBuilder& AddU32(std::string key, uint32_t v) {
    return AddScalar(std::move(key), kGgufU32, v);
  }
  GgufBuilder& AddI32(std::string key, int32_t v) { return AddScalar(std::move(key), kGgufI32, v); }
  GgufBuilder& AddF32(std::string key, float v) { return AddScalar(std::move(key), kGgufF32, v); }
  GgufBuilder& AddBool(std::string key, bool v) {
    return AddScalar(std::move(key), kGgufBool, static_cast<uint8_t>(v ? 1 : 0));
  }
  GgufBuilder& AddU64(std::string key, uint64_t v) {
    return AddScalar(std::move(key), kGgufU64, v);
  }
  GgufBuilder& AddI64(std::string key, int64_t v) { return AddScalar(std::move(key), kGgufI64, v); }
  GgufBuilder& AddF64(std::string key, double v) { return AddScalar(std::move(key), kGgufF64, v); }
  GgufBuilder& AddString(std::string key, std::string_view v) {
    return AddRaw(std::move(key), kGgufString, Str(v));
  }

  GgufBuilder& AddStringArray(std::string key, const std::vector<std::string>& values) {
    std::string payload;
    for (const std::string& s : values) payload += Str(s);
    return AddRawArray(std::move(key), kGgufString, values.size(), std::move(payload));
  }
  GgufBuilder& AddU8Array(std::string key, const std::vector<uint8_t>& v) {
    return AddArray(std::move(key), kGgufU8, v);
  }
  GgufBuilder& AddI8Array(std::string key, const std::vector<int8_t>& v) {
    return AddArray(std::move(key), kGgufI8, v);
  }
  GgufBuilder& AddU16Array(std::string key, const std::vector<uint16_t>& v) {
    return AddArray(std::move(key), kGgufU16, v);
  }
  GgufBuilder& AddI16Array(std::string key, const std::vector<int16_t>& v) {
    return AddArray(std::move(key), kGgufI16, v);
  }
  GgufBuilder& AddU32Array(std::string key, const std::vector<uint32_t>& v) {
    return AddArray(std::move(key), kGgufU32, v);
  }
  GgufBuilder& AddI32Array(std::string key, const std::vector<int32_t>& v) {
    return AddArray(std::move(key), kGgufI32, v);
  }
  GgufBuilder& AddU64Array(std::string key, const std::vector<uint64_t>& v) {
    return AddArray(std::move(key), kGgufU64, v);
  }
  GgufBuilder& AddI64Array(std::string key, const std::vector<int64_t>& v) {
    return AddArray(std::move(key), kGgufI64, v);
  }
  GgufBuilder& AddF32Array(std::string key, const std::vector<float>& v) {
    return AddArray(std::move(key), kGgufF32, v);
  }
  GgufBuilder& AddF64Array(std::string key, const std::vector<double>& v) {
    return AddArray(std::move(key), kGgufF64, v);
  }
  GgufBuilder& AddBoolArray(std::string key, const std::vector<bool>& v) {
    std::vector<uint8_t> bytes(v.begin(), v.end());
    return AddArray(std::move(key), kGgufBool, bytes);
  }
  // Any element type, each element's bytes as T's (little-endian hosts).
  template <typename T>
  GgufBuilder& AddArray(std::string key, uint32_t element_type, const std::vector<T>& values) {
    std::string payload(values.size() * sizeof(T), '\0');
    if (!values.empty()) std::memcpy(payload.data(), values.data(), payload.size());
    return AddRawArray(std::move(key), element_type, values.size(), std::move(payload));
  }

  // Hooks: the value type and the value's bytes exactly as given.
  GgufBuilder& AddRaw(std::string key, uint32_t type, std::string value_bytes) {
    kvs_.push_back({std::move(key), type, std::move(value_bytes)});
    return *this;
  }
  // An array with this element type and written count, then `payload` verbatim.
  GgufBuilder& AddRawArray(std::string key, uint32_t element_type, uint64_t count,
                           std::string payload) {
    std::string value = Pod(element_type) + Pod(count) + payload;
    return AddRaw(std::move(key), kGgufArray, std::move(value));
  }

  // --- Tensors. `dims` are ne, innermost first; each returns the tensor's index for tensor().
  size_t AddTensorF32(std::string name, std::vector<uint64_t> dims,
                      const std::vector<float>& values) {
    std::string data(values.size() * 4, '\0');
    if (!values.empty()) std::memcpy(data.data(), values.data(), data.size());
    return AddTensorRaw(std::move(name), std::move(dims), kGgmlF32, std::move(data));
  }
  // Rounds each value to fp16 (nearest even).
  size_t AddTensorF16(std::string name, std::vector<uint64_t> dims,
                      const std::vector<float>& values) {
    std::vector<uint16_t> bits;
    for (float v : values) bits.push_back(FloatToHalf(v).bits);
    return AddTensorF16Bits(std::move(name), std::move(dims), bits);
  }
  size_t AddTensorF16Bits(std::string name, std::vector<uint64_t> dims,
                          const std::vector<uint16_t>& bits) {
    return AddTensorRaw(std::move(name), std::move(dims), kGgmlF16, U16s(bits));
  }
  // Rounds each value to bf16 (nearest even).
  size_t AddTensorBF16(std::string name, std::vector<uint64_t> dims,
                       const std::vector<float>& values) {
    std::vector<uint16_t> bits;
    for (float v : values) bits.push_back(FloatToBFloat16(v).bits);
    return AddTensorBF16Bits(std::move(name), std::move(dims), bits);
  }
  size_t AddTensorBF16Bits(std::string name, std::vector<uint64_t> dims,
                           const std::vector<uint16_t>& bits) {
    return AddTensorRaw(std::move(name), std::move(dims), kGgmlBF16, U16s(bits));
  }
  // Quantizes as ggml's quantize_row_q8_0_ref: per block of 32, d = max|x| / 127 and
  // q = round(x / d). values.size() should be a multiple of 32.
  size_t AddTensorQ8_0(std::string name, std::vector<uint64_t> dims,
                       const std::vector<float>& values) {
    std::vector<Q8_0Block> blocks(values.size() / 32);
    for (size_t b = 0; b < blocks.size(); ++b) {
      float amax = 0;
      for (size_t j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(values[b * 32 + j]));
      const float d = amax / 127.0f;
      const float id = d != 0 ? 1.0f / d : 0.0f;
      blocks[b].d = FloatToHalf(d).bits;
      for (size_t j = 0; j < 32; ++j) {
        blocks[b].q[j] = static_cast<int8_t>(std::lround(values[b * 32 + j] * id));
      }
    }
    return AddTensorQ8_0Blocks(std::move(name), std::move(dims), blocks);
  }
  size_t AddTensorQ8_0Blocks(std::string name, std::vector<uint64_t> dims,
                             const std::vector<Q8_0Block>& blocks) {
    std::string data;
    for (const Q8_0Block& b : blocks) {
      data += Pod(b.d);
      data.append(reinterpret_cast<const char*>(b.q.data()), b.q.size());
    }
    return AddTensorRaw(std::move(name), std::move(dims), kGgmlQ8_0, std::move(data));
  }
  // Any type code and data bytes, unchecked.
  size_t AddTensorRaw(std::string name, std::vector<uint64_t> dims, uint32_t type,
                      std::string data) {
    Tensor t;
    t.name = std::move(name);
    t.dims = std::move(dims);
    t.type = type;
    t.data = std::move(data);
    tensors_.push_back(std::move(t));
    return tensors_.size() - 1;
  }
  // The i-th tensor added, to change before Build() (hooks: offset, n_dims, type, data).
  Tensor& tensor(size_t i) { return tensors_.at(i); }

  // The file. `layout`, when given, receives where its parts are.
  std::string Build(GgufLayout* layout = nullptr) const {
    GgufLayout l;
    const uint64_t align = alignment_ == 0 ? 1 : alignment_;
    std::vector<Kv> kvs;
    if (write_alignment_key_) kvs.push_back({"general.alignment", kGgufU32, Pod(alignment_)});
    kvs.insert(kvs.end(), kvs_.begin(), kvs_.end());

    std::string out = magic_;
    out += Pod(version_);
    l.tensor_count_offset = out.size();
    out += Pod(tensor_count_.value_or(tensors_.size()));
    l.kv_count_offset = out.size();
    out += Pod(kv_count_.value_or(kvs.size()));
    for (const Kv& kv : kvs) {
      l.kv_offsets.push_back(out.size());
      out += Str(kv.key);
      l.value_offsets.push_back(out.size());
      out += Pod(kv.type);
      out += kv.value;
    }
    // Data offsets, relative to the data section.
    std::vector<uint64_t> offsets;
    uint64_t cursor = 0;
    for (const Tensor& t : tensors_) {
      cursor = AlignUp(cursor, align);
      offsets.push_back(cursor);
      cursor += t.data.size();
    }
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const Tensor& t = tensors_[i];
      l.tensor_info_offsets.push_back(out.size());
      out += Str(t.name);
      out += Pod(t.n_dims.value_or(static_cast<uint32_t>(t.dims.size())));
      for (uint64_t d : t.dims) out += Pod(d);
      out += Pod(t.type);
      l.tensor_offset_fields.push_back(out.size());
      out += Pod(t.offset.value_or(offsets[i]));
    }
    l.header_end = out.size();
    l.data_offset = AlignUp(out.size(), align);
    out.resize(l.data_offset, '\0');
    for (size_t i = 0; i < tensors_.size(); ++i) {
      out.resize(l.data_offset + offsets[i], '\0');
      l.tensor_data.push_back(out.size());
      out += tensors_[i].data;
    }
    if (pad_end_ && !tensors_.empty()) {
      out.resize(l.data_offset + AlignUp(out.size() - l.data_offset, align), '\0');
    }
    out += trailing_;
    if (layout != nullptr) *layout = std::move(l);
    return out;
  }

  // Little-endian encodings, for tests that write fields by hand.
  template <typename T>
  static std::string Pod(T v) {
    std::string s(sizeof(T), '\0');
    std::memcpy(s.data(), &v, sizeof(T));
    return s;
  }
  // A GGUF string: u64 length, then the bytes.
  static std::string Str(std::string_view s) {
    return Pod(static_cast<uint64_t>(s.size())) + std::string(s);
  }

 private:
  struct Kv {
    std::string key;
    uint32_t type;
    std::string value;
  };

  template <typename T>
  GgufBuilder& AddScalar(std::string key, uint32_t type, T v) {
    return AddRaw(std::move(key), type, Pod(v));
  }
  static std::string U16s(const std::vector<uint16_t>& bits) {
    std::string s(bits.size() * 2, '\0');
    if (!bits.empty()) std::memcpy(s.data(), bits.data(), s.size());
    return s;
  }
  static uint64_t AlignUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

  std::string magic_ = "GGUF";
  uint32_t version_ = 3;
  std::optional<uint64_t> tensor_count_;
  std::optional<uint64_t> kv_count_;
  uint32_t alignment_ = 32;
  bool write_alignment_key_ = false;
  bool pad_end_ = true;
  std::string trailing_;
  std::vector<Kv> kvs_;
  std::vector<Tensor> tensors_;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_ENGINE_GGUF_BUILDER_H_
