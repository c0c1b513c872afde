// The geometry, session options and trace every service integration test uses (small
// enough for CI, large enough that selection, speculation and correction all happen).
#ifndef KVTIER_TESTS_CLIENT_INTEGRATION_OPTIONS_H_
#define KVTIER_TESTS_CLIENT_INTEGRATION_OPTIONS_H_

#include "kvtier/client.h"
#include "tests/client/session_trace.h"

namespace kvtier::testing {

// 2 layers, Hq 8, Hkv 2, d 64, p 32, fp16.
inline Geometry IntegrationGeometry() {
  Geometry g;
  g.num_layers = 2;
  g.num_q_heads = 8;
  g.num_kv_heads = 2;
  g.head_dim = 64;
  g.page_size = 32;
  g.dtype = DType::kF16;
  return g;
}

// Budget 512 tokens (4 sink + 8 selected + 4 recent pages), 2048 tokens per layer, τ 0.9.
inline SessionOptions IntegrationSessionOptions(Transport transport, Device* device = nullptr) {
  SessionOptions o;
  o.geometry = IntegrationGeometry();
  (void)o.sequence.SetBudgetTokens(512, 32);
  o.sequence.max_tokens = 2048;
  o.sequence.correction_threshold = 0.9f;
  o.transport = transport;
  o.device = device;
  o.label = "integration";
  return o;
}

inline TraceOptions IntegrationTrace() {
  TraceOptions t;
  t.geometry = IntegrationGeometry();
  t.prefill = 600;
  t.steps = 40;
  t.seed = 7;
  return t;
}

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_CLIENT_INTEGRATION_OPTIONS_H_
