#include "bench/decode_bench.h"

#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/decode_policies.h"
#include "bench/decode_replay.h"
#include "bench/decode_sessions.h"
#include "bench/decode_step.h"
#include "bench/report.h"
#include "bench/trace.h"
#include "core/status.h"
#include "kernels/registry.h"
#include "kvtier/client.h"

namespace kvtier::bench {
namespace {

// The workloads, as bits of a set.
enum Workload : unsigned { kReplay = 1, kStep = 2, kPolicies = 4 };

struct WorkloadName {
  const char* name;
  Workload workload;
};
constexpr WorkloadName kWorkloads[] = {
    {"replay", kReplay}, {"step", kStep}, {"policies", kPolicies}};

const char* NameOf(Workload w) {
  for (const WorkloadName& n : kWorkloads) {
    if (n.workload == w) return n.name;
  }
  return "?";
}

// The flags that not every workload reads, with the workloads that do. One given while none
// of its readers is listed is refused (every other flag is read by all three).
struct FlagReaders {
  const char* name;
  unsigned readers;
};
constexpr FlagReaders kFlagReaders[] = {
    {"--trace", kReplay | kPolicies},
    {"--model-layers", kReplay | kPolicies},
    {"--budget", kReplay | kStep},
    {"--tau", kReplay | kStep},
    {"--no-sync", kReplay | kStep},
    {"--sink", kReplay},
    {"--selected", kReplay},
    {"--recent", kReplay},
    {"--step-range", kReplay},
    {"--mass-layers", kReplay},
    {"--profile-steps", kReplay},
    {"--no-drop", kReplay},
    {"--connect", kReplay},
    {"--tenant", kReplay},
    {"--token", kReplay},
    {"--transport", kReplay},
    {"--batch", kStep},
    {"--warmup", kStep},
    {"--graphs", kStep},
    {"--policy-list", kPolicies},
    {"--budgets", kPolicies},
    {"--plot", kPolicies},
};

// The flags that describe the synthetic trace. With --trace, those that change what is
// replayed (its sizes and geometry) are errors, the query process and seed a warning.
struct SyntheticFlag {
  const char* name;
  bool error;
  const char* hint;
};
constexpr SyntheticFlag kSyntheticFlags[] = {
    {"--context", true, ""},
    {"--steps", true, " (--step-range replays part of it)"},
    {"--model-layers", true, " (--layers replays part of it)"},
    {"--q-heads", true, ""},
    {"--kv-heads", true, ""},
    {"--head-dim", true, ""},
    {"--page-size", true, ""},
    {"--dtype", true, ""},
    {"--step-cosine", false, ""},
    {"--jump-probability", false, ""},
    {"--seed", false, ""},
};

// The command line as given. Fields whose flag was not given are not read: each workload
// keeps its own default for them (Given below).
struct DecodeFlags {
  std::string workloads = "replay,step,policies";
  // Read by every workload (or as kFlagReaders says).
  int32_t context = 0, steps = 0, budget = 0, model_layers = 0, q_heads = 0, kv_heads = 0,
          head_dim = 0, page_size = 0, threads = 0;
  std::string layers, dtype = "fp16", backend, recall = "auto",
                      taus = absl::StrCat(kDefaultCorrectionThreshold);
  double step_cosine = 0, jump_probability = 0;
  uint64_t seed = 1;
  bool no_sync = false, json = false;
  std::string out;
  // replay
  std::string trace, write_trace, step_range, mass_layers, connect, transport = "shm";
  int32_t sink = 0, selected = 0, recent = 0, profile_steps = 0;
  bool no_drop = false;
  ClientOptions client;
  // step
  std::string batches = "1,8";
  int32_t warmup = 0;
  bool graphs = false;
  // policies
  std::string policy_list = absl::StrJoin(PolicyReplayNames(), ","), budgets = "512,1024,2048,4096",
              plot;
};

// What runs: the workloads in order, each with its options resolved.
struct DecodePlan {
  std::vector<Workload> order;
  unsigned listed = 0;
  ReplayBenchOptions replay;
  StepBenchOptions step;
  PolicyReplayOptions policies;
  Transport transport = Transport::kShm;
};

int Refuse(const std::string& why) {
  std::cerr << "kvtier-bench decode: " << why << "\n";
  return 2;
}

// "all" → kEveryLayer; otherwise an integer ≥ 0.
bool ParseLayerCount(const std::string& s, int32_t* out) {
  if (s == "all") {
    *out = kEveryLayer;
    return true;
  }
  return absl::SimpleAtoi(s, out) && *out >= 0;
}

// "A:B", "A:" (to the trace's end) or ":B" (from step 0), integers ≥ 0.
bool ParseStepRange(const std::string& s, int32_t* begin, int32_t* end) {
  const std::vector<std::string> parts = absl::StrSplit(s, ':');
  if (parts.size() != 2) return false;
  *begin = 0;
  *end = -1;
  if (!parts[0].empty() && (!absl::SimpleAtoi(parts[0], begin) || *begin < 0)) return false;
  if (!parts[1].empty() && (!absl::SimpleAtoi(parts[1], end) || *end < 0)) return false;
  return true;
}

// Resolves the command line into a plan: 0, or the exit status (2) after saying why.
class Resolver {
 public:
  Resolver(const CLI::App& cmd, const DecodeFlags& f) : cmd_(cmd), f_(f) {}

  int Resolve(DecodePlan* p) {
    if (const int rc = Workloads(p); rc != 0) return rc;
    if (const int rc = Readers(*p); rc != 0) return rc;
    if (const int rc = Shared(p); rc != 0) return rc;
    // The replay's options also shape --write-trace's synthetic trace.
    if (const int rc = Replay(&p->replay); rc != 0) return rc;
    if (const int rc = (p->listed & kStep) ? Step(&p->step) : 0; rc != 0) return rc;
    return (p->listed & kPolicies) ? Policies(&p->policies) : 0;
  }

  bool Given(const char* name) const { return cmd_.get_option(name)->count() > 0; }

 private:
  int Workloads(DecodePlan* p) {
    for (absl::string_view name : absl::StrSplit(f_.workloads, ',', absl::SkipEmpty())) {
      const WorkloadName* found = nullptr;
      for (const WorkloadName& n : kWorkloads) {
        if (name == n.name) found = &n;
      }
      if (found == nullptr) {
        return Refuse(
            absl::StrCat("--workloads: unknown workload '", name, "' (replay, step, policies)"));
      }
      if (p->listed & found->workload) {
        return Refuse(absl::StrCat("--workloads: ", name, " is listed twice"));
      }
      p->listed |= found->workload;
      p->order.push_back(found->workload);
    }
    if (p->order.empty() && !Given("--write-trace")) {
      return Refuse("--workloads: name at least one of replay, step, policies");
    }
    return 0;
  }

  // A flag given that no listed workload reads; the synthetic trace's flags with --trace.
  int Readers(const DecodePlan& p) {
    for (const FlagReaders& r : kFlagReaders) {
      if (!Given(r.name) || (r.readers & p.listed) != 0 || Given("--write-trace")) continue;
      std::vector<std::string> readers;
      for (const WorkloadName& n : kWorkloads) {
        if (r.readers & n.workload) readers.push_back(n.name);
      }
      return Refuse(absl::StrCat(r.name, " is read by the ", absl::StrJoin(readers, " and "),
                                 " workload", readers.size() > 1 ? "s" : "",
                                 ", which --workloads does not list"));
    }
    if (f_.trace.empty()) return 0;
    if (p.listed & kStep) {
      return Refuse(
          "--trace: the step workload times synthetic KV, not a trace file; list it "
          "in a run of its own");
    }
    for (const SyntheticFlag& s : kSyntheticFlags) {
      if (!Given(s.name)) continue;
      if (s.error) {
        return Refuse(
            absl::StrCat(s.name, " is for the synthetic trace; a trace file has its own", s.hint));
      }
      std::cerr << "kvtier-bench decode: warning: " << s.name
                << " is for the synthetic trace; ignored with --trace\n";
    }
    if (Given("--write-trace")) {
      return Refuse("--write-trace writes the synthetic trace; it cannot be used with --trace");
    }
    return 0;
  }

  // The flags every workload parses the same way.
  int Shared(DecodePlan* p) {
    if (!ParseDType(f_.dtype, &dtype_)) return Refuse("--dtype must be fp16, bf16 or fp32");
    if (!ParseRecallStrategy(f_.recall, &recall_)) {
      return Refuse("--recall must be auto, batched_dma or zero_copy");
    }
    for (absl::string_view t : absl::StrSplit(f_.taus, ',')) {
      float v = 0;
      if (!absl::SimpleAtof(t, &v)) return Refuse(absl::StrCat("--tau: '", t, "' is not a number"));
      taus_.push_back(v);
    }
    if (Given("--backend")) {
      if (!ParseDeviceKind(f_.backend, &backend_)) {
        return Refuse("--backend must be cpu, cuda or auto, got " + f_.backend);
      }
      if (backend_ == DeviceKind::kCuda && !CudaBackendBuilt()) {
        return Refuse(
            "--backend cuda: this build has no CUDA backend (configure with "
            "-DKVTIER_WITH_CUDA=ON where nvcc is installed)");
      }
      if (backend_ == DeviceKind::kCuda && CudaDeviceCount() == 0) {
        return Refuse("--backend cuda: no usable CUDA device (kvtier-bench devices lists them)");
      }
    }
    if (Given("--layers") && !ParseLayerCount(f_.layers, &layers_)) {
      return Refuse("--layers must be a layer count (>= 1; 0 = all) or all, got " + f_.layers);
    }
    if (f_.transport != "shm" && f_.transport != "grpc") {
      return Refuse("--transport must be shm or grpc");
    }
    p->transport = f_.transport == "grpc" ? Transport::kGrpc : Transport::kShm;
    return 0;
  }

  // The synthetic trace of replay and policies: the flags given over `s`.
  void Synthetic(SyntheticTraceOptions* s) const {
    if (Given("--context")) s->prefill_tokens = f_.context;
    if (Given("--steps")) s->num_steps = f_.steps;
    if (Given("--model-layers")) s->geometry.num_layers = f_.model_layers;
    if (Given("--dtype")) s->geometry.dtype = dtype_;
    if (Given("--step-cosine")) s->step_cosine = f_.step_cosine;
    if (Given("--jump-probability")) s->jump_probability = f_.jump_probability;
    if (Given("--seed")) s->seed = f_.seed;
    ApplyGeometry(&s->geometry);
  }

  void ApplyGeometry(Geometry* g) const {
    if (Given("--q-heads")) g->num_q_heads = f_.q_heads;
    if (Given("--kv-heads")) g->num_kv_heads = f_.kv_heads;
    if (Given("--head-dim")) g->head_dim = f_.head_dim;
    if (Given("--page-size")) g->page_size = f_.page_size;
  }

  int Replay(ReplayBenchOptions* o) const {
    o->synthetic.num_steps = 16;  // modest by default; --steps for longer runs
    Synthetic(&o->synthetic);
    o->trace_path = f_.trace;
    if (Given("--layers")) o->layers = layers_;
    if (Given("--budget")) o->budget_tokens = f_.budget;
    if (Given("--mass-layers") && !ParseLayerCount(f_.mass_layers, &o->mass_layers)) {
      return Refuse("--mass-layers must be a layer count (>= 0) or all, got " + f_.mass_layers);
    }
    const int split = Given("--sink") + Given("--selected") + Given("--recent");
    if (split != 0 && split != 3) {
      return Refuse(
          "--sink, --selected and --recent go together (pages): give all three, or "
          "--budget alone");
    }
    if (split == 3) {
      o->pages = ReplayBudgetPages{f_.sink, f_.selected, f_.recent};
      if (!Given("--budget")) o->budget_tokens = 0;  // their sum
    }
    if (Given("--step-range") && !ParseStepRange(f_.step_range, &o->step_begin, &o->step_end)) {
      return Refuse("--step-range must be A:B (half-open, A:, :B) with integers >= 0, got " +
                    f_.step_range);
    }
    if (Given("--backend")) o->backend = backend_;
    o->taus = taus_;
    o->sync = !f_.no_sync;
    o->drop = !f_.no_drop;
    o->recall = recall_;
    if (Given("--profile-steps")) o->profile_steps = f_.profile_steps;
    if (Given("--threads")) o->threads = f_.threads;
    return 0;
  }

  int Step(StepBenchOptions* o) const {
    if (Given("--context")) o->context = f_.context;
    if (Given("--steps")) o->steps = f_.steps;
    if (Given("--budget")) o->budget_tokens = f_.budget;
    if (Given("--layers")) {
      if (layers_ < 1)
        return Refuse("--layers: the step workload needs a count >= 1, got " + f_.layers);
      o->geometry.num_layers = layers_;
    }
    if (Given("--dtype")) o->geometry.dtype = dtype_;
    ApplyGeometry(&o->geometry);
    if (Given("--step-cosine")) o->step_cosine = f_.step_cosine;
    if (Given("--jump-probability")) o->jump_probability = f_.jump_probability;
    if (Given("--seed")) o->seed = f_.seed;
    if (Given("--tau")) o->tau = taus_.front();
    o->recall = recall_;
    o->sync = !f_.no_sync;
    o->graphs = f_.graphs;
    o->backend = Given("--backend") ? backend_ : DeviceKind::kAuto;
    if (Given("--threads")) o->threads = f_.threads;
    if (Given("--warmup")) o->warmup = f_.warmup;
    if (!ParseIntList(f_.batches, &o->batches)) {
      return Refuse("--batch must be comma-separated integers, got " + f_.batches);
    }
    return 0;
  }

  int Policies(PolicyReplayOptions* o) const {
    o->trace_path = f_.trace;
    Synthetic(&o->synthetic);
    o->layers = Given("--layers") ? layers_ : (f_.trace.empty() ? kDefaultSyntheticLayers : 0);
    if (o->layers == kEveryLayer) o->layers = 0;
    if (Given("--backend")) o->backend = backend_;
    if (Given("--threads")) o->threads = f_.threads;
    o->recall = recall_;
    o->policies.clear();
    for (absl::string_view p : absl::StrSplit(f_.policy_list, ',', absl::SkipEmpty())) {
      o->policies.push_back(std::string(p));
    }
    if (!ParseIntList(f_.budgets, &o->budgets)) {
      return Refuse("--budgets must be comma-separated integers, got " + f_.budgets);
    }
    o->plot_path = f_.plot;
    return 0;
  }

  const CLI::App& cmd_;
  const DecodeFlags& f_;
  DType dtype_ = DType::kF16;
  RecallStrategy recall_ = RecallStrategy::kAuto;
  std::vector<float> taus_;
  DeviceKind backend_ = DeviceKind::kCpu;
  int32_t layers_ = 0;
};

// The replay workload, through kvtierd sessions with --connect.
absl::StatusOr<JsonObject> RunReplay(ReplayBenchOptions o, const DecodeFlags& f,
                                     Transport transport, std::ostream& log) {
  if (f.connect.empty()) return RunReplayBench(o, log);
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<ReplaySessions> sessions,
                          ReplaySessions::Connect(f.connect, f.client, transport, log));
  sessions->Install(o);
  absl::StatusOr<JsonObject> report = RunReplayBench(o, log);
  const absl::Status closed = sessions->CloseAll();
  if (report.ok() && !closed.ok()) {
    return absl::Status(closed.code(), absl::StrCat("closing sessions: ", closed.message()));
  }
  return report;
}

absl::StatusOr<JsonObject> RunWorkload(Workload w, const DecodePlan& p, const DecodeFlags& f,
                                       std::ostream& log) {
  switch (w) {
    case kReplay:
      return RunReplay(p.replay, f, p.transport, log);
    case kStep:
      return RunStepBench(p.step, log);
    case kPolicies:
      return RunPolicyReplay(p.policies, log);
  }
  return absl::InternalError("unknown workload");
}

int WriteTrace(const SyntheticTraceOptions& s, const std::string& path) {
  auto src = MakeSyntheticTrace(s);
  const absl::Status st = src.ok() ? WriteTraceFile(**src, path) : src.status();
  if (!st.ok()) {
    std::cerr << "kvtier-bench decode: --write-trace: " << st << "\n";
    return absl::IsInvalidArgument(st) ? 2 : 1;
  }
  return 0;
}

int RunDecode(const CLI::App& cmd, const DecodeFlags& f) {
  DecodePlan p;
  Resolver resolver(cmd, f);
  if (const int rc = resolver.Resolve(&p); rc != 0) return rc;
  if (resolver.Given("--write-trace")) return WriteTrace(p.replay.synthetic, f.write_trace);
  std::ostream& log = f.json ? std::cerr : std::cout;
  std::vector<std::string> names;
  for (Workload w : p.order) names.push_back(NameOf(w));
  JsonObject report;
  report.Add("bench", "decode")
      .Add("workloads", absl::StrJoin(names, ","))
      .Add("commit", Commit())
      .Add("time", UtcNow());
  for (Workload w : p.order) {
    absl::StatusOr<JsonObject> section = RunWorkload(w, p, f, log);
    if (!section.ok()) {
      const absl::Status& st = section.status();
      std::cerr << "kvtier-bench decode: " << NameOf(w) << ": " << st << "\n";
      return absl::IsInvalidArgument(st) || absl::IsUnimplemented(st) ? 2 : 1;
    }
    report.AddObject(NameOf(w), *section);
    log << "\n";
  }
  if (f.json) std::cout << report.ToString() << "\n";
  if (!f.out.empty()) std::ofstream(f.out) << report.ToString() << "\n";
  return 0;
}

// The options, in groups: every workload's, then each one's own.
void AddShared(CLI::App* cmd, DecodeFlags& f) {
  cmd->add_option("--workloads", f.workloads,
                  "comma-separated workloads, run in this order: replay, step, policies")
      ->capture_default_str();
  cmd->add_option("--context", f.context,
                  "prefill tokens (default: replay and step 32768, policies 8192)");
  cmd->add_option("--steps", f.steps,
                  "decode steps: the synthetic trace's (replay 16, policies 40); step: timed "
                  "steps (32)");
  cmd->add_option("--layers", f.layers,
                  "replay, policies: replay the first N layers, or all (4 of the synthetic "
                  "trace, all of a trace file); step: layers per decode step (4)");
  cmd->add_option("--budget", f.budget,
                  "replay, step: working-set budget in tokens, split as SetBudgetTokens splits it: "
                  "an eighth sinks (at least 1 page), an eighth recent (2 pages to a quarter), "
                  "the rest selected (a multiple of 4 pages; default 2048)");
  cmd->add_option("--q-heads", f.q_heads, "geometry (default Llama-3.1-8B's)");
  cmd->add_option("--kv-heads", f.kv_heads);
  cmd->add_option("--head-dim", f.head_dim);
  cmd->add_option("--page-size", f.page_size);
  cmd->add_option("--dtype", f.dtype, "fp16, bf16 or fp32")->capture_default_str();
  cmd->add_option("--step-cosine", f.step_cosine,
                  "queries: mean cos(q_t, q_t-1) per query head (default 0.95)");
  cmd->add_option("--jump-probability", f.jump_probability,
                  "queries: topic jumps per step and KV head (default 0.02)");
  cmd->add_option("--seed", f.seed, "of the synthetic trace and queries (default 1)");
  cmd->add_option("--backend", f.backend,
                  "cpu, cuda or auto (default: replay and policies cpu, step auto)");
  cmd->add_option("--recall", f.recall, "recall strategy: auto, batched_dma or zero_copy")
      ->capture_default_str();
  cmd->add_option("--threads", f.threads, "cpu backend threads (0 = all)")->capture_default_str();
  cmd->add_option("--tau", f.taus,
                  "replay, step: comma-separated correction thresholds; replay runs one "
                  "speculative mode each (the first is reported as \"speculative\"), step the "
                  "first")
      ->capture_default_str();
  cmd->add_flag("--no-sync", f.no_sync, "replay, step: skip sync mode");
  cmd->add_flag("--json", f.json, "print one JSON object on stdout (a section per workload)");
  cmd->add_option("--out", f.out, "also write the JSON report to this file");
}

void AddReplay(CLI::App* cmd, DecodeFlags& f) {
  cmd->add_option("--trace", f.trace,
                  "replay, policies: read this trace file instead of the synthetic trace "
                  "(docs/trace-format.md)");
  cmd->add_option("--write-trace", f.write_trace,
                  "write the synthetic trace (replay's) to this file and exit; no workload runs");
  cmd->add_option("--model-layers", f.model_layers,
                  "replay, policies: layers of the synthetic trace's shape (default 32)");
  cmd->add_option("--sink,--sink-pages", f.sink,
                  "replay: sink pages per layer (with --selected and --recent: the budget is "
                  "their sum)");
  cmd->add_option("--selected,--selected-pages", f.selected, "replay: selected pages per layer");
  cmd->add_option("--recent,--recent-pages", f.recent,
                  "replay: recent pages per layer (>= 1: the page being filled is one)");
  cmd->add_option("--step-range", f.step_range,
                  "replay: score and time steps A..B-1 only (A:B, A:, :B); earlier steps are "
                  "decoded unscored");
  cmd->add_flag("--no-drop", f.no_drop, "replay: skip drop mode (sinks + sliding window)");
  cmd->add_option("--mass-layers", f.mass_layers,
                  "replay: replayed layers (evenly spaced) scored for attention mass recall, or "
                  "all (default 4)");
  cmd->add_option("--profile-steps", f.profile_steps,
                  "replay: trailing steps run with profiling for the select/recall/attention "
                  "split (default 4)");
  cmd->add_option("--connect", f.connect,
                  "replay: run speculative and sync modes as sessions of the kvtierd at this "
                  "target (unix:///path or host:port)");
  cmd->add_option("--tenant", f.client.tenant, "replay, with --connect: the tenant")
      ->capture_default_str();
  cmd->add_option("--token", f.client.token, "replay, with --connect: the tenant's token");
  cmd->add_option("--transport", f.transport, "replay, with --connect: shm or grpc")
      ->capture_default_str();
}

void AddStepAndPolicies(CLI::App* cmd, DecodeFlags& f) {
  cmd->add_option("--batch", f.batches, "step: comma-separated decode batch sizes")
      ->capture_default_str();
  cmd->add_option("--warmup", f.warmup, "step: untimed decode steps before the timed (default 4)");
  cmd->add_flag("--graphs", f.graphs,
                "step: capture speculative layer-steps as graphs (SequenceOptions::"
                "capture_graphs; zero-copy recall only)");
  cmd->add_option("--policy-list", f.policy_list, "policies: the runs")->capture_default_str();
  cmd->add_option("--budgets", f.budgets,
                  "policies: working-set budgets in tokens (those not below the context are "
                  "skipped)")
      ->capture_default_str();
  cmd->add_option("--plot", f.plot, "policies: write a PNG of rel_error vs memory fraction here");
}

}  // namespace

CLI::App* AddDecodeCommand(CLI::App& app, int* rc) {
  auto flags = std::make_shared<DecodeFlags>();
  auto* cmd = app.add_subcommand(
      "decode",
      "decode-step workloads over one option set, in the order --workloads lists them: replay "
      "(retrieval modes on a decode trace: accuracy vs full KV, step time), step (per-layer "
      "step times: dense, resident, speculative, sync, per batch), policies (drop policies: "
      "memory vs error)");
  AddShared(cmd, *flags);
  AddReplay(cmd, *flags);
  AddStepAndPolicies(cmd, *flags);
  cmd->callback([cmd, flags, rc] { *rc = RunDecode(*cmd, *flags); });
  return cmd;
}

}  // namespace kvtier::bench
