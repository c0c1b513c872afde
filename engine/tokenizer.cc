#include "engine/tokenizer.h"

#include <unicode/uchar.h>

#include <algorithm>
#include <queue>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace kvtier::engine {
namespace {

// ---------------------------------------------------------------- UTF-8 and character classes

constexpr char32_t kInvalid = 0xFFFFFFFF;  // an invalid byte: a character of no class

// Decodes one character at s[i] (strict UTF-8); *len gets its byte count (1 for an invalid
// byte, which decodes to kInvalid).
char32_t DecodeUtf8(std::string_view s, size_t i, size_t* len) {
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t b0 = b(i);
  *len = 1;
  if (b0 < 0x80) return b0;
  size_t n;
  char32_t cp;
  uint8_t lo = 0x80, hi = 0xBF;  // the second byte's range
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    n = 2;
    cp = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    n = 3;
    cp = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;  // no overlongs
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    n = 4;
    cp = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;  // no overlongs
    if (b0 == 0xF4) hi = 0x8F;  // nothing past U+10FFFF
  } else {
    return kInvalid;
  }
  if (i + n > s.size()) return kInvalid;
  if (b(i + 1) < lo || b(i + 1) > hi) return kInvalid;
  for (size_t k = 1; k < n; ++k) {
    if (k > 1 && (b(i + k) & 0xC0) != 0x80) return kInvalid;
    cp = (cp << 6) | (b(i + k) & 0x3F);
  }
  *len = n;
  return cp;
}

void AppendUtf8(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

enum class Cls : uint8_t { kLetter, kNumber, kSpace, kOther };

Cls Classify(char32_t cp) {
  if (cp < 0x80) {  // the common case, without ICU
    if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') return Cls::kLetter;
    if (cp >= '0' && cp <= '9') return Cls::kNumber;
    if (cp == ' ' || (cp >= '\t' && cp <= '\r')) return Cls::kSpace;
    return Cls::kOther;
  }
  if (cp == kInvalid) return Cls::kOther;
  const auto c = static_cast<UChar32>(cp);
  if (u_isUWhiteSpace(c)) return Cls::kSpace;
  switch (u_charType(c)) {
    case U_UPPERCASE_LETTER:
    case U_LOWERCASE_LETTER:
    case U_TITLECASE_LETTER:
    case U_MODIFIER_LETTER:
    case U_OTHER_LETTER:
      return Cls::kLetter;
    case U_DECIMAL_DIGIT_NUMBER:
    case U_LETTER_NUMBER:
    case U_OTHER_NUMBER:
      return Cls::kNumber;
    default:
      return Cls::kOther;
  }
}

// ---------------------------------------------------------------- pre-tokenizers

// The text as characters: code point, class, byte offset (off has one more entry: the end).
struct Chars {
  std::vector<char32_t> cp;
  std::vector<Cls> cls;
  std::vector<size_t> off;
};

Chars Split(std::string_view text) {
  Chars c;
  c.cp.reserve(text.size());
  c.cls.reserve(text.size());
  c.off.reserve(text.size() + 1);
  for (size_t i = 0; i < text.size();) {
    size_t len;
    const char32_t cp = DecodeUtf8(text, i, &len);
    c.cp.push_back(cp);
    c.cls.push_back(Classify(cp));
    c.off.push_back(i);
    i += len;
  }
  c.off.push_back(text.size());
  return c;
}

// Each matcher returns the end (a character index > i) of the word that starts at
// character i < end, reproducing the regex documented in tokenizer.h alternative by
// alternative on the text's first `end` characters (by default all of them).
class Matcher {
 public:
  explicit Matcher(const Chars& c) : Matcher(c, c.cp.size()) {}
  Matcher(const Chars& c, size_t end) : c_(c), n_(end) {}

  // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  size_t Gpt2(size_t i) const {
    if (size_t e = Contraction(i, /*fold=*/false); e != 0) return e;
    // ` ?X+` for X = letters, numbers, others (in that order; a character is in exactly
    // one class, so the first that applies is the one whose class follows the space).
    if (c_.cp[i] == ' ' && i + 1 < n_ && c_.cls[i + 1] != Cls::kSpace) {
      return RunOf(i + 1, c_.cls[i + 1]);
    }
    if (c_.cls[i] != Cls::kSpace) return RunOf(i, c_.cls[i]);
    return Spaces(i);
  }

  // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}
  // | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  size_t Llama3(size_t i, size_t max_digits) const {
    if (size_t e = Contraction(i, /*fold=*/true); e != 0) return e;
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (c_.cls[i] == Cls::kLetter) return RunOf(i, Cls::kLetter);
    if (!IsCrLf(i) && c_.cls[i] != Cls::kNumber && i + 1 < n_ && c_.cls[i + 1] == Cls::kLetter) {
      return RunOf(i + 1, Cls::kLetter);
    }
    // \p{N}{1,max_digits}
    if (c_.cls[i] == Cls::kNumber) return std::min(RunOf(i, Cls::kNumber), i + max_digits);
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    size_t j = i;
    if (c_.cp[i] == ' ' && i + 1 < n_ && c_.cls[i + 1] == Cls::kOther) j = i + 1;
    if (c_.cls[j] == Cls::kOther) {
      size_t e = RunOf(j, Cls::kOther);
      while (e < n_ && IsCrLf(e)) ++e;
      return e;
    }
    // Only white space is left. \s*[\r\n]+: \s* takes the whole run, then gives back until
    // [\r\n]+ matches, i.e. the match ends after the run's last \r or \n.
    const size_t run = RunOf(i, Cls::kSpace);
    for (size_t k = run; k > i; --k) {
      if (IsCrLf(k - 1)) return k;
    }
    return Spaces(i);
  }

 private:
  bool IsCrLf(size_t i) const { return c_.cp[i] == '\r' || c_.cp[i] == '\n'; }

  // The end of the run of class `cls` from i (c_.cls[i] == cls).
  size_t RunOf(size_t i, Cls cls) const {
    size_t e = i + 1;
    while (e < n_ && c_.cls[e] == cls) ++e;
    return e;
  }

  // \s+(?!\S)|\s+ at a white-space character: the run, less its last character when a
  // non-space follows and the run is longer than one.
  size_t Spaces(size_t i) const {
    const size_t e = RunOf(i, Cls::kSpace);
    return (e < n_ && e - i > 1) ? e - 1 : e;
  }

  // 's|'t|'re|'ve|'m|'ll|'d at i: its end, or 0. With `fold`, case-insensitive under simple
  // case folding: A-Z, and U+017F (long s) for s.
  size_t Contraction(size_t i, bool fold) const {
    if (c_.cp[i] != '\'' || i + 1 >= n_) return 0;
    const auto lower = [&](size_t k) -> char32_t {
      const char32_t cp = c_.cp[k];
      if (!fold) return cp;
      if (cp >= 'A' && cp <= 'Z') return cp + ('a' - 'A');
      if (cp == 0x17F) return 's';
      return cp;
    };
    const char32_t a = lower(i + 1);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if (i + 2 >= n_) return 0;
    const char32_t b = lower(i + 2);
    if (((a == 'r' || a == 'v') && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
    return 0;
  }

  const Chars& c_;
  const size_t n_;
};

// [\p{P}\$\+<=>\^~\|] of llama.cpp's default pre-tokenizer: ASCII punctuation and symbols
// but `, and every other punctuation character.
bool IsDefaultPunct(char32_t cp) {
  if (cp < 0x80) {
    const bool alnum = (cp >= '0' && cp <= '9') || ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z');
    return cp > ' ' && cp < 0x7F && cp != '`' && !alnum;
  }
  return cp != kInvalid && u_ispunct(static_cast<UChar32>(cp));
}

// Calls f(b', e') for each longest run of characters of [b, e) on which pred(k) agrees.
template <typename Pred, typename F>
void ForEachRun(size_t b, size_t e, const Pred& pred, const F& f) {
  while (b < e) {
    const bool v = pred(b);
    size_t r = b + 1;
    while (r < e && pred(r) == v) ++r;
    f(b, r);
    b = r;
  }
}

// llama.cpp's default pre-tokenizer (tokenizer.h): emit(b, e) gets each word's characters.
template <typename Emit>
void DefaultWords(const Chars& c, const Emit& emit) {
  const auto punct = [&](size_t k) { return IsDefaultPunct(c.cp[k]); };
  const auto number = [&](size_t k) { return c.cls[k] == Cls::kNumber; };
  const auto digit = [&](size_t k) { return c.cp[k] >= '0' && c.cp[k] <= '9'; };
  // [0-9][0-9][0-9] in [b, e): the leftmost three ASCII digits, again after them, and the
  // text between.
  const auto triples = [&](size_t b, size_t e) {
    size_t start = b;
    for (size_t k = b; k + 3 <= e;) {
      if (!digit(k) || !digit(k + 1) || !digit(k + 2)) {
        ++k;
        continue;
      }
      if (k > start) emit(start, k);
      emit(k, k + 3);
      start = k += 3;
    }
    if (e > start) emit(start, e);
  };
  ForEachRun(0, c.cp.size(), punct, [&](size_t b, size_t e) {
    // GPT-2's regex within the piece (which ends the text for it), then \p{N}+ (runs of
    // numbers and the text between) and the triples within each of its words.
    const Matcher m(c, e);
    for (size_t i = b; i < e;) {
      const size_t w = m.Gpt2(i);
      ForEachRun(i, w, number, triples);
      i = w;
    }
  });
}

// ---------------------------------------------------------------- GPT-2's byte alphabet

struct ByteAlphabet {
  std::array<char32_t, 256> to_cp{};
  std::array<int16_t, 0x144> to_byte{};  // -1 where the code point is no byte's

  ByteAlphabet() {
    to_byte.fill(-1);
    char32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool printable =
          (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_cp[b] = printable ? static_cast<char32_t>(b) : next++;
      to_byte[to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteAlphabet& Alphabet() {
  static const ByteAlphabet* const alphabet = new ByteAlphabet();
  return *alphabet;
}

// A token string (in the byte alphabet) → its raw bytes; false when it is not valid UTF-8
// or has a code point outside the alphabet (*bad gets it, or kInvalid).
bool FromByteAlphabet(std::string_view s, std::string* bytes, char32_t* bad) {
  const ByteAlphabet& a = Alphabet();
  bytes->clear();
  for (size_t i = 0; i < s.size();) {
    size_t len;
    const char32_t cp = DecodeUtf8(s, i, &len);
    if (cp == kInvalid || cp >= a.to_byte.size() || a.to_byte[cp] < 0) {
      *bad = cp;
      return false;
    }
    *bytes += static_cast<char>(a.to_byte[cp]);
    i += len;
  }
  return true;
}

// A token string for an error message: escaped, and cut at 40 bytes.
std::string Quote(std::string_view s) {
  constexpr size_t kMax = 40;
  std::string q = absl::CHexEscape(absl::string_view(s.data(), std::min(s.size(), kMax)));
  return absl::StrCat("\"", q, s.size() > kMax ? "\"..." : "\"");
}

bool IsByteLevelType(int32_t type) { return type != kTokenControl && type != kTokenUserDefined; }

}  // namespace

absl::StatusOr<PreTokenizer> ParsePreTokenizer(std::string_view name) {
  if (name == "gpt-2") return PreTokenizer::kGpt2;
  if (name == "llama-bpe" || name == "llama3" || name == "llama-v3" || name == "smaug-bpe") {
    return PreTokenizer::kLlama3;
  }
  if (name == "qwen2") return PreTokenizer::kQwen2;
  if (name == "default") return PreTokenizer::kDefault;
  return absl::InvalidArgumentError(absl::StrFormat(
      "tokenizer.pre = %s: unsupported pre-tokenizer; supported: default, gpt-2, llama-bpe "
      "(also llama3, llama-v3, smaug-bpe), qwen2",
      Quote(name)));
}

bool IgnoresMerges(std::string_view name) {
  return name == "llama-bpe" || name == "llama3" || name == "llama-v3";
}

std::vector<std::string_view> PreTokenize(PreTokenizer kind, std::string_view text) {
  std::vector<std::string_view> words;
  if (text.empty()) return words;
  const Chars c = Split(text);
  const auto emit = [&](size_t b, size_t e) {
    words.push_back(text.substr(c.off[b], c.off[e] - c.off[b]));
  };
  if (kind == PreTokenizer::kDefault) {
    DefaultWords(c, emit);
    return words;
  }
  const Matcher m(c);
  const size_t n = c.cp.size();
  for (size_t i = 0; i < n;) {
    size_t e;
    switch (kind) {
      case PreTokenizer::kGpt2:
        e = m.Gpt2(i);
        break;
      case PreTokenizer::kLlama3:
        e = m.Llama3(i, 3);
        break;
      case PreTokenizer::kQwen2:
      default:
        e = m.Llama3(i, 1);
        break;
    }
    emit(i, e);
    i = e;
  }
  return words;
}

std::string ToByteAlphabet(std::string_view bytes) {
  const ByteAlphabet& a = Alphabet();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char b : bytes) AppendUtf8(a.to_cp[static_cast<uint8_t>(b)], out);
  return out;
}

// ---------------------------------------------------------------- Tokenizer

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Create(TokenizerSpec spec) {
  if (spec.model != "gpt2") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tokenizer.model = %s: unsupported; only \"gpt2\" (byte-level BPE) is supported%s",
        Quote(spec.model),
        spec.model == "llama" ? " (\"llama\" is SentencePiece, which is not)" : ""));
  }
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  auto pre = ParsePreTokenizer(spec.pre);
  if (!pre.ok()) return pre.status();
  t->pre_kind_ = *pre;
  t->ignore_merges_ = IgnoresMerges(spec.pre);
  t->pre_ = std::move(spec.pre);

  const std::vector<std::string>& tokens = spec.tokens;
  if (tokens.empty() || tokens.size() > static_cast<size_t>(TokenizerSpec::kMaxTokens)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tokenizer.tokens: %d tokens; must be in [1, %d]", tokens.size(),
                        TokenizerSpec::kMaxTokens));
  }
  const auto n = static_cast<int32_t>(tokens.size());
  if (!spec.token_types.empty() && spec.token_types.size() != tokens.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tokenizer.token_types: %d types for %d tokens; must be empty or one "
                        "per token",
                        spec.token_types.size(), n));
  }
  const auto type = [&](int32_t id) {
    return spec.token_types.empty() ? kTokenNormal : spec.token_types[static_cast<size_t>(id)];
  };

  absl::flat_hash_map<std::string_view, int32_t> ids;
  ids.reserve(tokens.size());
  t->bytes_.resize(tokens.size());
  t->control_.resize(tokens.size());
  for (int32_t id = 0; id < n; ++id) {
    const std::string& s = tokens[static_cast<size_t>(id)];
    const int32_t ty = type(id);
    if (ty < kTokenUndefined || ty > kTokenByte) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tokenizer.token_types[%d] = %d: must be in [0, 6]", id, ty));
    }
    const auto [it, inserted] = ids.emplace(s, id);
    if (!inserted) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tokenizer.tokens[%d] = %s: duplicates tokens[%d]; token strings "
                          "must be unique",
                          id, Quote(s), it->second));
    }
    std::string& bytes = t->bytes_[static_cast<size_t>(id)];
    if (ty == kTokenControl) {
      t->control_[static_cast<size_t>(id)] = 1;
    } else if (ty == kTokenUserDefined) {
      bytes = s;
    } else if (char32_t bad; !FromByteAlphabet(s, &bytes, &bad)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tokenizer.tokens[%d] = %s (type %d): %s is not in GPT-2's byte alphabet",
                          id, Quote(s), ty,
                          bad == kInvalid ? std::string("invalid UTF-8")
                                          : absl::StrFormat("U+%04X", static_cast<uint32_t>(bad))));
    }
    if ((ty == kTokenControl || ty == kTokenUserDefined) && !s.empty()) {
      t->specials_.push_back({s, id});
    }
  }

  // The byte-alphabet token of a string, or -1 (absent, or control / user-defined).
  const auto byte_level = [&](std::string_view s) {
    const auto it = ids.find(s);
    return it != ids.end() && IsByteLevelType(type(it->second)) ? it->second : -1;
  };
  for (int b = 0; b < 256; ++b) {
    const std::string symbol = ToByteAlphabet(std::string(1, static_cast<char>(b)));
    const int32_t id = byte_level(symbol);
    if (id < 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tokenizer.tokens: no token for byte 0x%02X (%s); a byte-level BPE vocabulary needs "
          "all 256 byte tokens (not control or user-defined)",
          b, Quote(symbol)));
    }
    t->byte_token_[static_cast<size_t>(b)] = id;
  }
  if (t->ignore_merges_) {
    // Byte-level token strings are unique, and so are their bytes.
    t->whole_.reserve(tokens.size());
    for (int32_t id = 0; id < n; ++id) {
      if (IsByteLevelType(type(id))) t->whole_.emplace(t->bytes_[static_cast<size_t>(id)], id);
    }
  }

  if (spec.merges.size() > static_cast<size_t>(TokenizerSpec::kMaxMerges)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tokenizer.merges: %d merges; at most %d", spec.merges.size(), TokenizerSpec::kMaxMerges));
  }
  t->merges_.reserve(spec.merges.size());
  std::string joined;
  for (size_t r = 0; r < spec.merges.size(); ++r) {
    const std::string_view m = spec.merges[r];
    const size_t space = m.find(' ');
    if (space == std::string_view::npos || space == 0 || space + 1 == m.size() ||
        m.find(' ', space + 1) != std::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tokenizer.merges[%d] = %s: must be \"A B\" (two non-empty parts "
                          "separated by one space)",
                          r, Quote(m)));
    }
    const std::string_view a = m.substr(0, space), b = m.substr(space + 1);
    joined.assign(a);
    joined.append(b);
    const int32_t ia = byte_level(a), ib = byte_level(b), ij = byte_level(joined);
    if (ia < 0 || ib < 0 || ij < 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tokenizer.merges[%d] = %s: %s is not a token of the byte alphabet", r, Quote(m),
          Quote(ia < 0   ? a
                : ib < 0 ? b
                         : std::string_view(joined))));
    }
    t->merges_.try_emplace(PairKey(ia, ib), Merge{static_cast<int32_t>(r), ij});
  }

  for (const auto& [name, v] : {std::pair<const char*, int32_t>{"bos", spec.bos},
                                std::pair<const char*, int32_t>{"eos", spec.eos}}) {
    if (v < -1 || v >= n) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tokenizer.%s = %d: must be -1 (none) or a token id in [0, %d)", name, v, n));
    }
  }
  if (spec.add_bos && spec.bos < 0) {
    return absl::InvalidArgumentError("tokenizer.add_bos = true: needs a bos token (bos = -1)");
  }
  t->bos_ = spec.bos;
  t->eos_ = spec.eos;
  t->add_bos_ = spec.add_bos;

  std::stable_sort(
      t->specials_.begin(), t->specials_.end(),
      [](const Special& x, const Special& y) { return x.text.size() > y.text.size(); });
  for (const Special& s : t->specials_) {
    t->special_first_byte_[static_cast<uint8_t>(s.text[0])] = true;
  }
  return t;
}

bool Tokenizer::IsControl(int32_t id) const {
  return id >= 0 && id < vocab_size() && control_[static_cast<size_t>(id)] != 0;
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_special,
                                       bool parse_special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 2);
  if (add_special && add_bos_) out.push_back(bos_);
  WordCache cache;
  if (!parse_special || specials_.empty()) {
    EncodeSpan(text, cache, out);
    return out;
  }
  size_t start = 0;
  for (size_t i = 0; i < text.size();) {
    int32_t id;
    const size_t len = MatchSpecial(text, i, &id);
    if (len == 0) {
      ++i;
      continue;
    }
    EncodeSpan(text.substr(start, i - start), cache, out);
    out.push_back(id);
    i += len;
    start = i;
  }
  EncodeSpan(text.substr(start), cache, out);
  return out;
}

size_t Tokenizer::MatchSpecial(std::string_view text, size_t pos, int32_t* id) const {
  if (!special_first_byte_[static_cast<uint8_t>(text[pos])]) return 0;
  const std::string_view rest = text.substr(pos);
  for (const Special& s : specials_) {  // longest first
    if (rest.starts_with(s.text)) {
      *id = s.id;
      return s.text.size();
    }
  }
  return 0;
}

void Tokenizer::EncodeSpan(std::string_view span, WordCache& cache,
                           std::vector<int32_t>& out) const {
  for (std::string_view word : PreTokenize(pre_kind_, span)) EncodeWord(word, cache, out);
}

void Tokenizer::EncodeWord(std::string_view word, WordCache& cache,
                           std::vector<int32_t>& out) const {
  if (word.size() == 1) {
    out.push_back(byte_token_[static_cast<uint8_t>(word[0])]);
    return;
  }
  if (const auto whole = whole_.find(word); whole != whole_.end()) {  // ignore_merges
    out.push_back(whole->second);
    return;
  }
  auto it = cache.find(word);
  if (it == cache.end()) it = cache.emplace(word, Bpe(word)).first;
  out.insert(out.end(), it->second.begin(), it->second.end());
}

std::vector<int32_t> Tokenizer::Bpe(std::string_view word) const {
  // The symbols: a linked list over the word's bytes, each a token id (-1 once merged into
  // its left neighbour). A candidate is an adjacent pair with a rank; the heap pops the
  // lowest rank, leftmost first. A candidate is stale once either symbol changed: a symbol's
  // id only ever changes to a longer token's, so comparing ids is enough.
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
  };
  struct Candidate {
    int32_t rank;
    int32_t left;
    int32_t left_id;
    int32_t right_id;
    int32_t result;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  const auto n = static_cast<int32_t>(word.size());
  std::vector<Symbol> sym(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    sym[static_cast<size_t>(i)] = {byte_token_[static_cast<uint8_t>(word[static_cast<size_t>(i)])],
                                   i - 1, i + 1 < n ? i + 1 : -1};
  }
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  const auto consider = [&](int32_t left) {
    const Symbol& l = sym[static_cast<size_t>(left)];
    if (l.next < 0) return;
    const int32_t right_id = sym[static_cast<size_t>(l.next)].id;
    const auto it = merges_.find(PairKey(l.id, right_id));
    if (it != merges_.end()) {
      heap.push({it->second.rank, left, l.id, right_id, it->second.result});
    }
  };
  for (int32_t i = 0; i + 1 < n; ++i) consider(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    Symbol& l = sym[static_cast<size_t>(c.left)];
    if (l.id != c.left_id || l.next < 0) continue;
    Symbol& r = sym[static_cast<size_t>(l.next)];
    if (r.id != c.right_id) continue;
    l.id = c.result;
    l.next = r.next;
    r.id = -1;
    if (l.next >= 0) sym[static_cast<size_t>(l.next)].prev = c.left;
    if (l.prev >= 0) consider(l.prev);
    consider(c.left);
  }
  std::vector<int32_t> ids;
  for (int32_t i = 0; i >= 0; i = sym[static_cast<size_t>(i)].next) {
    ids.push_back(sym[static_cast<size_t>(i)].id);
  }
  return ids;
}

std::string Tokenizer::Decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id >= 0 && id < vocab_size()) out += bytes_[static_cast<size_t>(id)];
  }
  return out;
}

// ---------------------------------------------------------------- Utf8Stream

namespace {

// How many bytes at the end of `s` are an incomplete character that more bytes could still
// complete (0 to 3).
size_t IncompleteTail(std::string_view s) {
  for (size_t back = 1; back <= 3 && back <= s.size(); ++back) {
    const auto b0 = static_cast<uint8_t>(s[s.size() - back]);
    if ((b0 & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    size_t n;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
      n = 2;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      n = 3;
      if (b0 == 0xE0) lo = 0xA0;
      if (b0 == 0xED) hi = 0x9F;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      n = 4;
      if (b0 == 0xF0) lo = 0x90;
      if (b0 == 0xF4) hi = 0x8F;
    } else {
      return 0;  // ASCII, or a byte no character starts with
    }
    if (back >= n) return 0;  // complete (or too long: invalid either way)
    if (back >= 2) {
      const auto b1 = static_cast<uint8_t>(s[s.size() - back + 1]);
      if (b1 < lo || b1 > hi) return 0;
    }
    return back;
  }
  return 0;
}

}  // namespace

std::string Utf8Stream::Push(std::string_view bytes) {
  pending_.append(bytes);
  const size_t keep = IncompleteTail(pending_);
  std::string out = pending_.substr(0, pending_.size() - keep);
  pending_.erase(0, pending_.size() - keep);
  return out;
}

std::string Utf8Stream::Flush() {
  std::string out = std::move(pending_);
  pending_.clear();
  return out;
}

}  // namespace kvtier::engine
