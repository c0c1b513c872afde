# kvtier-run eval at the shipped model's full context (cmake -P script): every variant the
# command runs by default, at the smallest and the largest of its default budgets (1/32 and
# 1/4 of 4096 tokens), over a prefill of the whole context and a few scored steps. The big
# runs are the only workload where a drop layer managed by policies holds a 4096-token prompt
# (131 slots for a 4-page budget) and every layer's attention probe is of that size, so a
# change to the decode path that breaks them shows here, not only in README's eval. Every
# run must succeed: exit 0, one result per (variant, budget) after full mode's, no error.
#   -DRUN=<kvtier-run> -DMODEL_DIR=<engine/model> -DWORK=<dir>
cmake_minimum_required(VERSION 3.19)  # string(JSON)
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
set(budgets 128 1024)
execute_process(
  COMMAND "${RUN}" eval --model "${MODEL_DIR}/kvtier-tiny.gguf"
    --text "${MODEL_DIR}/golden/eval.txt" --steps 4 --budgets 128,1024 --recall-every 2
    --threads 2 --json "${WORK}/eval.json"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "kvtier-run eval at full context failed (${rc}):\n${err}")
endif()
# The variants it ran: the header on stderr counts them ("...; budgets 128,1024; 11 variants").
if(NOT err MATCHES "budgets 128,1024; ([0-9]+) variants")
  message(FATAL_ERROR "no variant count in kvtier-run eval's header:\n${err}")
endif()
set(variants ${CMAKE_MATCH_1})
file(READ "${WORK}/eval.json" json)
string(JSON context GET "${json}" context)
string(JSON prefill GET "${json}" prefill_tokens)
if(NOT context EQUAL 4096 OR NOT prefill EQUAL 4092)
  message(FATAL_ERROR "context ${context} = prefill ${prefill} + 4: want the model's 4096")
endif()
string(JSON n LENGTH "${json}" results)
math(EXPR want "1 + ${variants} * 2")
if(NOT n EQUAL want)
  message(FATAL_ERROR "${n} results, want full + ${variants} variants × 2 budgets:\n${json}")
endif()
math(EXPR last "${n} - 1")
foreach(i RANGE ${last})
  string(JSON variant GET "${json}" results ${i} variant)
  string(JSON budget GET "${json}" results ${i} budget_tokens)
  string(JSON error ERROR_VARIABLE lookup GET "${json}" results ${i} error)
  if(lookup STREQUAL "NOTFOUND")  # found: the run failed
    message(FATAL_ERROR "${variant}@${budget} failed: ${error}")
  endif()
  string(JSON steps GET "${json}" results ${i} steps)
  string(JSON ppl GET "${json}" results ${i} perplexity)
  if(NOT steps EQUAL 4 OR NOT ppl GREATER 1)
    message(FATAL_ERROR "${variant}@${budget}: ${steps} steps (want 4), perplexity ${ppl}")
  endif()
  if(i GREATER 0)
    # Runs go variant by variant, each over the budgets in order.
    math(EXPR b "(${i} - 1) % 2")
    list(GET budgets ${b} want_budget)
    if(NOT budget EQUAL want_budget)
      message(FATAL_ERROR "result ${i} (${variant}) is at ${budget}, want ${want_budget}")
    endif()
  endif()
endforeach()
