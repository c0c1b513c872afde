// The tokenizer of GGUF "gpt2"-model vocabularies: byte-level BPE with ranked merges, as the
// GGUF files of GPT-2, Llama 3 and Qwen2 (and engine/model/train.py's kvtier-tiny) carry it.
//
// The vocabulary (tokenizer.ggml.*): token strings written in GPT-2's byte alphabet, where
// every raw byte is one printable code point (bytes '!'..'~', '¡'..'¬', '®'..'ÿ' stand for
// themselves, the other 68 bytes map in byte order to U+0100, U+0101, ...); merges "A B" in
// rank order (index = priority, lower first); token types (1 normal, 2 unknown, 3 control,
// 4 user-defined, 5 unused, 6 byte; 0 undefined is read as normal). Control and user-defined
// tokens are literal text, not byte-alphabet strings (as llama.cpp reads them).
//
// Encode(text):
//   1. with parse_special, the literal text of control and user-defined tokens found in the
//      input becomes that token: scanning left to right, at each byte the longest special
//      token that starts there wins (leftmost-longest, as Hugging Face's added vocabulary);
//   2. each span between them is split into words by the pre-tokenizer (below);
//   3. with ignore_merges (below), a word whose bytes are a token (other than control and
//      user-defined ones) is that token, whatever its merges would make;
//   4. each other word's UTF-8 bytes start as single-byte symbols; the adjacent pair with the
//      lowest merge rank is merged (the leftmost occurrence when it occurs more than once),
//      and again, until no adjacent pair has a rank. This is llama.cpp's and train.py's
//      Bpe.word(); it equals GPT-2's bpe() (every occurrence of the best pair per pass) on
//      any vocabulary whose merges rank after the merges that make their parts, i.e. every
//      trained one, and on others it is the one the GGUF runtimes agree on;
//   5. every symbol is a token by construction: Create() requires all 256 byte tokens and
//      that every merge's parts and concatenation are tokens, so no fallback is ever needed.
// ignore_merges is Llama 3's (its tokenizer.json's model.ignore_merges): llama.cpp sets it
// for tokenizer.ggml.pre "llama-bpe", "llama3" and "llama-v3" (not "smaug-bpe", whose
// regex is the same), and so does Create(). It matters where a token is not what the merges
// make of its bytes: Llama 3's " Việt" is one token, which its merges would make three.
// Decode(ids) concatenates the tokens' raw bytes, control tokens skipped.
//
// Pre-tokenizers (tokenizer.ggml.pre), hand-written matchers over Unicode code points that
// reproduce Python `regex.findall(pattern, text)` exactly, and llama.cpp's splits for
// "default" (\p{L}, \p{N}, \p{P}, \s from ICU: letter categories, number categories,
// punctuation categories, White_Space):
//   "gpt-2"       's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//   "llama-bpe"   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}
//                 | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//                 (Llama 3; aliases "llama3", "llama-v3", "smaug-bpe")
//   "qwen2"       as "llama-bpe" with \p{N} (one digit per word) for \p{N}{1,3}
//   "default"     llama.cpp's default BPE pre-tokenizer, which it also takes for a GGUF with
//                 no tokenizer.ggml.pre: four regexes, each splitting every piece the one
//                 before left (what a regex matches and the text between matches are both
//                 pieces, and a piece's end is the end of the text for lookaheads):
//                 [\p{P}\$\+<=>\^~\|]+ (every punctuation character, and the ASCII
//                 symbols but `), then "gpt-2"'s regex, then \p{N}+, then [0-9][0-9][0-9]
// Alternatives are tried in order at each position and the first that matches wins. The
// case-insensitive contractions follow Unicode simple case folding as Python's regex does:
// 'S and 'ſ (U+017F) match 's (llama.cpp folds A-Z only). Input need not be valid UTF-8:
// an invalid byte (strict UTF-8: no overlongs, surrogates or code points past U+10FFFF) is
// a character of its own, of no class (neither letter, number nor space), the way Python
// sees bytes decoded with errors="surrogateescape". Every input byte lands in exactly one word.
//
// A Tokenizer is immutable after Create(): thread-safe to share.
#ifndef KVTIER_ENGINE_TOKENIZER_H_
#define KVTIER_ENGINE_TOKENIZER_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

namespace kvtier::engine {

// tokenizer.ggml.token_type values.
inline constexpr int32_t kTokenUndefined = 0;
inline constexpr int32_t kTokenNormal = 1;
inline constexpr int32_t kTokenUnknown = 2;
inline constexpr int32_t kTokenControl = 3;
inline constexpr int32_t kTokenUserDefined = 4;
inline constexpr int32_t kTokenUnused = 5;
inline constexpr int32_t kTokenByte = 6;

enum class PreTokenizer { kGpt2, kLlama3, kQwen2, kDefault };

// "gpt-2" → kGpt2; "llama-bpe", "llama3", "llama-v3", "smaug-bpe" → kLlama3; "qwen2" →
// kQwen2; "default" → kDefault. Anything else: INVALID_ARGUMENT naming the value and the
// supported names.
absl::StatusOr<PreTokenizer> ParsePreTokenizer(std::string_view name);

// Whether the pre-tokenizer `name` comes with ignore_merges: "llama-bpe", "llama3",
// "llama-v3".
bool IgnoresMerges(std::string_view name);

// The words of `text` under `kind`, in order; non-empty, and they concatenate to `text`.
std::vector<std::string_view> PreTokenize(PreTokenizer kind, std::string_view text);

// `bytes` written in GPT-2's byte alphabet (one code point per byte), as token strings are.
std::string ToByteAlphabet(std::string_view bytes);

struct TokenizerSpec {
  // Limits Create() enforces.
  static constexpr int32_t kMaxTokens = 1 << 22;
  static constexpr int32_t kMaxMerges = 1 << 22;

  std::string model = "gpt2";  // only "gpt2" (byte-level BPE); "llama" (SentencePiece) is not
  std::string pre = "gpt-2";   // see ParsePreTokenizer
  std::vector<std::string> tokens;
  std::vector<std::string> merges;   // "A B", rank order
  std::vector<int32_t> token_types;  // empty (all normal), or one per token
  int32_t bos = -1, eos = -1;        // -1: none
  bool add_bos = false;
};

class Tokenizer {
 public:
  Tokenizer(const Tokenizer&) = delete;  // whole_ points into bytes_
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Validates the spec; INVALID_ARGUMENT naming the field, the value and the limit for:
  //   - model other than "gpt2"; pre not one ParsePreTokenizer knows;
  //   - no tokens or more than kMaxTokens; token_types neither empty nor one per token, or
  //     a type outside [0, 6]; two tokens with the same string (naming both indices);
  //   - a token that is neither control nor user-defined whose string is not valid UTF-8
  //     in GPT-2's byte alphabet; a byte (of the 256) with no such token;
  //   - more than kMaxMerges merges; a merge (named by index) that is not "A B" (two
  //     non-empty parts, one space), or whose parts or concatenation are not tokens of the
  //     byte alphabet (control and user-defined tokens are not);
  //   - bos or eos neither -1 nor a token id; add_bos without a bos.
  // A merge listed twice keeps its first (lower) rank, as llama.cpp does.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Create(TokenizerSpec spec);

  // Token ids of `text` (BOS first when add_bos and `add_special`). With parse_special,
  // literal control/user-defined token text in `text` becomes that token; without it, such
  // text is encoded as ordinary text. ~16 KB of text encodes in a few milliseconds: each
  // distinct word is merged once per call (a heap over its pairs, O(n log n) in its length).
  std::vector<int32_t> Encode(std::string_view text, bool add_special = true,
                              bool parse_special = false) const;

  // Text of the ids: the tokens' bytes concatenated, control tokens (and ids outside
  // [0, vocab_size)) skipped. The result is invalid UTF-8 only where the ids make it so.
  std::string Decode(const std::vector<int32_t>& ids) const;

  // The raw bytes of one token (control tokens: empty). REQUIRES: 0 <= id < vocab_size().
  const std::string& TokenBytes(int32_t id) const { return bytes_[static_cast<size_t>(id)]; }

  int32_t vocab_size() const { return static_cast<int32_t>(bytes_.size()); }
  int32_t bos() const { return bos_; }  // -1: none
  int32_t eos() const { return eos_; }  // -1: none
  bool add_bos() const { return add_bos_; }
  // False for ids outside [0, vocab_size).
  bool IsControl(int32_t id) const;
  // The pre-tokenizer's name as the spec gave it, and what it names.
  const std::string& pre() const { return pre_; }
  PreTokenizer pre_tokenizer() const { return pre_kind_; }
  // Whether a word that is a token is encoded as that token (IgnoresMerges(pre())).
  bool ignore_merges() const { return ignore_merges_; }

 private:
  struct Merge {
    int32_t rank;
    int32_t result;  // token id of the concatenation
  };
  struct Special {
    std::string text;
    int32_t id;
  };
  using WordCache = absl::flat_hash_map<std::string_view, std::vector<int32_t>>;

  Tokenizer() = default;
  static uint64_t PairKey(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  // Appends the ids of one pre-tokenized word.
  void EncodeWord(std::string_view word, WordCache& cache, std::vector<int32_t>& out) const;
  std::vector<int32_t> Bpe(std::string_view word) const;
  void EncodeSpan(std::string_view span, WordCache& cache, std::vector<int32_t>& out) const;
  // Length of the longest special token at text[pos], 0 if none; its id in *id.
  size_t MatchSpecial(std::string_view text, size_t pos, int32_t* id) const;

  std::string pre_;
  PreTokenizer pre_kind_ = PreTokenizer::kGpt2;
  bool ignore_merges_ = false;
  std::vector<std::string> bytes_;  // per token: raw bytes (control: empty)
  std::vector<uint8_t> control_;    // per token: 1 when control
  std::array<int32_t, 256> byte_token_{};
  absl::flat_hash_map<uint64_t, Merge> merges_;  // PairKey(left, right) →
  std::vector<Special> specials_;                // longest first
  std::array<bool, 256> special_first_byte_{};   // some special starts with this byte
  int32_t bos_ = -1;
  int32_t eos_ = -1;
  bool add_bos_ = false;
  // With ignore_merges: raw bytes (views into bytes_) → id, for every token but the control
  // and user-defined ones; empty otherwise.
  absl::flat_hash_map<std::string_view, int32_t> whole_;
};

// Streams decoded text: Push(bytes of a token) returns the longest prefix of the accumulated
// bytes that does not end inside a UTF-8 character, keeping an incomplete tail (at most 3
// bytes, and only while it can still become a valid character) for the next Push; Flush()
// returns the rest. Bytes that can never form a character pass through at once.
class Utf8Stream {
 public:
  std::string Push(std::string_view bytes);
  std::string Flush();

 private:
  std::string pending_;
};

}  // namespace kvtier::engine

#endif  // KVTIER_ENGINE_TOKENIZER_H_
