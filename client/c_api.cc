// The C API (kvtier/c_api.h) over kvtier::Client and kvtier::Session. No exception crosses
// the boundary: every entry point catches and reports.
#include "kvtier/c_api.h"

#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "client/c_api_internal.h"
#include "kvtier/client.h"

struct kvtier_client {
  std::unique_ptr<kvtier::Client> client;
};

struct kvtier_session {
  std::unique_ptr<kvtier::Session> session;
};

namespace {

using kvtier::c_api::Guard;
using kvtier::c_api::InvalidArgument;

// A session's calls return once the compute stream has run their work.
// Every call returns once the work that reads or writes the caller's buffers has run: the
// compute stream of a local sequence (background selection and recall go on); a remote
// sequence's calls have finished when they return.
absl::Status Synced(kvtier::Session& s, absl::Status st) {
  if (!st.ok()) return st;
  kvtier::LocalSequence* local = s.sequence().local();
  return local != nullptr ? local->compute_stream().Synchronize() : absl::OkStatus();
}

// The C enums are the C++ ones: a value passes through and the resolver judges it.
static_assert(KVTIER_MODE_SPECULATIVE == static_cast<int>(kvtier::RetrievalMode::kSpeculative) &&
              KVTIER_MODE_SYNC == static_cast<int>(kvtier::RetrievalMode::kSync) &&
              KVTIER_MODE_FULL == static_cast<int>(kvtier::RetrievalMode::kFull) &&
              KVTIER_MODE_DROP == static_cast<int>(kvtier::RetrievalMode::kDrop));
static_assert(KVTIER_CORRECTION_TRIGGER_COSINE ==
                  static_cast<int>(kvtier::CorrectionTrigger::kCosine) &&
              KVTIER_CORRECTION_TRIGGER_MASS == static_cast<int>(kvtier::CorrectionTrigger::kMass));
static_assert(KVTIER_SUMMARY_MINMAX == static_cast<int>(kvtier::SummaryMode::kMinMax) &&
              KVTIER_SUMMARY_CENTER_MAD == static_cast<int>(kvtier::SummaryMode::kCenterMad) &&
              KVTIER_SUMMARY_KEY_CODES == static_cast<int>(kvtier::SummaryMode::kKeyCodes));

// The C options as the C++ ones: only what C adds is checked here (the dtype, the transport,
// the demotion flag, the policies' C form; an int that is no enum value of the C++ type at
// all). The sequence
// options are the resolver's (kvtier::ResolveSequenceOptions), which the client runs before
// it sends, so the C API answers exactly as the C++ client and kvtierd do.
absl::StatusOr<kvtier::SessionOptions> ToSessionOptions(const kvtier_session_options& given) {
  absl::StatusOr<kvtier_session_options> read =
      kvtier::c_api::ReadOptions(given, kvtier_session_options_init,
                                 kvtier::c_api::kSessionOptionsMinSize, "kvtier_session_options");
  if (!read.ok()) return read.status();
  const kvtier_session_options& o = *read;
  kvtier::SessionOptions s;
  absl::StatusOr<kvtier::Geometry> g = kvtier::c_api::GeometryFromC(o.geometry);
  if (!g.ok()) return g.status();
  s.geometry = *g;
  // Out of uint8_t's range the cast would alias a valid value.
  if (o.mode < 0 || o.mode > 255) {
    return absl::InvalidArgumentError(
        absl::StrFormat("mode = %d: must be a KVTIER_MODE_*", o.mode));
  }
  s.sequence.mode = static_cast<kvtier::RetrievalMode>(o.mode);
  if (o.budget_tokens != 0) {
    if (absl::Status st = s.sequence.SetBudgetTokens(o.budget_tokens, g->page_size); !st.ok()) {
      return st;
    }
  }
  if (absl::Status st = kvtier::c_api::SplitFromC(o.split, o.sink_pages, o.recent_pages,
                                                  s.sequence);
      !st.ok()) {
    return st;
  }
  s.sequence.max_tokens = o.max_tokens;
  s.host_tokens = o.host_tokens;
  if (o.host_drop_demote != 0 && o.host_drop_demote != 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("host_drop_demote = %d: must be 0 or 1", o.host_drop_demote));
  }
  absl::StatusOr<kvtier::PolicyConfig> policy = kvtier::c_api::PolicyFromC(o.policy);
  if (!policy.ok()) return policy.status();
  s.sequence.policy = *std::move(policy);
  if (o.host_drop_demote == 1) {
    if (o.policy.host_drop != nullptr && s.sequence.policy.host_drop != "demote") {
      return absl::InvalidArgumentError(absl::StrFormat(
          "host_drop_demote = 1 and policy.host_drop = '%s' disagree: give one",
          s.sequence.policy.host_drop));
    }
    // Without a residency policy the oldest pages are demoted first.
    s.sequence.policy.host_drop = "demote";
  }
  s.sequence.correction_threshold = o.correction_threshold;
  if (o.correction_trigger < 0 || o.correction_trigger > 255) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "correction_trigger = %d: must be a KVTIER_CORRECTION_TRIGGER_*", o.correction_trigger));
  }
  s.sequence.correction_trigger = static_cast<kvtier::CorrectionTrigger>(o.correction_trigger);
  s.sequence.correction_max_loss = o.correction_max_loss;
  if (o.summary < 0 || o.summary > 255) {
    return absl::InvalidArgumentError(
        absl::StrFormat("summary = %d: must be a KVTIER_SUMMARY_*", o.summary));
  }
  s.sequence.summary = static_cast<kvtier::SummaryMode>(o.summary);
  if (o.transport != KVTIER_TRANSPORT_SHM && o.transport != KVTIER_TRANSPORT_GRPC) {
    return absl::InvalidArgumentError(
        absl::StrFormat("transport = %d: must be a KVTIER_TRANSPORT_*", o.transport));
  }
  s.transport = static_cast<kvtier::Transport>(o.transport);
  if (o.label != nullptr) s.label = o.label;
  return s;
}

int OpenOrReattach(kvtier_client* client, const char* session_id,
                   const kvtier_session_options* options, kvtier_session** out) {
  if (client == nullptr || options == nullptr || out == nullptr) {
    return InvalidArgument("client, options and out must be non-null");
  }
  *out = nullptr;
  return Guard([&]() -> absl::Status {
    absl::StatusOr<kvtier::SessionOptions> converted = ToSessionOptions(*options);
    if (!converted.ok()) return converted.status();
    const kvtier::SessionOptions& o = *converted;
    absl::StatusOr<std::unique_ptr<kvtier::Session>> s =
        session_id == nullptr ? client->client->OpenSession(o)
                              : client->client->Reattach(session_id, o);
    if (!s.ok()) return s.status();
    *out = new kvtier_session{*std::move(s)};
    return absl::OkStatus();
  });
}

}  // namespace

extern "C" {

void kvtier_client_options_init(kvtier_client_options* o) {
  if (o == nullptr) return;
  std::memset(o, 0, sizeof(*o));
  o->struct_size = sizeof(*o);
  o->rpc_timeout_ms = 30000;
}

void kvtier_session_options_init(kvtier_session_options* o) {
  if (o == nullptr) return;
  std::memset(o, 0, sizeof(*o));
  o->struct_size = sizeof(*o);
  o->geometry.page_size = kvtier::kDefaultPageSize;
  o->geometry.dtype = KVTIER_DTYPE_F16;
  o->mode = KVTIER_MODE_SPECULATIVE;
  o->budget_tokens = kvtier::kDefaultBudgetTokens;
  o->correction_threshold = kvtier::kDefaultCorrectionThreshold;
  o->correction_trigger = KVTIER_CORRECTION_TRIGGER_COSINE;
  o->correction_max_loss = kvtier::kDefaultCorrectionMaxLoss;
  o->summary = static_cast<int32_t>(kvtier::SequenceOptions().summary);
  o->transport = KVTIER_TRANSPORT_SHM;
}

const char* kvtier_version(void) {
  static const std::string version =
      absl::StrFormat("%s (protocol %d)", KVTIER_VERSION_STRING, kvtier::kProtocolVersion);
  return version.c_str();
}

int32_t kvtier_abi_version(void) { return KVTIER_ABI_VERSION; }

const char* kvtier_last_error(void) { return kvtier::c_api::last_error.c_str(); }

int kvtier_connect(const char* target, const kvtier_client_options* options, kvtier_client** out) {
  if (target == nullptr || out == nullptr) {
    return InvalidArgument("kvtier_connect: target and out must be non-null");
  }
  *out = nullptr;
  return Guard([&]() -> absl::Status {
    kvtier::ClientOptions o;
    o.client_name = "libkvtier-c";
    if (options != nullptr) {
      absl::StatusOr<kvtier_client_options> read =
          kvtier::c_api::ReadOptions(*options, kvtier_client_options_init,
                                     kvtier::c_api::kClientOptionsMinSize, "kvtier_client_options");
      if (!read.ok()) return read.status();
      const kvtier_client_options& c = *read;
      if (c.tenant != nullptr) o.tenant = c.tenant;
      if (c.token != nullptr) o.token = c.token;
      if (c.client_name != nullptr) o.client_name = c.client_name;
      if (c.rpc_timeout_ms > 0) o.rpc_timeout = absl::Milliseconds(c.rpc_timeout_ms);
      if (c.attach_socket != nullptr) o.attach_socket = c.attach_socket;
      o.max_message_bytes = c.max_message_bytes;
    }
    absl::StatusOr<std::unique_ptr<kvtier::Client>> c = kvtier::Client::Connect(target, o);
    if (!c.ok()) return c.status();
    *out = new kvtier_client{*std::move(c)};
    return absl::OkStatus();
  });
}

void kvtier_client_free(kvtier_client* client) { delete client; }

int kvtier_open_session(kvtier_client* client, const kvtier_session_options* options,
                        kvtier_session** out) {
  return OpenOrReattach(client, nullptr, options, out);
}

int kvtier_reattach(kvtier_client* client, const char* session_id,
                    const kvtier_session_options* options, kvtier_session** out) {
  if (session_id == nullptr) return InvalidArgument("kvtier_reattach: session_id is null");
  return OpenOrReattach(client, session_id, options, out);
}

const char* kvtier_session_id(const kvtier_session* session) {
  return session == nullptr ? "" : session->session->id().c_str();
}

int32_t kvtier_num_tokens(const kvtier_session* session, int32_t layer) {
  return session == nullptr ? 0 : session->session->sequence().num_tokens(layer);
}

int kvtier_append(kvtier_session* session, int32_t layer, const void* k, const void* v,
                  int32_t n_tokens) {
  if (session == nullptr) return InvalidArgument("kvtier_append: session is null");
  return Guard([&] {
    kvtier::Session& s = *session->session;
    return Synced(s, s.sequence().Append(layer, k, v, n_tokens));
  });
}

int kvtier_decode(kvtier_session* session, int32_t layer, const void* q, void* out, float* lse,
                  int32_t* num_slots, int32_t* slot_table, size_t slot_table_capacity) {
  if (session == nullptr) return InvalidArgument("kvtier_decode: session is null");
  return Guard([&]() -> absl::Status {
    kvtier::Session& s = *session->session;
    if (absl::Status st = Synced(s, s.sequence().Decode(layer, q, out, lse)); !st.ok()) return st;
    if (num_slots == nullptr && slot_table == nullptr) return absl::OkStatus();
    // The step's record (its slot table) is complete once all work enqueued so far has run.
    if (absl::Status st = s.sequence().Wait(); !st.ok()) return st;
    return kvtier::c_api::CopySlotTable(s.sequence().LastStep(layer), num_slots, slot_table,
                                        slot_table_capacity,
                                        "kvtier_decode: slot_table_capacity");
  });
}

int kvtier_report_signals(kvtier_session* session, const kvtier_step_signals* signals) {
  if (session == nullptr || signals == nullptr) {
    return InvalidArgument("kvtier_report_signals: session and signals must be non-null");
  }
  return Guard([&]() -> absl::Status {
    absl::StatusOr<kvtier::StepSignals> s =
        kvtier::c_api::SignalsFromC(*signals, "kvtier_report_signals");
    if (!s.ok()) return s.status();
    return session->session->sequence().ReportSignals(*s);
  });
}

int kvtier_observe_queries(kvtier_session* session, int32_t layer, const void* q, int32_t n,
                           int64_t first_position) {
  if (session == nullptr) return InvalidArgument("kvtier_observe_queries: session is null");
  return Guard([&]() -> absl::Status {
    kvtier::Session& s = *session->session;
    return Synced(s, s.sequence().ObserveQueries(layer, q, n, first_position));
  });
}

int kvtier_flush(kvtier_session* session) {
  if (session == nullptr) return InvalidArgument("kvtier_flush: session is null");
  return Guard([&] { return session->session->Flush(); });
}

int kvtier_close_session(kvtier_session* session) {
  if (session == nullptr) return InvalidArgument("kvtier_close_session: session is null");
  return Guard([&] { return session->session->Close(); });
}

int kvtier_session_suspend(kvtier_session* session) {
  if (session == nullptr) return InvalidArgument("kvtier_session_suspend: session is null");
  return Guard([&] { return session->session->Suspend(); });
}

void kvtier_session_free(kvtier_session* session) {
  try {
    delete session;
  } catch (...) {  // a destructor that threw: nothing to report it to
  }
}

}  // extern "C"
