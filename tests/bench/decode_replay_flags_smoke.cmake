# kvtier-bench decode's replay workload on a tiny trace file (cmake -P script, so the checks need
# nothing but CMake): every flag that shapes a replay of a real trace is accepted and shows in the
# JSON's replay section, or is refused (exit 2) with a message naming the flag and the limit.
#   -DBENCH=<kvtier-bench> -DWORK_DIR=<scratch directory>
cmake_minimum_required(VERSION 3.19)  # string(JSON)
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(trace "${WORK_DIR}/tiny.kvtrace")
set(geometry --q-heads 4 --kv-heads 2 --head-dim 32 --page-size 16)
# 3 layers, 256 prefill tokens (16 pages), 6 decode steps.
set(trace_layers 3)
set(trace_steps 6)

# Runs `kvtier-bench decode --workloads replay ARGN`; fails unless it exits with `want_rc`. Sets
# out (the JSON's replay section, with --json and exit 0) and err.
function(replay want_rc)
  execute_process(COMMAND "${BENCH}" decode --workloads replay ${ARGN}
    RESULT_VARIABLE rc OUTPUT_VARIABLE stdout ERROR_VARIABLE stderr)
  if(NOT rc STREQUAL want_rc)
    message(FATAL_ERROR "kvtier-bench decode --workloads replay ${ARGN}: exit ${rc}, want "
      "${want_rc}\nstderr:\n${stderr}\nstdout:\n${stdout}")
  endif()
  if(rc EQUAL 0 AND NOT stdout STREQUAL "")
    string(JSON stdout GET "${stdout}" replay)
  endif()
  set(out "${stdout}" PARENT_SCOPE)
  set(err "${stderr}" PARENT_SCOPE)
endfunction()

# Fails unless `text` contains every one of ARGN.
function(expect_in what text)
  foreach(needle IN LISTS ARGN)
    string(FIND "${text}" "${needle}" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "${what} lacks \"${needle}\":\n${text}")
    endif()
  endforeach()
endfunction()

# Fails unless the JSON in `out` has `want` at the path ARGN.
function(expect_json want)
  string(JSON got ERROR_VARIABLE json_error GET "${out}" ${ARGN})
  if(json_error OR NOT got EQUAL want)
    message(FATAL_ERROR "JSON ${ARGN} = '${got}', want ${want} ${json_error}:\n${out}")
  endif()
endfunction()

# Every mode has one `layers` entry per replayed layer (`n`), in order, and the mass recall
# (pages and tokens) in [0, 1] on the first `mass` of them; full mode's is exactly 1.
function(expect_layers n mass)
  string(JSON modes_n LENGTH "${out}" modes)
  math(EXPR last_mode "${modes_n} - 1")
  math(EXPR last_layer "${n} - 1")
  foreach(mi RANGE ${last_mode})
    string(JSON mode MEMBER "${out}" modes ${mi})
    string(JSON got LENGTH "${out}" modes ${mode} layers)
    if(NOT got EQUAL n)
      message(FATAL_ERROR "${mode} has ${got} layer entries, want ${n}:\n${out}")
    endif()
    foreach(l RANGE ${last_layer})
      expect_json(${l} modes ${mode} layers ${l} layer)
      foreach(key rel_error correction_rate)
        string(JSON type TYPE "${out}" modes ${mode} layers ${l} ${key})
        if(NOT type STREQUAL "NUMBER")
          message(FATAL_ERROR "${mode} layer ${l}: ${key} is not a number:\n${out}")
        endif()
      endforeach()
      set(keys attn_mass_recall_pages attn_mass_recall_tokens)
      foreach(key IN LISTS keys)
        string(JSON v ERROR_VARIABLE missing GET "${out}" modes ${mode} layers ${l} ${key})
        if(l LESS mass)
          if(missing OR v LESS 0 OR v GREATER 1)
            message(FATAL_ERROR "${mode} layer ${l}: ${key} = '${v}', want in [0, 1]:\n${out}")
          endif()
          if(mode STREQUAL "full" AND NOT v EQUAL 1)
            message(FATAL_ERROR "full mode holds every token, but layer ${l} ${key} = ${v}")
          endif()
        elseif(NOT missing)
          message(FATAL_ERROR "${mode} layer ${l} is not sampled but has ${key}:\n${out}")
        endif()
      endforeach()
    endforeach()
  endforeach()
endfunction()

# The trace file, written by the synthetic trace's writer.
execute_process(
  COMMAND "${BENCH}" decode --write-trace "${trace}" --context 256 --steps ${trace_steps}
    --model-layers ${trace_layers} ${geometry}
  RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT EXISTS "${trace}")
  message(FATAL_ERROR "--write-trace failed (${rc}):\n${err}")
endif()
set(run --trace "${trace}" --tau 0.9 --profile-steps 1 --threads 2 --json)

# A trace file replays all its layers by default; every layer is scored (--mass-layers 4 is
# more than 3); the mode-level token and page recalls are in [0, 1], 1 for full mode;
# --seed (the synthetic query process) is only a warning.
replay(0 ${run} --budget 64 --seed 3)
expect_in("the log" "${err}" "replaying all ${trace_layers} layers of the trace"
  "warning: --seed is for the synthetic trace")
expect_json(${trace_layers} layers)
expect_json(${trace_layers} trace_layers)
expect_json(${trace_steps} steps)
# 4 pages, split as SetBudgetTokens splits them: 1 sink, 2 selected, 1 recent.
expect_json(1 sink_pages)
expect_json(2 selected_pages)
expect_json(1 recent_pages)
expect_layers(${trace_layers} ${trace_layers})
foreach(mode full speculative sync drop)
  foreach(key attn_mass_recall_pages attn_mass_recall_tokens)
    string(JSON v GET "${out}" modes ${mode} ${key})
    if(v LESS 0 OR v GREATER 1 OR (mode STREQUAL "full" AND NOT v EQUAL 1))
      message(FATAL_ERROR "${mode}: ${key} = ${v}")
    endif()
  endforeach()
endforeach()
expect_json(0 modes full rel_error)

# --layers all and --mass-layers all: the same, said explicitly.
replay(0 ${run} --budget 64 --layers all --mass-layers all --no-sync --no-drop)
expect_in("the log" "${err}" "replaying all ${trace_layers} layers of the trace")
expect_layers(${trace_layers} ${trace_layers})

# An explicit split: any page counts (6 pages is no multiple of 4), --budget may restate
# their sum; --layers N still cuts the trace, --mass-layers 1 scores only layer 0.
replay(0 ${run} --sink 1 --selected 3 --recent 2 --budget 96 --layers 2 --mass-layers 1)
expect_json(1 sink_pages)
expect_json(3 selected_pages)
expect_json(2 recent_pages)
expect_json(96 budget_tokens)
expect_json(2 layers)
expect_layers(2 1)
string(FIND "${err}" "replaying all" at)
if(NOT at EQUAL -1)
  message(FATAL_ERROR "--layers 2 of 3 logged \"replaying all\":\n${err}")
endif()

# A step range: only its steps are scored; steps 0 and 1 only grow the sequences, so
# speculative mode checks 2 KV heads × 3 layers × 3 steps.
replay(0 ${run} --budget 64 --step-range 2:5)
expect_json(3 steps)
expect_json(2 step_begin)
expect_json(5 step_end)
expect_json(${trace_steps} trace_steps)
expect_json(18 modes speculative checked_heads)
replay(0 ${run} --budget 64 --step-range 4:)
expect_json(2 steps)

# Refusals (exit 2), each naming the flag and the limit.
replay(2 ${run} --budget 96)
expect_in("the refusal" "${err}" "--budget = 96" "multiple of 4 pages" "--sink/--selected/--recent")
replay(2 ${run} --sink 1 --selected 2)
expect_in("the refusal" "${err}" "--sink, --selected and --recent go together")
replay(2 ${run} --sink 1 --selected 3 --recent 0)
expect_in("the refusal" "${err}" "--recent = 0" "recent >= 1")
replay(2 ${run} --sink 1 --selected 3 --recent 2 --budget 64)
expect_in("the refusal" "${err}" "--budget = 64 tokens disagrees")
replay(2 ${run} --budget 320)
expect_in("the refusal" "${err}" "--budget = 320" "256 prefill tokens")
replay(2 ${run} --budget 64 --step-range 2:7)
expect_in("the refusal" "${err}" "--step-range = 2:7" "<= ${trace_steps}")
replay(2 ${run} --budget 64 --step-range 3:3)
expect_in("the refusal" "${err}" "--step-range = 3:3")
replay(2 ${run} --budget 64 --step-range 3)
expect_in("the refusal" "${err}" "--step-range must be A:B")
replay(2 ${run} --budget 64 --layers 4)
expect_in("the refusal" "${err}" "--layers = 4" "the trace has ${trace_layers} layers")
foreach(flag --context --steps --model-layers --page-size --head-dim)
  replay(2 ${run} --budget 64 ${flag} 64)
  expect_in("the refusal" "${err}" "${flag} is for the synthetic trace; a trace file has its own")
endforeach()
replay(2 ${run} --budget 64 --dtype fp32)
expect_in("the refusal" "${err}" "--dtype is for the synthetic trace")
replay(2 ${run} --budget 64 --backend tpu)
expect_in("the refusal" "${err}" "--backend must be cpu, cuda or auto")

# --backend cuda: refused without a usable device (or a build without CUDA), run with one.
execute_process(COMMAND "${BENCH}" devices OUTPUT_VARIABLE devices)
if(devices MATCHES "usable cuda devices: 0")
  replay(2 ${run} --budget 64 --backend cuda)
  expect_in("the refusal" "${err}" "--backend cuda")
else()
  replay(0 ${run} --budget 64 --backend cuda)
  expect_json(${trace_steps} steps)
endif()

# The synthetic trace keeps its modest default of 4 layers.
replay(0 --context 256 --steps 2 --model-layers 5 ${geometry} --budget 64 --tau 0.9
  --profile-steps 1 --mass-layers 1 --threads 2 --json)
expect_json(4 layers)
expect_json(5 trace_layers)
