// The decoder: a Llama-family forward pass whose attention reads and writes through kvtier
// sequences (docs/architecture.md#the-engine). Prefill runs the prompt in chunks with
// causal attention over the prompt (the engine's own, as every engine does) and appends
// each chunk's K/V to the sequence; a decode step appends the new token's K/V and, per
// layer, drives the sequence as an engine does: BeginStep → attention over the working set
// → EndStep on a LocalSequence, Decode on a remote one. Several sequences decode as one
// batch: one matrix product per weight for the whole batch; attention is one BeginStep →
// Attend → EndStep for the batch when they are members of one SequenceBatch, else per sequence.
//
// The same forward also runs over a plain dense KV cache of its own (DenseKv): the
// baseline "dense decoder loop" kvtier is compared with, and the prefill's scratch.
//
// Thread-compatible: one thread drives a Decoder (and its sequences) at a time.
#ifndef KVTIER_ENGINE_DECODER_H_
#define KVTIER_ENGINE_DECODER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/math.h"
#include "engine/model.h"
#include "kvtier/sequence.h"

namespace kvtier::engine {

// One layer's rows of a forward pass, after RoPE, in host memory (F32): what an observer
// (kvtier-run eval and trace) sees. Rows are the prompt chunk's tokens, or the decode batch's
// sequences in order.
struct LayerRows {
  int32_t layer = 0;
  int64_t rows = 0;
  const int32_t* positions = nullptr;  // [rows]
  const float* q = nullptr;            // [rows][Hq][d]
  const float* k = nullptr;            // [rows][Hkv][d]
  const float* v = nullptr;            // [rows][Hkv][d]
};

struct DecoderOptions {
  DType kv_dtype = DType::kF16;  // of the K/V (and q) handed to kvtier
  int32_t prefill_chunk = 256;   // prompt tokens per forward pass
  int32_t max_batch = 16;        // sequences per decode step
  // Prompt queries given to ObserveQueries after prefill (policies that read attention).
  int32_t observe_window = 32;
  // Report each step's next-token logits to the sequences' policies (ReportSignals).
  bool report_logits = true;
  // Report each token's hidden-state change per layer, ‖h_l(t) − h_l(t−1)‖ with h_l the
  // residual stream after layer l (0 for a sequence's first token), to the sequences'
  // policies (StepSignals::hidden_delta: EpiKV). Computed on the device; per local sequence
  // the decoder keeps the last h_l of every layer until Forget().
  bool report_hidden_delta = true;
};

// Called for every layer of every forward pass (prefills and steps, dense ones too) with its
// rows: evaluation and trace dumps only — it costs a copy to the host and a wait per layer.
// An error stops the pass.
using LayerObserver = std::function<absl::Status(const LayerRows&)>;

// A dense F32 KV cache in device memory: K and V [layers][capacity][Hkv][d].
class DenseKv {
 public:
  static absl::StatusOr<std::unique_ptr<DenseKv>> Create(const LlamaConfig& config, Device& device,
                                                         int64_t capacity);
  int64_t capacity() const { return capacity_; }
  int64_t length() const { return length_; }
  int64_t bytes() const { return static_cast<int64_t>(k_.size() + v_.size()); }
  float* k(int32_t layer, int64_t pos) { return k_.as<float>() + (layer * capacity_ + pos) * row_; }
  float* v(int32_t layer, int64_t pos) { return v_.as<float>() + (layer * capacity_ + pos) * row_; }
  void set_length(int64_t n) { length_ = n; }

 private:
  DeviceBuffer k_, v_;
  int64_t capacity_ = 0;
  int64_t row_ = 0;  // Hkv·d
  int64_t length_ = 0;
};

// A prompt's prefill, kept so that more sequences start from the same prompt without the
// model running again (kvtier-run eval runs every variant from one prompt): the prompt's K/V
// (F32, device memory), its observed queries, hidden-state changes, logits and last hidden
// states. The first Prefill given an empty record fills it; a Prefill of the same ids given
// the filled record replays it, handing the sequence exactly the calls the first one made
// (Append per chunk and layer, ReportSignals, ObserveQueries) in the same order, so the
// sequence and its policies start from the same state without a forward pass.
class PrefillRecord {
 public:
  bool empty() const { return ids_.empty(); }
  const std::vector<int32_t>& ids() const { return ids_; }
  void Clear();

 private:
  friend class Decoder;
  std::vector<int32_t> ids_;
  std::unique_ptr<DenseKv> kv_;
  DeviceBuffer observe_;  // [layers][window][Hq][d], KV dtype
  int64_t window_ = 0;
  std::vector<float> delta_;  // [n][layers], when the decoder reports hidden deltas
  std::vector<float> logits_;
  DeviceBuffer last_hidden_;  // [layers][dim], when it does
};

class Decoder {
 public:
  // REQUIRES: config, weights and math outlive the decoder.
  // `stream` is the one `math` is ordered on: the sequences' compute stream.
  static absl::StatusOr<std::unique_ptr<Decoder>> Create(const LlamaConfig& config,
                                                         const LlamaWeights& weights, Math& math,
                                                         Stream& stream,
                                                         const DecoderOptions& options);

  const LlamaConfig& config() const { return config_; }
  const DecoderOptions& options() const { return options_; }

  // Runs `ids` (the whole prompt, at positions 0 ..) through the model and appends every
  // layer's K/V to `seq` (which must be empty); `logits` gets the next-token logits after
  // the last prompt token [vocab]. `progress(done, total)` after each chunk.
  // With `record`: fills it when it is empty; replays it (no forward pass) when it holds the
  // same ids (INVALID_ARGUMENT when it holds others). Records only for a LocalSequence.
  absl::Status Prefill(Sequence& seq, const std::vector<int32_t>& ids, std::vector<float>* logits,
                       const std::function<void(int64_t, int64_t)>& progress = {},
                       PrefillRecord* record = nullptr);
  // The same over the dense cache `kv` (its length grows by ids.size()).
  absl::Status PrefillDense(DenseKv& kv, const std::vector<int32_t>& ids,
                            std::vector<float>* logits,
                            const std::function<void(int64_t, int64_t)>& progress = {});

  // One decode step of a batch: token[b] at position seqs[b]->num_tokens(0); logits
  // [B][vocab].
  absl::Status Step(const std::vector<Sequence*>& seqs, const std::vector<int32_t>& tokens,
                    std::vector<float>* logits);
  // One decode step over the dense cache (batch 1).
  absl::Status StepDense(DenseKv& kv, int32_t token, std::vector<float>* logits);

  // Installs (or, with an empty function, removes) the layer observer.
  void SetLayerObserver(LayerObserver observer) { observer_ = std::move(observer); }

  // Drops what the decoder keeps for `seq` (its last hidden states); call before the
  // sequence is destroyed.
  void Forget(const Sequence* seq) { last_hidden_.erase(seq); }

 private:
  Decoder(const LlamaConfig& config, const LlamaWeights& weights, Math& math, Stream& stream,
          const DecoderOptions& options)
      : config_(config), weights_(weights), math_(math), stream_(stream), options_(options) {}
  absl::Status Init();

  // Attention of layer l for the m rows of q_, k_, v_ (RoPE applied) into attn_.
  using AttentionFn = std::function<absl::Status(int32_t layer, int64_t m)>;
  // After layer l: its output rows x (the residual stream, device memory).
  using AfterLayerFn = std::function<absl::Status(int32_t layer, const float* x)>;
  // The forward pass of m rows (ids_ and positions_ uploaded); with `k_rows`/`v_rows`
  // non-null, layer l's K/V rows are written at k_rows(l) instead of k_. Logits of the
  // last `logit_rows` rows into `logits`; with `after_layer`, delta_'s m rows into
  // host_delta_ too.
  absl::Status Forward(int64_t m, const std::function<float*(int32_t)>& k_rows,
                       const std::function<float*(int32_t)>& v_rows, const AttentionFn& attention,
                       const AfterLayerFn& after_layer, int64_t logit_rows,
                       std::vector<float>* logits);
  // Hands layer l's rows to the observer (copied to the host).
  absl::Status Observe(int32_t layer, int64_t m, const float* k, const float* v);
  // The hidden-state change of rows [0, m) of x for layer l into delta_ [m][L]: rows
  // follow each other (a prompt chunk) after `prev` (the sequence's last h_l, which then
  // becomes x's last row); first_token: row 0 is the sequence's first (change 0).
  absl::Status HiddenDelta(int32_t layer, const float* x, int64_t m, float* prev, int64_t row0,
                           bool first_token);
  // Reports the m rows of host_delta_ (Forward brought them back) to `seq`.
  absl::Status ReportHiddenDelta(Sequence& seq, int64_t first_position, int64_t m);
  // The observation window of `layer` (n query rows in the KV dtype, engine memory) to `seq`,
  // staged through host memory for a remote sequence on a device the host cannot read.
  absl::Status Observe(Sequence& seq, int32_t layer, const void* q, int64_t n,
                       int64_t first_position);
  // The sequence's last-hidden buffer [L][dim] (created on first use).
  absl::StatusOr<float*> LastHidden(const Sequence* seq);
  absl::Status PrefillInto(Sequence* seq, DenseKv& kv, const std::vector<int32_t>& ids,
                           std::vector<float>* logits,
                           const std::function<void(int64_t, int64_t)>& progress,
                           PrefillRecord* record = nullptr);
  // Hands `seq` what a recorded prefill handed its sequence.
  absl::Status Replay(Sequence& seq, const PrefillRecord& record, std::vector<float>* logits);
  // host_ids_ and host_positions_ into ids_ and positions_, waited for.
  absl::Status UploadStep();

  const LlamaConfig& config_;
  const LlamaWeights& weights_;
  Math& math_;
  Stream& stream_;
  const DecoderOptions options_;
  int64_t rows_ = 0;  // max(prefill_chunk, max_batch)
  // Scratch in device memory.
  DeviceBuffer ids_, positions_, x_, h_, q_, k_, v_, attn_, gate_, up_, logits_;
  DeviceBuffer q_kv_, k_kv_, v_kv_, out_kv_;  // in the KV dtype
  DeviceBuffer observe_;                      // [layers][window][Hq][d], KV dtype
  std::vector<int32_t> host_ids_, host_positions_;
  DeviceBuffer delta_;                           // [rows][layers]: hidden-state changes of a pass
  std::vector<float> host_delta_;                // its host copy
  std::vector<float> host_q_, host_k_, host_v_;  // the observer's rows
  std::unordered_map<const Sequence*, DeviceBuffer> last_hidden_;
  LayerObserver observer_;
};

}  // namespace kvtier::engine

#endif  // KVTIER_ENGINE_DECODER_H_
