# kvtier-run generate end to end on the shipped model (cmake -P script): settings from a TOML
# config file with one flag overriding it, every mode side by side, the JSON report has one
# run per mode with the numbers the summary promises; full mode's text equals the dense
# loop's; a config with an unknown key is refused naming it (exit 2); the mass correction
# trigger runs and bad trigger flags are refused.
#   -DRUN=<kvtier-run> -DMODEL_DIR=<engine/model> -DWORK=<scratch dir>
cmake_minimum_required(VERSION 3.19)  # string(JSON)
file(MAKE_DIRECTORY "${WORK}")
file(WRITE "${WORK}/run.toml" "
model = \"${MODEL_DIR}/kvtier-tiny.gguf\"
modes = \"full,speculative,sync,drop,dense\"
budget = 128
n = 200
kv_dtype = \"fp32\"
threads = 2
[policy]
budget = \"fixed\"
")
execute_process(
  COMMAND "${RUN}" generate --config "${WORK}/run.toml" --prompt-file
    "${MODEL_DIR}/golden/prompt.txt" -n 16 --json "${WORK}/out.json" --no-stream
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "kvtier-run generate failed (${rc}):\n${err}")
endif()
message("${err}")
file(READ "${WORK}/out.json" json)
string(JSON budget GET "${json}" budget_tokens)
string(JSON n GET "${json}" new_tokens)
if(NOT budget EQUAL 128 OR NOT n EQUAL 16)
  message(FATAL_ERROR "budget_tokens = ${budget} (config: 128), new_tokens = ${n} (flag: 16)")
endif()
string(JSON runs LENGTH "${json}" runs)
if(NOT runs EQUAL 5)
  message(FATAL_ERROR "${runs} runs, want one per mode (5):\n${json}")
endif()
math(EXPR last "${runs} - 1")
foreach(i RANGE ${last})
  string(JSON mode GET "${json}" runs ${i} mode)
  string(JSON count LENGTH "${json}" runs ${i} tokens)
  if(NOT count EQUAL 16)
    message(FATAL_ERROR "${mode}: ${count} tokens, want 16")
  endif()
  foreach(key prefill_tokens_per_s decode_tokens_per_s device_kv_bytes full_kv_bytes agreement)
    string(JSON type ERROR_VARIABLE json_error TYPE "${json}" runs ${i} ${key})
    if(json_error OR NOT type STREQUAL "NUMBER")
      message(FATAL_ERROR "${mode}: no number \"${key}\":\n${json}")
    endif()
  endforeach()
  string(JSON text_${mode} GET "${json}" runs ${i} text)
  string(JSON held_${mode} GET "${json}" runs ${i} device_kv_bytes)
endforeach()
if(NOT text_full STREQUAL text_dense)
  message(FATAL_ERROR "full mode and the dense loop differ:\n${text_full}\n---\n${text_dense}")
endif()
if(NOT held_speculative LESS held_full)
  message(FATAL_ERROR "speculative holds ${held_speculative} bytes, full ${held_full}")
endif()

file(WRITE "${WORK}/bad.toml" "model = \"x.gguf\"\nbugdet = 128\n")
execute_process(COMMAND "${RUN}" generate --config "${WORK}/bad.toml" --prompt hi
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 2 OR NOT err MATCHES "unknown key 'bugdet'")
  message(FATAL_ERROR "a config with an unknown key: exit ${rc}, stderr:\n${err}")
endif()

# The correction trigger: mass with a tolerated loss of 1 never corrects; bad values exit 2.
execute_process(
  COMMAND "${RUN}" generate --model "${MODEL_DIR}/kvtier-tiny.gguf" --prompt-file
    "${MODEL_DIR}/golden/prompt.txt" -n 8 --modes speculative --budget 128 --trigger mass
    --max-loss 1 --threads 2 --json "${WORK}/mass.json" --no-stream --quiet
  RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "generate --trigger mass failed (${rc}):\n${err}")
endif()
file(READ "${WORK}/mass.json" json)
string(JSON rate GET "${json}" runs 0 correction_rate)
if(NOT rate EQUAL 0)
  message(FATAL_ERROR "--trigger mass --max-loss 1 corrected (rate ${rate})")
endif()
foreach(bad "--trigger;entropy;--trigger: unknown 'entropy'" "--max-loss;2;correction_max_loss = 2: must be in")
  list(GET bad 0 flag)
  list(GET bad 1 value)
  list(GET bad 2 pattern)
  execute_process(COMMAND "${RUN}" generate --model "${MODEL_DIR}/kvtier-tiny.gguf" --prompt hi
    ${flag} ${value} RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 2 OR NOT err MATCHES "${pattern}")
    message(FATAL_ERROR "${flag} ${value}: exit ${rc} (want 2 naming it):\n${err}")
  endif()
endforeach()
