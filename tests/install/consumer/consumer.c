/* An engine in plain C99 outside kvtier's tree, built against an installed kvtier through
 * pkg-config (kvtier.pc): connects to a running kvtierd, opens an SHM session with a tiny
 * fp32 geometry, appends a prompt, runs a few decode steps per layer and closes.
 *
 *   consumer_c unix:///path/kvtierd.sock [tenant]
 * Prints one line and exits 0, or prints the failing call and exits 1. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kvtier/c_api.h"

#define LAYERS 2
#define Q_HEADS 4
#define KV_HEADS 2
#define HEAD_DIM 64
#define PAGE_SIZE 16
#define PREFILL_TOKENS 100
#define STEPS 3

static uint32_t rng_state = 12345u;

/* Deterministic values in [-1, 1). */
static float next_random(void) {
  rng_state = rng_state * 1664525u + 1013904223u;
  return (float)(rng_state >> 8) / (float)(1u << 23) - 1.0f;
}

static void fill(float* x, size_t n) {
  size_t i;
  for (i = 0; i < n; ++i) x[i] = next_random();
}

static int failed(const char* call, int code) {
  fprintf(stderr, "consumer_c: FAILED: %s: code %d: %s\n", call, code, kvtier_last_error());
  return 1;
}

int main(int argc, char** argv) {
  kvtier_client_options client_options;
  kvtier_session_options options;
  kvtier_client* client = NULL;
  kvtier_session* session = NULL;
  static float k[PREFILL_TOKENS * KV_HEADS * HEAD_DIM];
  static float v[PREFILL_TOKENS * KV_HEADS * HEAD_DIM];
  float q[Q_HEADS * HEAD_DIM];
  float out[Q_HEADS * HEAD_DIM];
  float step_k[KV_HEADS * HEAD_DIM];
  float step_v[KV_HEADS * HEAD_DIM];
  int32_t num_slots = 0;
  int32_t layer;
  int step;
  size_t i;
  int rc;

  if (argc < 2 || argc > 3) {
    fprintf(stderr, "usage: %s TARGET [TENANT]\n", argv[0]);
    return 2;
  }
  kvtier_client_options_init(&client_options);
  client_options.tenant = argc == 3 ? argv[2] : "default";
  client_options.client_name = "kvtier-install-consumer-c";
  rc = kvtier_connect(argv[1], &client_options, &client);
  if (rc != KVTIER_OK) return failed("kvtier_connect", rc);

  kvtier_session_options_init(&options);
  options.geometry.num_layers = LAYERS;
  options.geometry.num_q_heads = Q_HEADS;
  options.geometry.num_kv_heads = KV_HEADS;
  options.geometry.head_dim = HEAD_DIM;
  options.geometry.page_size = PAGE_SIZE;
  options.geometry.dtype = KVTIER_DTYPE_F32;
  options.mode = KVTIER_MODE_SPECULATIVE;
  options.budget_tokens = 4 * PAGE_SIZE;
  options.max_tokens = 1024;
  options.transport = KVTIER_TRANSPORT_SHM;
  options.label = "install-consumer-c";
  rc = kvtier_open_session(client, &options, &session);
  if (rc != KVTIER_OK) {
    kvtier_client_free(client);
    return failed("kvtier_open_session", rc);
  }

  for (layer = 0; layer < LAYERS; ++layer) {
    fill(k, sizeof(k) / sizeof(k[0]));
    fill(v, sizeof(v) / sizeof(v[0]));
    rc = kvtier_append(session, layer, k, v, PREFILL_TOKENS);
    if (rc != KVTIER_OK) goto fail_append;
  }
  for (step = 0; step < STEPS; ++step) {
    for (layer = 0; layer < LAYERS; ++layer) {
      fill(step_k, sizeof(step_k) / sizeof(step_k[0]));
      fill(step_v, sizeof(step_v) / sizeof(step_v[0]));
      fill(q, sizeof(q) / sizeof(q[0]));
      rc = kvtier_append(session, layer, step_k, step_v, 1);
      if (rc != KVTIER_OK) goto fail_append;
      rc = kvtier_decode(session, layer, q, out, NULL, &num_slots, NULL, 0);
      if (rc != KVTIER_OK) {
        failed("kvtier_decode", rc);
        goto fail;
      }
      for (i = 0; i < sizeof(out) / sizeof(out[0]); ++i) {
        if (!isfinite(out[i])) {
          fprintf(stderr, "consumer_c: FAILED: step %d layer %d: output %lu is not finite\n", step,
                  (int)layer, (unsigned long)i);
          goto fail;
        }
      }
    }
  }
  for (layer = 0; layer < LAYERS; ++layer) {
    if (kvtier_num_tokens(session, layer) != PREFILL_TOKENS + STEPS) {
      fprintf(stderr, "consumer_c: FAILED: kvtier_num_tokens(%d) = %d, expected %d\n", (int)layer,
              (int)kvtier_num_tokens(session, layer), PREFILL_TOKENS + STEPS);
      goto fail;
    }
  }
  rc = kvtier_flush(session);
  if (rc != KVTIER_OK) {
    failed("kvtier_flush", rc);
    goto fail;
  }
  rc = kvtier_close_session(session);
  if (rc != KVTIER_OK) {
    failed("kvtier_close_session", rc);
    goto fail;
  }
  printf(
      "consumer_c: OK: shm session %s, %d layers x (%d tokens + %d decode steps), "
      "%d working-set slots, %s\n",
      kvtier_session_id(session), LAYERS, PREFILL_TOKENS, STEPS, (int)num_slots, kvtier_version());
  kvtier_session_free(session);
  kvtier_client_free(client);
  return 0;

fail_append:
  failed("kvtier_append", rc);
fail:
  kvtier_session_free(session);
  kvtier_client_free(client);
  return 1;
}
