// Generation with kvtier holding the KV cache (docs/architecture.md#the-engine): an Engine
// (model file, tokenizer, weights on the compute device, the decoder), the kvtier sequences
// it decodes over — in-process, or sessions of a running kvtierd over shared memory or
// gRPC — and the generation loop (prefill, then batched decode steps, streaming tokens).
#ifndef KVTIER_ENGINE_GENERATE_H_
#define KVTIER_ENGINE_GENERATE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/decoder.h"
#include "engine/gguf.h"
#include "engine/math.h"
#include "engine/model.h"
#include "engine/tokenizer.h"
#include "kvtier/client.h"
#include "kvtier/device.h"
#include "kvtier/sequence.h"

namespace kvtier::engine {

struct EngineOptions {
  std::string model_path;
  DeviceKind device = DeviceKind::kCpu;  // kAuto: CUDA when a GPU is usable
  int threads = 0;                       // CPU: BLAS and kvtier worker threads; 0: all cores
  DecoderOptions decoder;
};

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Open(const EngineOptions& options);
  ~Engine();

  const LlamaConfig& config() const { return config_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  Decoder& decoder() { return *decoder_; }
  Device& device() { return *device_; }
  Stream& stream() { return *stream_; }
  const GgufFile& file() const { return *file_; }
  const LlamaWeights& weights() const { return weights_; }

 private:
  Engine() = default;
  std::unique_ptr<GgufFile> file_;
  LlamaConfig config_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Math> math_;
  LlamaWeights weights_;
  std::unique_ptr<Decoder> decoder_;
};

// Where the sequences' host tier lives.
enum class Placement : uint8_t {
  kInProcess,  // NewLocalSequence: a private pinned host tier, no daemon
  kShm,        // a kvtierd session over shared memory (the sequence runs in this process)
  kGrpc,       // a kvtierd session over gRPC (host tier, working set and attention in kvtierd)
};
bool ParsePlacement(std::string_view name, Placement* out);
std::string_view PlacementName(Placement p);
bool ParseMode(std::string_view name, RetrievalMode* out);

struct SequenceSpec {
  Placement placement = Placement::kInProcess;
  SequenceOptions options;  // compute_stream is set to the engine's
  int32_t page_size = 32;
  std::string connect;  // kvtierd's address, for kShm and kGrpc
  ClientOptions client;
  std::string label = "kvtier-run";
};

// A SequenceBatch of up to max_batch in-process sequences of `spec`, for EngineSequence::Open:
// the decoder steps its members with one launch of each op per layer for the batch.
absl::StatusOr<std::unique_ptr<SequenceBatch>> EngineBatch(Engine& engine, const SequenceSpec& spec,
                                                           int32_t max_batch);

// One sequence the engine decodes over, and what owns it (a Session, or itself).
class EngineSequence {
 public:
  // `batch`: in-process sequences become members of it (SequenceBatch::NewSequence), which
  // the decoder steps together; its geometry and options must be the spec's (EngineBatch).
  static absl::StatusOr<std::unique_ptr<EngineSequence>> Open(Engine& engine,
                                                              const SequenceSpec& spec,
                                                              Client* client,
                                                              SequenceBatch* batch = nullptr);
  ~EngineSequence();
  Sequence& sequence() { return session_ ? session_->sequence() : *local_; }
  // The kvtierd session's id; empty in-process.
  std::string session_id() const { return session_ ? session_->id() : std::string(); }
  absl::Status Close();

 private:
  Engine* engine_ = nullptr;
  std::unique_ptr<LocalSequence> local_;
  std::unique_ptr<Session> session_;
};

struct GenerateOptions {
  int32_t max_new_tokens = 64;
  float temperature = 0.0f;  // 0: greedy
  int32_t top_k = 40;
  uint64_t seed = 1;
  bool stop_at_eos = true;
  // Keep the logits of every step (golden tests): [step][vocab], step 0 after the prompt.
  bool keep_logits = false;
  // The last prompt_steps tokens of each prompt go through decode steps after the prefill
  // (the working set, as kvtier decodes) instead of the prefill's full attention, as an
  // engine feeds a question after a cached context: the answer's first token then depends
  // on what the working set holds too. 0: the whole prompt is prefilled.
  int32_t prompt_steps = 0;
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated
  std::vector<std::vector<float>> logits;
  double prefill_seconds = 0;
  double decode_seconds = 0;
  int64_t prompt_tokens = 0;
  int64_t decode_steps = 0;  // batched steps
};

// Streams each generated token: (sequence index, token id).
using TokenFn = std::function<void(int32_t, int32_t)>;
using ProgressFn = std::function<void(int64_t, int64_t)>;

// Prefills each prompt into its sequence, then decodes all of them as one batch until each
// has max_new_tokens (or its EOS). One result per sequence; times are the batch's.
absl::StatusOr<std::vector<GenerateResult>> Generate(
    Engine& engine, const std::vector<Sequence*>& seqs,
    const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& options,
    const TokenFn& on_token = {}, const ProgressFn& progress = {});

// The baseline: the same model over a plain dense KV cache in the engine (batch 1).
absl::StatusOr<GenerateResult> GenerateDense(Engine& engine, const std::vector<int32_t>& prompt,
                                             const GenerateOptions& options,
                                             const TokenFn& on_token = {},
                                             const ProgressFn& progress = {});

}  // namespace kvtier::engine

#endif  // KVTIER_ENGINE_GENERATE_H_
