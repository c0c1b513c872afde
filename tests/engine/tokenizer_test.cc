// Tests of the byte-level BPE tokenizer (engine/tokenizer.h): the regex pre-tokenizers against
// splits computed with Python's `regex` module and llama.cpp's default one against llama.cpp,
// byte-level round trips, merge-rank semantics against a straightforward reference (train.py's
// Bpe.word), ignore_merges, special tokens, every Create() refusal, speed, and Utf8Stream.
#include "engine/tokenizer.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::engine {
namespace {

using namespace std::string_literals;
using namespace std::string_view_literals;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// ---------------------------------------------------------------- pre-tokenizers

struct SplitCase {
  std::string_view text;
  std::vector<std::string_view> words;
};

// Expected splits: Python's regex.findall(pattern, text) for the patterns in tokenizer.h
// (regex 2.5.123). Invalid UTF-8 was given to Python as bytes decoded with
// errors="surrogateescape" (each invalid byte one character of no class) and the words
// encoded back the same way.
const std::vector<SplitCase>& Gpt2Cases() {
  static const auto* const cases = new std::vector<SplitCase>{
      {"Hello world"sv, {"Hello"sv, " world"sv}},
      {"I'm here, it's he'll we've they're I'd"sv,
       {"I"sv, "'m"sv, " here"sv, ","sv, " it"sv, "'s"sv, " he"sv, "'ll"sv, " we"sv, "'ve"sv,
        " they"sv, "'re"sv, " I"sv, "'d"sv}},
      {"DON'T 'S 'Re 'LL 'VE 'M 'D 'sup"sv,
       {"DON"sv, "'"sv, "T"sv, " '"sv, "S"sv, " '"sv, "Re"sv, " '"sv, "LL"sv, " '"sv, "VE"sv,
        " '"sv, "M"sv, " '"sv, "D"sv, " '"sv, "sup"sv}},
      {"'ſ 'x '"sv, {"'"sv, "ſ"sv, " '"sv, "x"sv, " '"sv}},
      {"1 12 123 1234 12345 123456 1234567"sv,
       {"1"sv, " 12"sv, " 123"sv, " 1234"sv, " 12345"sv, " 123456"sv, " 1234567"sv}},
      {"a1b22c333 x9"sv, {"a"sv, "1"sv, "b"sv, "22"sv, "c"sv, "333"sv, " x"sv, "9"sv}},
      {"line1\r\nline2\n\n  next\r\n"sv,
       {"line"sv, "1"sv, "\r"sv, "\n"sv, "line"sv, "2"sv, "\n\n "sv, " next"sv, "\r\n"sv}},
      {"\ttab\t\tx  \t y\t"sv, {"\t"sv, "tab"sv, "\t"sv, "\t"sv, "x"sv, "  \t"sv, " y"sv, "\t"sv}},
      {"a   b"sv, {"a"sv, "  "sv, " b"sv}},
      {"trailing   "sv, {"trailing"sv, "   "sv}},
      {"   leading"sv, {"  "sv, " leading"sv}},
      {" "sv, {" "sv}},
      {"naive naïve café Ωmega straße"sv,
       {"naive"sv, " naïve"sv, " café"sv, " Ωmega"sv, " straße"sv}},
      {"na\314\210ive"sv, {"na"sv, "\314\210"sv, "ive"sv}},
      {"日本語のテキスト123です"sv, {"日本語のテキスト"sv, "123"sv, "です"sv}},
      {"emoji 😀😀 👍🏽!"sv, {"emoji"sv, " 😀😀"sv, " 👍🏽!"sv}},
      {"x\302\240y \343\200\200z\342\200\250w\302\205v"sv,
       {"x"sv, "\302\240"sv, "y"sv, " "sv, "\343\200\200"sv, "z"sv, "\342\200\250"sv, "w"sv,
        "\302\205"sv, "v"sv}},
      {"Ⅻ ½ ٣٤٥ ²"sv, {"Ⅻ"sv, " ½"sv, " ٣٤٥"sv, " ²"sv}},
      {"  !!!?\r\n\r\nword"sv, {" "sv, " !!!?"sv, "\r\n\r"sv, "\n"sv, "word"sv}},
      {"hello!!\n\nworld"sv, {"hello"sv, "!!"sv, "\n"sv, "\n"sv, "world"sv}},
      {"$100.00 — “quoted” (parens)"sv,
       {"$"sv, "100"sv, "."sv, "00"sv, " —"sv, " “"sv, "quoted"sv, "”"sv, " ("sv, "parens"sv,
        ")"sv}},
      {"\013v\014f\034x\037y \000z"sv,
       {"\013"sv, "v"sv, "\014"sv, "f"sv, "\034"sv, "x"sv, "\037"sv, "y"sv, " \000"sv, "z"sv}},
      {" \r\n  \n\tx"sv, {" \r\n  \n"sv, "\t"sv, "x"sv}},
      {"ab\377cd \303( \342\202 \360\237\230"sv,
       {"ab"sv, "\377"sv, "cd"sv, " \303("sv, " \342\202"sv, " \360\237\230"sv}},
      {"\300\257 \355\240\200 \364\220\200\200 \377word \376\376"sv,
       {"\300\257"sv, " \355\240\200"sv, " \364\220\200\200"sv, " \377"sv, "word"sv,
        " \376\376"sv}},
  };
  return *cases;
}

const std::vector<SplitCase>& Llama3Cases() {
  static const auto* const cases = new std::vector<SplitCase>{
      {"Hello world"sv, {"Hello"sv, " world"sv}},
      {"I'm here, it's he'll we've they're I'd"sv,
       {"I"sv, "'m"sv, " here"sv, ","sv, " it"sv, "'s"sv, " he"sv, "'ll"sv, " we"sv, "'ve"sv,
        " they"sv, "'re"sv, " I"sv, "'d"sv}},
      {"DON'T 'S 'Re 'LL 'VE 'M 'D 'sup"sv,
       {"DON"sv, "'T"sv, " '"sv, "S"sv, " '"sv, "Re"sv, " '"sv, "LL"sv, " '"sv, "VE"sv, " '"sv,
        "M"sv, " '"sv, "D"sv, " '"sv, "sup"sv}},
      {"'ſ 'x '"sv, {"'ſ"sv, " '"sv, "x"sv, " '"sv}},
      {"1 12 123 1234 12345 123456 1234567"sv,
       {"1"sv, " "sv, "12"sv, " "sv, "123"sv, " "sv, "123"sv, "4"sv, " "sv, "123"sv, "45"sv, " "sv,
        "123"sv, "456"sv, " "sv, "123"sv, "456"sv, "7"sv}},
      {"a1b22c333 x9"sv, {"a"sv, "1"sv, "b"sv, "22"sv, "c"sv, "333"sv, " x"sv, "9"sv}},
      {"line1\r\nline2\n\n  next\r\n"sv,
       {"line"sv, "1"sv, "\r\n"sv, "line"sv, "2"sv, "\n\n"sv, " "sv, " next"sv, "\r\n"sv}},
      {"\ttab\t\tx  \t y\t"sv, {"\ttab"sv, "\t"sv, "\tx"sv, "  \t"sv, " y"sv, "\t"sv}},
      {"a   b"sv, {"a"sv, "  "sv, " b"sv}},
      {"trailing   "sv, {"trailing"sv, "   "sv}},
      {"   leading"sv, {"  "sv, " leading"sv}},
      {" "sv, {" "sv}},
      {"naive naïve café Ωmega straße"sv,
       {"naive"sv, " naïve"sv, " café"sv, " Ωmega"sv, " straße"sv}},
      {"na\314\210ive"sv, {"na"sv, "\314\210ive"sv}},
      {"日本語のテキスト123です"sv, {"日本語のテキスト"sv, "123"sv, "です"sv}},
      {"emoji 😀😀 👍🏽!"sv, {"emoji"sv, " 😀😀"sv, " 👍🏽!"sv}},
      {"x\302\240y \343\200\200z\342\200\250w\302\205v"sv,
       {"x"sv, "\302\240y"sv, " "sv, "\343\200\200z"sv, "\342\200\250w"sv, "\302\205v"sv}},
      {"Ⅻ ½ ٣٤٥ ²"sv, {"Ⅻ"sv, " "sv, "½"sv, " "sv, "٣٤٥"sv, " "sv, "²"sv}},
      {"  !!!?\r\n\r\nword"sv, {" "sv, " !!!?\r\n\r\n"sv, "word"sv}},
      {"hello!!\n\nworld"sv, {"hello"sv, "!!\n\n"sv, "world"sv}},
      {"$100.00 — “quoted” (parens)"sv,
       {"$"sv, "100"sv, "."sv, "00"sv, " —"sv, " “"sv, "quoted"sv, "”"sv, " ("sv, "parens"sv,
        ")"sv}},
      {"\013v\014f\034x\037y \000z"sv,
       {"\013v"sv, "\014f"sv, "\034x"sv, "\037y"sv, " \000"sv, "z"sv}},
      {" \r\n  \n\tx"sv, {" \r\n  \n"sv, "\tx"sv}},
      {"ab\377cd \303( \342\202 \360\237\230"sv,
       {"ab"sv, "\377cd"sv, " \303("sv, " \342\202"sv, " \360\237\230"sv}},
      {"\300\257 \355\240\200 \364\220\200\200 \377word \376\376"sv,
       {"\300\257"sv, " \355\240\200"sv, " \364\220\200\200"sv, " \377"sv, "word"sv,
        " \376\376"sv}},
  };
  return *cases;
}

const std::vector<SplitCase>& Qwen2Cases() {
  static const auto* const cases = new std::vector<SplitCase>{
      {"Hello world"sv, {"Hello"sv, " world"sv}},
      {"I'm here, it's he'll we've they're I'd"sv,
       {"I"sv, "'m"sv, " here"sv, ","sv, " it"sv, "'s"sv, " he"sv, "'ll"sv, " we"sv, "'ve"sv,
        " they"sv, "'re"sv, " I"sv, "'d"sv}},
      {"DON'T 'S 'Re 'LL 'VE 'M 'D 'sup"sv,
       {"DON"sv, "'T"sv, " '"sv, "S"sv, " '"sv, "Re"sv, " '"sv, "LL"sv, " '"sv, "VE"sv, " '"sv,
        "M"sv, " '"sv, "D"sv, " '"sv, "sup"sv}},
      {"'ſ 'x '"sv, {"'ſ"sv, " '"sv, "x"sv, " '"sv}},
      {"1 12 123 1234 12345 123456 1234567"sv,
       {"1"sv, " "sv, "1"sv, "2"sv, " "sv, "1"sv, "2"sv, "3"sv, " "sv, "1"sv, "2"sv, "3"sv,
        "4"sv, " "sv, "1"sv, "2"sv, "3"sv, "4"sv, "5"sv, " "sv, "1"sv, "2"sv, "3"sv, "4"sv,
        "5"sv, "6"sv, " "sv, "1"sv, "2"sv, "3"sv, "4"sv, "5"sv, "6"sv, "7"sv}},
      {"a1b22c333 x9"sv,
       {"a"sv, "1"sv, "b"sv, "2"sv, "2"sv, "c"sv, "3"sv, "3"sv, "3"sv, " x"sv, "9"sv}},
      {"line1\r\nline2\n\n  next\r\n"sv,
       {"line"sv, "1"sv, "\r\n"sv, "line"sv, "2"sv, "\n\n"sv, " "sv, " next"sv, "\r\n"sv}},
      {"\ttab\t\tx  \t y\t"sv, {"\ttab"sv, "\t"sv, "\tx"sv, "  \t"sv, " y"sv, "\t"sv}},
      {"a   b"sv, {"a"sv, "  "sv, " b"sv}},
      {"trailing   "sv, {"trailing"sv, "   "sv}},
      {"   leading"sv, {"  "sv, " leading"sv}},
      {" "sv, {" "sv}},
      {"naive naïve café Ωmega straße"sv,
       {"naive"sv, " naïve"sv, " café"sv, " Ωmega"sv, " straße"sv}},
      {"na\314\210ive"sv, {"na"sv, "\314\210ive"sv}},
      {"日本語のテキスト123です"sv, {"日本語のテキスト"sv, "1"sv, "2"sv, "3"sv, "です"sv}},
      {"emoji 😀😀 👍🏽!"sv, {"emoji"sv, " 😀😀"sv, " 👍🏽!"sv}},
      {"x\302\240y \343\200\200z\342\200\250w\302\205v"sv,
       {"x"sv, "\302\240y"sv, " "sv, "\343\200\200z"sv, "\342\200\250w"sv, "\302\205v"sv}},
      {"Ⅻ ½ ٣٤٥ ²"sv, {"Ⅻ"sv, " "sv, "½"sv, " "sv, "٣"sv, "٤"sv, "٥"sv, " "sv, "²"sv}},
      {"  !!!?\r\n\r\nword"sv, {" "sv, " !!!?\r\n\r\n"sv, "word"sv}},
      {"hello!!\n\nworld"sv, {"hello"sv, "!!\n\n"sv, "world"sv}},
      {"$100.00 — “quoted” (parens)"sv,
       {"$"sv, "1"sv, "0"sv, "0"sv, "."sv, "0"sv, "0"sv, " —"sv, " “"sv, "quoted"sv, "”"sv, " ("sv,
        "parens"sv, ")"sv}},
      {"\013v\014f\034x\037y \000z"sv,
       {"\013v"sv, "\014f"sv, "\034x"sv, "\037y"sv, " \000"sv, "z"sv}},
      {" \r\n  \n\tx"sv, {" \r\n  \n"sv, "\tx"sv}},
      {"ab\377cd \303( \342\202 \360\237\230"sv,
       {"ab"sv, "\377cd"sv, " \303("sv, " \342\202"sv, " \360\237\230"sv}},
      {"\300\257 \355\240\200 \364\220\200\200 \377word \376\376"sv,
       {"\300\257"sv, " \355\240\200"sv, " \364\220\200\200"sv, " \377"sv, "word"sv,
        " \376\376"sv}},
  };
  return *cases;
}

// Expected splits: llama.cpp's default pre-tokenizer, four regexes each splitting the pieces
// the one before left (llama-vocab.cpp, unicode.cpp's unicode_regex_split), worked through
// as tokenizer.h describes it and checked against llama.cpp's own implementation. An invalid
// byte is a character of no class, so not punctuation; llama.cpp reads it as U+FFFD (a
// symbol, so also not \p{P}) and splits the same way.
const std::vector<SplitCase>& DefaultCases() {
  static const auto* const cases = new std::vector<SplitCase>{
      {"Hello, world!"sv, {"Hello"sv, ","sv, " world"sv, "!"sv}},
      {"don't"sv, {"don"sv, "'"sv, "t"sv}},
      {"I'm here, it's he'll"sv,
       {"I"sv, "'"sv, "m"sv, " here"sv, ","sv, " it"sv, "'"sv, "s"sv, " he"sv, "'"sv, "ll"sv}},
      {"x (y)"sv, {"x"sv, " "sv, "("sv, "y"sv, ")"sv}},
      {"a  ("sv, {"a"sv, "  "sv, "("sv}},
      {"a 12345"sv, {"a"sv, " "sv, "123"sv, "45"sv}},
      {"x1234567"sv, {"x"sv, "123"sv, "456"sv, "7"sv}},
      {" 12 1234567 ٣٤٥٦"sv, {" "sv, "12"sv, " "sv, "123"sv, "456"sv, "7"sv, " "sv, "٣٤٥٦"sv}},
      {"12.5% 3,000"sv, {"12"sv, "."sv, "5"sv, "%"sv, " "sv, "3"sv, ","sv, "000"sv}},
      {"$+<=>^~|`"sv, {"$+<=>^~|"sv, "`"sv}},
      {"a_b a-b a@b"sv, {"a"sv, "_"sv, "b"sv, " a"sv, "-"sv, "b"sv, " a"sv, "@"sv, "b"sv}},
      {"$100.00 — “quoted” (parens)"sv,
       {"$"sv, "100"sv, "."sv, "00"sv, " "sv, "—"sv, " "sv, "“"sv, "quoted"sv, "”"sv, " "sv, "("sv,
        "parens"sv, ")"sv}},
      {"  Hello"sv, {" "sv, " Hello"sv}},
      {"   leading"sv, {"  "sv, " leading"sv}},
      {"trailing   "sv, {"trailing"sv, "   "sv}},
      {"a   b"sv, {"a"sv, "  "sv, " b"sv}},
      {" "sv, {" "sv}},
      {"line1\r\nline2\n\n  next\r\n"sv,
       {"line"sv, "1"sv, "\r"sv, "\n"sv, "line"sv, "2"sv, "\n\n "sv, " next"sv, "\r\n"sv}},
      {"\t\tx  \t y\t"sv, {"\t"sv, "\t"sv, "x"sv, "  \t"sv, " y"sv, "\t"sv}},
      {"hello!!\n\nworld"sv, {"hello"sv, "!!"sv, "\n"sv, "\n"sv, "world"sv}},
      {"  !!!?\r\n\r\nword"sv, {"  "sv, "!!!?"sv, "\r\n\r"sv, "\n"sv, "word"sv}},
      {"naive naïve café"sv, {"naive"sv, " naïve"sv, " café"sv}},
      {"日本語のテキスト123です"sv, {"日本語のテキスト"sv, "123"sv, "です"sv}},
      {"emoji 😀😀 👍🏽!"sv, {"emoji"sv, " 😀😀"sv, " 👍🏽"sv, "!"sv}},
      {"Ⅻ ½ ٣٤٥ ²"sv, {"Ⅻ"sv, " "sv, "½"sv, " "sv, "٣٤٥"sv, " "sv, "²"sv}},
      {"x\302\240y \343\200\200z"sv, {"x"sv, "\302\240"sv, "y"sv, " "sv, "\343\200\200"sv, "z"sv}},
      {"ab\377cd \303("sv, {"ab"sv, "\377"sv, "cd"sv, " \303"sv, "("sv}},
  };
  return *cases;
}

void ExpectSplits(PreTokenizer kind, const std::vector<SplitCase>& cases) {
  for (const SplitCase& c : cases) {
    std::vector<std::string_view> words = PreTokenize(kind, c.text);
    EXPECT_EQ(words, c.words) << "text: \"" << absl::CHexEscape(std::string(c.text)) << "\"";
  }
}

TEST(PreTokenizeTest, Gpt2MatchesPythonRegex) { ExpectSplits(PreTokenizer::kGpt2, Gpt2Cases()); }

TEST(PreTokenizeTest, Llama3MatchesPythonRegex) {
  ExpectSplits(PreTokenizer::kLlama3, Llama3Cases());
}

TEST(PreTokenizeTest, Qwen2MatchesPythonRegex) { ExpectSplits(PreTokenizer::kQwen2, Qwen2Cases()); }

TEST(PreTokenizeTest, DefaultMatchesLlamaCpp) {
  ExpectSplits(PreTokenizer::kDefault, DefaultCases());
}

TEST(PreTokenizeTest, EmptyTextHasNoWords) {
  EXPECT_TRUE(PreTokenize(PreTokenizer::kGpt2, "").empty());
  EXPECT_TRUE(PreTokenize(PreTokenizer::kLlama3, "").empty());
  EXPECT_TRUE(PreTokenize(PreTokenizer::kDefault, "").empty());
}

// Random text over an alphabet of every class (and invalid bytes): the words are non-empty
// and concatenate to the input, so every byte is in exactly one word.
TEST(PreTokenizeTest, EveryByteInExactlyOneWord) {
  const std::vector<std::string> pieces = {"a",
                                           "Z",
                                           "'",
                                           "s",
                                           "S",
                                           "ll",
                                           "7",
                                           " ",
                                           "  ",
                                           "\t",
                                           "\r",
                                           "\n",
                                           "!",
                                           ".",
                                           "$",
                                           "`",
                                           "\xe2\x80\x94",
                                           "\xc3\xa9",
                                           "\xce\xa9",
                                           "\xe6\x97\xa5",
                                           "\xf0\x9f\x98\x80",
                                           "\xc2\xa0",
                                           "\xe3\x80\x80",
                                           "\xcc\x88",
                                           "\xd9\xa3",
                                           "\xff",
                                           "\xc3",
                                           "\xe2\x82",
                                           "\xed\xa0\x80",
                                           "\x00"s};
  std::mt19937 rng(7);
  for (PreTokenizer kind :
       {PreTokenizer::kGpt2, PreTokenizer::kLlama3, PreTokenizer::kQwen2, PreTokenizer::kDefault}) {
    for (int trial = 0; trial < 300; ++trial) {
      std::string text;
      const int len = static_cast<int>(rng() % 40);
      for (int i = 0; i < len; ++i) text += pieces[rng() % pieces.size()];
      std::string joined;
      for (std::string_view w : PreTokenize(kind, text)) {
        ASSERT_FALSE(w.empty());
        joined += w;
      }
      ASSERT_EQ(joined, text);
    }
  }
}

TEST(PreTokenizeTest, Names) {
  EXPECT_EQ(*ParsePreTokenizer("gpt-2"), PreTokenizer::kGpt2);
  for (const char* name : {"llama-bpe", "llama3", "llama-v3", "smaug-bpe"}) {
    EXPECT_EQ(*ParsePreTokenizer(name), PreTokenizer::kLlama3) << name;
  }
  EXPECT_EQ(*ParsePreTokenizer("qwen2"), PreTokenizer::kQwen2);
  EXPECT_EQ(*ParsePreTokenizer("default"), PreTokenizer::kDefault);
  for (const char* name : {"Default", "gpt2", "", "deepseek-llm"}) {
    const absl::StatusOr<PreTokenizer> p = ParsePreTokenizer(name);
    ASSERT_FALSE(p.ok()) << name;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(p.status().message(), HasSubstr("supported: default, gpt-2, llama-bpe"));
  }
}

// ---------------------------------------------------------------- vocabularies

TEST(ByteAlphabetTest, GptTwoMapping) {
  EXPECT_EQ(ToByteAlphabet("az!~"), "az!~");
  EXPECT_EQ(ToByteAlphabet(" "), "\xc4\xa0");      // U+0120 'Ġ'
  EXPECT_EQ(ToByteAlphabet("\n"), "\xc4\x8a");     // U+010A 'Ċ'
  EXPECT_EQ(ToByteAlphabet("\x00"s), "\xc4\x80");  // U+0100 'Ā'
  EXPECT_EQ(ToByteAlphabet("\xad"), "\xc5\x83");   // U+0143, the 68th
  EXPECT_EQ(ToByteAlphabet("\xe9"), "\xc3\xa9");   // 'é' stands for itself
}

// The 256 byte tokens, in byte order (ids 0..255).
std::vector<std::string> ByteTokens() {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b)
    tokens.push_back(ToByteAlphabet(std::string(1, static_cast<char>(b))));
  return tokens;
}

using RawMerge = std::pair<std::string, std::string>;  // raw bytes

// The byte tokens, then one token per merge (its concatenation, unless already present), and
// the merges in the given rank order.
TokenizerSpec BpeSpec(const std::vector<RawMerge>& merges, std::string pre = "gpt-2") {
  TokenizerSpec spec;
  spec.pre = std::move(pre);
  spec.tokens = ByteTokens();
  for (const auto& [a, b] : merges) {
    const std::string joined = ToByteAlphabet(a + b);
    if (std::find(spec.tokens.begin(), spec.tokens.end(), joined) == spec.tokens.end()) {
      spec.tokens.push_back(joined);
    }
    spec.merges.push_back(ToByteAlphabet(a) + " " + ToByteAlphabet(b));
  }
  return spec;
}

std::unique_ptr<Tokenizer> MustCreate(TokenizerSpec spec) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::Create(std::move(spec));
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : nullptr;
}

// The raw bytes of each token of `ids`.
std::vector<std::string> Pieces(const Tokenizer& t, const std::vector<int32_t>& ids) {
  std::vector<std::string> out;
  for (int32_t id : ids) out.push_back(t.TokenBytes(id));
  return out;
}

std::vector<std::string> EncodePieces(const Tokenizer& t, std::string_view text) {
  return Pieces(t, t.Encode(text));
}

std::string RandomBytes(std::mt19937& rng, size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng() & 0xFF);
  return s;
}

TEST(TokenizerTest, ByteLevelRoundTripsAnyBytes) {
  for (const char* pre : {"gpt-2", "llama-bpe", "qwen2", "default"}) {
    std::unique_ptr<Tokenizer> t = MustCreate(BpeSpec({}, pre));
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->vocab_size(), 256);
    std::mt19937 rng(1);
    for (int trial = 0; trial < 200; ++trial) {
      const std::string text = RandomBytes(rng, rng() % 300);
      const std::vector<int32_t> ids = t->Encode(text);
      ASSERT_EQ(ids.size(), text.size());  // byte b is token b
      for (size_t i = 0; i < ids.size(); ++i) {
        ASSERT_EQ(ids[i], static_cast<uint8_t>(text[i]));
      }
      ASSERT_EQ(t->Decode(ids), text);
    }
    const std::string text = "naïve Ωmega 日本 😀 \r\n\t 1234567 it's";
    EXPECT_EQ(t->Decode(t->Encode(text)), text);
  }
}

TEST(TokenizerTest, MergeRankOrderDecides) {
  std::unique_ptr<Tokenizer> t = MustCreate(BpeSpec({{"l", "o"}, {"lo", "w"}, {"e", "r"}}));
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(EncodePieces(*t, "lower"), ElementsAre("low", "er"));
  EXPECT_THAT(EncodePieces(*t, "lowly"), ElementsAre("low", "l", "y"));
  // The exact ids: bytes are 0..255, then one token per merge in order.
  EXPECT_THAT(t->Encode("lower"), ElementsAre(257, 258));
  EXPECT_THAT(t->Encode("slow er"), ElementsAre('s', 257, ' ', 258));

  // "abc" with both "a b" and "b c": whichever ranks first wins, whatever the order the
  // vocabulary lists the tokens in.
  std::unique_ptr<Tokenizer> ab_first = MustCreate(BpeSpec({{"a", "b"}, {"b", "c"}}));
  std::unique_ptr<Tokenizer> bc_first = MustCreate(BpeSpec({{"b", "c"}, {"a", "b"}}));
  EXPECT_THAT(EncodePieces(*ab_first, "abc"), ElementsAre("ab", "c"));
  EXPECT_THAT(EncodePieces(*bc_first, "abc"), ElementsAre("a", "bc"));
}

// Llama 3's ignore_merges: a word that is a token is that token, whatever the merges would
// make of it (llama.cpp sets it for pre "llama-bpe", "llama3" and "llama-v3" only). Here the
// merges make "ab" + "c" of "abc", and "abc" is a token of its own that no merge makes, as
// " Việt" is in Llama 3's vocabulary.
TEST(TokenizerTest, IgnoreMergesEmitsWordsThatAreTokensWhole) {
  const auto spec = [](std::string pre) {
    TokenizerSpec s = BpeSpec({{"a", "b"}}, std::move(pre));
    s.tokens.push_back("abc");
    return s;
  };
  for (const char* pre : {"llama-bpe", "llama3", "llama-v3"}) {
    SCOPED_TRACE(pre);
    std::unique_ptr<Tokenizer> t = MustCreate(spec(pre));
    ASSERT_NE(t, nullptr);
    EXPECT_TRUE(t->ignore_merges());
    EXPECT_THAT(t->Encode("abc"), ElementsAre(257));
    EXPECT_THAT(EncodePieces(*t, "abc abc abcd"),
                ElementsAre("abc", " ", "ab", "c", " ", "ab", "c", "d"));
  }
  for (const char* pre : {"smaug-bpe", "qwen2", "gpt-2", "default"}) {
    SCOPED_TRACE(pre);
    std::unique_ptr<Tokenizer> t = MustCreate(spec(pre));
    ASSERT_NE(t, nullptr);
    EXPECT_FALSE(t->ignore_merges());
    EXPECT_THAT(EncodePieces(*t, "abc"), ElementsAre("ab", "c"));
  }
}

TEST(TokenizerTest, RepeatedPairsMergeLeftmostFirst) {
  std::unique_ptr<Tokenizer> t = MustCreate(BpeSpec({{"a", "a"}, {"aa", "aa"}}));
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(EncodePieces(*t, "aaa"), ElementsAre("aa", "a"));
  EXPECT_THAT(EncodePieces(*t, "aaaa"), ElementsAre("aaaa"));
  EXPECT_THAT(EncodePieces(*t, "aaaaa"), ElementsAre("aaaa", "a"));
  EXPECT_THAT(EncodePieces(*t, "aaaaaaa"), ElementsAre("aaaa", "aa", "a"));
}

// A merge that ranks before the merge making one of its parts (never so in a trained
// vocabulary): the lowest-ranked pair is merged one occurrence at a time, leftmost first,
// and pairs are ranked afresh after each merge (train.py's Bpe.word, llama.cpp). GPT-2's
// bpe(), merging every "a b" in one pass, would give ["ab", "ab"] here.
TEST(TokenizerTest, MergesOneOccurrenceAtATime) {
  TokenizerSpec spec = BpeSpec({{"a", "b"}});
  spec.tokens.push_back("aba");
  spec.merges.insert(spec.merges.begin(), "ab a");  // rank 0
  std::unique_ptr<Tokenizer> t = MustCreate(std::move(spec));
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(EncodePieces(*t, "abab"), ElementsAre("aba", "b"));
}

// train.py's Bpe.word: the straightforward quadratic loop the heap must agree with.
std::vector<std::string> ReferenceBpe(std::string_view word, const std::map<RawMerge, int>& rank) {
  std::vector<std::string> parts;
  for (char c : word) parts.emplace_back(1, c);
  while (parts.size() > 1) {
    int best = -1;
    size_t at = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      const auto it = rank.find({parts[i], parts[i + 1]});
      if (it != rank.end() && (best < 0 || it->second < best)) {
        best = it->second;
        at = i;
      }
    }
    if (best < 0) break;
    parts[at] += parts[at + 1];
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
  return parts;
}

std::vector<std::string> ReferenceEncode(std::string_view text,
                                         const std::vector<RawMerge>& merges) {
  std::map<RawMerge, int> rank;
  for (size_t r = 0; r < merges.size(); ++r) rank.emplace(merges[r], static_cast<int>(r));
  std::vector<std::string> out;
  for (std::string_view w : PreTokenize(PreTokenizer::kGpt2, text)) {
    for (std::string& p : ReferenceBpe(w, rank)) out.push_back(std::move(p));
  }
  return out;
}

// A tiny BPE trainer: over the corpus's pre-tokenized words (with their counts), merge the
// most frequent adjacent pair (ties: the smaller pair), `n` times.
std::vector<RawMerge> Learn(std::string_view corpus, int n) {
  std::map<std::string, int> counts;
  for (std::string_view w : PreTokenize(PreTokenizer::kGpt2, corpus)) ++counts[std::string(w)];
  std::vector<std::pair<std::vector<std::string>, int>> words;
  for (const auto& [w, c] : counts) {
    std::vector<std::string> symbols;
    for (char ch : w) symbols.emplace_back(1, ch);
    words.emplace_back(std::move(symbols), c);
  }
  std::vector<RawMerge> merges;
  while (static_cast<int>(merges.size()) < n) {
    std::map<RawMerge, int> pairs;
    for (const auto& [symbols, c] : words) {
      for (size_t i = 0; i + 1 < symbols.size(); ++i) pairs[{symbols[i], symbols[i + 1]}] += c;
    }
    if (pairs.empty()) break;
    const auto best =
        std::max_element(pairs.begin(), pairs.end(), [](const auto& x, const auto& y) {
          return x.second < y.second;  // max_element keeps the first (smallest pair) of equals
        });
    const RawMerge m = best->first;
    merges.push_back(m);
    for (auto& [symbols, c] : words) {
      std::vector<std::string> out;
      for (size_t i = 0; i < symbols.size(); ++i) {
        if (i + 1 < symbols.size() && symbols[i] == m.first && symbols[i + 1] == m.second) {
          out.push_back(m.first + m.second);
          ++i;
        } else {
          out.push_back(symbols[i]);
        }
      }
      symbols = std::move(out);
    }
  }
  return merges;
}

constexpr std::string_view kCorpus =
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no "
    "money in my purse, and nothing particular to interest me on shore, I thought I would "
    "sail about a little and see the watery part of the world. It is a way I have of driving "
    "off the spleen and regulating the circulation. Whenever I find myself growing grim about "
    "the mouth; whenever it is a damp, drizzly November in my soul; whenever I find myself "
    "involuntarily pausing before coffin warehouses, and bringing up the rear of every "
    "funeral I meet; then, I account it high time to get to sea as soon as I can. There is "
    "nothing surprising in this. If they but knew it, almost all men in their degree, some "
    "time or other, cherish very nearly the same feelings towards the ocean with me. 1851, "
    "1852 and 2024: they're the lowest, newest, widest years.\n\n";

std::vector<std::string> CorpusWords() {
  std::vector<std::string> words;
  for (std::string_view w : PreTokenize(PreTokenizer::kGpt2, kCorpus)) words.emplace_back(w);
  return words;
}

TEST(TokenizerTest, LearnedMergesMatchReferenceAndRoundTrip) {
  const std::vector<RawMerge> merges = Learn(kCorpus, 60);
  ASSERT_EQ(merges.size(), 60u);
  std::unique_ptr<Tokenizer> t = MustCreate(BpeSpec(merges));
  ASSERT_NE(t, nullptr);
  // The most frequent words of the corpus became single tokens.
  EXPECT_THAT(EncodePieces(*t, " the"), ElementsAre(" the"));
  EXPECT_THAT(EncodePieces(*t, " I"), ElementsAre(" I"));
  EXPECT_EQ(t->Encode(kCorpus).size(), ReferenceEncode(kCorpus, merges).size());

  const std::vector<std::string> words = CorpusWords();
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    std::string text;
    const int n = static_cast<int>(rng() % 60);
    for (int i = 0; i < n; ++i) {
      text += words[rng() % words.size()];
      if (rng() % 5 == 0) text += " ";  // and some text that is not a corpus word
    }
    const std::vector<int32_t> ids = t->Encode(text);
    ASSERT_EQ(Pieces(*t, ids), ReferenceEncode(text, merges)) << text;
    ASSERT_EQ(t->Decode(ids), text);
  }
}

// Merges in random rank order over random pairs of tokens, so that merges often rank before
// those making their parts: the heap still agrees with the reference loop.
TEST(TokenizerTest, ArbitraryMergeOrdersMatchReference) {
  std::mt19937 rng(11);
  for (int vocab = 0; vocab < 20; ++vocab) {
    std::vector<std::string> pool = {"a", "b", "c", "d"};
    std::vector<RawMerge> merges;
    std::map<RawMerge, int> seen;
    while (merges.size() < 30) {
      RawMerge m{pool[rng() % pool.size()], pool[rng() % pool.size()]};
      if ((m.first + m.second).size() > 6 || !seen.emplace(m, 0).second) continue;
      merges.push_back(m);
      if (std::find(pool.begin(), pool.end(), m.first + m.second) == pool.end()) {
        pool.push_back(m.first + m.second);
      }
    }
    std::shuffle(merges.begin(), merges.end(), rng);
    std::unique_ptr<Tokenizer> t = MustCreate(BpeSpec(merges));
    ASSERT_NE(t, nullptr);
    for (int trial = 0; trial < 50; ++trial) {
      std::string text;
      const int n = static_cast<int>(rng() % 24);
      for (int i = 0; i < n; ++i) text += static_cast<char>("abcd  "[rng() % 6]);
      ASSERT_EQ(EncodePieces(*t, text), ReferenceEncode(text, merges)) << text;
    }
  }
}

// ---------------------------------------------------------------- special tokens

// Bytes, "<|bos|>" and "<|eos|>" (control), "<tool>" and "<tool_call>" (user-defined).
std::unique_ptr<Tokenizer> SpecialTokenizer(bool add_bos) {
  TokenizerSpec spec = BpeSpec({{"a", "b"}});
  spec.token_types.assign(spec.tokens.size(), kTokenNormal);
  for (auto [text, type] : {std::pair<const char*, int32_t>{"<|bos|>", kTokenControl},
                            {"<|eos|>", kTokenControl},
                            {"<tool>", kTokenUserDefined},
                            {"<tool_call>", kTokenUserDefined}}) {
    spec.tokens.push_back(text);
    spec.token_types.push_back(type);
  }
  spec.bos = 257;
  spec.eos = 258;
  spec.add_bos = add_bos;
  return MustCreate(std::move(spec));
}

TEST(TokenizerTest, SpecialTokensParsedOnlyWhenAsked) {
  std::unique_ptr<Tokenizer> t = SpecialTokenizer(/*add_bos=*/true);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->bos(), 257);
  EXPECT_EQ(t->eos(), 258);
  EXPECT_TRUE(t->IsControl(257));
  EXPECT_FALSE(t->IsControl(259));
  EXPECT_FALSE(t->IsControl(-1));
  EXPECT_FALSE(t->IsControl(1000));
  EXPECT_EQ(t->TokenBytes(257), "");
  EXPECT_EQ(t->TokenBytes(259), "<tool>");

  const std::string text = "ab<|eos|><tool_call>x <tool>ab<|bos|>";
  EXPECT_THAT(t->Encode(text, /*add_special=*/false, /*parse_special=*/true),
              ElementsAre(256, 258, 260, 'x', ' ', 259, 256, 257));
  EXPECT_THAT(t->Encode(text, /*add_special=*/true, /*parse_special=*/true),
              ElementsAre(257, 256, 258, 260, 'x', ' ', 259, 256, 257));
  // Without parse_special the markers are text.
  const std::vector<int32_t> plain = t->Encode(text, /*add_special=*/false);
  EXPECT_EQ(plain.front(), 256);
  for (int32_t id : plain) EXPECT_LT(id, 257);
  EXPECT_EQ(t->Decode(plain), text);
  // Decode skips control tokens and keeps user-defined text.
  EXPECT_EQ(t->Decode(t->Encode(text, true, true)), "ab<tool_call>x <tool>ab");
  // Ids outside the vocabulary are skipped.
  EXPECT_EQ(t->Decode({'h', -1, 'i', 100000}), "hi");
}

TEST(TokenizerTest, SpecialTokensLeftmostLongest) {
  std::unique_ptr<Tokenizer> t = SpecialTokenizer(/*add_bos=*/false);
  ASSERT_NE(t, nullptr);
  // "<tool_call>" over "<tool>" where both match; a prefix of one that never completes is
  // text; a special splits a word (each side is pre-tokenized on its own).
  EXPECT_THAT(t->Encode("<tool_call><tool><tool_cal", true, true),
              ElementsAre(260, 259, '<', 't', 'o', 'o', 'l', '_', 'c', 'a', 'l'));
  EXPECT_THAT(t->Encode("a<|bos|>b", true, true), ElementsAre('a', 257, 'b'));
  EXPECT_THAT(t->Encode("<<|eos|>>", true, true), ElementsAre('<', 258, '>'));
  EXPECT_TRUE(t->Encode("", true, true).empty());  // add_bos is off
}

// ---------------------------------------------------------------- Create refusals

void ExpectRefused(TokenizerSpec spec, std::string_view message) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::Create(std::move(spec));
  ASSERT_FALSE(t.ok()) << "expected a refusal mentioning: " << message;
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr(message));
}

TEST(TokenizerTest, CreateRefusals) {
  const TokenizerSpec good = BpeSpec({{"a", "b"}});  // tokens 0..256
  ASSERT_TRUE(Tokenizer::Create(good).ok());

  TokenizerSpec s = good;
  s.model = "llama";
  ExpectRefused(s, "tokenizer.model = \"llama\": unsupported; only \"gpt2\"");
  ExpectRefused(s, "SentencePiece");
  s.model = "bert";
  ExpectRefused(s, "tokenizer.model = \"bert\"");

  s = good;
  s.pre = "deepseek-llm";
  ExpectRefused(s,
                "tokenizer.pre = \"deepseek-llm\": unsupported pre-tokenizer; supported: default");

  s = good;
  s.tokens.clear();
  s.merges.clear();
  ExpectRefused(s, "tokenizer.tokens: 0 tokens; must be in [1, 4194304]");
  s.tokens.assign(TokenizerSpec::kMaxTokens + 1, std::string());
  ExpectRefused(s, "tokenizer.tokens: 4194305 tokens; must be in [1, 4194304]");

  s = good;
  s.token_types.assign(3, kTokenNormal);
  ExpectRefused(s, "tokenizer.token_types: 3 types for 257 tokens");
  s.token_types.assign(257, kTokenNormal);
  s.token_types[9] = 7;
  ExpectRefused(s, "tokenizer.token_types[9] = 7: must be in [0, 6]");
  s.token_types[9] = -1;
  ExpectRefused(s, "tokenizer.token_types[9] = -1");

  s = good;
  s.tokens.push_back("ab");
  ExpectRefused(s, "tokenizer.tokens[257] = \"ab\": duplicates tokens[256]");

  s = good;
  s.tokens.push_back("a b");  // a raw space is not in the byte alphabet ("Ġ" is)
  ExpectRefused(s, "tokenizer.tokens[257] = \"a b\" (type 1): U+0020 is not in GPT-2's byte");
  s.tokens.back() = "\xe2\x82\xac";  // U+20AC
  ExpectRefused(s, "U+20AC is not in GPT-2's byte alphabet");
  s.tokens.back() = "\xff";
  ExpectRefused(s, "invalid UTF-8 is not in GPT-2's byte alphabet");
  s.token_types.assign(s.tokens.size(), kTokenNormal);
  s.token_types.back() = kTokenUserDefined;  // user-defined tokens are literal text
  EXPECT_TRUE(Tokenizer::Create(s).ok());

  s = good;
  s.tokens['\n'] = "<newline>";
  ExpectRefused(s, "no token for byte 0x0A (\"\\xc4\\x8a\")");
  s = good;
  s.token_types.assign(s.tokens.size(), kTokenNormal);
  s.token_types['x'] = kTokenControl;
  ExpectRefused(s, "no token for byte 0x78");

  for (const char* bad : {"ab", " b", "a ", "a  b", "a b c", ""}) {
    s = good;
    s.merges.push_back(bad);
    ExpectRefused(s, "tokenizer.merges[1] = \"" + std::string(bad) + "\": must be \"A B\"");
  }
  s = good;
  s.merges.push_back("a c");  // "ac" is no token
  ExpectRefused(s, "tokenizer.merges[1] = \"a c\": \"ac\" is not a token of the byte alphabet");
  s.merges.back() = "x\xc4\xa0 y";  // "xĠ" is no token
  ExpectRefused(s, "tokenizer.merges[1] = \"x\\xc4\\xa0 y\": \"x\\xc4\\xa0\" is not a token");
  s = good;
  s.token_types.assign(s.tokens.size(), kTokenNormal);
  s.token_types[256] = kTokenControl;  // "ab"
  ExpectRefused(s, "tokenizer.merges[0] = \"a b\": \"ab\" is not a token of the byte alphabet");
  s = good;
  s.merges.assign(TokenizerSpec::kMaxMerges + 1, "a b");
  ExpectRefused(s, "tokenizer.merges: 4194305 merges; at most 4194304");

  s = good;
  s.bos = 257;
  ExpectRefused(s, "tokenizer.bos = 257: must be -1 (none) or a token id in [0, 257)");
  s.bos = -2;
  ExpectRefused(s, "tokenizer.bos = -2");
  s = good;
  s.eos = 1000;
  ExpectRefused(s, "tokenizer.eos = 1000");
  s = good;
  s.add_bos = true;
  ExpectRefused(s, "tokenizer.add_bos = true: needs a bos token");
}

TEST(TokenizerTest, DuplicateMergeKeepsFirstRank) {
  TokenizerSpec spec = BpeSpec({{"b", "c"}, {"a", "b"}});
  spec.merges.push_back(ToByteAlphabet("b") + " " + ToByteAlphabet("c"));  // again, last
  std::unique_ptr<Tokenizer> t = MustCreate(std::move(spec));
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(EncodePieces(*t, "abc"), ElementsAre("a", "bc"));
}

// ---------------------------------------------------------------- speed

double EncodeMillis(const Tokenizer& t, std::string_view text, size_t* n_ids) {
  const auto start = std::chrono::steady_clock::now();
  *n_ids = t.Encode(text).size();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// ~16 KB of text encodes in milliseconds, and so does one 16 KB word (the merge heap is
// O(n log n) in a word's length, not quadratic). The bounds are loose: they catch a
// quadratic algorithm on a loaded machine or under a sanitizer, not a slow one.
TEST(TokenizerTest, EncodesSixteenKilobytesInMilliseconds) {
  const std::vector<RawMerge> merges = Learn(kCorpus, 200);
  std::unique_ptr<Tokenizer> t = MustCreate(BpeSpec(merges));
  ASSERT_NE(t, nullptr);
  const std::vector<std::string> words = CorpusWords();
  std::mt19937 rng(5);
  std::string text;
  while (text.size() < 16384) text += words[rng() % words.size()];
  size_t n_ids = 0;
  const double ms = EncodeMillis(*t, text, &n_ids);
  EXPECT_LT(ms, 250.0);
  EXPECT_EQ(t->Decode(t->Encode(text)), text);
  RecordProperty("encode_16k_ms", std::to_string(ms));

  std::string word;
  while (word.size() < 16384) word += static_cast<char>('a' + rng() % 26);
  const double word_ms = EncodeMillis(*t, word, &n_ids);
  EXPECT_LT(word_ms, 250.0);
  std::unique_ptr<Tokenizer> doubling =
      MustCreate(BpeSpec({{"a", "a"}, {"aa", "aa"}, {"aaaa", "aaaa"}, {"aaaaaaaa", "aaaaaaaa"}}));
  ASSERT_NE(doubling, nullptr);
  const double a_ms = EncodeMillis(*doubling, std::string(16384, 'a'), &n_ids);
  EXPECT_EQ(n_ids, 16384u / 16);
  EXPECT_LT(a_ms, 250.0);
  std::printf("16 KB: text %.2f ms, one random word %.2f ms, 'a'x16384 %.2f ms\n", ms, word_ms,
              a_ms);
}

// ---------------------------------------------------------------- Utf8Stream

TEST(Utf8StreamTest, HoldsIncompleteCharacters) {
  Utf8Stream s;
  EXPECT_EQ(s.Push("ab"), "ab");
  EXPECT_EQ(s.Push("\xc3"), "");  // é, split
  EXPECT_EQ(s.Push("\xa9x\xe2"), "\xc3\xa9x");
  EXPECT_EQ(s.Push("\x82"), "");  // €, one byte at a time
  EXPECT_EQ(s.Push("\xac\xf0\x9f"), "\xe2\x82\xac");
  EXPECT_EQ(s.Push("\x98"), "");  // 😀, split 2 + 1 + 1
  EXPECT_EQ(s.Push("\x80"), "\xf0\x9f\x98\x80");
  EXPECT_EQ(s.Flush(), "");
  EXPECT_EQ(s.Push("z\xe6\x97"), "z");  // 日, cut short by the end of the stream
  EXPECT_EQ(s.Flush(), "\xe6\x97");
  EXPECT_EQ(s.Flush(), "");
}

TEST(Utf8StreamTest, InvalidBytesPassThrough) {
  Utf8Stream s;
  EXPECT_EQ(s.Push("\xff"), "\xff");          // starts no character
  EXPECT_EQ(s.Push("\x80\x80"), "\x80\x80");  // continuation bytes with no lead
  EXPECT_EQ(s.Push("\xc0"), "\xc0");          // overlong lead
  EXPECT_EQ(s.Push("\xe0\x80"), "\xe0\x80");  // overlong: E0 needs A0..BF next
  EXPECT_EQ(s.Push("\xed\xa0"), "\xed\xa0");  // a surrogate
  EXPECT_EQ(s.Push("\xf4\x90"), "\xf4\x90");  // past U+10FFFF
  EXPECT_EQ(s.Push("\xc3\xa9\x80"), "\xc3\xa9\x80");
  EXPECT_EQ(s.Push("\xc3"), "");
  EXPECT_EQ(s.Push("A"),
            "\xc3"
            "A");  // a lead whose character never came
  EXPECT_EQ(s.Flush(), "");
}

// Streaming the pieces of any token sequence gives Decode's text, and every Push ends on a
// character boundary when the whole text is valid UTF-8.
TEST(Utf8StreamTest, StreamsTokenPiecesToDecodedText) {
  std::unique_ptr<Tokenizer> t = MustCreate(BpeSpec(Learn(kCorpus, 40)));
  ASSERT_NE(t, nullptr);
  const std::string text = "naïve Ωmega — 日本語 😀👍🏽 Call me Ishmael.";
  const std::vector<int32_t> ids = t->Encode(text);
  Utf8Stream s;
  std::string streamed;
  for (int32_t id : ids) {
    const std::string out = s.Push(t->TokenBytes(id));
    streamed += out;
    ASSERT_EQ(text.compare(0, streamed.size(), streamed), 0);
    if (!out.empty()) {
      EXPECT_NE(static_cast<uint8_t>(out.back()) & 0xC0, 0xC0) << "ends on a lead byte";
    }
  }
  streamed += s.Flush();
  EXPECT_EQ(streamed, text);
}

}  // namespace
}  // namespace kvtier::engine
