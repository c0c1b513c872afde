# kvtier-bench decode with several workloads in one run (cmake -P script, so the checks need
# nothing but CMake): the workloads run in the order listed, each with a section of the one JSON
# object, and a flag given reaches every workload that reads it (each has its own default
# context); the resolver refuses (exit 2, naming the flag) an unknown or repeated workload, a
# flag no listed workload reads, and a trace file for the step workload.
#   -DBENCH=<kvtier-bench>
cmake_minimum_required(VERSION 3.19)  # string(JSON)

# Runs `kvtier-bench decode ARGN`; fails unless it exits with `want_rc`. Sets out and err.
function(decode want_rc)
  execute_process(COMMAND "${BENCH}" decode ${ARGN}
    RESULT_VARIABLE rc OUTPUT_VARIABLE stdout ERROR_VARIABLE stderr)
  if(NOT rc STREQUAL want_rc)
    message(FATAL_ERROR "kvtier-bench decode ${ARGN}: exit ${rc}, want ${want_rc}\n"
      "stderr:\n${stderr}\nstdout:\n${stdout}")
  endif()
  set(out "${stdout}" PARENT_SCOPE)
  set(err "${stderr}" PARENT_SCOPE)
endfunction()

# Fails unless `text` contains `needle`.
function(expect_in what text needle)
  string(FIND "${text}" "${needle}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${what} lacks \"${needle}\":\n${text}")
  endif()
endfunction()

set(tiny --context 512 --steps 12 --layers 2 --model-layers 2 --q-heads 4 --kv-heads 2
  --head-dim 32 --page-size 16 --threads 2)

# All three, listed out of their default order: sections in that order, each at --context.
decode(0 --workloads step,policies,replay ${tiny} --budget 256 --batch 1 --warmup 1
  --budgets 128 --policy-list window,h2o --profile-steps 1 --mass-layers 1 --json)
message("${err}")
string(JSON workloads GET "${out}" workloads)
if(NOT workloads STREQUAL "step,policies,replay")
  message(FATAL_ERROR "workloads = ${workloads}, want step,policies,replay")
endif()
string(JSON bench GET "${out}" bench)
if(NOT bench STREQUAL "decode")
  message(FATAL_ERROR "bench = ${bench}, want decode")
endif()
# The sections in the order run (CMake's JSON reader sorts members, so look at the text).
set(last_at -1)
foreach(section step policies replay)
  string(FIND "${out}" "\"${section}\": {\"bench\": \"${section}\"" at)
  if(at LESS_EQUAL last_at)
    message(FATAL_ERROR "the ${section} section is missing or out of order:\n${out}")
  endif()
  set(last_at ${at})
endforeach()
foreach(section step policies replay)
  if(section STREQUAL "replay")
    string(JSON context GET "${out}" replay prefill_tokens)
  else()
    string(JSON context GET "${out}" ${section} sizes context)
  endif()
  if(NOT context EQUAL 512)
    message(FATAL_ERROR "${section}: context ${context}, want 512 (--context):\n${out}")
  endif()
endforeach()
string(JSON n LENGTH "${out}" policies runs)
if(NOT n EQUAL 3)  # full, window, h2o at one budget
  message(FATAL_ERROR "policies ran ${n} runs, want 3:\n${out}")
endif()

# Refusals, each naming what is wrong, before anything runs.
decode(2 --workloads replay,bogus)
expect_in("the refusal" "${err}" "unknown workload 'bogus'")
decode(2 --workloads step,step)
expect_in("the refusal" "${err}" "step is listed twice")
decode(2 --workloads replay --batch 2)
expect_in("the refusal" "${err}" "--batch is read by the step workload")
decode(2 --workloads step --plot x.png)
expect_in("the refusal" "${err}" "--plot is read by the policies workload")
decode(2 --workloads step --trace x.kvtrace)
expect_in("the refusal" "${err}" "--trace is read by the replay and policies workloads")
decode(2 --workloads replay,step --trace x.kvtrace)
expect_in("the refusal" "${err}" "the step workload times synthetic KV")
decode(2 --workloads step --layers all)
expect_in("the refusal" "${err}" "the step workload needs a count >= 1")
