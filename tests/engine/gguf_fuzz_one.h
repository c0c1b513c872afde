// The GGUF reader's fuzz target, shared by the seeded mutation driver (gguf_fuzz.cc) and the
// libFuzzer entry (gguf_libfuzzer.cc): one input through GgufFile::FromBytes, and, when it
// is accepted, every getter on every key and Dequantize on every tensor.
//
// Invariants checked (a crash or a sanitizer report is the other kind of failure):
//   - a refusal is INVALID_ARGUMENT with a short message starting "GGUF";
//   - an accepted file has version 2 or 3 and a power-of-two alignment; every key is found,
//     its stored type's own getter succeeds (u64 values above int64 aside), and every other
//     getter answers OK or INVALID_ARGUMENT, never another code;
//   - every tensor's data lies inside the data section, its byte count matches its type and
//     element count, and FindTensor finds it.
// Header-only so that both binaries link nothing beyond kvtier_gguf.
#ifndef KVTIER_TESTS_ENGINE_GGUF_FUZZ_ONE_H_
#define KVTIER_TESTS_ENGINE_GGUF_FUZZ_ONE_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/gguf.h"
#include "tests/engine/gguf_builder.h"

namespace kvtier::testing {

struct GgufFuzzCounts {
  uint64_t cases = 0;
  uint64_t accepted = 0;
  uint64_t refused = 0;
  uint64_t tensors_dequantized = 0;
  uint64_t invariant_failures = 0;
};

inline GgufFuzzCounts& GgufFuzzCountsNow() {
  static GgufFuzzCounts counts;
  return counts;
}

namespace gguf_fuzz_internal {

// Keeps dequantized values observable, so no loop is optimised away.
inline volatile float sink = 0;

inline bool Fail(std::string* why, std::string message) {
  *why = std::move(message);
  ++GgufFuzzCountsNow().invariant_failures;
  return false;
}

// OK or INVALID_ARGUMENT: what a getter may answer for a key that exists.
inline bool GetterCodeOk(const absl::Status& s) {
  return s.ok() || s.code() == absl::StatusCode::kInvalidArgument;
}

inline bool CheckFile(const engine::GgufFile& f, std::string* why) {
  using engine::GgufValueType;
  if (f.version() != 2 && f.version() != 3) {
    return Fail(why, absl::StrCat("accepted version ", f.version()));
  }
  const size_t a = f.alignment();
  if (a == 0 || (a & (a - 1)) != 0) return Fail(why, absl::StrCat("accepted alignment ", a));
  if (f.data_offset() > f.file_size()) return Fail(why, "data_offset past the end of the file");

  const std::vector<std::string> keys = f.Keys();
  std::unordered_set<std::string> seen;
  for (const std::string& key : keys) {
    if (!seen.insert(key).second) return Fail(why, absl::StrCat("duplicate key ", key));
    if (!f.Has(key)) return Fail(why, absl::StrCat("Has() misses key ", key));
    GgufValueType element = GgufValueType::kU8;
    uint64_t count = 0;
    absl::StatusOr<GgufValueType> type = f.TypeOf(key, &element, &count);
    if (!type.ok()) return Fail(why, absl::StrCat("TypeOf failed: ", type.status().ToString()));
    const absl::Status results[] = {
        f.GetInt(key).status(),      f.GetUint32(key).status(),
        f.GetFloat(key).status(),    f.GetBool(key).status(),
        f.GetString(key).status(),   f.GetStringArray(key).status(),
        f.GetIntArray(key).status(), f.GetFloatArray(key).status(),
        f.GetIntOr(key, 1).status(), f.GetFloatOr(key, 1).status(),
    };
    for (const absl::Status& s : results) {
      if (!GetterCodeOk(s)) return Fail(why, absl::StrCat("getter on ", key, ": ", s.ToString()));
    }
    // The getter of the stored type succeeds.
    absl::Status own = absl::OkStatus();
    switch (*type) {
      case GgufValueType::kF32:
      case GgufValueType::kF64:
        own = f.GetFloat(key).status();
        break;
      case GgufValueType::kBool:
        own = f.GetBool(key).status();
        break;
      case GgufValueType::kString:
        own = f.GetString(key).status();
        break;
      case GgufValueType::kU64:  // may exceed int64
        break;
      case GgufValueType::kArray:
        if (element == GgufValueType::kString) {
          absl::StatusOr<std::vector<std::string>> v = f.GetStringArray(key);
          own = v.status();
          if (v.ok() && v->size() != count) return Fail(why, "string array count mismatch");
        } else if (element == GgufValueType::kF32 || element == GgufValueType::kF64) {
          own = f.GetFloatArray(key).status();
        } else if (element != GgufValueType::kBool && element != GgufValueType::kU64) {
          own = f.GetIntArray(key).status();
        }
        break;
      default:
        own = f.GetInt(key).status();
    }
    if (!own.ok()) return Fail(why, absl::StrCat("own-type getter on ", key, ": ", own.ToString()));
  }
  if (f.Has("\xff\xfe no such key") ||
      f.GetInt("\xff\xfe no such key").status().code() != absl::StatusCode::kNotFound ||
      !f.GetIntOr("\xff\xfe no such key", 3).ok()) {
    return Fail(why, "absent key misreported");
  }

  const uint8_t* data_begin = f.file_data() + f.data_offset();
  const uint8_t* file_end = f.file_data() + f.file_size();
  for (const engine::GgufTensor& t : f.tensors()) {
    if (f.FindTensor(t.name) != &t) return Fail(why, absl::StrCat("FindTensor misses ", t.name));
    if (t.elements < 1 || t.dims.empty() || t.dims.size() > 4) {
      return Fail(why, absl::StrCat("tensor ", t.name, ": bad shape accepted"));
    }
    int64_t product = 1;
    for (int64_t d : t.dims) product *= d;  // validated: cannot overflow
    if (product != t.elements) return Fail(why, "elements is not the product of dims");
    size_t expected = 0;
    switch (t.type) {
      case engine::GgmlType::kF32:
        expected = static_cast<size_t>(t.elements) * 4;
        break;
      case engine::GgmlType::kF16:
      case engine::GgmlType::kBF16:
        expected = static_cast<size_t>(t.elements) * 2;
        break;
      case engine::GgmlType::kQ8_0:
        if (t.dims[0] % 32 != 0) return Fail(why, "Q8_0 with ragged rows accepted");
        expected = static_cast<size_t>(t.elements) / 32 * 34;
        break;
      default:
        return Fail(why, "unsupported type accepted");
    }
    if (t.bytes != expected) return Fail(why, absl::StrCat("tensor ", t.name, ": byte count"));
    if (t.data < data_begin || t.data > file_end ||
        t.bytes > static_cast<size_t>(file_end - t.data)) {
      return Fail(why, absl::StrCat("tensor ", t.name, ": data outside the data section"));
    }
    // Bounded: the data lies in the input, so elements ≤ 2 · input bytes.
    std::vector<float> out(static_cast<size_t>(t.elements));
    engine::GgufFile::Dequantize(t, out.data());
    float sum = 0;
    for (float v : out) sum += std::isfinite(v) ? v : 0.0f;
    sink = sum;
    ++GgufFuzzCountsNow().tensors_dequantized;
  }
  return true;
}

}  // namespace gguf_fuzz_internal

// One input. Returns false, with the reason in *why, when an invariant failed.
inline bool GgufFuzzOne(const uint8_t* data, size_t size, std::string* why) {
  GgufFuzzCounts& counts = GgufFuzzCountsNow();
  ++counts.cases;
  absl::StatusOr<std::unique_ptr<engine::GgufFile>> f =
      engine::GgufFile::FromBytes(std::string(reinterpret_cast<const char*>(data), size));
  if (!f.ok()) {
    ++counts.refused;
    const absl::Status& s = f.status();
    if (s.code() != absl::StatusCode::kInvalidArgument) {
      return gguf_fuzz_internal::Fail(why, absl::StrCat("refused with ", s.ToString()));
    }
    if (s.message().substr(0, 4) != "GGUF" || s.message().size() > 1024) {
      return gguf_fuzz_internal::Fail(why, absl::StrCat("bad message: ", s.message()));
    }
    return true;
  }
  ++counts.accepted;
  return gguf_fuzz_internal::CheckFile(**f, why);
}

// Valid files to mutate: every metadata type, every tensor type, alignments 1 / 32 / 64,
// versions 2 and 3, a llama-shaped vocabulary, tensors listed out of data order.
inline std::vector<std::string> GgufSeedCorpus() {
  std::vector<std::string> seeds;
  {
    GgufBuilder b;
    b.AddU8("u8", 200)
        .AddI8("i8", -5)
        .AddU16("u16", 60000)
        .AddI16("i16", -3)
        .AddU32("u32", 7)
        .AddI32("i32", -9)
        .AddF32("f32", 0.5f)
        .AddBool("bool", true)
        .AddString("string", "hello")
        .AddU64("u64", ~uint64_t{0})
        .AddI64("i64", -1)
        .AddF64("f64", 2.5)
        .AddStringArray("strings", {"a", "", "ccc"})
        .AddI32Array("i32s", {1, -2, 3})
        .AddU64Array("u64s", {1, ~uint64_t{0}})
        .AddF32Array("f32s", {1.5f})
        .AddF64Array("f64s", {-1.0})
        .AddBoolArray("bools", {true, false});
    b.AddTensorF32("f32", {2, 2}, {1, 2, 3, 4});
    b.AddTensorF16("f16", {3}, {1, -2, 0.5f});
    b.AddTensorBF16("bf16", {2, 1, 1}, {3, -4});
    std::vector<float> q(64);
    for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(i) - 30.0f;
    b.AddTensorQ8_0("q8", {32, 2}, q);
    seeds.push_back(b.Build());
  }
  {
    GgufBuilder b;
    b.AddString("general.architecture", "llama")
        .AddU32("llama.block_count", 1)
        .AddU32("llama.embedding_length", 8)
        .AddU32("llama.attention.head_count", 2)
        .AddF32("llama.attention.layer_norm_rms_epsilon", 1e-5f)
        .AddString("tokenizer.ggml.model", "gpt2");
    std::vector<std::string> tokens;
    std::vector<float> scores;
    std::vector<int32_t> types;
    for (int i = 0; i < 40; ++i) {
      tokens.push_back(absl::StrCat("t", i));
      scores.push_back(-static_cast<float>(i));
      types.push_back(i < 3 ? 3 : 1);
    }
    b.AddStringArray("tokenizer.ggml.tokens", tokens)
        .AddF32Array("tokenizer.ggml.scores", scores)
        .AddI32Array("tokenizer.ggml.token_type", types)
        .AddStringArray("tokenizer.ggml.merges", {"t 1", "t1 2"})
        .AddU32("tokenizer.ggml.bos_token_id", 1);
    b.AddTensorF16("token_embd.weight", {8, 4}, std::vector<float>(32, 0.25f));
    b.AddTensorQ8_0("blk.0.attn_q.weight", {32, 2}, std::vector<float>(64, -1.0f));
    b.AddTensorF32("output_norm.weight", {8}, std::vector<float>(8, 1.0f));
    seeds.push_back(b.Build());
  }
  {
    GgufBuilder b;
    b.set_version(2).set_alignment(1).set_pad_end(false);
    b.AddString("general.name", "tiny");
    b.AddTensorBF16("a", {3}, {1, 2, 3});
    b.AddTensorF16("b", {1}, {7});
    b.AddTensorF32("c", {1, 1, 1, 1}, {9});
    seeds.push_back(b.Build());
  }
  {
    // Two same-sized tensors whose offsets are swapped: valid, out of data order.
    GgufBuilder b;
    b.set_alignment(64);
    b.tensor(b.AddTensorF32("x", {4}, {1, 2, 3, 4})).offset = 64;
    b.tensor(b.AddTensorF32("y", {4}, {5, 6, 7, 8})).offset = 0;
    seeds.push_back(b.Build());
  }
  {
    GgufBuilder b;
    b.AddStringArray("empty.strings", {}).AddU8Array("empty.u8", {}).AddString("s", "");
    seeds.push_back(b.Build());
  }
  return seeds;
}

// One to three mutations of `base`: bit flips, bytes set to 0x00/0xFF/0x7F/0x80, 4- and
// 8-byte fields overwritten with edge values, truncation, insertion, deletion, duplication
// and splices with another seed. Half the positions fall in the first KiB (the header).
inline std::string GgufMutate(const std::string& base, const std::vector<std::string>& corpus,
                              std::mt19937_64& rng) {
  static constexpr uint8_t kBytes[] = {0x00, 0xff, 0x7f, 0x80};
  static constexpr uint64_t kU64s[] = {~uint64_t{0},
                                       uint64_t{1} << 63,
                                       uint64_t{1} << 62,
                                       uint64_t{1} << 48,
                                       (uint64_t{1} << 48) + 1,
                                       uint64_t{1} << 32,
                                       uint64_t{1} << 24,
                                       (uint64_t{1} << 20) + 1,
                                       0x7fffffffffffffff,
                                       65536,
                                       1000,
                                       32,
                                       1,
                                       0};
  static constexpr uint32_t kU32s[] = {0,  1,  2,     3,     4,          5,          7,
                                       8,  9,  12,    13,    24,         30,         31,
                                       32, 64, 65535, 65536, 0x7fffffff, 0x80000000, 0xffffffff};
  std::string s = base;
  const auto pos = [&](size_t extra) -> size_t {
    const size_t limit = s.size() + extra;
    if (limit == 0) return 0;
    const size_t window = (rng() & 1) ? std::min<size_t>(limit, 1024) : limit;
    return rng() % window;
  };
  const int n = 1 + static_cast<int>(rng() % 3);
  for (int m = 0; m < n; ++m) {
    switch (rng() % 10) {
      case 0:
        if (!s.empty()) s[pos(0)] ^= static_cast<char>(1u << (rng() % 8));
        break;
      case 1:
        if (!s.empty()) s[pos(0)] = static_cast<char>(kBytes[rng() % std::size(kBytes)]);
        break;
      case 2:
      case 3: {
        if (s.size() < 8) break;
        // Fields sit at 4-byte boundaries in builder files more often than not.
        size_t at = pos(0) % (s.size() - 7);
        if (rng() & 1) at &= ~size_t{3};
        const uint64_t v = kU64s[rng() % std::size(kU64s)];
        std::memcpy(s.data() + at, &v, 8);
        break;
      }
      case 4: {
        if (s.size() < 4) break;
        const size_t at = pos(0) % (s.size() - 3);
        const uint32_t v = kU32s[rng() % std::size(kU32s)];
        std::memcpy(s.data() + at, &v, 4);
        break;
      }
      case 5:
        s.resize(pos(0));
        break;
      case 6: {
        std::string bytes(1 + rng() % 16, '\0');
        for (char& c : bytes) c = static_cast<char>(rng());
        s.insert(pos(1), bytes);
        break;
      }
      case 7:
        if (!s.empty()) {
          const size_t at = pos(0);
          s.erase(at, 1 + rng() % 16);
        }
        break;
      case 8:
        if (!s.empty()) {
          const size_t from = pos(0);
          const std::string chunk = s.substr(from, 1 + rng() % 32);
          s.insert(pos(1), chunk);
        }
        break;
      default: {
        const std::string& other = corpus[rng() % corpus.size()];
        const size_t cut = pos(1);
        const size_t from = other.empty() ? 0 : rng() % other.size();
        s = s.substr(0, cut) + other.substr(from);
        break;
      }
    }
  }
  if (s.size() > (size_t{1} << 20)) s.resize(size_t{1} << 20);
  return s;
}

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_ENGINE_GGUF_FUZZ_ONE_H_
