/* libkvtier's C API: the client of kvtier/client.h for engines written in C or reached
 * through an FFI (ctypes, cffi, Rust, Go). Plain C99: opaque handles, POD option structs,
 * int return codes.
 *
 *   kvtier_client* c;  kvtier_session* s;
 *   kvtier_client_options co;  kvtier_client_options_init(&co);  co.tenant = "a";
 *   if (kvtier_connect("unix:///run/kvtier/kvtierd.sock", &co, &c) != KVTIER_OK)
 *     fprintf(stderr, "%s\n", kvtier_last_error());
 *   kvtier_session_options so;  kvtier_session_options_init(&so);  so.geometry = ...;
 *   kvtier_open_session(c, &so, &s);
 *   kvtier_append(s, layer, k, v, n);
 *   kvtier_decode(s, layer, q, out, lse, &num_slots, table, table_capacity);
 *   kvtier_close_session(s);  kvtier_session_free(s);  kvtier_client_free(c);
 *
 * Every function returning int returns a canonical status code (KVTIER_OK = 0; the codes of
 * absl and gRPC); on failure kvtier_last_error() says what was wrong. Sessions opened through
 * the C API run SHM sessions on a CPU backend owned by the client, so every data pointer is
 * host memory; each call returns after the work that reads or writes the caller's buffers has
 * run, so buffers may be reused at once.
 *
 * Thread-safety: a kvtier_client may be used from many threads; a kvtier_session from one
 * thread at a time. kvtier_last_error() is per thread. Free a session before its client.
 *
 * ABI. KVTIER_ABI_VERSION is the version of this header; kvtier_abi_version() the library's.
 * A binding that lays out the structs itself (ctypes, cffi, Rust, Go) checks that the two are
 * equal when it loads the library. The option structs a caller fills (kvtier_client_options,
 * kvtier_session_options, kvtier_sequence_options) begin with struct_size, which their _init
 * function sets to the struct's size in the caller's header; fields are only added at their
 * end, and a field added later means its default when it is 0. The library reads struct_size
 * bytes: a struct of an older header gets the defaults for the fields it lacks; one of a newer
 * header is accepted when every byte this library does not know is 0; anything else (a newer
 * field set, struct_size 0 because the struct was not made by _init, or a size below the
 * first version's) is KVTIER_INVALID_ARGUMENT naming the struct and both sizes. The other
 * structs (kvtier_geometry, kvtier_policy_options, kvtier_working_set, kvtier_step_signals)
 * are frozen: changing one is a new struct, new functions and a new KVTIER_ABI_VERSION.
 */
#ifndef KVTIER_C_API_H_
#define KVTIER_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Canonical status codes. */
enum {
  KVTIER_OK = 0,
  KVTIER_CANCELLED = 1,
  KVTIER_UNKNOWN = 2,
  KVTIER_INVALID_ARGUMENT = 3,
  KVTIER_DEADLINE_EXCEEDED = 4,
  KVTIER_NOT_FOUND = 5,
  KVTIER_ALREADY_EXISTS = 6,
  KVTIER_PERMISSION_DENIED = 7,
  KVTIER_RESOURCE_EXHAUSTED = 8,
  KVTIER_FAILED_PRECONDITION = 9,
  KVTIER_ABORTED = 10,
  KVTIER_OUT_OF_RANGE = 11,
  KVTIER_UNIMPLEMENTED = 12,
  KVTIER_INTERNAL = 13,
  KVTIER_UNAVAILABLE = 14,
  KVTIER_DATA_LOSS = 15,
  KVTIER_UNAUTHENTICATED = 16
};

/* Element types (kvtier::DType). */
enum { KVTIER_DTYPE_F16 = 0, KVTIER_DTYPE_BF16 = 1, KVTIER_DTYPE_F32 = 2 };
/* Retrieval modes (kvtier::RetrievalMode). */
enum {
  KVTIER_MODE_SPECULATIVE = 0,
  KVTIER_MODE_SYNC = 1,
  KVTIER_MODE_FULL = 2,
  KVTIER_MODE_DROP = 3
};
/* Correction triggers of speculative mode (kvtier::CorrectionTrigger). */
enum { KVTIER_CORRECTION_TRIGGER_COSINE = 0, KVTIER_CORRECTION_TRIGGER_MASS = 1 };
/* What a page is scored by (kvtier::SummaryMode): key codes (the default: the bounds and a
 * 4-bit code per key and dimension, a quarter of the keys more on the device), or page
 * summaries alone (center-mad, Quest's min/max bounds). */
enum { KVTIER_SUMMARY_MINMAX = 0, KVTIER_SUMMARY_CENTER_MAD = 1, KVTIER_SUMMARY_KEY_CODES = 2 };
/* Transports (kvtier::Transport). */
enum { KVTIER_TRANSPORT_SHM = 0, KVTIER_TRANSPORT_GRPC = 1 };

/* The C ABI this header describes (see "ABI" above). */
#define KVTIER_ABI_VERSION 1

typedef struct kvtier_client kvtier_client;
typedef struct kvtier_session kvtier_session;

/* The model shape (kvtier/geometry.h). */
typedef struct kvtier_geometry {
  int32_t num_layers;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t head_dim;  /* elements */
  int32_t page_size; /* tokens per page */
  int32_t dtype;     /* KVTIER_DTYPE_* */
} kvtier_geometry;

typedef struct kvtier_client_options {
  uint32_t struct_size;       /* set by the _init function ("ABI" above) */
  const char* tenant;         /* NULL: "default" */
  const char* token;          /* NULL: none */
  const char* client_name;    /* NULL: "libkvtier-c" */
  int64_t rpc_timeout_ms;     /* deadline of every unary call; <= 0: 30000 */
  const char* attach_socket;  /* NULL: the path the daemon reports */
  uint64_t max_message_bytes; /* 0: the daemon's limit */
} kvtier_client_options;

/* The drop-style policies a sequence runs (kvtier::PolicyConfig, docs/policies.md). NULL
 * names keep the defaults; params are num_params strings "<policy>.<name>=<value>" (e.g.
 * "h2o.recent_pages=4"). Names and params are judged by the policy registry when the
 * sequence or session is made: INVALID_ARGUMENT naming the policy or parameter and its rule,
 * the same message the C++ API and kvtierd give. */
typedef struct kvtier_policy_options {
  const char* budget;         /* fixed | confidence | xkv | kv_compress; NULL: fixed */
  const char* residency;      /* none | attention | h2o | epiphany | kv_compress; NULL: none */
  const char* host_drop;      /* refuse | evict | demote; NULL: refuse */
  const char* const* params;  /* num_params "key=value" strings, or NULL */
  int32_t num_params;
} kvtier_policy_options;

typedef struct kvtier_session_options {
  uint32_t struct_size;       /* set by the _init function ("ABI" above) */
  kvtier_geometry geometry;
  int32_t mode;               /* KVTIER_MODE_* */
  int32_t budget_tokens;      /* working set per layer, a multiple of 4 pages; 0: 2048 */
  int32_t max_tokens;         /* capacity per layer; 0: the daemon's default */
  float correction_threshold; /* tau: any finite value (> 1 always corrects, <= -1 never) */
  int32_t transport;          /* KVTIER_TRANSPORT_* */
  const char* label;          /* NULL: none */
  int32_t correction_trigger; /* KVTIER_CORRECTION_TRIGGER_* */
  float correction_max_loss;  /* mass trigger: largest relative loss kept, in [0, 1] */
  int32_t host_tokens;        /* tokens per layer in the host tier; 0: max_tokens */
  int32_t host_drop_demote;   /* 1: a full host tier demotes pages to the daemon's cold tier
                                 (policy.host_drop = "demote"; needed below max_tokens) */
  /* The policies (an SHM session runs them in this process, a GRPC one in kvtierd);
   * policy.host_drop and host_drop_demote = 1 must not disagree. */
  kvtier_policy_options policy;
  int32_t summary; /* KVTIER_SUMMARY_* (a GRPC session's Retriever in kvtierd takes it too) */
  /* The budget's split: 0 = budget_tokens split as the library splits it (an eighth sink, at
   * least 1 page; an eighth recent, 2 pages to a quarter; the rest selected); 1 = sink_pages
   * and recent_pages below, the rest of the budget selected (the resolver judges them). */
  int32_t split;
  int32_t sink_pages;
  int32_t recent_pages;
} kvtier_session_options;

/* Fills the defaults: tenant "default", 30 s timeout; fp16 geometry with page size 32,
 * speculative mode, budget 2048, tau 0.7, the cosine trigger, max loss 0.1, key codes, SHM
 * (kvtier/options.h: kDefault*). */
void kvtier_client_options_init(kvtier_client_options* options);
void kvtier_session_options_init(kvtier_session_options* options);

/* The library version, e.g. "0.1.0 (protocol 1)". Static storage. */
const char* kvtier_version(void);
/* The library's KVTIER_ABI_VERSION. */
int32_t kvtier_abi_version(void);
/* The message of the last call on this thread that failed; "" when it succeeded. Valid
 * until the next kvtier_* call on this thread. */
const char* kvtier_last_error(void);

/* Connects (kvtier::Client::Connect). options may be NULL (defaults). *out owns the client. */
int kvtier_connect(const char* target, const kvtier_client_options* options, kvtier_client** out);
void kvtier_client_free(kvtier_client* client); /* NULL: no-op */

int kvtier_open_session(kvtier_client* client, const kvtier_session_options* options,
                        kvtier_session** out);
/* Takes over session `session_id` (kvtier::Client::Reattach): SHM sessions come back with
 * their committed pages; kvtier_num_tokens says where to re-append from. */
int kvtier_reattach(kvtier_client* client, const char* session_id,
                    const kvtier_session_options* options, kvtier_session** out);
/* The session id, valid while the session lives. */
const char* kvtier_session_id(const kvtier_session* session);
/* Tokens of `layer` so far (0 for a bad layer). */
int32_t kvtier_num_tokens(const kvtier_session* session, int32_t layer);

/* k, v: NHD [n_tokens][num_kv_heads][head_dim] in the session dtype. */
int kvtier_append(kvtier_session* session, int32_t layer, const void* k, const void* v,
                  int32_t n_tokens);
/* One decode step of `layer` (kvtier::Sequence::Decode): q [num_q_heads][head_dim] in the
 * session dtype; out [num_q_heads][head_dim] receives the attention output (NULL: none);
 * lse [num_q_heads] floats, or NULL. Returns once out and lse are written (the background
 * selection and recall for the next step go on). When num_slots or slot_table is not NULL
 * it also waits for that background work, then sets *num_slots and, when slot_table is not
 * NULL, copies the per-KV-head slot table [num_kv_heads][num_slots] the attention read
 * (logical page per slot, -1 empty) into it: KVTIER_OUT_OF_RANGE when slot_table_capacity
 * (entries) is smaller; the step ran all the same. */
int kvtier_decode(kvtier_session* session, int32_t layer, const void* q, void* out, float* lse,
                  int32_t* num_slots, int32_t* slot_table, size_t slot_table_capacity);
/* Waits for every offload so far and commits it (kvtier::Session::Flush). */
int kvtier_flush(kvtier_session* session);
/* Closes the session in the daemon; the handle must still be freed. */
int kvtier_close_session(kvtier_session* session);
/* Suspends the session for a later kvtier_reattach (kvtier::Session::Suspend): flushes
 * (SHM: waits for the offloads in flight to commit), closes the handle's sequence and asks
 * the daemon to suspend it. The handle's calls then fail KVTIER_FAILED_PRECONDITION,
 * kvtier_close_session leaves the daemon's session alone, and suspending again is OK; the
 * handle must still be freed. kvtier_reattach resumes it (kvtier_num_tokens says where to
 * re-append from). */
int kvtier_session_suspend(kvtier_session* session);
/* Frees the handle; a session not closed is detached (kvtier_reattach takes it over). */
void kvtier_session_free(kvtier_session* session);

/* ---- In-process sequences: the data path without kvtierd (kvtier/sequence.h) ----------
 *
 * A device, batches of local sequences on it, and the batch-first step protocol: a sequence
 * made alone (kvtier_sequence_create) is the one member of its own batch of one
 * (kvtier_sequence_batch), so an engine steps every sequence as a batch:
 *
 *   kvtier_device* d;  kvtier_sequence* s;
 *   kvtier_device_create(KVTIER_DEVICE_CPU, &d);
 *   kvtier_sequence_options so;  kvtier_sequence_options_init(&so);
 *   kvtier_sequence_create(d, &geometry, &so, &s);
 *   kvtier_sequence_append(s, layer, k, v, n);             (prefill; then 1 per step)
 *   kvtier_sequence_decode(s, layer, q, out, NULL);          (one step of one layer)
 *   or, batch-first, with the engine's own attention in between:
 *   kvtier_batch* b = kvtier_sequence_batch(s);
 *   kvtier_batch_begin_step(b, layer, &s, 1, q, &view);   (view: the working set)
 *   kvtier_batch_attend(b, layer, &s, 1, q, out, NULL);    (or the engine's kernel on view)
 *   kvtier_batch_end_step(b, layer, &s, 1, q);
 *   kvtier_batch_synchronize(b);                            (before the host reads out)
 *
 * Pointers (k, v, q, out, lse) are memory of the device: host memory on the CPU device;
 * device memory (or host memory the device can read) on CUDA. The calls enqueue on the
 * batch's compute stream and return without waiting for it (speculative mode's background
 * selection and recall run on their own stream): kvtier_batch_synchronize waits for the
 * compute stream, kvtier_sequence_wait for everything. Handles may be freed in any order:
 * batches and sequences keep their device, and a batch's members keep the batch's storage
 * (the step calls then need a handle of theirs). Thread-compatible: one thread drives a batch and
 * its members at a time. Long calls do not hold any lock a binding takes (ctypes releases
 * Python's GIL around every call). */

/* Device kinds (kvtier::DeviceKind); auto: CUDA when a GPU is usable, else the CPU. */
enum { KVTIER_DEVICE_AUTO = 0, KVTIER_DEVICE_CPU = 1, KVTIER_DEVICE_CUDA = 2 };
/* Recall strategies (kvtier::RecallStrategy). */
/* (1 was slab_dma: removed, refused with INVALID_ARGUMENT.) */
enum { KVTIER_RECALL_AUTO = 0, KVTIER_RECALL_BATCHED_DMA = 2, KVTIER_RECALL_ZERO_COPY = 3 };

typedef struct kvtier_device kvtier_device;
typedef struct kvtier_batch kvtier_batch;
typedef struct kvtier_sequence kvtier_sequence;

typedef struct kvtier_sequence_options {
  uint32_t struct_size;       /* set by the _init function ("ABI" above) */
  int32_t mode;               /* KVTIER_MODE_* */
  int32_t budget_tokens;      /* working set per layer, a multiple of 4 pages; 0: 2048 */
  int32_t max_tokens;         /* capacity per layer (sizes the host tier); 0: 131072 */
  float correction_threshold; /* tau: any finite value (> 1 always corrects, <= -1 never) */
  int32_t correction_trigger; /* KVTIER_CORRECTION_TRIGGER_* */
  float correction_max_loss;  /* mass trigger: in [0, 1] */
  int32_t recall;             /* KVTIER_RECALL_* */
  int32_t capture_graphs;     /* 1: capture steady-state steps as graphs (speculative, gather) */
  /* CUDA: the engine's cudaStream_t, adopted (not owned) as the compute stream of every
   * member, so kvtier's work is ordered with the engine's on it; NULL: kvtier makes one
   * (kvtier_batch_native_stream hands it out). Must outlive the batch. */
  void* compute_stream;
  kvtier_policy_options policy; /* the drop-style policies; zeroed: none */
  int32_t summary;              /* KVTIER_SUMMARY_* */
  /* The budget's split, as kvtier_session_options's: 0 = the library's; 1 = these. */
  int32_t split;
  int32_t sink_pages;
  int32_t recent_pages;
} kvtier_sequence_options;

/* One member's working set of one layer for this step (kvtier::WorkingSetView): what a
 * paged decode kernel reads. Device memory, valid until the member's next step of the layer. */
typedef struct kvtier_working_set {
  int32_t layer;
  int32_t num_slots;           /* S */
  int32_t num_tokens;          /* tokens of the sequence so far */
  int32_t reserved;
  const void* k_cache;         /* [S][page_size][num_kv_heads][head_dim], the geometry dtype */
  const void* v_cache;
  const int32_t* slot_table;   /* [num_kv_heads][S]: logical page per slot, -1 empty */
  const int32_t* partial_page; /* [1]: the logical page being filled, or -1 */
  const int32_t* partial_len;  /* [1]: its tokens */
} kvtier_working_set;

/* Defaults: speculative, budget 2048, max_tokens 131072, tau 0.7, the cosine trigger, max
 * loss 0.1, key codes, recall auto, no graphs, kvtier's own stream (kvtier/options.h: kDefault*). */
void kvtier_sequence_options_init(kvtier_sequence_options* options);

/* KVTIER_UNAVAILABLE when the kind is not usable here (no CUDA device, or a build without). */
int kvtier_device_create(int32_t kind, kvtier_device** out);
void kvtier_device_free(kvtier_device* device); /* NULL: no-op */
int32_t kvtier_device_kind(const kvtier_device* device);

/* A batch of up to max_batch sequences of one geometry and options (kvtier::NewSequenceBatch):
 * KVTIER_INVALID_ARGUMENT naming the option and rule, or the combination a batch of more
 * than one cannot run. */
int kvtier_batch_create(kvtier_device* device, const kvtier_geometry* geometry,
                        const kvtier_sequence_options* options, int32_t max_batch,
                        kvtier_batch** out);
/* A new member. KVTIER_RESOURCE_EXHAUSTED when max_batch members are open. */
int kvtier_batch_add(kvtier_batch* batch, kvtier_sequence** out);
int32_t kvtier_batch_max_batch(const kvtier_batch* batch);
/* The step protocol for n members of the batch (each at most once), their queries q
 * [n][num_q_heads][head_dim] in that order. begin_step readies the working sets and writes
 * the n views (may be NULL); attend writes out [n][num_q_heads][head_dim] (lse [n][num_q_heads]
 * floats, or NULL); end_step launches the next step's selection and recall. */
int kvtier_batch_begin_step(kvtier_batch* batch, int32_t layer, kvtier_sequence* const* members,
                            int32_t n, const void* q, kvtier_working_set* views);
int kvtier_batch_attend(kvtier_batch* batch, int32_t layer, kvtier_sequence* const* members,
                        int32_t n, const void* q, void* out, float* lse);
int kvtier_batch_end_step(kvtier_batch* batch, int32_t layer, kvtier_sequence* const* members,
                          int32_t n, const void* q);
/* Waits for the batch's compute stream (bounded by the members' deadline). */
int kvtier_batch_synchronize(kvtier_batch* batch);
/* CUDA: the cudaStream_t of the batch's compute stream; KVTIER_UNIMPLEMENTED on the CPU. */
int kvtier_batch_native_stream(kvtier_batch* batch, void** out);
/* Frees the handle; members stay usable through their own calls. */
void kvtier_batch_free(kvtier_batch* batch);

/* A sequence made alone, with a private host tier of max_tokens per layer in pinned host
 * memory (kvtier::NewLocalSequence): the one member of its own batch of one. */
int kvtier_sequence_create(kvtier_device* device, const kvtier_geometry* geometry,
                           const kvtier_sequence_options* options, kvtier_sequence** out);
/* The batch the sequence is a member of (its own batch of one when made alone); valid while
 * the sequence (and, for a member of kvtier_batch_create's batch, that handle) lives; NULL
 * once that handle was freed. */
kvtier_batch* kvtier_sequence_batch(kvtier_sequence* sequence);
/* k, v: NHD [n_tokens][num_kv_heads][head_dim]. KVTIER_OUT_OF_RANGE past max_tokens. */
int kvtier_sequence_append(kvtier_sequence* sequence, int32_t layer, const void* k,
                           const void* v, int32_t n_tokens);
int32_t kvtier_sequence_num_tokens(const kvtier_sequence* sequence, int32_t layer);
/* One step of one layer: begin, attend (out may be NULL), end (kvtier::Sequence::Decode). */
int kvtier_sequence_decode(kvtier_sequence* sequence, int32_t layer, const void* q, void* out,
                           float* lse);
/* Waits for all work enqueued so far (background recalls included). */
int kvtier_sequence_wait(kvtier_sequence* sequence);
/* Counter `name` of kvtier/counters.h into *value (KVTIER_NOT_FOUND for another name); the
 * counts of the steps whose work is known to have run (after kvtier_sequence_wait: all). */
int kvtier_sequence_counter(kvtier_sequence* sequence, const char* name, int64_t* value);
/* The last step of `layer` (after kvtier_sequence_wait): KV heads corrected, and the slot
 * table its attention read into table [num_kv_heads][*num_slots] when capacity allows
 * (KVTIER_OUT_OF_RANGE otherwise; *num_slots is set either way). */
int kvtier_sequence_last_step(kvtier_sequence* sequence, int32_t layer, int32_t* corrected_heads,
                              int32_t* num_slots, int32_t* table, size_t table_capacity);
/* What the engine observed after a forward pass, for the policies that read it
 * (kvtier::StepSignals): the tokens at first_position .. + num_tokens − 1 were processed;
 * logits: the next-token logits after the last one ([vocab] floats, host memory; NULL:
 * none, Conf-KV's signal); hidden_delta: [num_tokens][num_layers] floats, host memory, the
 * change of each token's hidden state per layer (NULL: none, EpiKV's signal). */
typedef struct kvtier_step_signals {
  int64_t first_position;
  int32_t num_tokens;
  int32_t vocab;
  const float* logits;
  const float* hidden_delta;
  int32_t num_layers;
} kvtier_step_signals;
/* Hands the signals to the sequence's policies (kvtier::LocalSequence::ReportSignals); applied
 * from the next step on. KVTIER_OK and ignored when no policy reads them;
 * KVTIER_INVALID_ARGUMENT for inconsistent sizes. */
int kvtier_sequence_report_signals(kvtier_sequence* sequence, const kvtier_step_signals* signals);
/* The same for a session of kvtierd: an SHM session's sequence runs here; a GRPC session's
 * signals go to the daemon, where its policies run (nothing is sent when it has none). */
int kvtier_report_signals(kvtier_session* session, const kvtier_step_signals* signals);
/* The prompt's last n queries q [n][num_q_heads][head_dim] of `layer` (device memory, the
 * geometry dtype), at positions first_position .. + n − 1, after the prompt was appended: the
 * observation window of XKV, KV-Compress and Conf-KV's ranker
 * (kvtier::LocalSequence::ObserveQueries). Blocks until done; KVTIER_OK and nothing done when
 * no policy reads attention. */
int kvtier_sequence_observe_queries(kvtier_sequence* sequence, int32_t layer, const void* q,
                                    int32_t n, int64_t first_position);
/* The same for a session of kvtierd (q: host memory, the session's device being the CPU). */
int kvtier_observe_queries(kvtier_session* session, int32_t layer, const void* q, int32_t n,
                           int64_t first_position);
/* Stops the sequence (drains its work); later calls fail KVTIER_FAILED_PRECONDITION. */
int kvtier_sequence_close(kvtier_sequence* sequence);
void kvtier_sequence_free(kvtier_sequence* sequence); /* NULL: no-op */

/* The counters of kvtier/counters.h: how many, and the name of the i-th (NULL out of range). */
int32_t kvtier_counter_count(void);
const char* kvtier_counter_name(int32_t i);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVTIER_C_API_H_ */
