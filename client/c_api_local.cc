// The C API's in-process sequences (kvtier/c_api.h, "In-process sequences") over
// kvtier/sequence.h: devices, batches, sequences made alone (each its own batch of one), the
// batch-first step protocol. No exception crosses the boundary.
#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "client/c_api_internal.h"
#include "kvtier/c_api.h"
#include "kvtier/counters.h"
#include "kvtier/cuda.h"
#include "kvtier/device.h"
#include "kvtier/sequence.h"

// A device handle shares the device with every batch and sequence made on it, so freeing the
// handles in any order (a binding's garbage collector does) never frees it under them.
struct kvtier_device {
  std::shared_ptr<kvtier::Device> device;
};

struct kvtier_batch {
  std::shared_ptr<kvtier::Device> device;  // first: destroyed last
  // The engine's stream, adopted: declared before the batch object, so it outlives it.
  std::unique_ptr<kvtier::Stream> adopted;
  std::unique_ptr<kvtier::SequenceBatch> owned;  // null for a sequence's own batch of one
  kvtier::SequenceBatch* batch = nullptr;
  kvtier::Geometry geometry;
  // False once kvtier_batch_free ran (members ask before they hand the handle out).
  std::shared_ptr<std::atomic<bool>> alive = std::make_shared<std::atomic<bool>>(true);
};

struct kvtier_sequence {
  std::shared_ptr<kvtier::Device> device;  // first: destroyed last
  std::unique_ptr<kvtier_batch> own;  // made alone: the handle of its batch of one
  std::unique_ptr<kvtier::LocalSequence> seq;
  kvtier_batch* parent = nullptr;  // a member of kvtier_batch_create's batch
  std::shared_ptr<std::atomic<bool>> parent_alive;
  ~kvtier_sequence() {
    seq.reset();  // before its batch of one (and an adopted stream) go
    own.reset();
  }
};

namespace {

using kvtier::c_api::Guard;
using kvtier::c_api::InvalidArgument;
using kvtier::c_api::Report;

static_assert(KVTIER_RECALL_AUTO == static_cast<int>(kvtier::RecallStrategy::kAuto) &&
              KVTIER_RECALL_BATCHED_DMA == static_cast<int>(kvtier::RecallStrategy::kBatchedDma) &&
              KVTIER_RECALL_ZERO_COPY == static_cast<int>(kvtier::RecallStrategy::kZeroCopy));
static_assert(KVTIER_DEVICE_AUTO == static_cast<int>(kvtier::DeviceKind::kAuto) &&
              KVTIER_DEVICE_CPU == static_cast<int>(kvtier::DeviceKind::kCpu) &&
              KVTIER_DEVICE_CUDA == static_cast<int>(kvtier::DeviceKind::kCuda));

// The C options as SequenceOptions (the resolver judges the values when the sequence is made;
// only what C adds is checked here), adopting the engine's stream into *adopted.
absl::StatusOr<kvtier::SequenceOptions> ToSequenceOptions(const kvtier_sequence_options& given,
                                                          int32_t page_size,
                                                          kvtier::Device& device,
                                                          std::unique_ptr<kvtier::Stream>* adopted) {
  absl::StatusOr<kvtier_sequence_options> read = kvtier::c_api::ReadOptions(
      given, kvtier_sequence_options_init, kvtier::c_api::kSequenceOptionsMinSize,
      "kvtier_sequence_options");
  if (!read.ok()) return read.status();
  const kvtier_sequence_options& c = *read;
  kvtier::SequenceOptions o;
  const auto enum_value = [](const char* name, int32_t v, int32_t max) -> absl::Status {
    if (v < 0 || v > max) {
      return absl::InvalidArgumentError(absl::StrFormat("%s = %d: must be in [0, %d]", name, v, max));
    }
    return absl::OkStatus();
  };
  if (absl::Status st = enum_value("mode", c.mode, KVTIER_MODE_DROP); !st.ok()) return st;
  o.mode = static_cast<kvtier::RetrievalMode>(c.mode);
  if (c.budget_tokens != 0) {
    if (absl::Status st = o.SetBudgetTokens(c.budget_tokens, page_size); !st.ok()) return st;
  }
  if (absl::Status st = kvtier::c_api::SplitFromC(c.split, c.sink_pages, c.recent_pages, o);
      !st.ok()) {
    return st;
  }
  if (c.max_tokens != 0) o.max_tokens = c.max_tokens;
  o.correction_threshold = c.correction_threshold;
  if (absl::Status st = enum_value("correction_trigger", c.correction_trigger,
                                   KVTIER_CORRECTION_TRIGGER_MASS);
      !st.ok()) {
    return st;
  }
  o.correction_trigger = static_cast<kvtier::CorrectionTrigger>(c.correction_trigger);
  o.correction_max_loss = c.correction_max_loss;
  if (absl::Status st = enum_value("summary", c.summary, KVTIER_SUMMARY_KEY_CODES); !st.ok()) {
    return st;
  }
  o.summary = static_cast<kvtier::SummaryMode>(c.summary);
  if (absl::Status st = enum_value("recall", c.recall, KVTIER_RECALL_ZERO_COPY); !st.ok()) {
    return st;
  }
  o.recall = static_cast<kvtier::RecallStrategy>(c.recall);
  if (c.capture_graphs != 0 && c.capture_graphs != 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("capture_graphs = %d: must be 0 or 1", c.capture_graphs));
  }
  o.capture_graphs = c.capture_graphs == 1;
  absl::StatusOr<kvtier::PolicyConfig> policy = kvtier::c_api::PolicyFromC(c.policy);
  if (!policy.ok()) return policy.status();
  o.policy = *std::move(policy);
  if (c.compute_stream != nullptr) {
    if (device.kind() != kvtier::DeviceKind::kCuda) {
      return absl::InvalidArgumentError(
          "compute_stream: an engine's stream can be adopted on a CUDA device only (this one is "
          "the CPU); pass NULL");
    }
    absl::StatusOr<std::unique_ptr<kvtier::Stream>> s =
        kvtier::AdoptCudaStream(device, static_cast<cudaStream_t>(c.compute_stream));
    if (!s.ok()) return s.status();
    *adopted = *std::move(s);
    o.compute_stream = adopted->get();
  }
  return o;
}

absl::StatusOr<std::vector<kvtier::LocalSequence*>> Members(kvtier_sequence* const* members,
                                                            int32_t n, const char* what) {
  if (members == nullptr || n < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: members must be non-null and n = %d >= 1", what, n));
  }
  std::vector<kvtier::LocalSequence*> m;
  m.reserve(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    if (members[i] == nullptr || members[i]->seq == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat("%s: members[%d] is null", what, i));
    }
    m.push_back(members[i]->seq.get());
  }
  return m;
}

}  // namespace

extern "C" {

void kvtier_sequence_options_init(kvtier_sequence_options* o) {
  if (o == nullptr) return;
  std::memset(o, 0, sizeof(*o));
  o->struct_size = sizeof(*o);
  o->mode = KVTIER_MODE_SPECULATIVE;
  o->budget_tokens = kvtier::kDefaultBudgetTokens;
  o->max_tokens = kvtier::kDefaultMaxTokens;
  o->correction_threshold = kvtier::kDefaultCorrectionThreshold;
  o->correction_trigger = KVTIER_CORRECTION_TRIGGER_COSINE;
  o->correction_max_loss = kvtier::kDefaultCorrectionMaxLoss;
  o->summary = static_cast<int32_t>(kvtier::SequenceOptions().summary);
  o->recall = KVTIER_RECALL_AUTO;
}

int kvtier_device_create(int32_t kind, kvtier_device** out) {
  if (out == nullptr) return InvalidArgument("kvtier_device_create: out must be non-null");
  *out = nullptr;
  if (kind != KVTIER_DEVICE_AUTO && kind != KVTIER_DEVICE_CPU && kind != KVTIER_DEVICE_CUDA) {
    return Report(absl::InvalidArgumentError(
        absl::StrFormat("kvtier_device_create: kind = %d: must be a KVTIER_DEVICE_*", kind)));
  }
  return Guard([&]() -> absl::Status {
    absl::StatusOr<std::unique_ptr<kvtier::Device>> d =
        kvtier::CreateDevice(static_cast<kvtier::DeviceKind>(kind));
    if (!d.ok()) return absl::UnavailableError(d.status().message());
    *out = new kvtier_device{std::shared_ptr<kvtier::Device>(*std::move(d))};
    return absl::OkStatus();
  });
}

void kvtier_device_free(kvtier_device* device) { delete device; }

int32_t kvtier_device_kind(const kvtier_device* device) {
  return device == nullptr ? -1 : static_cast<int32_t>(device->device->kind());
}

int kvtier_batch_create(kvtier_device* device, const kvtier_geometry* geometry,
                        const kvtier_sequence_options* options, int32_t max_batch,
                        kvtier_batch** out) {
  if (device == nullptr || geometry == nullptr || options == nullptr || out == nullptr) {
    return InvalidArgument("kvtier_batch_create: device, geometry, options and out must be "
                           "non-null");
  }
  *out = nullptr;
  return Guard([&]() -> absl::Status {
    absl::StatusOr<kvtier::Geometry> g = kvtier::c_api::GeometryFromC(*geometry);
    if (!g.ok()) return g.status();
    auto b = std::make_unique<kvtier_batch>();
    absl::StatusOr<kvtier::SequenceOptions> o =
        ToSequenceOptions(*options, g->page_size, *device->device, &b->adopted);
    if (!o.ok()) return o.status();
    absl::StatusOr<std::unique_ptr<kvtier::SequenceBatch>> made =
        kvtier::NewSequenceBatch(*g, *o, max_batch, *device->device);
    if (!made.ok()) return made.status();
    b->owned = *std::move(made);
    b->batch = b->owned.get();
    b->device = device->device;
    b->geometry = *g;
    *out = b.release();
    return absl::OkStatus();
  });
}

int kvtier_batch_add(kvtier_batch* batch, kvtier_sequence** out) {
  if (batch == nullptr || out == nullptr) {
    return InvalidArgument("kvtier_batch_add: batch and out must be non-null");
  }
  *out = nullptr;
  return Guard([&]() -> absl::Status {
    absl::StatusOr<std::unique_ptr<kvtier::LocalSequence>> s = batch->batch->NewSequence();
    if (!s.ok()) return s.status();
    auto seq = std::make_unique<kvtier_sequence>();
    seq->seq = *std::move(s);
    seq->device = batch->device;
    seq->parent = batch;
    seq->parent_alive = batch->alive;
    *out = seq.release();
    return absl::OkStatus();
  });
}

int32_t kvtier_batch_max_batch(const kvtier_batch* batch) {
  return batch == nullptr ? 0 : batch->batch->max_batch();
}

int kvtier_batch_begin_step(kvtier_batch* batch, int32_t layer, kvtier_sequence* const* members,
                            int32_t n, const void* q, kvtier_working_set* views) {
  if (batch == nullptr) return InvalidArgument("kvtier_batch_begin_step: batch is null");
  return Guard([&]() -> absl::Status {
    absl::StatusOr<std::vector<kvtier::LocalSequence*>> m =
        Members(members, n, "kvtier_batch_begin_step");
    if (!m.ok()) return m.status();
    absl::StatusOr<std::vector<kvtier::WorkingSetView>> v = batch->batch->BeginStep(layer, *m, q);
    if (!v.ok()) return v.status();
    for (size_t i = 0; views != nullptr && i < v->size(); ++i) {
      const kvtier::WorkingSetView& w = (*v)[i];
      kvtier_working_set& c = views[i];
      std::memset(&c, 0, sizeof(c));
      c.layer = w.layer;
      c.num_slots = w.num_slots;
      c.num_tokens = w.num_tokens;
      c.k_cache = w.k_cache;
      c.v_cache = w.v_cache;
      c.slot_table = w.slot_table;
      c.partial_page = w.partial_page;
      c.partial_len = w.partial_len;
    }
    return absl::OkStatus();
  });
}

int kvtier_batch_attend(kvtier_batch* batch, int32_t layer, kvtier_sequence* const* members,
                        int32_t n, const void* q, void* out, float* lse) {
  if (batch == nullptr) return InvalidArgument("kvtier_batch_attend: batch is null");
  return Guard([&]() -> absl::Status {
    absl::StatusOr<std::vector<kvtier::LocalSequence*>> m =
        Members(members, n, "kvtier_batch_attend");
    if (!m.ok()) return m.status();
    return batch->batch->Attend(layer, *m, q, out, lse);
  });
}

int kvtier_batch_end_step(kvtier_batch* batch, int32_t layer, kvtier_sequence* const* members,
                          int32_t n, const void* q) {
  if (batch == nullptr) return InvalidArgument("kvtier_batch_end_step: batch is null");
  return Guard([&]() -> absl::Status {
    absl::StatusOr<std::vector<kvtier::LocalSequence*>> m =
        Members(members, n, "kvtier_batch_end_step");
    if (!m.ok()) return m.status();
    return batch->batch->EndStep(layer, *m, q);
  });
}

int kvtier_batch_synchronize(kvtier_batch* batch) {
  if (batch == nullptr) return InvalidArgument("kvtier_batch_synchronize: batch is null");
  return Guard([&] { return batch->batch->compute_stream().Synchronize(); });
}

int kvtier_batch_native_stream(kvtier_batch* batch, void** out) {
  if (batch == nullptr || out == nullptr) {
    return InvalidArgument("kvtier_batch_native_stream: batch and out must be non-null");
  }
  *out = nullptr;
  return Guard([&]() -> absl::Status {
    absl::StatusOr<cudaStream_t> s =
        kvtier::NativeCudaStream(batch->batch->compute_stream());
    if (!s.ok()) return s.status();
    *out = static_cast<void*>(*s);
    return absl::OkStatus();
  });
}

void kvtier_batch_free(kvtier_batch* batch) {
  if (batch == nullptr) return;
  batch->alive->store(false);
  try {
    delete batch;
  } catch (...) {
  }
}

int kvtier_sequence_create(kvtier_device* device, const kvtier_geometry* geometry,
                           const kvtier_sequence_options* options, kvtier_sequence** out) {
  if (device == nullptr || geometry == nullptr || options == nullptr || out == nullptr) {
    return InvalidArgument("kvtier_sequence_create: device, geometry, options and out must be "
                           "non-null");
  }
  *out = nullptr;
  return Guard([&]() -> absl::Status {
    absl::StatusOr<kvtier::Geometry> g = kvtier::c_api::GeometryFromC(*geometry);
    if (!g.ok()) return g.status();
    auto seq = std::make_unique<kvtier_sequence>();
    seq->own = std::make_unique<kvtier_batch>();
    absl::StatusOr<kvtier::SequenceOptions> o =
        ToSequenceOptions(*options, g->page_size, *device->device, &seq->own->adopted);
    if (!o.ok()) return o.status();
    absl::StatusOr<std::unique_ptr<kvtier::LocalSequence>> s =
        kvtier::NewLocalSequence(*g, *o, *device->device);
    if (!s.ok()) return s.status();
    seq->seq = *std::move(s);
    seq->device = device->device;
    seq->own->batch = seq->seq->batch();
    seq->own->geometry = *g;
    if (seq->own->batch == nullptr) {
      return absl::InternalError("kvtier_sequence_create: the sequence has no batch of one");
    }
    *out = seq.release();
    return absl::OkStatus();
  });
}

kvtier_batch* kvtier_sequence_batch(kvtier_sequence* sequence) {
  if (sequence == nullptr) return nullptr;
  if (sequence->own != nullptr) return sequence->own.get();
  return sequence->parent_alive != nullptr && sequence->parent_alive->load() ? sequence->parent
                                                                              : nullptr;
}

int kvtier_sequence_append(kvtier_sequence* sequence, int32_t layer, const void* k,
                           const void* v, int32_t n_tokens) {
  if (sequence == nullptr) return InvalidArgument("kvtier_sequence_append: sequence is null");
  return Guard([&] { return sequence->seq->Append(layer, k, v, n_tokens); });
}

int32_t kvtier_sequence_num_tokens(const kvtier_sequence* sequence, int32_t layer) {
  return sequence == nullptr ? 0 : sequence->seq->num_tokens(layer);
}

int kvtier_sequence_decode(kvtier_sequence* sequence, int32_t layer, const void* q, void* out,
                           float* lse) {
  if (sequence == nullptr) return InvalidArgument("kvtier_sequence_decode: sequence is null");
  return Guard([&] { return sequence->seq->Decode(layer, q, out, lse); });
}

int kvtier_sequence_report_signals(kvtier_sequence* sequence, const kvtier_step_signals* signals) {
  if (sequence == nullptr || signals == nullptr) {
    return InvalidArgument("kvtier_sequence_report_signals: sequence and signals must be non-null");
  }
  return Guard([&]() -> absl::Status {
    absl::StatusOr<kvtier::StepSignals> s =
        kvtier::c_api::SignalsFromC(*signals, "kvtier_sequence_report_signals");
    if (!s.ok()) return s.status();
    return sequence->seq->ReportSignals(*s);
  });
}

int kvtier_sequence_observe_queries(kvtier_sequence* sequence, int32_t layer, const void* q,
                                    int32_t n, int64_t first_position) {
  if (sequence == nullptr) {
    return InvalidArgument("kvtier_sequence_observe_queries: sequence is null");
  }
  return Guard([&] { return sequence->seq->ObserveQueries(layer, q, n, first_position); });
}

int kvtier_sequence_wait(kvtier_sequence* sequence) {
  if (sequence == nullptr) return InvalidArgument("kvtier_sequence_wait: sequence is null");
  return Guard([&] { return sequence->seq->Wait(); });
}

int kvtier_sequence_counter(kvtier_sequence* sequence, const char* name, int64_t* value) {
  if (sequence == nullptr || name == nullptr || value == nullptr) {
    return InvalidArgument("kvtier_sequence_counter: sequence, name and value must be non-null");
  }
  return Guard([&]() -> absl::Status {
    const std::optional<int64_t> v = kvtier::GetCounter(sequence->seq->Stats(), name);
    if (!v.has_value()) {
      return absl::NotFoundError(absl::StrFormat(
          "kvtier_sequence_counter: '%s' is not a counter (kvtier_counter_name lists them)", name));
    }
    *value = *v;
    return absl::OkStatus();
  });
}

int kvtier_sequence_last_step(kvtier_sequence* sequence, int32_t layer, int32_t* corrected_heads,
                              int32_t* num_slots, int32_t* table, size_t table_capacity) {
  if (sequence == nullptr) return InvalidArgument("kvtier_sequence_last_step: sequence is null");
  return Guard([&]() -> absl::Status {
    const kvtier::StepStats step = sequence->seq->LastStep(layer);
    if (corrected_heads != nullptr) *corrected_heads = step.corrected_heads;
    return kvtier::c_api::CopySlotTable(step, num_slots, table, table_capacity,
                                        "kvtier_sequence_last_step: table_capacity");
  });
}

int kvtier_sequence_close(kvtier_sequence* sequence) {
  if (sequence == nullptr) return InvalidArgument("kvtier_sequence_close: sequence is null");
  return Guard([&] { return sequence->seq->Close(); });
}

void kvtier_sequence_free(kvtier_sequence* sequence) {
  try {
    delete sequence;
  } catch (...) {
  }
}

int32_t kvtier_counter_count(void) { return kvtier::kNumSequenceCounters; }

const char* kvtier_counter_name(int32_t i) {
  if (i < 0 || i >= kvtier::kNumSequenceCounters) return nullptr;
  // The names are string literals (kvtier/counters.h): NUL-terminated, static storage.
  return kvtier::SequenceCounters()[static_cast<size_t>(i)].name.data();
}

}  // extern "C"
