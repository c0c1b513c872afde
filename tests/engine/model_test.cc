// LlamaConfig, the weights and the tokenizer from GGUF files the test builds: the llama and
// qwen2 layouts load and generate (kvtier's full mode agreeing with the dense loop), Q8_0
// weights act as their dequantised values, RoPE scaling is read, tokenizer.ggml.pre
// "default" and a missing tokenizer.ggml.pre select llama.cpp's default pre-tokenizer, and
// every malformed model is refused naming the key or tensor.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "engine/generate.h"
#include "engine/model.h"
#include "gtest/gtest.h"
#include "tests/engine/gguf_builder.h"

namespace kvtier::engine {
namespace {

using kvtier::testing::GgufBuilder;

struct Tiny {
  std::string arch = "llama";
  bool q8 = false;
  bool bias = false;
  bool tied = true;
  uint32_t layers = 2, dim = 32, q_heads = 4, kv_heads = 2, ffn = 64;
  // Hooks to break the file.
  std::function<void(GgufBuilder&)> extra_metadata;
  std::string skip_tensor;
  std::string bad_dims_tensor;
  std::string tokenizer_model = "gpt2";
  std::optional<std::string> tokenizer_pre = "llama-bpe";  // nullopt: no key; qwen2: "qwen2"
};

constexpr uint32_t kVocab = 258;  // the 256 byte tokens, BOS, EOS

std::string Build(const Tiny& t) {
  GgufBuilder b;
  b.AddString("general.architecture", t.arch);
  const std::string p = t.arch + ".";
  b.AddU32(p + "context_length", 512);
  b.AddU32(p + "embedding_length", t.dim);
  b.AddU32(p + "block_count", t.layers);
  b.AddU32(p + "feed_forward_length", t.ffn);
  b.AddU32(p + "attention.head_count", t.q_heads);
  b.AddU32(p + "attention.head_count_kv", t.kv_heads);
  b.AddF32(p + "rope.freq_base", 10000.0f);
  b.AddF32(p + "attention.layer_norm_rms_epsilon", 1e-5f);
  if (t.extra_metadata) t.extra_metadata(b);
  std::vector<std::string> tokens;
  for (int i = 0; i < 256; ++i) tokens.push_back(ToByteAlphabet(std::string(1, static_cast<char>(i))));
  tokens.push_back("<|bos|>");
  tokens.push_back("<|eos|>");
  std::vector<int32_t> types(256, 1);
  types.push_back(3);
  types.push_back(3);
  b.AddString("tokenizer.ggml.model", t.tokenizer_model);
  if (t.tokenizer_pre) {
    b.AddString("tokenizer.ggml.pre", t.arch == "qwen2" ? "qwen2" : *t.tokenizer_pre);
  }
  b.AddStringArray("tokenizer.ggml.tokens", tokens);
  b.AddI32Array("tokenizer.ggml.token_type", types);
  b.AddStringArray("tokenizer.ggml.merges", {});
  b.AddU32("tokenizer.ggml.bos_token_id", 256);
  b.AddU32("tokenizer.ggml.eos_token_id", 257);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.2f);
  const uint32_t hd = t.dim / t.q_heads;
  auto add = [&](const std::string& name, std::vector<uint64_t> dims, bool norm = false) {
    if (name == t.skip_tensor) return;
    if (name == t.bad_dims_tensor) dims[0] += 32;
    uint64_t n = 1;
    for (uint64_t d : dims) n *= d;
    std::vector<float> v(n);
    for (float& x : v) x = norm ? 1.0f + 0.1f * normal(rng) : normal(rng);
    if (t.q8 && dims.size() == 2) {
      b.AddTensorQ8_0(name, dims, v);
    } else {
      b.AddTensorF32(name, dims, v);
    }
  };
  add("token_embd.weight", {t.dim, kVocab});
  if (!t.tied) add("output.weight", {t.dim, kVocab});
  add("output_norm.weight", {t.dim}, true);
  for (uint32_t l = 0; l < t.layers; ++l) {
    const std::string bl = "blk." + std::to_string(l) + ".";
    add(bl + "attn_norm.weight", {t.dim}, true);
    add(bl + "attn_q.weight", {t.dim, t.q_heads * hd});
    add(bl + "attn_k.weight", {t.dim, t.kv_heads * hd});
    add(bl + "attn_v.weight", {t.dim, t.kv_heads * hd});
    if (t.bias) {
      add(bl + "attn_q.bias", {t.q_heads * hd});
      add(bl + "attn_k.bias", {t.kv_heads * hd});
      add(bl + "attn_v.bias", {t.kv_heads * hd});
    }
    add(bl + "attn_output.weight", {t.q_heads * hd, t.dim});
    add(bl + "ffn_norm.weight", {t.dim}, true);
    add(bl + "ffn_gate.weight", {t.dim, t.ffn});
    add(bl + "ffn_up.weight", {t.dim, t.ffn});
    add(bl + "ffn_down.weight", {t.ffn, t.dim});
  }
  return b.Build();
}

std::string WriteTemp(const std::string& bytes) {
  char path[] = "/tmp/kvtier-model-test-XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  close(fd);
  return path;
}

absl::StatusOr<std::unique_ptr<Engine>> OpenTiny(const Tiny& t) {
  const std::string path = WriteTemp(Build(t));
  EngineOptions o;
  o.model_path = path;
  o.threads = 1;
  o.decoder.kv_dtype = DType::kF32;
  absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Open(o);
  std::remove(path.c_str());  // the mapping stays valid
  return e;
}

// Greedy tokens of kvtier's full mode and of the dense loop, which must agree.
void ExpectFullEqualsDense(Engine& e) {
  const std::vector<int32_t> prompt = e.tokenizer().Encode("The quick brown fox jumps over");
  GenerateOptions g;
  g.max_new_tokens = 12;
  g.stop_at_eos = false;
  g.keep_logits = true;
  SequenceSpec spec;
  spec.options.mode = RetrievalMode::kFull;
  spec.options.max_tokens = 256;
  spec.page_size = 16;
  absl::StatusOr<std::unique_ptr<EngineSequence>> s = EngineSequence::Open(e, spec, nullptr);
  ASSERT_TRUE(s.ok()) << s.status();
  absl::StatusOr<std::vector<GenerateResult>> full = Generate(e, {&(*s)->sequence()}, {prompt}, g);
  ASSERT_TRUE(full.ok()) << full.status();
  absl::StatusOr<GenerateResult> dense = GenerateDense(e, prompt, g);
  ASSERT_TRUE(dense.ok()) << dense.status();
  EXPECT_EQ((*full)[0].tokens, dense->tokens);
  for (size_t i = 0; i < dense->logits.size(); ++i) {
    for (size_t j = 0; j < dense->logits[i].size(); ++j) {
      ASSERT_NEAR((*full)[0].logits[i][j], dense->logits[i][j], 1e-4) << "step " << i;
    }
  }
}

TEST(ModelTest, LlamaLoadsAndFullModeEqualsTheDenseLoop) {
  absl::StatusOr<std::unique_ptr<Engine>> e = OpenTiny({});
  ASSERT_TRUE(e.ok()) << e.status();
  const LlamaConfig& c = (*e)->config();
  EXPECT_EQ(c.layers, 2);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.vocab, static_cast<int32_t>(kVocab));
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_FALSE(c.rope_neox);
  ExpectFullEqualsDense(**e);
}

TEST(ModelTest, Qwen2LoadsWithBiasesAndNeoxRope) {
  Tiny t;
  t.arch = "qwen2";
  t.bias = true;
  t.tied = false;
  absl::StatusOr<std::unique_ptr<Engine>> e = OpenTiny(t);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_TRUE((*e)->config().rope_neox);
  EXPECT_TRUE((*e)->config().qkv_bias);
  EXPECT_FALSE((*e)->config().tied_embeddings);
  ExpectFullEqualsDense(**e);
}

TEST(ModelTest, Q8_0WeightsActAsTheirDequantisedValues) {
  Tiny t;
  t.q8 = true;
  absl::StatusOr<std::unique_ptr<Engine>> q8 = OpenTiny(t);
  ASSERT_TRUE(q8.ok()) << q8.status();
  // The engine holds F32 of exactly the dequantised values.
  const GgufFile& f = (*q8)->file();
  const GgufTensor* wq = f.FindTensor("blk.0.attn_q.weight");
  ASSERT_NE(wq, nullptr);
  ASSERT_EQ(wq->type, GgmlType::kQ8_0);
  std::vector<float> want(wq->elements);
  GgufFile::Dequantize(*wq, want.data());
  const float* got = (*q8)->weights().layers[0].wq.as<float>();
  for (int64_t i = 0; i < wq->elements; ++i) ASSERT_EQ(got[i], want[i]) << i;
  ExpectFullEqualsDense(**q8);
}

TEST(ModelTest, ReadsRopeScaling) {
  Tiny t;
  t.extra_metadata = [](GgufBuilder& b) {
    b.AddString("llama.rope.scaling.type", "linear");
    b.AddF32("llama.rope.scaling.factor", 4.0f);
  };
  absl::StatusOr<std::unique_ptr<Engine>> e = OpenTiny(t);
  ASSERT_TRUE(e.ok()) << e.status();
  const float* inv = (*e)->weights().inv_freq.as<float>();
  const int32_t d = (*e)->config().rope_dim;
  for (int32_t i = 0; i < d / 2; ++i) {
    EXPECT_FLOAT_EQ(inv[i], static_cast<float>(std::pow(10000.0, -2.0 * i / d) / 4.0)) << i;
  }
  // Llama-3's scaling: per-frequency factors in the rope_freqs tensor divide the frequencies.
  const std::vector<float> factors = {1.0f, 2.0f, 8.0f, 32.0f};
  t.extra_metadata = [&](GgufBuilder& b) { b.AddTensorF32("rope_freqs.weight", {4}, factors); };
  e = OpenTiny(t);
  ASSERT_TRUE(e.ok()) << e.status();
  inv = (*e)->weights().inv_freq.as<float>();
  for (int32_t i = 0; i < d / 2; ++i) {
    EXPECT_FLOAT_EQ(inv[i], static_cast<float>(std::pow(10000.0, -2.0 * i / d) / factors[i])) << i;
  }
}

// ---------------------------------------------------------------- tokenizer.ggml.pre

// A GGUF holding only a tokenizer: the 256 byte tokens and, for each of `words` in order, the
// merges that build it left to right (one token per prefix; a merge already made keeps its
// rank), with tokenizer.ggml.pre = `pre` (no key when nullopt).
std::string TokenizerGguf(const std::vector<std::string>& words, std::optional<std::string> pre) {
  std::vector<std::string> tokens, merges;
  std::set<std::string> known;
  for (int i = 0; i < 256; ++i) {
    tokens.push_back(ToByteAlphabet(std::string(1, static_cast<char>(i))));
    known.insert(tokens.back());
  }
  for (const std::string& w : words) {
    std::string prefix = ToByteAlphabet(w.substr(0, 1));
    for (size_t i = 1; i < w.size(); ++i) {
      const std::string next = ToByteAlphabet(w.substr(i, 1));
      if (known.insert(prefix + next).second) {
        tokens.push_back(prefix + next);
        merges.push_back(prefix + " " + next);
      }
      prefix += next;
    }
  }
  GgufBuilder b;
  b.AddString("tokenizer.ggml.model", "gpt2");
  if (pre) b.AddString("tokenizer.ggml.pre", *pre);
  b.AddStringArray("tokenizer.ggml.tokens", tokens);
  b.AddStringArray("tokenizer.ggml.merges", merges);
  return b.Build();
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerOf(const std::string& gguf) {
  absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::FromBytes(gguf);
  if (!f.ok()) return f.status();
  return LoadTokenizer(**f);
}

// The bytes of each token of `text`'s encoding.
std::vector<std::string> Pieces(const Tokenizer& t, std::string_view text) {
  std::vector<std::string> pieces;
  for (int32_t id : t.Encode(text, /*add_special=*/false)) pieces.push_back(t.TokenBytes(id));
  return pieces;
}

struct PreCase {
  std::string text;
  std::vector<std::string> default_words;  // llama.cpp's default pre-tokenizer
  std::vector<std::string> gpt2_words;     // "gpt-2"
};

// llama.cpp's default pre-tokenizer (llama-vocab.cpp: the regexes it uses when no other
// applies) splits the text with [\p{P}\$\+<=>\^~\|]+ (every punctuation character and the
// ASCII symbols but `), then each piece with GPT-2's regex (looking no further than the
// piece), then with \p{N}+, then with [0-9][0-9][0-9]; matches and the text between them are
// all pieces. Worked through by hand:
//   "don't"      punctuation: don ' t              (gpt-2: don 't)
//   "x (y)"      punctuation: "x " ( y ); GPT-2's regex: "x " → x, " "
//   "a 12345"    GPT-2: a " 12345"; \p{N}+: " " 12345; [0-9]{3}: 123 45
//   "a  ("       punctuation: "a  " (; GPT-2 within "a  ": a "  " (the spaces end the piece,
//                so \s+(?!\S) takes both)       (gpt-2: a " " " (")
//   "x1234567"   GPT-2: x 1234567; [0-9]{3}: 123 456 7
//   "$+<=>^~|`"  punctuation: "$+<=>^~|", then ` (not in the class)
//   "x —y"       punctuation (— is \p{Pd}): "x " — y
const std::vector<PreCase>& PreCases() {
  static const auto* const cases = new std::vector<PreCase>{
      {"don't", {"don", "'", "t"}, {"don", "'t"}},
      {"x (y)", {"x", " ", "(", "y", ")"}, {"x", " (", "y", ")"}},
      {"a 12345", {"a", " ", "123", "45"}, {"a", " 12345"}},
      {"a  (", {"a", "  ", "("}, {"a", " ", " ("}},
      {"x1234567", {"x", "123", "456", "7"}, {"x", "1234567"}},
      {"$+<=>^~|`", {"$+<=>^~|", "`"}, {"$+<=>^~|`"}},
      {"x \u2014y", {"x", " ", "\u2014", "y"}, {"x", " \u2014", "y"}},
      {"Hello, world!", {"Hello", ",", " world", "!"}, {"Hello", ",", " world", "!"}},
  };
  return *cases;
}

// Every word of either split is one token: GPT-2's words first, so that their merges rank
// before those of the default's words and a word the default would split stays whole.
std::vector<std::string> PreCaseWords() {
  std::vector<std::string> words;
  for (const PreCase& c : PreCases()) {
    words.insert(words.end(), c.gpt2_words.begin(), c.gpt2_words.end());
  }
  for (const PreCase& c : PreCases()) {
    words.insert(words.end(), c.default_words.begin(), c.default_words.end());
  }
  return words;
}

void ExpectDefaultSplits(const std::optional<std::string>& pre) {
  SCOPED_TRACE(pre ? "tokenizer.ggml.pre = " + *pre : "no tokenizer.ggml.pre");
  absl::StatusOr<std::unique_ptr<Tokenizer>> t =
      LoadTokenizerOf(TokenizerGguf(PreCaseWords(), pre));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->pre(), "default");
  for (const PreCase& c : PreCases()) EXPECT_EQ(Pieces(**t, c.text), c.default_words) << c.text;
}

TEST(ModelTest, DefaultAndMissingPreTokenizerAreLlamaCppsDefault) {
  ExpectDefaultSplits("default");
  ExpectDefaultSplits(std::nullopt);
  // The vocabulary tells the splits apart: "gpt-2" gives GPT-2's words.
  absl::StatusOr<std::unique_ptr<Tokenizer>> gpt2 =
      LoadTokenizerOf(TokenizerGguf(PreCaseWords(), "gpt-2"));
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  for (const PreCase& c : PreCases()) EXPECT_EQ(Pieces(**gpt2, c.text), c.gpt2_words) << c.text;
}

void ExpectOpensAndGenerates(const std::optional<std::string>& pre) {
  SCOPED_TRACE(pre ? "tokenizer.ggml.pre = " + *pre : "no tokenizer.ggml.pre");
  Tiny t;
  t.tokenizer_pre = pre;
  absl::StatusOr<std::unique_ptr<Engine>> e = OpenTiny(t);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ((*e)->tokenizer().pre(), "default");
  ExpectFullEqualsDense(**e);
}

// A model whose tokenizer.ggml.pre is "default", or missing, opens and generates.
TEST(ModelTest, OpensWithDefaultOrMissingPreTokenizer) {
  ExpectOpensAndGenerates("default");
  ExpectOpensAndGenerates(std::nullopt);
}

struct Refusal {
  const char* name;
  Tiny tiny;
  absl::StatusCode code;
  const char* names;  // what the message must name
};

TEST(ModelTest, RefusesMalformedModelsNamingTheField) {
  std::vector<Refusal> cases;
  {
    Tiny t;
    t.arch = "gemma";
    cases.push_back({"architecture", t, absl::StatusCode::kUnimplemented, "general.architecture"});
  }
  {
    Tiny t;
    t.skip_tensor = "blk.1.ffn_up.weight";
    cases.push_back({"missing tensor", t, absl::StatusCode::kInvalidArgument, "blk.1.ffn_up.weight"});
  }
  {
    Tiny t;
    t.bad_dims_tensor = "blk.0.attn_k.weight";
    cases.push_back({"tensor dims", t, absl::StatusCode::kInvalidArgument, "blk.0.attn_k.weight"});
  }
  {
    Tiny t;
    t.q_heads = 4;
    t.kv_heads = 3;
    cases.push_back({"heads", t, absl::StatusCode::kInvalidArgument, "head_count"});
  }
  {
    Tiny t;
    t.extra_metadata = [](GgufBuilder& b) { b.AddString("llama.rope.scaling.type", "yarn"); };
    cases.push_back({"yarn", t, absl::StatusCode::kUnimplemented, "rope.scaling.type"});
  }
  {
    Tiny t;
    t.extra_metadata = [](GgufBuilder& b) { b.AddU32("llama.rope.dimension_count", 9); };
    cases.push_back({"rope dims", t, absl::StatusCode::kInvalidArgument, "rope.dimension_count"});
  }
  {
    Tiny t;
    t.tokenizer_model = "llama";
    cases.push_back({"sentencepiece", t, absl::StatusCode::kInvalidArgument, "llama"});
  }
  {
    Tiny t;
    t.extra_metadata = [](GgufBuilder& b) { b.AddF32("llama.rope.freq_base_", 1.0f); };
    t.skip_tensor = "token_embd.weight";
    cases.push_back({"no embedding", t, absl::StatusCode::kInvalidArgument, "token_embd.weight"});
  }
  for (const Refusal& r : cases) {
    SCOPED_TRACE(r.name);
    absl::StatusOr<std::unique_ptr<Engine>> e = OpenTiny(r.tiny);
    ASSERT_FALSE(e.ok());
    EXPECT_EQ(e.status().code(), r.code) << e.status();
    EXPECT_NE(std::string(e.status().message()).find(r.names), std::string::npos) << e.status();
  }
}

}  // namespace
}  // namespace kvtier::engine
