// The training script's golden reference (engine/model/golden/, written by
// engine/model/train.py): the prompt, its token ids, the greedy continuation and the logits
// of the script's own forward pass. KVTIER_TEST_MODEL_DIR overrides the model directory.
#ifndef KVTIER_TESTS_ENGINE_GOLDEN_H_
#define KVTIER_TESTS_ENGINE_GOLDEN_H_

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"

namespace kvtier::testing {

inline std::string ModelDir() {
  const char* env = std::getenv("KVTIER_TEST_MODEL_DIR");
  return env != nullptr ? env : KVTIER_MODEL_DIR;
}

inline std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The integers of `"key": [ ... ]` in golden.json (flat arrays of integers only).
inline std::vector<int32_t> IntArray(const std::string& json, const std::string& key) {
  std::vector<int32_t> out;
  const size_t at = json.find("\"" + key + "\": [");
  if (at == std::string::npos) return out;
  const size_t i = json.find('[', at) + 1;
  std::stringstream ss(json.substr(i, json.find(']', i) - i));
  std::string item;
  while (std::getline(ss, item, ',')) {
    int32_t v;
    if (absl::SimpleAtoi(item, &v)) out.push_back(v);
  }
  return out;
}

struct Golden {
  std::string prompt;
  std::vector<int32_t> prompt_ids, greedy_ids, logit_steps;
  std::vector<float> logits;  // [logit_steps][vocab]
  int32_t vocab = 0;
};

inline Golden LoadGolden() {
  Golden g;
  const std::string dir = ModelDir() + "/golden/";
  g.prompt = ReadAll(dir + "prompt.txt");
  const std::string json = ReadAll(dir + "golden.json");
  g.prompt_ids = IntArray(json, "prompt_ids");
  g.greedy_ids = IntArray(json, "greedy_ids");
  g.logit_steps = IntArray(json, "logit_steps");
  const std::string raw = ReadAll(dir + "logits.f32");
  g.logits.resize(raw.size() / sizeof(float));
  std::memcpy(g.logits.data(), raw.data(), g.logits.size() * sizeof(float));
  if (!g.logit_steps.empty()) {
    g.vocab = static_cast<int32_t>(g.logits.size() / g.logit_steps.size());
  }
  return g;
}

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_ENGINE_GOLDEN_H_
