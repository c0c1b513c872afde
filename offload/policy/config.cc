// Policy configuration: parameters by name → the policies' option structs → policy objects.
// Every parameter is read through ParamReader, which records what it consumed; whatever is
// left afterwards is unknown (or belongs to a policy that is not configured) and refused.
#include "offload/policy/config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status.h"
#include "offload/policy/attention_ranker.h"
#include "offload/policy/confidence.h"
#include "offload/policy/epiphany.h"
#include "offload/policy/kv_compress.h"
#include "offload/policy/xkv.h"

namespace kvtier::policy {
namespace {

class ParamReader {
 public:
  explicit ParamReader(const std::map<std::string, std::string>& params) : params_(params) {}

  absl::Status Int(const std::string& key, int64_t lo, int64_t hi, int64_t* out) {
    const std::string* v = Take(key);
    if (v == nullptr) return absl::OkStatus();
    errno = 0;
    char* end = nullptr;
    const long long x = std::strtoll(v->c_str(), &end, 10);
    if (v->empty() || *end != '\0' || errno != 0 || x < lo || x > hi) {
      return Bad(key, *v, absl::StrFormat("an integer in [%d, %d]", lo, hi));
    }
    *out = x;
    return absl::OkStatus();
  }
  absl::Status Int32(const std::string& key, int32_t lo, int32_t hi, int32_t* out) {
    int64_t x = *out;
    KVTIER_RETURN_IF_ERROR(Int(key, lo, hi, &x));
    *out = static_cast<int32_t>(x);
    return absl::OkStatus();
  }
  absl::Status Float(const std::string& key, double lo, double hi, float* out) {
    double x = *out;
    KVTIER_RETURN_IF_ERROR(Double(key, lo, hi, &x));
    *out = static_cast<float>(x);
    return absl::OkStatus();
  }
  absl::Status Double(const std::string& key, double lo, double hi, double* out) {
    const std::string* v = Take(key);
    if (v == nullptr) return absl::OkStatus();
    errno = 0;
    char* end = nullptr;
    const double x = std::strtod(v->c_str(), &end);
    if (v->empty() || *end != '\0' || errno != 0 || !std::isfinite(x) || x < lo || x > hi) {
      return Bad(key, *v, absl::StrFormat("a number in [%g, %g]", lo, hi));
    }
    *out = x;
    return absl::OkStatus();
  }
  absl::Status Bool(const std::string& key, bool* out) {
    const std::string* v = Take(key);
    if (v == nullptr) return absl::OkStatus();
    if (*v == "true" || *v == "1") {
      *out = true;
    } else if (*v == "false" || *v == "0") {
      *out = false;
    } else {
      return Bad(key, *v, "true or false");
    }
    return absl::OkStatus();
  }
  absl::Status String(const std::string& key, std::string* out) {
    if (const std::string* v = Take(key); v != nullptr) *out = *v;
    return absl::OkStatus();
  }
  // One of `names` (index into it).
  absl::Status Choice(const std::string& key, const std::vector<std::string>& names, int* out) {
    const std::string* v = Take(key);
    if (v == nullptr) return absl::OkStatus();
    for (size_t i = 0; i < names.size(); ++i) {
      if (*v == names[i]) {
        *out = static_cast<int>(i);
        return absl::OkStatus();
      }
    }
    return Bad(key, *v, absl::StrCat("one of ", absl::StrJoin(names, ", ")));
  }
  // INVALID_ARGUMENT for the first parameter nothing consumed.
  absl::Status Finish(const PolicyConfig& c) const {
    for (const auto& [key, value] : params_) {
      if (taken_.contains(key)) continue;
      if (key == "int8.window_pages") {
        return absl::InvalidArgumentError(
            "policy.params['int8.window_pages']: INT8 storage was removed (it kept the FP16 "
            "slot beside the INT8 copy, so it saved no memory); docs/policies.md");
      }
      return absl::InvalidArgumentError(absl::StrFormat(
          "policy.params['%s']: unknown, or for a policy this session does not run (budget = "
          "%s, residency = %s); docs/policies.md lists the parameters",
          key, c.budget, c.residency));
    }
    return absl::OkStatus();
  }

 private:
  const std::string* Take(const std::string& key) {
    auto it = params_.find(key);
    if (it == params_.end()) return nullptr;
    taken_.insert(key);
    return &it->second;
  }
  static absl::Status Bad(const std::string& key, const std::string& value,
                          const std::string& want) {
    return absl::InvalidArgumentError(
        absl::StrFormat("policy.params['%s'] = '%s': must be %s", key, value, want));
  }

  const std::map<std::string, std::string>& params_;
  std::set<std::string> taken_;
};

absl::Status ReadConfidence(ParamReader& r, ConfidenceOptions* o) {
  KVTIER_RETURN_IF_ERROR(r.Int32("confidence.top_m", 1, 1 << 20, &o->top_m));
  KVTIER_RETURN_IF_ERROR(r.Float("confidence.w_entropy", 0, 1e6, &o->w_entropy));
  KVTIER_RETURN_IF_ERROR(r.Float("confidence.w_margin", 0, 1e6, &o->w_margin));
  KVTIER_RETURN_IF_ERROR(r.Float("confidence.w_top_mass", 0, 1e6, &o->w_top_mass));
  KVTIER_RETURN_IF_ERROR(r.Float("confidence.margin_scale", 1e-6, 1e6, &o->margin_scale));
  KVTIER_RETURN_IF_ERROR(r.Float("confidence.enter_tight", 0, 1, &o->enter_tight));
  KVTIER_RETURN_IF_ERROR(r.Float("confidence.exit_tight", 0, 1, &o->exit_tight));
  KVTIER_RETURN_IF_ERROR(r.Int32("confidence.confident_steps", 1, 1 << 20, &o->confident_steps));
  KVTIER_RETURN_IF_ERROR(r.Float("confidence.tight_fraction", 1e-6, 1, &o->tight_fraction));
  return o->Validate();
}

absl::Status ReadRanker(ParamReader& r, const std::string& prefix, AttentionRankerOptions* o) {
  KVTIER_RETURN_IF_ERROR(r.Float(prefix + ".beta", 0, 1, &o->beta));
  KVTIER_RETURN_IF_ERROR(r.Float(prefix + ".recency_weight", 0, 1, &o->recency_weight));
  KVTIER_RETURN_IF_ERROR(r.Int32(prefix + ".protected_pages", 0, 1 << 20, &o->protected_pages));
  return o->Validate();
}

absl::Status ReadEpiphany(ParamReader& r, EpiphanyOptions* o) {
  KVTIER_RETURN_IF_ERROR(r.Int32("epiphany.positive_first", 0, 1 << 16, &o->positive_first));
  KVTIER_RETURN_IF_ERROR(r.Int32("epiphany.positive_last", 0, 1 << 16, &o->positive_last));
  KVTIER_RETURN_IF_ERROR(r.Int32("epiphany.negative_first", 0, 1 << 16, &o->negative_first));
  KVTIER_RETURN_IF_ERROR(r.Int32("epiphany.negative_last", 0, 1 << 16, &o->negative_last));
  KVTIER_RETURN_IF_ERROR(r.Bool("epiphany.scale_bands", &o->scale_bands));
  KVTIER_RETURN_IF_ERROR(r.Int32("epiphany.window", 2, 1 << 20, &o->window));
  int aggregate = static_cast<int>(o->aggregate);
  KVTIER_RETURN_IF_ERROR(r.Choice("epiphany.aggregate", {"max", "mean"}, &aggregate));
  o->aggregate = static_cast<EpiphanyOptions::Aggregate>(aggregate);
  int signal = static_cast<int>(o->signal);
  KVTIER_RETURN_IF_ERROR(
      r.Choice("epiphany.signal", {"hidden_delta", "key_variance", "lag_kv"}, &signal));
  o->signal = static_cast<EpiphanyOptions::Signal>(signal);
  KVTIER_RETURN_IF_ERROR(r.Float("epiphany.pin_threshold", -1e6, 1e6, &o->pin_threshold));
  KVTIER_RETURN_IF_ERROR(r.Int32("epiphany.max_pinned_pages", 0, 1 << 20, &o->max_pinned_pages));
  return o->Validate();
}

absl::Status ReadXkv(ParamReader& r, XkvOptions* o) {
  KVTIER_RETURN_IF_ERROR(r.Int32("xkv.window", 1, 4096, &o->window));
  KVTIER_RETURN_IF_ERROR(r.Int32("xkv.pooling", 1, 4095, &o->pooling));
  KVTIER_RETURN_IF_ERROR(r.Int("xkv.total_pages", 0, int64_t{1} << 40, &o->total_pages));
  KVTIER_RETURN_IF_ERROR(r.Double("xkv.target_ratio", 0, 1, &o->target_ratio));
  KVTIER_RETURN_IF_ERROR(r.Int32("xkv.min_pages", 0, 1 << 20, &o->min_pages));
  KVTIER_RETURN_IF_ERROR(r.String("xkv.task_type", &o->task_type));
  return o->Validate();
}

absl::Status ReadKvCompress(ParamReader& r, KvCompressOptions* o) {
  KVTIER_RETURN_IF_ERROR(r.Int32("kv_compress.exclude_nearest", 0, 1 << 20, &o->exclude_nearest));
  KVTIER_RETURN_IF_ERROR(r.Int("kv_compress.total_pages", 0, int64_t{1} << 40, &o->total_pages));
  KVTIER_RETURN_IF_ERROR(r.Int32("kv_compress.min_pages", 0, 1 << 20, &o->min_pages));
  KVTIER_RETURN_IF_ERROR(r.Bool("kv_compress.decode_updates", &o->decode_updates));
  return o->Validate();
}

const std::vector<std::string>& BudgetNames() {
  static const auto* names =
      new std::vector<std::string>{"fixed", "confidence", "xkv", "kv_compress"};
  return *names;
}
const std::vector<std::string>& ResidencyNames() {
  static const auto* names =
      new std::vector<std::string>{"none", "attention", "h2o", "epiphany", "kv_compress"};
  return *names;
}

absl::Status CheckName(const std::string& field, const std::string& value,
                       const std::vector<std::string>& names) {
  for (const std::string& n : names) {
    if (n == value) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrFormat("policy.%s = '%s': unknown; one of %s", field,
                                                    value, absl::StrJoin(names, ", ")));
}

// Builds (or, with ctx == nullptr, only validates) the policies of `c`.
absl::StatusOr<Policies> Build(const PolicyConfig& c, const PolicyContext* ctx) {
  KVTIER_RETURN_IF_ERROR(CheckName("budget", c.budget, BudgetNames()));
  KVTIER_RETURN_IF_ERROR(CheckName("residency", c.residency, ResidencyNames()));
  Policies out;
  if (!ParseHostDropMode(c.host_drop, &out.host_drop)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "policy.host_drop = '%s': unknown; one of refuse (the default), evict, demote", c.host_drop));
  }
  ParamReader r(c.params);
  ConfidenceOptions conf;
  AttentionRankerOptions ranker;
  EpiphanyOptions epi;
  XkvOptions xkv;
  KvCompressOptions kvc;
  const bool kvc_on = c.budget == "kv_compress" || c.residency == "kv_compress";
  if (c.budget == "confidence") KVTIER_RETURN_IF_ERROR(ReadConfidence(r, &conf));
  if (c.budget == "xkv") KVTIER_RETURN_IF_ERROR(ReadXkv(r, &xkv));
  if (kvc_on) KVTIER_RETURN_IF_ERROR(ReadKvCompress(r, &kvc));
  if (c.residency == "attention") KVTIER_RETURN_IF_ERROR(ReadRanker(r, "attention", &ranker));
  if (c.residency == "h2o") {
    // H2O: accumulated attention, no recency term.
    ranker.cumulative = true;
    ranker.recency_weight = 0;
    KVTIER_RETURN_IF_ERROR(ReadRanker(r, "h2o", &ranker));
  }
  if (c.residency == "epiphany") KVTIER_RETURN_IF_ERROR(ReadEpiphany(r, &epi));
  KVTIER_RETURN_IF_ERROR(r.Finish(c));
  if (ctx == nullptr) return out;

  const PolicyContext& x = *ctx;
  KvCompressPolicies kv;
  if (kvc_on) {
    kv = MakeKvCompress(kvc, x.num_layers, x.num_q_heads, x.num_kv_heads, x.page_size,
                        x.default_pages);
  }
  if (c.budget == "confidence") {
    out.budget = std::make_unique<ConfidenceBudget>(conf, x.default_pages);
  } else if (c.budget == "xkv") {
    out.budget = std::make_unique<XkvBudget>(xkv, x.num_layers, x.num_kv_heads, x.default_pages,
                                             x.xkv_store);
  } else if (c.budget == "kv_compress") {
    out.budget = std::move(kv.budget);
  } else {
    out.budget = std::make_unique<FixedBudget>(x.default_pages);
  }
  if (c.residency == "attention" || c.residency == "h2o") {
    KVTIER_ASSIGN_OR_RETURN(out.residency,
                            AttentionRanker::Create(ranker, x.num_layers, x.num_kv_heads));
  } else if (c.residency == "epiphany") {
    KVTIER_ASSIGN_OR_RETURN(out.residency,
                            EpiphanyScorer::Create(epi, x.num_layers, x.num_kv_heads, x.page_size));
  } else if (kvc_on) {
    // The KV-Compress budget reads the metrics its ranker gathers: the ranker comes along.
    out.residency = std::move(kv.ranker);
  }
  return out;
}

}  // namespace

void FixedBudget::Budget(int32_t /*layer*/, int32_t max_pages, std::span<int32_t> out) {
  for (int32_t& b : out) b = std::min(pages_, max_pages);
}

absl::Status ValidatePolicyConfig(const PolicyConfig& c) { return Build(c, nullptr).status(); }

absl::StatusOr<Policies> MakePolicies(const PolicyConfig& c, const PolicyContext& ctx) {
  if (ctx.num_layers < 1 || ctx.num_q_heads < 1 || ctx.num_kv_heads < 1 || ctx.page_size < 1 ||
      ctx.default_pages < 0) {
    return absl::InvalidArgumentError("MakePolicies: the context's shape must be positive");
  }
  return Build(c, &ctx);
}

}  // namespace kvtier::policy
