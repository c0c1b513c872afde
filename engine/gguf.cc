#include "engine/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "kvtier/dtype.h"

namespace kvtier::engine {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the GGUF reader loads little-endian fields in place");

// The smallest encodings, for bounding counts by the bytes left before looping over them.
constexpr uint64_t kMinKvBytes = 8 + 4 + 1;                  // empty key, type, a 1-byte value
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;  // empty name, 1 dim, type, offset
constexpr uint64_t kStringHeaderBytes = 8;
constexpr uint32_t kLastValueType = static_cast<uint32_t>(GgufValueType::kF64);

template <typename T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The system abseil's string_view is its own type, not std::string_view.
absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// Bytes of a fixed-size value type; 0 for strings, arrays and unknown types.
size_t ScalarBytes(uint32_t type) {
  switch (static_cast<GgufValueType>(type)) {
    case GgufValueType::kU8:
    case GgufValueType::kI8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kU16:
    case GgufValueType::kI16:
      return 2;
    case GgufValueType::kU32:
    case GgufValueType::kI32:
    case GgufValueType::kF32:
      return 4;
    case GgufValueType::kU64:
    case GgufValueType::kI64:
    case GgufValueType::kF64:
      return 8;
    case GgufValueType::kString:
    case GgufValueType::kArray:
      return 0;
  }
  return 0;
}

bool IsInteger(uint32_t type) {
  switch (static_cast<GgufValueType>(type)) {
    case GgufValueType::kU8:
    case GgufValueType::kI8:
    case GgufValueType::kU16:
    case GgufValueType::kI16:
    case GgufValueType::kU32:
    case GgufValueType::kI32:
    case GgufValueType::kU64:
    case GgufValueType::kI64:
      return true;
    default:
      return false;
  }
}

bool IsFloat(uint32_t type) {
  return type == static_cast<uint32_t>(GgufValueType::kF32) ||
         type == static_cast<uint32_t>(GgufValueType::kF64);
}

// An integer value at `p` of integer type `type`: signed types sign-extended into `bits`.
struct Integer {
  bool is_signed = false;
  uint64_t bits = 0;
};

Integer LoadInteger(uint32_t type, const uint8_t* p) {
  switch (static_cast<GgufValueType>(type)) {
    case GgufValueType::kU8:
      return {false, Load<uint8_t>(p)};
    case GgufValueType::kI8:
      return {true, static_cast<uint64_t>(int64_t{Load<int8_t>(p)})};
    case GgufValueType::kU16:
      return {false, Load<uint16_t>(p)};
    case GgufValueType::kI16:
      return {true, static_cast<uint64_t>(int64_t{Load<int16_t>(p)})};
    case GgufValueType::kU32:
      return {false, Load<uint32_t>(p)};
    case GgufValueType::kI32:
      return {true, static_cast<uint64_t>(int64_t{Load<int32_t>(p)})};
    case GgufValueType::kU64:
      return {false, Load<uint64_t>(p)};
    case GgufValueType::kI64:
      return {true, Load<uint64_t>(p)};
    default:
      return {};
  }
}

double LoadNumber(uint32_t type, const uint8_t* p) {
  if (type == static_cast<uint32_t>(GgufValueType::kF32)) return Load<float>(p);
  if (type == static_cast<uint32_t>(GgufValueType::kF64)) return Load<double>(p);
  const Integer i = LoadInteger(type, p);
  return i.is_signed ? static_cast<double>(static_cast<int64_t>(i.bits))
                     : static_cast<double>(i.bits);
}

// A name from the file, quoted for a message: escaped, and cut after 64 bytes.
std::string Quote(std::string_view s) {
  constexpr size_t kShown = 64;
  if (s.size() <= kShown) return absl::StrCat("'", absl::CHexEscape(Sv(s)), "'");
  return absl::StrCat("'", absl::CHexEscape(Sv(s.substr(0, kShown))), "'... (", s.size(),
                      " bytes)");
}

bool IsPowerOfTwo(uint64_t x) { return x != 0 && (x & (x - 1)) == 0; }

constexpr std::string_view kSupportedTypes = "F32, F16, BF16, Q8_0";

// Bytes of `elements` elements of a supported tensor type (Q8_0: a multiple of 32).
size_t TensorBytes(GgmlType type, int64_t elements) {
  const size_t n = static_cast<size_t>(elements);
  switch (type) {
    case GgmlType::kF32:
      return n * 4;
    case GgmlType::kF16:
    case GgmlType::kBF16:
      return n * 2;
    case GgmlType::kQ8_0:
      return n / GgufFile::kQ8_0BlockElements * GgufFile::kQ8_0BlockBytes;
  }
  return 0;
}

}  // namespace

std::string_view GgmlTypeName(uint32_t type) {
  static constexpr std::string_view kNames[] = {
      "F32",   "F16",        "Q4_0",       "Q4_1",       "Q4_2",     "Q4_3",     "Q5_0",
      "Q5_1",  "Q8_0",       "Q8_1",       "Q2_K",       "Q3_K",     "Q4_K",     "Q5_K",
      "Q6_K",  "Q8_K",       "IQ2_XXS",    "IQ2_XS",     "IQ3_XXS",  "IQ1_S",    "IQ4_NL",
      "IQ3_S", "IQ2_S",      "IQ4_XS",     "I8",         "I16",      "I32",      "I64",
      "F64",   "IQ1_M",      "BF16",       "Q4_0_4_4",   "Q4_0_4_8", "Q4_0_8_8", "TQ1_0",
      "TQ2_0", "IQ4_NL_4_4", "IQ4_NL_4_8", "IQ4_NL_8_8", "MXFP4",
  };
  if (type < std::size(kNames)) return kNames[type];
  return "unknown";
}

std::string_view GgufValueTypeName(uint32_t type) {
  static constexpr std::string_view kNames[] = {"u8",  "i8",  "u16",  "i16",    "u32",
                                                "i32", "f32", "bool", "string", "array",
                                                "u64", "i64", "f64"};
  if (type < std::size(kNames)) return kNames[type];
  return "unknown";
}

// Walks the buffer once, filling the GgufFile; every read is bounds-checked first. Messages
// say where they are ("metadata key 'k' (kv #3): ", "tensor 'w' (#0): ") through Where().
class GgufFile::Parser {
 public:
  explicit Parser(GgufFile* file) : f_(file), p_(file->base_), size_(file->size_) {}

  absl::Status Run() {
    KVTIER_RETURN_IF_ERROR(ParseHeader());
    KVTIER_RETURN_IF_ERROR(ParseMetadata());
    KVTIER_RETURN_IF_ERROR(ParseAlignment());
    KVTIER_RETURN_IF_ERROR(ParseTensorInfos());
    return PlaceTensors();
  }

 private:
  enum class Section { kHeader, kMetadata, kTensors };

  size_t left() const { return size_ - pos_; }

  std::string Where() const {
    switch (section_) {
      case Section::kHeader:
        return "";
      case Section::kMetadata:
        return named_ ? absl::StrCat("metadata key ", Quote(name_), " (kv #", index_, "): ")
                      : absl::StrCat("metadata kv #", index_, ": ");
      case Section::kTensors:
        return named_ ? absl::StrCat("tensor ", Quote(name_), " (#", index_, "): ")
                      : absl::StrCat("tensor #", index_, ": ");
    }
    return "";
  }

  absl::Status Error(std::string_view message) const {
    return absl::InvalidArgumentError(absl::StrCat("GGUF ", Where(), Sv(message)));
  }
  // Ran out of bytes: says "truncated", the field, its offset and what it needed.
  absl::Status Truncated(std::string_view field, uint64_t needed) const {
    return absl::InvalidArgumentError(
        absl::StrFormat("GGUF truncated: %s%s at offset %d needs %d bytes, but the file ends "
                        "at byte %d",
                        Where(), field, pos_, needed, size_));
  }

  template <typename T>
  absl::Status Read(std::string_view field, T* out) {
    if (left() < sizeof(T)) return Truncated(field, sizeof(T));
    *out = Load<T>(p_ + pos_);
    pos_ += sizeof(T);
    return absl::OkStatus();
  }

  // A GGUF string (u64 length, bytes) of at most `max` bytes, as a view into the buffer.
  // `element` ≥ 0 names an array element in messages.
  absl::Status ReadString(std::string_view field, int64_t element, uint64_t max,
                          std::string_view* out) {
    // Built only for a message: string arrays can hold millions of strings.
    const auto label = [&] {
      return element < 0 ? std::string(field) : absl::StrCat(Sv(field), " element ", element);
    };
    if (left() < sizeof(uint64_t)) return Truncated(absl::StrCat(label(), " length"), 8);
    const uint64_t length = Load<uint64_t>(p_ + pos_);
    pos_ += sizeof(length);
    if (length > max) {
      return Error(
          absl::StrFormat("%s length %d exceeds the limit of %d bytes", label(), length, max));
    }
    if (length > left()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "GGUF truncated: %s%s length %d at offset %d exceeds the %d bytes left in the file",
          Where(), label(), length, pos_ - sizeof(length), left()));
    }
    *out = std::string_view(reinterpret_cast<const char*>(p_ + pos_), length);
    pos_ += length;
    return absl::OkStatus();
  }

  absl::Status ParseHeader() {
    section_ = Section::kHeader;
    if (left() < 4) return Truncated("magic", 4);
    if (std::memcmp(p_, "GGUF", 4) != 0) {
      return Error(absl::StrFormat(
          "magic \"%s\" (%s) is not \"GGUF\": not a GGUF file",
          absl::CHexEscape(absl::string_view(reinterpret_cast<const char*>(p_), 4)),
          absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(p_), 4))));
    }
    pos_ = 4;
    uint32_t version = 0;
    KVTIER_RETURN_IF_ERROR(Read("version", &version));
    if (version != 2 && version != 3) {
      const uint32_t swapped = __builtin_bswap32(version);
      if (swapped >= 1 && swapped <= 3) {
        return Error(absl::StrFormat(
            "version %d (0x%08x) is version %d byteswapped: a big-endian GGUF file, which is "
            "not supported (supported: little-endian versions 2 and 3)",
            version, version, swapped));
      }
      if (version == 1) {
        return Error(
            "version 1 is not supported (supported: 2 and 3; version 1 had 32-bit counts)");
      }
      return Error(absl::StrFormat("version %d is not supported (supported: 2 and 3)", version));
    }
    f_->version_ = version;
    KVTIER_RETURN_IF_ERROR(Read("tensor_count", &tensor_count_));
    KVTIER_RETURN_IF_ERROR(Read("metadata_kv_count", &kv_count_));
    if (tensor_count_ > kMaxTensors) {
      return Error(
          absl::StrFormat("tensor_count = %d exceeds the limit of %d", tensor_count_, kMaxTensors));
    }
    if (kv_count_ > kMaxMetadata) {
      return Error(absl::StrFormat("metadata_kv_count = %d exceeds the limit of %d", kv_count_,
                                   kMaxMetadata));
    }
    // Both ≤ 2^20, so these products cannot overflow.
    const uint64_t tensor_min = tensor_count_ * kMinTensorInfoBytes;
    if (tensor_min > left()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "GGUF truncated: tensor_count = %d needs at least %d bytes of tensor infos (%d each), "
          "but only %d bytes are left at offset %d",
          tensor_count_, tensor_min, kMinTensorInfoBytes, left(), pos_));
    }
    const uint64_t kv_min = kv_count_ * kMinKvBytes;
    if (kv_min > left() - tensor_min) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "GGUF truncated: metadata_kv_count = %d needs at least %d bytes (%d per kv) besides "
          "%d bytes of tensor infos, but only %d bytes are left at offset %d",
          kv_count_, kv_min, kMinKvBytes, tensor_min, left(), pos_));
    }
    return absl::OkStatus();
  }

  absl::Status ParseMetadata() {
    section_ = Section::kMetadata;
    f_->values_.reserve(kv_count_);
    f_->value_index_.reserve(kv_count_);
    for (uint64_t i = 0; i < kv_count_; ++i) {
      index_ = i;
      named_ = false;
      Value v;
      KVTIER_RETURN_IF_ERROR(ReadString("key", -1, kMaxNameBytes, &v.key));
      name_ = v.key;
      named_ = true;
      KVTIER_RETURN_IF_ERROR(Read("value type", &v.type));
      KVTIER_RETURN_IF_ERROR(ParseValue(&v));
      const auto [it, inserted] = f_->value_index_.emplace(v.key, f_->values_.size());
      if (!inserted) return Error(absl::StrCat("duplicate key (first at kv #", it->second, ")"));
      f_->values_.push_back(v);
    }
    return absl::OkStatus();
  }

  // The value of type v->type at pos_: checked, skipped, and located in *v.
  absl::Status ParseValue(Value* v) {
    if (v->type > kLastValueType) {
      return Error(absl::StrFormat("value type %d is unknown (the types are 0..%d)", v->type,
                                   kLastValueType));
    }
    if (const size_t bytes = ScalarBytes(v->type); bytes != 0) {
      if (left() < bytes) {
        return Truncated(absl::StrCat(Sv(GgufValueTypeName(v->type)), " value"), bytes);
      }
      if (v->type == static_cast<uint32_t>(GgufValueType::kBool) && p_[pos_] > 1) {
        return Error(absl::StrFormat("bool value = %d: a bool must be 0 or 1", p_[pos_]));
      }
      v->offset = pos_;
      pos_ += bytes;
      return absl::OkStatus();
    }
    if (v->type == static_cast<uint32_t>(GgufValueType::kString)) {
      std::string_view s;
      KVTIER_RETURN_IF_ERROR(ReadString("string value", -1, kMaxStringBytes, &s));
      v->offset = static_cast<size_t>(reinterpret_cast<const uint8_t*>(s.data()) - p_);
      v->count = s.size();
      return absl::OkStatus();
    }
    // An array.
    KVTIER_RETURN_IF_ERROR(Read("array element type", &v->element_type));
    if (v->element_type == static_cast<uint32_t>(GgufValueType::kArray)) {
      return Error(
          "array element type 9 (array): arrays of arrays are not supported (no nested arrays)");
    }
    if (v->element_type > kLastValueType) {
      return Error(absl::StrFormat("array element type %d is unknown (the types are 0..%d)",
                                   v->element_type, kLastValueType));
    }
    KVTIER_RETURN_IF_ERROR(Read("array count", &v->count));
    const size_t element_bytes = ScalarBytes(v->element_type);
    const uint64_t min_bytes = element_bytes != 0 ? element_bytes : kStringHeaderBytes;
    if (v->count > left() / min_bytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "GGUF truncated: %sarray count %d of %s (at least %d bytes each) at offset %d exceeds "
          "the %d bytes left in the file",
          Where(), v->count, GgufValueTypeName(v->element_type), min_bytes, pos_ - sizeof(v->count),
          left()));
    }
    v->offset = pos_;
    if (element_bytes != 0) {
      if (v->element_type == static_cast<uint32_t>(GgufValueType::kBool)) {
        for (uint64_t i = 0; i < v->count; ++i) {
          if (p_[pos_ + i] > 1) {
            return Error(absl::StrFormat("bool array element %d = %d: a bool must be 0 or 1", i,
                                         p_[pos_ + i]));
          }
        }
      }
      pos_ += v->count * element_bytes;  // ≤ left(), checked above
      return absl::OkStatus();
    }
    for (uint64_t i = 0; i < v->count; ++i) {
      std::string_view s;
      KVTIER_RETURN_IF_ERROR(
          ReadString("string array", static_cast<int64_t>(i), kMaxStringBytes, &s));
    }
    return absl::OkStatus();
  }

  absl::Status ParseAlignment() {
    section_ = Section::kHeader;
    const auto it = f_->value_index_.find("general.alignment");
    if (it == f_->value_index_.end()) return absl::OkStatus();
    const Value& v = f_->values_[it->second];
    if (v.type != static_cast<uint32_t>(GgufValueType::kU32)) {
      return Error(absl::StrFormat("general.alignment has type %s; it must be u32",
                                   GgufValueTypeName(v.type)));
    }
    const uint32_t alignment = Load<uint32_t>(p_ + v.offset);
    if (!IsPowerOfTwo(alignment) || alignment > kMaxAlignment) {
      return Error(absl::StrFormat("general.alignment = %d: must be a power of two in [1, %d]",
                                   alignment, kMaxAlignment));
    }
    f_->alignment_ = alignment;
    return absl::OkStatus();
  }

  absl::Status ParseTensorInfos() {
    static constexpr std::string_view kDimNames[] = {"ne[0]", "ne[1]", "ne[2]", "ne[3]"};
    section_ = Section::kTensors;
    f_->tensors_.reserve(tensor_count_);
    f_->tensor_index_.reserve(tensor_count_);
    offsets_.reserve(tensor_count_);
    for (uint64_t i = 0; i < tensor_count_; ++i) {
      index_ = i;
      named_ = false;
      std::string_view name;
      KVTIER_RETURN_IF_ERROR(ReadString("name", -1, kMaxNameBytes, &name));
      name_ = name;
      named_ = true;
      uint32_t n_dims = 0;
      KVTIER_RETURN_IF_ERROR(Read("n_dims", &n_dims));
      if (n_dims < 1 || n_dims > kMaxDims) {
        return Error(absl::StrFormat("n_dims = %d: must be in [1, %d]", n_dims, kMaxDims));
      }
      GgufTensor t;
      t.dims.reserve(n_dims);
      int64_t elements = 1;
      for (uint32_t d = 0; d < n_dims; ++d) {
        uint64_t ne = 0;
        KVTIER_RETURN_IF_ERROR(Read(kDimNames[d], &ne));
        if (ne < 1) return Error(absl::StrFormat("%s = 0: every dim must be ≥ 1", kDimNames[d]));
        // elements ≤ kMaxElements here, so elements · ne ≤ kMaxElements exactly when
        // elements ≤ floor(kMaxElements / ne): no multiplication that could overflow.
        if (ne > static_cast<uint64_t>(kMaxElements) ||
            static_cast<uint64_t>(elements) > static_cast<uint64_t>(kMaxElements) / ne) {
          return Error(absl::StrFormat(
              "%s = %d: the element count (product of ne[0..%d]) exceeds the limit of 2^48 = %d",
              kDimNames[d], ne, d, kMaxElements));
        }
        elements *= static_cast<int64_t>(ne);
        t.dims.push_back(static_cast<int64_t>(ne));
      }
      uint32_t type = 0;
      KVTIER_RETURN_IF_ERROR(Read("type", &type));
      switch (static_cast<GgmlType>(type)) {
        case GgmlType::kF32:
        case GgmlType::kF16:
        case GgmlType::kBF16:
          break;
        case GgmlType::kQ8_0:
          if (t.dims[0] % kQ8_0BlockElements != 0) {
            return Error(absl::StrFormat(
                "type Q8_0 needs ne[0] a multiple of %d (its block size); ne[0] = %d",
                kQ8_0BlockElements, t.dims[0]));
          }
          break;
        default:
          return Error(absl::StrFormat("type %d (%s) is not supported (%s)", type,
                                       GgmlTypeName(type), kSupportedTypes));
      }
      uint64_t offset = 0;
      KVTIER_RETURN_IF_ERROR(Read("offset", &offset));
      if (offset % f_->alignment_ != 0) {
        return Error(absl::StrFormat("offset %d is not a multiple of the alignment %d", offset,
                                     f_->alignment_));
      }
      const auto [it, inserted] = f_->tensor_index_.emplace(name, f_->tensors_.size());
      if (!inserted) {
        return Error(absl::StrCat("duplicate tensor name (first at tensor #", it->second, ")"));
      }
      t.name = std::string(name);
      t.type = static_cast<GgmlType>(type);
      t.elements = elements;
      t.bytes = TensorBytes(t.type, elements);
      f_->tensors_.push_back(std::move(t));
      offsets_.push_back(offset);
    }
    return absl::OkStatus();
  }

  // The data section, and every tensor's data inside it without overlap.
  absl::Status PlaceTensors() {
    section_ = Section::kHeader;
    const size_t header_end = pos_;
    // header_end ≤ size_ and alignment ≤ 2^16: no overflow.
    const size_t data_offset = (header_end + f_->alignment_ - 1) / f_->alignment_ * f_->alignment_;
    if (f_->tensors_.empty()) {
      f_->data_offset_ = std::min(data_offset, size_);
      return absl::OkStatus();
    }
    if (data_offset > size_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "GGUF truncated: the data section starts at offset %d (the header ends at %d, "
          "aligned to %d), but the file ends at byte %d",
          data_offset, header_end, f_->alignment_, size_));
    }
    f_->data_offset_ = data_offset;
    const uint64_t data_bytes = size_ - data_offset;
    section_ = Section::kTensors;
    named_ = true;
    for (size_t i = 0; i < f_->tensors_.size(); ++i) {
      GgufTensor& t = f_->tensors_[i];
      index_ = i;
      name_ = t.name;
      if (offsets_[i] > data_bytes || t.bytes > data_bytes - offsets_[i]) {
        return Error(absl::StrFormat(
            "data at offset %d + %d bytes (file offset %d) lies past the end of the file "
            "(%d bytes, a data section of %d): truncated or corrupt",
            offsets_[i], t.bytes, data_offset + std::min(offsets_[i], data_bytes), size_,
            data_bytes));
      }
      t.data = p_ + data_offset + offsets_[i];
    }
    std::vector<size_t> order(f_->tensors_.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return offsets_[a] != offsets_[b] ? offsets_[a] < offsets_[b] : a < b;
    });
    for (size_t k = 1; k < order.size(); ++k) {
      const size_t prev = order[k - 1];
      const size_t cur = order[k];
      // Both ranges lie inside the data section: no overflow.
      if (offsets_[prev] + f_->tensors_[prev].bytes > offsets_[cur]) {
        index_ = cur;
        name_ = f_->tensors_[cur].name;
        return Error(absl::StrFormat("data [%d, %d) overlaps the data of tensor %s [%d, %d)",
                                     offsets_[cur], offsets_[cur] + f_->tensors_[cur].bytes,
                                     Quote(f_->tensors_[prev].name), offsets_[prev],
                                     offsets_[prev] + f_->tensors_[prev].bytes));
      }
    }
    return absl::OkStatus();
  }

  GgufFile* f_;
  const uint8_t* p_;
  size_t size_;
  size_t pos_ = 0;
  uint64_t tensor_count_ = 0;
  uint64_t kv_count_ = 0;
  std::vector<uint64_t> offsets_;  // per tensor, relative to the data section

  Section section_ = Section::kHeader;
  uint64_t index_ = 0;
  bool named_ = false;
  std::string_view name_;
};

absl::Status GgufFile::Parse() { return Parser(this).Run(); }

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::FromBytes(std::string bytes) {
  std::unique_ptr<GgufFile> file(new GgufFile());
  // The buffer never moves again: keys and names are views into it.
  file->owned_ = std::move(bytes);
  file->base_ = reinterpret_cast<const uint8_t*>(file->owned_.data());
  file->size_ = file->owned_.size();
  KVTIER_RETURN_IF_ERROR(file->Parse());
  return file;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", path));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::ErrnoToStatus(err, absl::StrCat("cannot stat ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  std::unique_ptr<GgufFile> file(new GgufFile());
  const size_t size = static_cast<size_t>(st.st_size);
  if (size > 0) {
    void* mapping = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapping == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return absl::ErrnoToStatus(err, absl::StrCat("cannot map ", path));
    }
    file->mapping_ = mapping;
    file->mapping_size_ = size;
    file->base_ = static_cast<const uint8_t*>(mapping);
  } else {
    file->base_ = reinterpret_cast<const uint8_t*>(file->owned_.data());  // empty
  }
  ::close(fd);  // the mapping keeps the file
  file->size_ = size;
  if (absl::Status s = file->Parse(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
  }
  return file;
}

GgufFile::~GgufFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_size_);
}

absl::StatusOr<const GgufFile::Value*> GgufFile::Find(std::string_view key) const {
  const auto it = value_index_.find(key);
  if (it == value_index_.end()) {
    return absl::NotFoundError(absl::StrCat("GGUF metadata key ", Quote(key), " not found"));
  }
  return &values_[it->second];
}

namespace {

std::string TypeDescription(uint32_t type, uint32_t element_type) {
  if (type == static_cast<uint32_t>(GgufValueType::kArray)) {
    return absl::StrCat("array of ", Sv(GgufValueTypeName(element_type)));
  }
  return std::string(GgufValueTypeName(type));
}

}  // namespace

#define KVTIER_GGUF_FIND(var, key) KVTIER_ASSIGN_OR_RETURN(const Value* var, Find(key))

namespace {

absl::Status Mismatch(std::string_view key, uint32_t type, uint32_t element_type,
                      std::string_view wanted) {
  return absl::InvalidArgumentError(absl::StrCat("GGUF metadata key ", Quote(key), " has type ",
                                                 TypeDescription(type, element_type), ", not ",
                                                 Sv(wanted)));
}

constexpr std::string_view kIntegerTypes = "an integer (u8, i8, u16, i16, u32, i32, u64, i64)";

}  // namespace

bool GgufFile::Has(std::string_view key) const { return value_index_.contains(key); }

absl::StatusOr<GgufValueType> GgufFile::TypeOf(std::string_view key, GgufValueType* element_type,
                                               uint64_t* count) const {
  KVTIER_GGUF_FIND(v, key);
  const bool array = v->type == static_cast<uint32_t>(GgufValueType::kArray);
  if (element_type != nullptr) *element_type = static_cast<GgufValueType>(v->element_type);
  if (count != nullptr) *count = array ? v->count : 0;
  return static_cast<GgufValueType>(v->type);
}

absl::StatusOr<int64_t> GgufFile::GetInt(std::string_view key) const {
  KVTIER_GGUF_FIND(v, key);
  if (!IsInteger(v->type)) return Mismatch(key, v->type, v->element_type, kIntegerTypes);
  const Integer i = LoadInteger(v->type, base_ + v->offset);
  if (!i.is_signed && i.bits > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("GGUF metadata key %s = %d (u64) does not fit int64", Quote(key), i.bits));
  }
  return static_cast<int64_t>(i.bits);
}

absl::StatusOr<uint32_t> GgufFile::GetUint32(std::string_view key) const {
  KVTIER_GGUF_FIND(v, key);
  if (!IsInteger(v->type)) return Mismatch(key, v->type, v->element_type, kIntegerTypes);
  const Integer i = LoadInteger(v->type, base_ + v->offset);
  if (i.is_signed && static_cast<int64_t>(i.bits) < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("GGUF metadata key %s = %d (%s) does not fit uint32", Quote(key),
                        static_cast<int64_t>(i.bits), GgufValueTypeName(v->type)));
  }
  if (i.bits > std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("GGUF metadata key %s = %d (%s) does not fit uint32", Quote(key), i.bits,
                        GgufValueTypeName(v->type)));
  }
  return static_cast<uint32_t>(i.bits);
}

absl::StatusOr<double> GgufFile::GetFloat(std::string_view key) const {
  KVTIER_GGUF_FIND(v, key);
  if (!IsFloat(v->type) && !IsInteger(v->type)) {
    return Mismatch(key, v->type, v->element_type, "a number (f32, f64 or an integer type)");
  }
  return LoadNumber(v->type, base_ + v->offset);
}

absl::StatusOr<bool> GgufFile::GetBool(std::string_view key) const {
  KVTIER_GGUF_FIND(v, key);
  if (v->type != static_cast<uint32_t>(GgufValueType::kBool)) {
    return Mismatch(key, v->type, v->element_type, "bool");
  }
  return base_[v->offset] != 0;
}

absl::StatusOr<std::string> GgufFile::GetString(std::string_view key) const {
  KVTIER_GGUF_FIND(v, key);
  if (v->type != static_cast<uint32_t>(GgufValueType::kString)) {
    return Mismatch(key, v->type, v->element_type, "string");
  }
  return std::string(reinterpret_cast<const char*>(base_ + v->offset), v->count);
}

absl::StatusOr<std::vector<std::string>> GgufFile::GetStringArray(std::string_view key) const {
  KVTIER_GGUF_FIND(v, key);
  if (v->type != static_cast<uint32_t>(GgufValueType::kArray) ||
      v->element_type != static_cast<uint32_t>(GgufValueType::kString)) {
    return Mismatch(key, v->type, v->element_type, "array of string");
  }
  // Parse() walked these strings: every length fits.
  std::vector<std::string> out;
  out.reserve(v->count);
  size_t pos = v->offset;
  for (uint64_t i = 0; i < v->count; ++i) {
    const uint64_t length = Load<uint64_t>(base_ + pos);
    pos += sizeof(length);
    out.emplace_back(reinterpret_cast<const char*>(base_ + pos), length);
    pos += length;
  }
  return out;
}

absl::StatusOr<std::vector<int64_t>> GgufFile::GetIntArray(std::string_view key) const {
  KVTIER_GGUF_FIND(v, key);
  if (v->type != static_cast<uint32_t>(GgufValueType::kArray) || !IsInteger(v->element_type)) {
    return Mismatch(key, v->type, v->element_type, "an array of integers");
  }
  const size_t stride = ScalarBytes(v->element_type);
  std::vector<int64_t> out(v->count);
  for (uint64_t i = 0; i < v->count; ++i) {
    const Integer n = LoadInteger(v->element_type, base_ + v->offset + i * stride);
    if (!n.is_signed && n.bits > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "GGUF metadata key %s: element %d = %d (u64) does not fit int64", Quote(key), i, n.bits));
    }
    out[i] = static_cast<int64_t>(n.bits);
  }
  return out;
}

absl::StatusOr<std::vector<double>> GgufFile::GetFloatArray(std::string_view key) const {
  KVTIER_GGUF_FIND(v, key);
  if (v->type != static_cast<uint32_t>(GgufValueType::kArray) || !IsFloat(v->element_type)) {
    return Mismatch(key, v->type, v->element_type, "an array of f32 or f64");
  }
  const size_t stride = ScalarBytes(v->element_type);
  std::vector<double> out(v->count);
  for (uint64_t i = 0; i < v->count; ++i) {
    out[i] = LoadNumber(v->element_type, base_ + v->offset + i * stride);
  }
  return out;
}

absl::StatusOr<int64_t> GgufFile::GetIntOr(std::string_view key, int64_t fallback) const {
  if (!Has(key)) return fallback;
  return GetInt(key);
}

absl::StatusOr<double> GgufFile::GetFloatOr(std::string_view key, double fallback) const {
  if (!Has(key)) return fallback;
  return GetFloat(key);
}

std::vector<std::string> GgufFile::Keys() const {
  std::vector<std::string> keys;
  keys.reserve(values_.size());
  for (const Value& v : values_) keys.emplace_back(v.key);
  return keys;
}

const GgufTensor* GgufFile::FindTensor(std::string_view name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

void GgufFile::Dequantize(const GgufTensor& t, float* out) {
  const size_t n = static_cast<size_t>(t.elements);
  const uint8_t* p = t.data;
  switch (t.type) {
    case GgmlType::kF32:
      std::memcpy(out, p, n * sizeof(float));
      return;
    case GgmlType::kF16:
      for (size_t i = 0; i < n; ++i) out[i] = HalfToFloat(Half{Load<uint16_t>(p + 2 * i)});
      return;
    case GgmlType::kBF16:
      for (size_t i = 0; i < n; ++i) {
        out[i] = BFloat16ToFloat(BFloat16{Load<uint16_t>(p + 2 * i)});
      }
      return;
    case GgmlType::kQ8_0: {
      const size_t blocks = n / kQ8_0BlockElements;
      for (size_t b = 0; b < blocks; ++b) {
        const uint8_t* block = p + b * kQ8_0BlockBytes;
        const float d = HalfToFloat(Half{Load<uint16_t>(block)});
        const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
        float* y = out + b * kQ8_0BlockElements;
        for (int64_t j = 0; j < kQ8_0BlockElements; ++j) y[j] = d * static_cast<float>(q[j]);
      }
      return;
    }
  }
}

#undef KVTIER_GGUF_FIND

}  // namespace kvtier::engine
