// SeedCorpus and Mutate: valid cases of every target, and the mutations the seeded driver
// applies to them. Field-level mutations go through protobuf reflection, so every field of
// every request type gets random and extreme values, not only the fields named here.
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/reflection.h"
#include "kvtier/v1/kvtier.pb.h"
#include "tests/client/raw_attach.h"
#include "tests/daemon/fuzz/kvtierd_fuzz.h"

namespace kvtier::fuzz {
namespace {

namespace pb = google::protobuf;

// Geometry of the seed sessions: 2 layers, Hq 4, Hkv 2, d 16, p 8, fp16 (64-byte K rows).
constexpr uint32_t kLayers = 2, kQHeads = 4, kKvHeads = 2, kHeadDim = 16, kPage = 8;
constexpr size_t kRowBytes = size_t{kKvHeads} * kHeadDim * 2;

std::string Case(uint8_t target, const std::string& payload, uint8_t options = 0) {
  return std::string(1, static_cast<char>(target)) + static_cast<char>(options) + payload;
}

v1::Geometry SeedGeometry(v1::DType dtype = v1::DTYPE_FP16) {
  v1::Geometry g;
  g.set_num_layers(kLayers);
  g.set_num_q_heads(kQHeads);
  g.set_num_kv_heads(kKvHeads);
  g.set_head_dim(kHeadDim);
  g.set_page_size(kPage);
  g.set_dtype(dtype);
  return g;
}

v1::OffloadRequest Chunk(int session, uint32_t layer, uint32_t n, bool commit, uint8_t seed,
                         bool with_start = false, uint64_t start = 0) {
  v1::OffloadRequest r;
  r.set_session_id(SessionPlaceholder(session));
  r.set_layer(layer);
  r.set_num_tokens(n);
  std::string k(n * kRowBytes, '\0'), v(n * kRowBytes, '\0');
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<char>(seed + i * 7);
    v[i] = static_cast<char>(seed * 3 + i * 11);
  }
  r.set_k(k);
  r.set_v(v);
  r.set_commit(commit);
  if (with_start) r.set_start_token(start);
  return r;
}

std::string Frames(const std::vector<v1::OffloadRequest>& msgs) {
  std::string out;
  for (const v1::OffloadRequest& m : msgs) {
    const std::string b = m.SerializeAsString();
    out.push_back(static_cast<char>(b.size() & 0xff));
    out.push_back(static_cast<char>(b.size() >> 8));
    out += b;
  }
  return out;
}

// ---- field-level mutation --------------------------------------------------------------

uint64_t Interesting(std::mt19937_64& rng) {
  static const uint64_t kValues[] = {0,
                                     1,
                                     2,
                                     7,
                                     8,
                                     31,
                                     32,
                                     33,
                                     64,
                                     255,
                                     256,
                                     1024,
                                     4096,
                                     65535,
                                     65536,
                                     1u << 24,
                                     0x7fffffff,
                                     0x80000000,
                                     0xffffffff,
                                     1ull << 32,
                                     ~uint64_t{0},
                                     ~uint64_t{0} >> 1};
  if (rng() % 3 == 0) return rng();
  return kValues[rng() % (sizeof(kValues) / sizeof(kValues[0]))];
}

std::string RandomBytes(std::mt19937_64& rng, size_t max) {
  std::string s(rng() % (max + 1), '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

void MutateField(pb::Message* m, std::mt19937_64& rng, int depth) {
  const pb::Descriptor* d = m->GetDescriptor();
  if (d->field_count() == 0) return;
  const pb::FieldDescriptor* f = d->field(static_cast<int>(rng() % d->field_count()));
  const pb::Reflection* r = m->GetReflection();
  if (f->is_repeated()) {
    if (rng() % 4 == 0) {
      r->ClearField(m, f);
      return;
    }
    const int adds = 1 + static_cast<int>(rng() % (rng() % 8 == 0 ? 2000 : 3));
    for (int i = 0; i < adds; ++i) {
      switch (f->cpp_type()) {
        case pb::FieldDescriptor::CPPTYPE_UINT32:
          r->AddUInt32(m, f, static_cast<uint32_t>(Interesting(rng)));
          break;
        case pb::FieldDescriptor::CPPTYPE_UINT64:
          r->AddUInt64(m, f, Interesting(rng));
          break;
        case pb::FieldDescriptor::CPPTYPE_INT32:
          r->AddInt32(m, f, static_cast<int32_t>(Interesting(rng)));
          break;
        case pb::FieldDescriptor::CPPTYPE_INT64:
          r->AddInt64(m, f, static_cast<int64_t>(Interesting(rng)));
          break;
        case pb::FieldDescriptor::CPPTYPE_FLOAT:
          r->AddFloat(m, f, static_cast<float>(static_cast<int64_t>(Interesting(rng))));
          break;
        case pb::FieldDescriptor::CPPTYPE_STRING:
          r->AddString(m, f, RandomBytes(rng, 16));
          break;
        case pb::FieldDescriptor::CPPTYPE_MESSAGE:
          if (depth < 3) MutateField(r->AddMessage(m, f), rng, depth + 1);
          break;
        default:
          break;
      }
    }
    return;
  }
  switch (f->cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_UINT32:
      r->SetUInt32(m, f, static_cast<uint32_t>(Interesting(rng)));
      break;
    case pb::FieldDescriptor::CPPTYPE_UINT64:
      r->SetUInt64(m, f, Interesting(rng));
      break;
    case pb::FieldDescriptor::CPPTYPE_INT32:
      r->SetInt32(m, f, static_cast<int32_t>(Interesting(rng)));
      break;
    case pb::FieldDescriptor::CPPTYPE_INT64:
      r->SetInt64(m, f, static_cast<int64_t>(Interesting(rng)));
      break;
    case pb::FieldDescriptor::CPPTYPE_BOOL:
      r->SetBool(m, f, !r->GetBool(*m, f));
      break;
    case pb::FieldDescriptor::CPPTYPE_FLOAT: {
      static const float kFloats[] = {0.0f,
                                      -1.0f,
                                      1.0f,
                                      5.0f,
                                      -5.0f,
                                      std::numeric_limits<float>::infinity(),
                                      std::numeric_limits<float>::quiet_NaN(),
                                      1e30f};
      r->SetFloat(m, f, kFloats[rng() % (sizeof(kFloats) / sizeof(kFloats[0]))]);
      break;
    }
    case pb::FieldDescriptor::CPPTYPE_DOUBLE:
      r->SetDouble(m, f, static_cast<double>(Interesting(rng)));
      break;
    case pb::FieldDescriptor::CPPTYPE_ENUM:
      r->SetEnumValue(m, f, static_cast<int>(Interesting(rng) % 7) - 1);
      break;
    case pb::FieldDescriptor::CPPTYPE_STRING: {
      std::string v = r->GetString(*m, f);
      switch (rng() % 4) {
        case 0:
          v = RandomBytes(rng, 40);
          break;  // any bytes, bad UTF-8 too
        case 1:
          v.clear();
          break;
        case 2:
          if (!v.empty()) v.resize(rng() % v.size());
          break;  // truncated
        default:
          v += RandomBytes(rng, 8);
          break;  // grown
      }
      r->SetString(m, f, v);
      break;
    }
    case pb::FieldDescriptor::CPPTYPE_MESSAGE:
      if (depth < 3) MutateField(r->MutableMessage(m, f), rng, depth + 1);
      break;
  }
}

// The request type of a unary or server-streaming target.
std::unique_ptr<pb::Message> RequestOf(uint8_t target) {
  switch (target) {
    case kHello:
      return std::make_unique<v1::HelloRequest>();
    case kOpenSession:
      return std::make_unique<v1::OpenSessionRequest>();
    case kCloseSession:
      return std::make_unique<v1::CloseSessionRequest>();
    case kListSessions:
      return std::make_unique<v1::ListSessionsRequest>();
    case kReattach:
      return std::make_unique<v1::ReattachRequest>();
    case kOffload:
      return std::make_unique<v1::OffloadRequest>();
    case kFetch:
      return std::make_unique<v1::FetchRequest>();
    case kStep:
      return std::make_unique<v1::StepRequest>();
    case kGetStats:
      return std::make_unique<v1::GetStatsRequest>();
    case kDrain:
      return std::make_unique<v1::DrainRequest>();
    case kSuspendSession:
      return std::make_unique<v1::SuspendSessionRequest>();
    case kDemotePages:
      return std::make_unique<v1::DemotePagesRequest>();
    case kPromotePages:
      return std::make_unique<v1::PromotePagesRequest>();
    case kReportSignals:
      return std::make_unique<v1::ReportSignalsRequest>();
    default:
      return std::make_unique<v1::AttachRequest>();
  }
}

// ---- byte-level mutation -----------------------------------------------------------------

std::string MutateBytes(std::string s, const std::vector<std::string>& corpus,
                        std::mt19937_64& rng) {
  const size_t n = s.size();
  switch (rng() % 9) {
    case 0:  // flip a bit
      if (n > 0) s[rng() % n] ^= static_cast<char>(1 << (rng() % 8));
      break;
    case 1:  // a random byte
      if (n > 0) s[rng() % n] = static_cast<char>(rng());
      break;
    case 2:  // insert random bytes
      s.insert(n == 0 ? 0 : rng() % (n + 1), RandomBytes(rng, 8));
      break;
    case 3:  // delete a range
      if (n > 0) {
        const size_t at = rng() % n;
        s.erase(at, 1 + rng() % std::max<size_t>(1, n - at));
      }
      break;
    case 4:  // truncate
      if (n > 0) s.resize(rng() % n);
      break;
    case 5: {  // duplicate a range
      if (n > 0) {
        const size_t at = rng() % n, len = 1 + rng() % std::min<size_t>(64, n - at);
        s.insert(rng() % (n + 1), s.substr(at, len));
      }
      break;
    }
    case 6: {  // splice the tail of another case's payload
      const std::string& other = corpus[rng() % corpus.size()];
      if (other.size() > 2)
        s = s.substr(0, n == 0 ? 0 : rng() % (n + 1)) +
            other.substr(2 + rng() % (other.size() - 2));
      break;
    }
    case 7:  // an overlong varint or a huge length
      s.insert(n == 0 ? 0 : rng() % (n + 1),
               rng() % 2 ? std::string(11, '\xff') : std::string("\x0a\xff\xff\xff\xff\x0f", 6));
      break;
    default:  // all random
      s = RandomBytes(rng, 64);
      break;
  }
  return s;
}

std::string MutateMessage(uint8_t target, const std::string& bytes,
                          const std::vector<std::string>& corpus, std::mt19937_64& rng) {
  std::unique_ptr<pb::Message> m = RequestOf(target);
  if (rng() % 2 == 0 && m->ParseFromString(bytes)) {
    MutateField(m.get(), rng, 0);
    return m->SerializeAsString();
  }
  return MutateBytes(bytes, corpus, rng);
}

std::string MutateAttach(const std::string& payload, const std::vector<std::string>& corpus,
                         std::mt19937_64& rng) {
  if (payload.size() >= 4 && rng() % 2 == 0) {
    // Mutate the request inside its frame and fix the length prefix (sometimes not).
    std::string body = MutateMessage(kAttach, payload.substr(4), corpus, rng);
    const uint32_t len = rng() % 8 == 0 ? static_cast<uint32_t>(Interesting(rng))
                                        : static_cast<uint32_t>(body.size());
    std::string out(4, '\0');
    for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((len >> (8 * i)) & 0xff);
    return out + body;
  }
  return MutateBytes(payload, corpus, rng);
}

std::string MutateOffload(const std::string& payload, const std::vector<std::string>& corpus,
                          std::mt19937_64& rng) {
  std::vector<std::string> frames;
  for (size_t i = 0; i + 2 <= payload.size();) {
    const size_t n = static_cast<uint8_t>(payload[i]) | (static_cast<uint8_t>(payload[i + 1]) << 8);
    if (i + 2 + n > payload.size()) break;
    frames.push_back(payload.substr(i + 2, n));
    i += 2 + n;
  }
  if (frames.empty()) frames.push_back(std::string());
  const size_t k = rng() % frames.size();
  switch (rng() % 6) {
    case 0:
      frames.erase(frames.begin() + static_cast<long>(k));
      break;
    case 1:
      frames.insert(frames.begin() + static_cast<long>(k), frames[k]);
      break;
    case 2:
      std::swap(frames[k], frames[rng() % frames.size()]);
      break;
    case 3:
      frames.insert(frames.begin() + static_cast<long>(k), RandomBytes(rng, 12));
      break;
    default:
      frames[k] = MutateMessage(kOffload, frames[k], corpus, rng);
      break;
  }
  std::string out;
  for (const std::string& f : frames) {
    const size_t n = std::min<size_t>(f.size(), 0xffff);
    out.push_back(static_cast<char>(n & 0xff));
    out.push_back(static_cast<char>(n >> 8));
    out.append(f, 0, n);
  }
  return out;
}

}  // namespace

std::vector<std::string> SeedCorpus() {
  std::vector<std::string> c;
  // Sessions first, so the placeholders resolve: GRPC and SHM, in every mode, both tenants.
  for (const v1::Transport t : {v1::TRANSPORT_GRPC, v1::TRANSPORT_SHM}) {
    for (const v1::Mode mode :
         {v1::MODE_SPECULATIVE, v1::MODE_SYNC, v1::MODE_FULL, v1::MODE_DROP}) {
      v1::OpenSessionRequest r;
      r.set_tenant("a");
      *r.mutable_geometry() = SeedGeometry();
      r.mutable_retrieval()->set_mode(mode);
      r.mutable_retrieval()->set_budget_tokens(64);
      r.mutable_retrieval()->set_max_tokens(256);
      r.set_transport(t);
      r.set_label("fuzz");
      c.push_back(Case(kOpenSession, r.SerializeAsString()));
      r.set_request_id("fuzz-request-1");
      c.push_back(Case(kOpenSession, r.SerializeAsString(), /*short deadline*/ 0x18));
    }
  }
  {
    v1::OpenSessionRequest r;
    r.set_tenant("b");
    *r.mutable_geometry() = SeedGeometry(v1::DTYPE_FP32);
    r.mutable_retrieval()->set_max_tokens(128);
    r.mutable_policy()->set_budget_policy("confidence");
    (*r.mutable_policy()->mutable_params())["confidence.enter_tight"] = "0.5";
    r.set_transport(v1::TRANSPORT_GRPC);
    c.push_back(Case(kOpenSession, r.SerializeAsString(), /*tenant b*/ 2));
  }
  {
    v1::HelloRequest r;
    r.set_protocol_version(1);
    r.set_client_name("fuzz");
    c.push_back(Case(kHello, r.SerializeAsString()));
  }
  // Offload streams to the first live session.
  c.push_back(Case(kOffload, Frames({Chunk(0, 0, 8, true, 1)})));
  c.push_back(Case(kOffload, Frames({Chunk(0, 0, 12, false, 2), Chunk(0, 1, 12, false, 3)})));
  c.push_back(Case(kOffload, Frames({Chunk(0, 0, 5, true, 4), Chunk(0, 1, 9, false, 5),
                                     Chunk(0, 1, 3, true, 6), Chunk(0, 0, 16, false, 7)})));
  c.push_back(Case(kOffload,
                   Frames({Chunk(1, 1, 4, false, 8, true, 0), Chunk(1, 1, 4, true, 9, true, 4)})));
  c.push_back(Case(kOffload, Frames({Chunk(0, 0, 3, true, 10), Chunk(0, 0, 3, true, 11)}), 0x18));
  {
    v1::FetchRequest r;
    r.set_session_id(SessionPlaceholder(0));
    r.set_layer(0);
    c.push_back(Case(kFetch, r.SerializeAsString()));
    r.add_pages(0);
    r.add_pages(1);
    r.add_pages(0);
    c.push_back(Case(kFetch, r.SerializeAsString()));
  }
  for (uint64_t step : {0, 1, 2}) {
    v1::StepRequest r;
    r.set_session_id(SessionPlaceholder(0));
    r.set_layer(static_cast<uint32_t>(step % 2));
    std::string q(kQHeads * kHeadDim * 2, '\0');
    for (size_t i = 0; i < q.size(); i += 2) q[i + 1] = static_cast<char>(0x38 + (i % 7));
    r.set_q(q);
    r.set_want_output(step != 2);
    r.set_step(step);
    c.push_back(Case(kStep, r.SerializeAsString(), step == 2 ? 0x18 : 0));
  }
  {
    // Signals (logits, hidden-state changes), an observation window, both, and their retry.
    v1::ReportSignalsRequest r;
    r.set_session_id(SessionPlaceholder(0));
    r.set_first_position(0);
    r.set_num_tokens(2);
    for (int i = 0; i < 16; ++i) r.add_logits(static_cast<float>(i % 5));
    for (int i = 0; i < 4; ++i) r.add_hidden_delta(0.5f * static_cast<float>(i));
    r.set_num_layers(2);
    c.push_back(Case(kReportSignals, r.SerializeAsString()));
    c.push_back(Case(kReportSignals, r.SerializeAsString()));
    v1::ReportSignalsRequest o;
    o.set_session_id(SessionPlaceholder(0));
    o.set_observe_layer(1);
    std::string q(2 * kQHeads * kHeadDim * 2, '\0');
    for (size_t i = 0; i < q.size(); i += 2) q[i + 1] = static_cast<char>(0x38 + (i % 5));
    o.set_observe_q(q);
    o.set_observe_first_position(4);
    c.push_back(Case(kReportSignals, o.SerializeAsString()));
    o.MergeFrom(r);
    o.mutable_logit_summary()->set_normalized_entropy(0.2f);
    o.mutable_logit_summary()->set_top_mass(0.9f);
    c.push_back(Case(kReportSignals, o.SerializeAsString()));
  }
  {
    v1::ReattachRequest r;
    r.set_session_id(SessionPlaceholder(1));
    c.push_back(Case(kReattach, r.SerializeAsString()));
    v1::GetStatsRequest g;
    c.push_back(Case(kGetStats, g.SerializeAsString()));
    g.set_session_id(SessionPlaceholder(0));
    c.push_back(Case(kGetStats, g.SerializeAsString()));
    c.push_back(Case(kListSessions, v1::ListSessionsRequest().SerializeAsString()));
    v1::DrainRequest d;
    d.set_timeout_ms(10);
    c.push_back(Case(kDrain, d.SerializeAsString()));
    v1::SuspendSessionRequest suspend;
    suspend.set_session_id(SessionPlaceholder(1));
    c.push_back(Case(kSuspendSession, suspend.SerializeAsString()));
    v1::DemotePagesRequest demote;
    demote.set_session_id(SessionPlaceholder(3));
    demote.set_epoch(1);
    v1::PageSlot* ps = demote.add_pages();
    ps->set_layer(0);
    ps->set_page(0);
    ps->set_slot(0);
    ps->set_generation(1);
    c.push_back(Case(kDemotePages, demote.SerializeAsString()));
    v1::PromotePagesRequest promote;
    promote.set_session_id(SessionPlaceholder(3));
    promote.set_epoch(1);
    *promote.add_pages() = *ps;
    c.push_back(Case(kPromotePages, promote.SerializeAsString()));
    v1::CloseSessionRequest close;
    close.set_session_id(SessionPlaceholder(2));
    c.push_back(Case(kCloseSession, close.SerializeAsString()));
  }
  for (uint32_t version : {1u, 999u}) {
    v1::AttachRequest r;
    r.set_protocol_version(version);
    r.set_tenant("a");
    r.set_token("ta");
    c.push_back(Case(kAttach, testing::FramedAttachRequest(r)));
  }
  return c;
}

std::string Mutate(const std::string& input, const std::vector<std::string>& corpus,
                   std::mt19937_64& rng) {
  if (input.size() < 2)
    return Case(static_cast<uint8_t>(rng() % kNumTargets), RandomBytes(rng, 32));
  uint8_t target = static_cast<uint8_t>(input[0]) % kNumTargets;
  uint8_t options = static_cast<uint8_t>(input[1]);
  std::string payload = input.substr(2);
  const int rounds = rng() % 2 == 0 ? 1 : 1 + static_cast<int>(rng() % 4);
  for (int i = 0; i < rounds; ++i) {
    const uint64_t what = rng() % 20;
    if (what == 0) {
      options = static_cast<uint8_t>(rng());  // another caller or deadline
    } else if (what == 1) {
      target = static_cast<uint8_t>(rng() % kNumTargets);  // the bytes to another method
    } else if (target == kOffload) {
      payload = MutateOffload(payload, corpus, rng);
    } else if (target == kAttach) {
      payload = MutateAttach(payload, corpus, rng);
    } else {
      payload = MutateMessage(target, payload, corpus, rng);
    }
  }
  return Case(target, payload, options);
}

}  // namespace kvtier::fuzz
