// A Llama-family model read from a GGUF file: its hyper-parameters (LlamaConfig), its
// weights in the compute device's memory (LlamaWeights) and its tokenizer.
// docs/architecture.md#the-engine.
//
// Architectures: "llama" (Llama 1–3.x, Mistral and the project's own model; RoPE on
// adjacent pairs, as GGUF stores llama weights) and "qwen2" (NeoX RoPE, biased q/k/v).
// RoPE scaling: none, linear (positions divided by the factor), and Llama-3's per-frequency
// factors (the rope_freqs tensor). Tied embeddings when the file has no output.weight.
// Weights are dequantised to F32 once at load (F32, F16, BF16, Q8_0 in the file).
#ifndef KVTIER_ENGINE_MODEL_H_
#define KVTIER_ENGINE_MODEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/gguf.h"
#include "engine/tokenizer.h"
#include "kvtier/device.h"
#include "kvtier/geometry.h"

namespace kvtier::engine {

struct LlamaConfig {
  std::string arch;
  std::string name;  // general.name, when present
  int32_t vocab = 0;
  int32_t dim = 0;
  int32_t layers = 0;
  int32_t q_heads = 0;
  int32_t kv_heads = 0;
  int32_t head_dim = 0;
  int32_t ffn = 0;
  int32_t context = 0;  // trained context length
  float eps = 1e-5f;
  float rope_base = 10000.0f;
  int32_t rope_dim = 0;  // dims rotated per head
  bool rope_neox = false;
  float rope_linear_factor = 1.0f;  // positions / factor
  bool tied_embeddings = false;
  bool qkv_bias = false;

  // The model's KV geometry for kvtier with KV elements of `dtype`.
  Geometry KvGeometry(DType dtype, int32_t page_size) const;
  // "llama: 6 layers, dim 256, 8/2 heads of 32, ffn 768, vocab 4096, context 4096".
  std::string ToString() const;

  // Reads and checks the hyper-parameters (INVALID_ARGUMENT naming the metadata key, or
  // UNIMPLEMENTED for an architecture or scaling this engine does not run).
  static absl::StatusOr<LlamaConfig> FromGguf(const GgufFile& file);
};

// F32 weights in the device's memory. Layer matrices are [out][in] row-major.
struct LayerWeights {
  DeviceBuffer attn_norm, wq, wk, wv, wo, bq, bk, bv;  // b*: empty unless qkv_bias
  DeviceBuffer ffn_norm, w_gate, w_up, w_down;
};

struct LlamaWeights {
  DeviceBuffer embed;   // [vocab][dim]
  DeviceBuffer output;  // [vocab][dim]; empty when tied (use embed)
  DeviceBuffer output_norm;
  DeviceBuffer inv_freq;  // [rope_dim / 2], with the file's scaling applied
  std::vector<LayerWeights> layers;
  int64_t bytes = 0;  // device memory held

  const float* output_matrix() const { return (output.data() ? output : embed).as<float>(); }
};

// Every tensor the config needs, with the shape it must have (INVALID_ARGUMENT naming the
// tensor, its dims and the expected ones), dequantised and copied into `device` memory.
absl::StatusOr<LlamaWeights> LoadWeights(const GgufFile& file, const LlamaConfig& config,
                                         Device& device, Stream& stream);

// The tokenizer of the file's own vocabulary (tokenizer.ggml.*); without tokenizer.ggml.pre,
// llama.cpp's default pre-tokenizer ("default"), as llama.cpp gives such a file.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const GgufFile& file);

}  // namespace kvtier::engine

#endif  // KVTIER_ENGINE_MODEL_H_
