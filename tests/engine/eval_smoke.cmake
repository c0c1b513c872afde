# kvtier-run eval and trace end to end on the shipped model (cmake -P script): the eval's
# JSON has one result per (variant, budget) after full mode's, with every metric, per-layer
# recall and full mode as its own reference; both PNG plots are written; bad flags are
# refused naming the flag (exit 2); a run that fails is a FAILED row with its error while
# the others, the JSON and the plots are still written (exit 2 for an invalid option); the
# trace has the size docs/trace-format.md gives and, when kvtier-bench is there, replays
# (every layer).
#   -DRUN=<kvtier-run> [-DBENCH=<kvtier-bench>] -DMODEL_DIR=<engine/model> -DWORK=<dir>
cmake_minimum_required(VERSION 3.19)  # string(JSON)
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
set(model "${MODEL_DIR}/kvtier-tiny.gguf")
set(text "${MODEL_DIR}/golden/eval.txt")
execute_process(
  COMMAND "${RUN}" eval --model "${model}" --text "${text}" --context 320 --steps 32
    --budgets 128 --variants speculative:tau=0.5,speculative-mass,window --recall-every 8 --threads 2
    --json "${WORK}/eval.json" --plot "${WORK}/eval"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "kvtier-run eval failed (${rc}):\n${err}")
endif()
message("${out}")
file(READ "${WORK}/eval.json" json)
string(JSON n LENGTH "${json}" results)
if(NOT n EQUAL 4)
  message(FATAL_ERROR "${n} results, want full + 3 variants × 1 budget:\n${json}")
endif()
string(JSON tau_name GET "${json}" results 1 variant)
if(NOT tau_name STREQUAL "speculative:tau=0.5")
  message(FATAL_ERROR "result 1 is '${tau_name}', want the swept variant speculative:tau=0.5")
endif()
foreach(i RANGE 3)
  string(JSON variant GET "${json}" results ${i} variant)
  foreach(key perplexity top1_agreement kl attn_mass_recall_tokens attn_mass_recall_pages
      correction_rate recalled_bytes_per_token ms_per_token resident_bytes)
    string(JSON type ERROR_VARIABLE json_error TYPE "${json}" results ${i} ${key})
    if(json_error OR NOT type STREQUAL "NUMBER")
      message(FATAL_ERROR "${variant}: no number \"${key}\":\n${json}")
    endif()
  endforeach()
  string(JSON layers LENGTH "${json}" results ${i} layers)
  if(NOT layers EQUAL 6)
    message(FATAL_ERROR "${variant}: ${layers} per-layer results, want the model's 6")
  endif()
  string(JSON steps GET "${json}" results ${i} steps)
  if(NOT steps EQUAL 32)
    message(FATAL_ERROR "${variant}: ${steps} steps, want 32")
  endif()
endforeach()
string(JSON full GET "${json}" results 0 variant)
string(JSON full_recall GET "${json}" results 0 attn_mass_recall_tokens)
string(JSON full_top1 GET "${json}" results 0 top1_agreement)
if(NOT full STREQUAL "full" OR NOT full_recall EQUAL 1 OR NOT full_top1 EQUAL 1)
  message(FATAL_ERROR "full mode first, its own reference (recall ${full_recall}, top-1 ${full_top1})")
endif()
string(JSON mass GET "${json}" results 2 variant)
string(JSON budget GET "${json}" results 2 budget_tokens)
if(NOT mass STREQUAL "speculative-mass" OR NOT budget EQUAL 128)
  message(FATAL_ERROR "result 2 is ${mass} at ${budget}, want speculative-mass at 128")
endif()
if(NOT out MATCHES "speculative-mass +1/2.5 ")
  message(FATAL_ERROR "the table has no speculative-mass row at 1/2.5 of the context:\n${out}")
endif()
foreach(png eval-ppl.png eval-kl.png eval-recall.png)
  file(READ "${WORK}/${png}" magic LIMIT 8 HEX)
  if(NOT magic STREQUAL "89504e470d0a1a0a")
    message(FATAL_ERROR "${png} is not a PNG (${magic})")
  endif()
endforeach()

# One run that fails does not lose the others: speculative-mass with a loss outside [0, 1]
# is refused when its sequence opens (a real failure, of that variant alone). Its row says
# FAILED with the error, in the table and the JSON; the other rows, the JSON and the plots
# are still written; the exit status is non-zero (2: the failure was an invalid option).
file(REMOVE "${WORK}/partial.json" "${WORK}/partial-ppl.png")
execute_process(
  COMMAND "${RUN}" eval --model "${model}" --text "${text}" --context 320 --steps 8
    --budgets 128 --variants window,speculative-mass:loss=2,sync --recall-every 8 --threads 2
    --json "${WORK}/partial.json" --plot "${WORK}/partial"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 2)
  message(FATAL_ERROR "a failed run: exit ${rc}, want 2 (an invalid option):\n${out}\n${err}")
endif()
if(NOT out MATCHES "speculative-mass:loss=2 +1/2.5 FAILED: INVALID_ARGUMENT: [^\n]*correction_max_loss"
   OR NOT out MATCHES "\nwindow +1/2.5 +[0-9.]+ " OR NOT out MATCHES "\nsync +1/2.5 +[0-9.]+ ")
  message(FATAL_ERROR "the table lacks the FAILED row or the others:\n${out}")
endif()
if(NOT err MATCHES "speculative-mass:loss=2@128 failed: INVALID_ARGUMENT")
  message(FATAL_ERROR "stderr does not name the failed run:\n${err}")
endif()
file(READ "${WORK}/partial.json" json)
string(JSON n LENGTH "${json}" results)
if(NOT n EQUAL 4)
  message(FATAL_ERROR "${n} results, want full + window + the failed run + sync:\n${json}")
endif()
string(JSON failed GET "${json}" results 2 variant)
string(JSON error GET "${json}" results 2 error)
string(JSON budget GET "${json}" results 2 budget_tokens)
if(NOT failed STREQUAL "speculative-mass:loss=2" OR NOT budget EQUAL 128
   OR NOT error MATCHES "correction_max_loss = 2")
  message(FATAL_ERROR "result 2 is ${failed}@${budget} with error '${error}':\n${json}")
endif()
foreach(i 0 1 3)
  string(JSON variant GET "${json}" results ${i} variant)
  string(JSON ppl ERROR_VARIABLE json_error GET "${json}" results ${i} perplexity)
  string(JSON error ERROR_VARIABLE lookup GET "${json}" results ${i} error)
  if(json_error OR lookup STREQUAL "NOTFOUND")  # no perplexity, or an error found
    message(FATAL_ERROR "${variant} lost its metrics or carries an error:\n${json}")
  endif()
endforeach()
file(READ "${WORK}/partial-ppl.png" magic LIMIT 8 HEX)
if(NOT magic STREQUAL "89504e470d0a1a0a")
  message(FATAL_ERROR "the plots of the runs that succeeded were not written (${magic})")
endif()

# Bad flags and input: exit 2, naming what is wrong.
function(expect_refused what pattern)
  execute_process(COMMAND "${RUN}" eval --model "${model}" --text "${text}" ${ARGN}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 2 OR NOT err MATCHES "${pattern}")
    message(FATAL_ERROR "${what}: exit ${rc} (want 2), stderr does not match '${pattern}':\n${err}")
  endif()
endfunction()
expect_refused("unknown variant" "--variants: unknown 'bogus'.*speculative-mass" --variants bogus)
expect_refused("a parameter the variant does not have" "'speculative-mass:tau=0.5': a parameter"
  --variants speculative-mass:tau=0.5)
expect_refused("budget not a multiple of 4 pages" "--budgets 100"
  --context 320 --steps 8 --budgets 100 --variants window)
expect_refused("budget not below the context" "--budgets 384"
  --context 320 --steps 8 --budgets 384 --variants window)
expect_refused("text too short" "needs 9009" --prefill 9000 --steps 8 --variants window)

# A real decode trace: 64 prompt tokens, 8 steps, fp16, pages of 8.
execute_process(
  COMMAND "${RUN}" trace --model "${model}" --text "${text}" --prefill 64 --steps 8
    --page-size 8 --out "${WORK}/t.kvtrace" --threads 2
  RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "kvtier-run trace failed (${rc}):\n${err}")
endif()
# H + 2·P·L + N·L·R: P = 64·2·32·2, R = (8 + 2·2)·32·2, L = 6, N = 8.
math(EXPR want "64 + 2 * (64 * 2 * 32 * 2) * 6 + 8 * 6 * ((8 + 2 * 2) * 32 * 2)")
file(SIZE "${WORK}/t.kvtrace" size)
if(NOT size EQUAL want)
  message(FATAL_ERROR "the trace is ${size} bytes, the format says ${want}")
endif()
execute_process(COMMAND "${RUN}" trace --model "${model}" --text "${text}" --prefill 64
  --steps 4 --dtype fp8 --out "${WORK}/bad.kvtrace" RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 2 OR NOT err MATCHES "--dtype")
  message(FATAL_ERROR "trace --dtype fp8: exit ${rc}, want 2 naming --dtype:\n${err}")
endif()
if(BENCH)
  execute_process(
    COMMAND "${BENCH}" decode --workloads replay --trace "${WORK}/t.kvtrace" --budget 32
      --profile-steps 2 --json
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "kvtier-bench decode's replay of the model's trace failed (${rc}):\n"
      "${out}\n${err}")
  endif()
  string(JSON out GET "${out}" replay)
  # Every layer of the trace file replayed; full mode holds everything.
  string(JSON layers GET "${out}" layers)
  string(JSON full_recall GET "${out}" modes full attn_mass_recall_tokens)
  if(NOT layers EQUAL 6 OR NOT full_recall EQUAL 1)
    message(FATAL_ERROR "replay: ${layers} layers (want 6), full recall ${full_recall}:\n${out}")
  endif()
endif()
