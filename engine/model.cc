#include "engine/model.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status.h"

namespace kvtier::engine {
namespace {

// A hyper-parameter that must be a positive int32 (`lo` at least).
absl::StatusOr<int32_t> PositiveInt(const GgufFile& f, const std::string& key, int64_t lo = 1,
                                    int64_t hi = int64_t{1} << 30) {
  KVTIER_ASSIGN_OR_RETURN(int64_t v, f.GetInt(key));
  if (v < lo || v > hi) {
    return absl::InvalidArgumentError(
        absl::StrFormat("GGUF metadata %s = %d: must be in [%d, %d]", key, v, lo, hi));
  }
  return static_cast<int32_t>(v);
}

absl::StatusOr<int32_t> PositiveIntOr(const GgufFile& f, const std::string& key,
                                      int32_t fallback) {
  if (!f.Has(key)) return fallback;
  return PositiveInt(f, key);
}

}  // namespace

Geometry LlamaConfig::KvGeometry(DType dtype, int32_t page_size) const {
  Geometry g;
  g.num_layers = layers;
  g.num_q_heads = q_heads;
  g.num_kv_heads = kv_heads;
  g.head_dim = head_dim;
  g.page_size = page_size;
  g.dtype = dtype;
  return g;
}

std::string LlamaConfig::ToString() const {
  return absl::StrFormat(
      "%s%s: %d layers, dim %d, %d/%d heads of %d, ffn %d, vocab %d, context %d", arch,
      name.empty() ? "" : " (" + name + ")", layers, dim, q_heads, kv_heads, head_dim, ffn,
      vocab, context);
}

absl::StatusOr<LlamaConfig> LlamaConfig::FromGguf(const GgufFile& f) {
  LlamaConfig c;
  KVTIER_ASSIGN_OR_RETURN(c.arch, f.GetString("general.architecture"));
  if (c.arch != "llama" && c.arch != "qwen2") {
    return absl::UnimplementedError(absl::StrFormat(
        "GGUF general.architecture = '%s': this engine runs llama and qwen2", c.arch));
  }
  if (f.Has("general.name")) {
    KVTIER_ASSIGN_OR_RETURN(c.name, f.GetString("general.name"));
  }
  const std::string p = c.arch + ".";
  KVTIER_ASSIGN_OR_RETURN(c.dim, PositiveInt(f, p + "embedding_length", 8, 65536));
  KVTIER_ASSIGN_OR_RETURN(c.layers, PositiveInt(f, p + "block_count", 1, Geometry::kMaxLayers));
  KVTIER_ASSIGN_OR_RETURN(c.ffn, PositiveInt(f, p + "feed_forward_length", 1, 1 << 20));
  KVTIER_ASSIGN_OR_RETURN(c.q_heads, PositiveInt(f, p + "attention.head_count", 1,
                                                 Geometry::kMaxQueryHeads));
  KVTIER_ASSIGN_OR_RETURN(c.kv_heads,
                          PositiveIntOr(f, p + "attention.head_count_kv", c.q_heads));
  KVTIER_ASSIGN_OR_RETURN(c.context, PositiveInt(f, p + "context_length", 1, 1 << 24));
  if (c.q_heads % c.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "GGUF metadata %sattention.head_count = %d is not a multiple of head_count_kv = %d", p,
        c.q_heads, c.kv_heads));
  }
  KVTIER_ASSIGN_OR_RETURN(c.head_dim,
                          PositiveIntOr(f, p + "attention.key_length", c.dim / c.q_heads));
  KVTIER_ASSIGN_OR_RETURN(int32_t value_length,
                          PositiveIntOr(f, p + "attention.value_length", c.head_dim));
  if (value_length != c.head_dim) {
    return absl::UnimplementedError(absl::StrFormat(
        "GGUF metadata %sattention.value_length = %d differs from key_length = %d", p,
        value_length, c.head_dim));
  }
  KVTIER_ASSIGN_OR_RETURN(c.rope_dim, PositiveIntOr(f, p + "rope.dimension_count", c.head_dim));
  if (c.rope_dim > c.head_dim || c.rope_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "GGUF metadata %srope.dimension_count = %d: must be even and at most the head size %d",
        p, c.rope_dim, c.head_dim));
  }
  KVTIER_ASSIGN_OR_RETURN(double base, f.GetFloatOr(p + "rope.freq_base", 10000.0));
  KVTIER_ASSIGN_OR_RETURN(double eps, f.GetFloatOr(p + "attention.layer_norm_rms_epsilon", 1e-5));
  if (!(base > 1.0) || !(eps > 0.0 && eps < 1.0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "GGUF metadata: %srope.freq_base = %g must be > 1 and "
        "attention.layer_norm_rms_epsilon = %g in (0, 1)",
        p, base, eps));
  }
  c.rope_base = static_cast<float>(base);
  c.eps = static_cast<float>(eps);
  if (f.Has(p + "rope.scaling.type")) {
    KVTIER_ASSIGN_OR_RETURN(std::string type, f.GetString(p + "rope.scaling.type"));
    if (type == "linear") {
      KVTIER_ASSIGN_OR_RETURN(double factor, f.GetFloat(p + "rope.scaling.factor"));
      if (!(factor >= 1.0 && factor <= 1024.0)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "GGUF metadata %srope.scaling.factor = %g: must be in [1, 1024]", p, factor));
      }
      c.rope_linear_factor = static_cast<float>(factor);
    } else if (type != "none") {
      return absl::UnimplementedError(absl::StrFormat(
          "GGUF metadata %srope.scaling.type = '%s': this engine runs none, linear and "
          "Llama-3's rope_freqs factors",
          p, type));
    }
  }
  c.rope_neox = c.arch == "qwen2";
  c.qkv_bias = f.FindTensor("blk.0.attn_q.bias") != nullptr;
  c.tied_embeddings = f.FindTensor("output.weight") == nullptr;
  const GgufTensor* embd = f.FindTensor("token_embd.weight");
  if (embd == nullptr) {
    return absl::InvalidArgumentError("GGUF: tensor 'token_embd.weight' is missing");
  }
  if (embd->dims.size() != 2) {
    return absl::InvalidArgumentError("GGUF: tensor 'token_embd.weight' must be a matrix");
  }
  c.vocab = static_cast<int32_t>(embd->dims[1]);
  KVTIER_RETURN_IF_ERROR(c.KvGeometry(DType::kF16, 32).Validate());
  return c;
}

namespace {

// Loads tensor `name` with exactly `dims` (innermost first) into device memory as F32.
absl::Status LoadTensor(const GgufFile& f, const std::string& name,
                        const std::vector<int64_t>& dims, Device& device, Stream& stream,
                        DeviceBuffer* out, int64_t* bytes, bool optional = false) {
  const GgufTensor* t = f.FindTensor(name);
  if (t == nullptr) {
    if (optional) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrFormat("GGUF: tensor '%s' is missing", name));
  }
  if (t->dims != dims) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "GGUF: tensor '%s' has dims {%s}; the model's metadata needs {%s}", name,
        absl::StrJoin(t->dims, ", "), absl::StrJoin(dims, ", ")));
  }
  std::vector<float> host(static_cast<size_t>(t->elements));
  GgufFile::Dequantize(*t, host.data());
  const size_t n = host.size() * sizeof(float);
  KVTIER_ASSIGN_OR_RETURN(*out, device.Allocate(n));
  KVTIER_RETURN_IF_ERROR(device.Copy(stream, out->data(), host.data(), n));
  // The host copy goes out of scope: the copy must have run.
  KVTIER_RETURN_IF_ERROR(stream.Synchronize());
  *bytes += static_cast<int64_t>(n);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LlamaWeights> LoadWeights(const GgufFile& f, const LlamaConfig& c, Device& device,
                                         Stream& stream) {
  LlamaWeights w;
  int64_t* b = &w.bytes;
  const int64_t d = c.dim, qd = int64_t{c.q_heads} * c.head_dim,
                kvd = int64_t{c.kv_heads} * c.head_dim;
  KVTIER_RETURN_IF_ERROR(
      LoadTensor(f, "token_embd.weight", {d, c.vocab}, device, stream, &w.embed, b));
  KVTIER_RETURN_IF_ERROR(
      LoadTensor(f, "output.weight", {d, c.vocab}, device, stream, &w.output, b, true));
  KVTIER_RETURN_IF_ERROR(
      LoadTensor(f, "output_norm.weight", {d}, device, stream, &w.output_norm, b));
  w.layers.resize(c.layers);
  for (int32_t i = 0; i < c.layers; ++i) {
    LayerWeights& l = w.layers[i];
    const std::string p = absl::StrCat("blk.", i, ".");
    struct Item {
      const char* name;
      std::vector<int64_t> dims;
      DeviceBuffer* out;
      bool optional;
    };
    const Item items[] = {
        {"attn_norm.weight", {d}, &l.attn_norm, false},
        {"attn_q.weight", {d, qd}, &l.wq, false},
        {"attn_k.weight", {d, kvd}, &l.wk, false},
        {"attn_v.weight", {d, kvd}, &l.wv, false},
        {"attn_output.weight", {qd, d}, &l.wo, false},
        {"attn_q.bias", {qd}, &l.bq, !c.qkv_bias},
        {"attn_k.bias", {kvd}, &l.bk, !c.qkv_bias},
        {"attn_v.bias", {kvd}, &l.bv, !c.qkv_bias},
        {"ffn_norm.weight", {d}, &l.ffn_norm, false},
        {"ffn_gate.weight", {d, c.ffn}, &l.w_gate, false},
        {"ffn_up.weight", {d, c.ffn}, &l.w_up, false},
        {"ffn_down.weight", {c.ffn, d}, &l.w_down, false},
    };
    for (const Item& it : items) {
      KVTIER_RETURN_IF_ERROR(
          LoadTensor(f, p + it.name, it.dims, device, stream, it.out, b, it.optional));
    }
  }
  // Rotary frequencies: base^(−2i/rope_dim), divided by Llama-3's per-frequency factors
  // when the file has them, and by the linear factor (positions / factor).
  const int32_t half = c.rope_dim / 2;
  std::vector<float> inv(half);
  std::vector<float> factors;
  if (const GgufTensor* t = f.FindTensor("rope_freqs.weight"); t != nullptr) {
    if (t->dims != std::vector<int64_t>{half}) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "GGUF: tensor 'rope_freqs.weight' has dims {%s}; the model needs {%d}",
          absl::StrJoin(t->dims, ", "), half));
    }
    factors.resize(half);
    GgufFile::Dequantize(*t, factors.data());
  }
  for (int32_t i = 0; i < half; ++i) {
    double v = std::pow(static_cast<double>(c.rope_base), -2.0 * i / c.rope_dim);
    if (!factors.empty()) v /= factors[i];
    inv[i] = static_cast<float>(v / c.rope_linear_factor);
  }
  KVTIER_ASSIGN_OR_RETURN(w.inv_freq, device.Allocate(inv.size() * sizeof(float)));
  KVTIER_RETURN_IF_ERROR(
      device.Copy(stream, w.inv_freq.data(), inv.data(), inv.size() * sizeof(float)));
  KVTIER_RETURN_IF_ERROR(stream.Synchronize());
  return w;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const GgufFile& f) {
  TokenizerSpec spec;
  KVTIER_ASSIGN_OR_RETURN(spec.model, f.GetString("tokenizer.ggml.model"));
  if (f.Has("tokenizer.ggml.pre")) {
    KVTIER_ASSIGN_OR_RETURN(spec.pre, f.GetString("tokenizer.ggml.pre"));
  } else {
    spec.pre = "default";  // as llama.cpp reads such a file
  }
  KVTIER_ASSIGN_OR_RETURN(spec.tokens, f.GetStringArray("tokenizer.ggml.tokens"));
  if (f.Has("tokenizer.ggml.merges")) {
    KVTIER_ASSIGN_OR_RETURN(spec.merges, f.GetStringArray("tokenizer.ggml.merges"));
  }
  if (f.Has("tokenizer.ggml.token_type")) {
    KVTIER_ASSIGN_OR_RETURN(std::vector<int64_t> types, f.GetIntArray("tokenizer.ggml.token_type"));
    spec.token_types.reserve(types.size());
    for (int64_t t : types) spec.token_types.push_back(static_cast<int32_t>(t));
  }
  KVTIER_ASSIGN_OR_RETURN(int64_t bos, f.GetIntOr("tokenizer.ggml.bos_token_id", -1));
  KVTIER_ASSIGN_OR_RETURN(int64_t eos, f.GetIntOr("tokenizer.ggml.eos_token_id", -1));
  if (bos < -1 || bos > INT32_MAX || eos < -1 || eos > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "GGUF metadata tokenizer.ggml.bos_token_id = %d / eos_token_id = %d out of range", bos,
        eos));
  }
  spec.bos = static_cast<int32_t>(bos);
  spec.eos = static_cast<int32_t>(eos);
  if (f.Has("tokenizer.ggml.add_bos_token")) {
    KVTIER_ASSIGN_OR_RETURN(spec.add_bos, f.GetBool("tokenizer.ggml.add_bos_token"));
  } else {
    spec.add_bos = spec.bos >= 0;
  }
  return Tokenizer::Create(std::move(spec));
}

}  // namespace kvtier::engine
