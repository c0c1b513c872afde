/* Compiled as C (not C++): include/kvtier/c_api.h must be valid C99 with no C++ in it. The
 * function below touches every declaration so a C compiler checks each one; the C++ test
 * calls it. */
#include <stddef.h>
#include <string.h>

#include "kvtier/c_api.h"

int kvtier_c_api_compile_check(void) {
  kvtier_client_options co;
  kvtier_session_options so;
  kvtier_client* client = NULL;
  kvtier_session* session = NULL;
  int32_t num_slots = 0;
  int rc;
  kvtier_client_options_init(&co);
  kvtier_session_options_init(&so);
  so.geometry.num_layers = 1;
  so.mode = KVTIER_MODE_SYNC;
  so.transport = KVTIER_TRANSPORT_GRPC;
  so.correction_trigger = KVTIER_CORRECTION_TRIGGER_MASS;
  so.correction_max_loss = 0.1f;
  if (strlen(kvtier_version()) == 0) return 1;
  /* Null arguments are refused with INVALID_ARGUMENT and a message, never a crash. */
  rc = kvtier_connect(NULL, &co, &client);
  if (rc != KVTIER_INVALID_ARGUMENT || strlen(kvtier_last_error()) == 0) return 2;
  if (kvtier_open_session(client, &so, &session) != KVTIER_INVALID_ARGUMENT) return 3;
  if (kvtier_reattach(client, "x", &so, &session) != KVTIER_INVALID_ARGUMENT) return 4;
  if (kvtier_append(session, 0, NULL, NULL, 1) != KVTIER_INVALID_ARGUMENT) return 5;
  if (kvtier_decode(session, 0, NULL, NULL, NULL, &num_slots, NULL, 0) != KVTIER_INVALID_ARGUMENT) {
    return 6;
  }
  if (kvtier_flush(session) != KVTIER_INVALID_ARGUMENT) return 9;
  if (kvtier_close_session(session) != KVTIER_INVALID_ARGUMENT) return 10;
  if (kvtier_session_suspend(session) != KVTIER_INVALID_ARGUMENT) return 14;
  if (strcmp(kvtier_session_id(session), "") != 0) return 11;
  if (kvtier_num_tokens(session, 0) != 0) return 12;
  kvtier_session_free(session);
  kvtier_client_free(client);
  if (so.geometry.dtype != KVTIER_DTYPE_F16 || co.rpc_timeout_ms <= 0) return 13;
  return 0;
}
