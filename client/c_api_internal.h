// What the C API's source files (c_api.cc: sessions of kvtierd; c_api_local.cc: in-process
// sequences) share: the thread's last error and the guard every entry point runs in, so no
// exception crosses the boundary. Internal.
#ifndef KVTIER_CLIENT_C_API_INTERNAL_H_
#define KVTIER_CLIENT_C_API_INTERNAL_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "kvtier/c_api.h"
#include "kvtier/geometry.h"
#include "kvtier/options.h"
#include "kvtier/sequence.h"

namespace kvtier::c_api {

// kvtier_last_error()'s text, per thread.
inline thread_local std::string last_error;

inline int Report(const absl::Status& st) {
  if (st.ok()) {
    last_error.clear();
  } else {
    last_error = std::string(st.message());
  }
  return static_cast<int>(st.code());
}

inline int InvalidArgument(const char* what) { return Report(absl::InvalidArgumentError(what)); }

// Runs `f` (returning absl::Status), turning exceptions into statuses.
template <typename F>
int Guard(F&& f) {
  try {
    return Report(f());
  } catch (const std::bad_alloc&) {
    return Report(absl::ResourceExhaustedError("out of memory"));
  } catch (const std::exception& e) {
    return Report(absl::InternalError(e.what()));
  } catch (...) {
    return Report(absl::InternalError("unknown exception"));
  }
}

// The first ABI's option structs end with these fields and have no trailing padding, so a
// field a later header adds starts at sizeof (the size this library knows): a struct_size
// past it is a newer header's struct. A field added here moves the sizeof, not the minimum.
inline constexpr size_t kClientOptionsMinSize =
    offsetof(kvtier_client_options, max_message_bytes) + sizeof(uint64_t);
inline constexpr size_t kSessionOptionsMinSize =
    offsetof(kvtier_session_options, recent_pages) + sizeof(int32_t);
inline constexpr size_t kSequenceOptionsMinSize =
    offsetof(kvtier_sequence_options, recent_pages) + sizeof(int32_t);
static_assert(sizeof(kvtier_client_options) == kClientOptionsMinSize &&
                  sizeof(kvtier_session_options) == kSessionOptionsMinSize &&
                  sizeof(kvtier_sequence_options) == kSequenceOptionsMinSize,
              "an option struct has trailing padding, or grew: a new field goes at the end and "
              "the static_assert names the new last field");

// The caller's option struct `in` as this library's (the rule is "ABI" in kvtier/c_api.h):
// its first struct_size bytes over the defaults `init` (the struct's _init function) writes.
// INVALID_ARGUMENT naming `name` for struct_size 0, below `min_size`, or with a non-zero byte
// past what this library knows.
template <typename T>
absl::StatusOr<T> ReadOptions(const T& in, void (*init)(T*), size_t min_size, const char* name) {
  T defaults;
  init(&defaults);
  const size_t size = in.struct_size;
  if (size == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s.struct_size = 0: fill the struct with %s_init, which sets it", name, name));
  }
  if (size < min_size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s.struct_size = %d: the smallest %s this library reads is %d bytes", name, size, name,
        min_size));
  }
  const auto* bytes = reinterpret_cast<const unsigned char*>(&in);
  for (size_t i = sizeof(T); i < size; ++i) {
    if (bytes[i] != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s.struct_size = %d sets a field this library does not know (byte %d; it knows %d "
          "bytes, C ABI %d): build against the header of the libkvtier you load",
          name, size, i, sizeof(T), KVTIER_ABI_VERSION));
    }
  }
  std::memcpy(&defaults, &in, std::min(size, sizeof(T)));
  defaults.struct_size = static_cast<uint32_t>(sizeof(T));
  return defaults;
}

// The C geometry as the C++ one: only the dtype is C's to check (the rest is
// Geometry::Validate's, where the geometry is used).
inline absl::StatusOr<Geometry> GeometryFromC(const kvtier_geometry& c) {
  Geometry g;
  g.num_layers = c.num_layers;
  g.num_q_heads = c.num_q_heads;
  g.num_kv_heads = c.num_kv_heads;
  g.head_dim = c.head_dim;
  g.page_size = c.page_size;
  switch (c.dtype) {
    case KVTIER_DTYPE_F16:
      g.dtype = DType::kF16;
      break;
    case KVTIER_DTYPE_BF16:
      g.dtype = DType::kBF16;
      break;
    case KVTIER_DTYPE_F32:
      g.dtype = DType::kF32;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("geometry.dtype = %d: must be a KVTIER_DTYPE_*", c.dtype));
  }
  return g;
}

// The C policies as the C++ ones: only their C form is checked here (params as "key=value",
// each key once); the names and values are the policy registry's to judge where the sequence
// is made, with the message every entry point gives.
inline absl::StatusOr<PolicyConfig> PolicyFromC(const kvtier_policy_options& c) {
  PolicyConfig p;
  if (c.budget != nullptr) p.budget = c.budget;
  if (c.residency != nullptr) p.residency = c.residency;
  if (c.host_drop != nullptr) p.host_drop = c.host_drop;
  if (c.num_params < 0 || (c.num_params > 0 && c.params == nullptr)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "policy.num_params = %d: must be >= 0, with policy.params holding that many strings",
        c.num_params));
  }
  for (int32_t i = 0; i < c.num_params; ++i) {
    const char* kv = c.params[i];
    const char* eq = kv == nullptr ? nullptr : std::strchr(kv, '=');
    if (eq == nullptr || eq == kv) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "policy.params[%d] = '%s': must be \"<policy>.<name>=<value>\"", i,
          kv == nullptr ? "(null)" : kv));
    }
    std::string key(kv, eq);
    if (!p.params.emplace(key, std::string(eq + 1)).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("policy.params[%d]: '%s' is given twice", i, key));
    }
  }
  return p;
}

// The C options' split (`split` 0: the library's, as SetBudgetTokens left it; 1: these
// sink and recent pages, the rest selected) applied to `o`, which holds the budget.
inline absl::Status SplitFromC(int32_t split, int32_t sink, int32_t recent, SequenceOptions& o) {
  if (split != 0 && split != 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "split = %d: must be 0 (the library's split of budget_tokens) or 1 (sink_pages and "
        "recent_pages)",
        split));
  }
  return split == 1 ? o.SplitBudget(sink, recent) : absl::OkStatus();
}

// The C signals as the C++ ones (spans over the caller's arrays): only their C form is
// checked here (sizes given with their pointers); the rest is the sequence's to judge.
inline absl::StatusOr<StepSignals> SignalsFromC(const kvtier_step_signals& c, const char* what) {
  if (c.vocab < 0 || (c.vocab > 0) != (c.logits != nullptr)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: vocab = %d with %s logits: give both or neither", what, c.vocab,
        c.logits == nullptr ? "no" : "non-null"));
  }
  if (c.num_tokens < 1 || c.num_layers < 0 || (c.num_layers > 0) != (c.hidden_delta != nullptr)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: num_tokens = %d must be >= 1, and num_layers = %d > 0 exactly when hidden_delta "
        "is given",
        what, c.num_tokens, c.num_layers));
  }
  StepSignals s;
  s.first_position = c.first_position;
  s.num_tokens = c.num_tokens;
  if (c.logits != nullptr) s.logits = {c.logits, static_cast<size_t>(c.vocab)};
  if (c.hidden_delta != nullptr) {
    s.hidden_delta = {c.hidden_delta, static_cast<size_t>(c.num_tokens) * c.num_layers};
    s.num_layers = c.num_layers;
  }
  return s;
}

// A step's slot table [Hkv][S] into the caller's `table` of `capacity` entries (*num_slots
// set first when given; nothing copied for a null table): OUT_OF_RANGE naming `capacity_name`
// when it does not fit.
inline absl::Status CopySlotTable(const StepStats& step, int32_t* num_slots, int32_t* table,
                                  size_t capacity, const char* capacity_name) {
  if (num_slots != nullptr) *num_slots = step.num_slots;
  if (table == nullptr) return absl::OkStatus();
  if (capacity < step.slot_table.size()) {
    return absl::OutOfRangeError(
        absl::StrFormat("%s = %d entries; the slot table has num_kv_heads x num_slots = %d",
                        capacity_name, capacity, step.slot_table.size()));
  }
  std::memcpy(table, step.slot_table.data(), step.slot_table.size() * sizeof(int32_t));
  return absl::OkStatus();
}

}  // namespace kvtier::c_api

#endif  // KVTIER_CLIENT_C_API_INTERNAL_H_
