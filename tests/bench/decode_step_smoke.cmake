# kvtier-bench decode's step workload end to end at a tiny size on the cpu backend (cmake -P
# script, so the check needs nothing but CMake): every mode is timed for every batch size, and the
# JSON's step section has the keys the report promises: per-step medians with p10/p90 next to
# the means, and the GPU targets null and not judged (no *_target_met for them) on the cpu
# backend, which the log says.
#   -DBENCH=<kvtier-bench>
cmake_minimum_required(VERSION 3.19)  # string(JSON)
execute_process(
  COMMAND "${BENCH}" decode --workloads step --backend cpu --threads 2 --context 512
    --budget 256 --batch 1,2 --layers 2 --steps 4 --warmup 1 --q-heads 4 --kv-heads 2
    --head-dim 32 --page-size 16 --json
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "kvtier-bench decode --workloads step failed (${rc}):\n${err}")
endif()
message("${err}")
string(JSON workloads GET "${out}" workloads)
if(NOT workloads STREQUAL "step")
  message(FATAL_ERROR "workloads = ${workloads}, want step:\n${out}")
endif()
string(JSON out GET "${out}" step)

foreach(key device commit recall_strategy)
  string(JSON value ERROR_VARIABLE json_error GET "${out}" ${key})
  if(json_error OR value STREQUAL "")
    message(FATAL_ERROR "the JSON has no \"${key}\":\n${out}")
  endif()
endforeach()
string(JSON context GET "${out}" sizes context)
if(NOT context EQUAL 512)
  message(FATAL_ERROR "sizes.context = ${context}, want 512")
endif()
foreach(batch 1 2)
  foreach(mode dense_us resident_us resident_per_seq_us speculative_us sync_us
          dense_median_us speculative_median_us correction_rate)
    string(JSON type ERROR_VARIABLE json_error TYPE "${out}" ${mode} ${batch})
    if(json_error OR NOT type STREQUAL "NUMBER")
      message(FATAL_ERROR "${mode}.${batch} is not a number (${json_error}):\n${out}")
    endif()
  endforeach()
  foreach(ratio speculative_over_resident sync_over_speculative dense_over_speculative)
    string(JSON type ERROR_VARIABLE json_error TYPE "${out}" ratios ${batch} ${ratio})
    if(json_error OR NOT type STREQUAL "NUMBER")
      message(FATAL_ERROR "ratios.${batch}.${ratio} is not a number (${json_error}):\n${out}")
    endif()
  endforeach()
  foreach(mode dense resident resident_per_seq speculative sync)
    foreach(stat median p10 p90 min max)
      string(JSON type ERROR_VARIABLE json_error TYPE "${out}" per_step_spread_us ${batch} ${mode}
        ${stat})
      if(json_error OR NOT type STREQUAL "NUMBER")
        message(FATAL_ERROR "per_step_spread_us.${batch}.${mode}.${stat} is not a number "
          "(${json_error}):\n${out}")
      endif()
    endforeach()
  endforeach()
  foreach(met speculative_target_met sync_target_met)
    string(JSON type ERROR_VARIABLE json_error TYPE "${out}" ratios ${batch} ${met})
    if(json_error STREQUAL "NOTFOUND")  # no error: the key is there
      message(FATAL_ERROR "ratios.${batch}.${met} is there (${type}) on the cpu backend")
    endif()
  endforeach()
  string(JSON steps GET "${out}" retriever_stats ${batch} speculative layer_steps)
  math(EXPR want "${batch} * 2 * 4")  # sequences × layers × timed steps
  if(NOT steps EQUAL want)
    message(FATAL_ERROR "speculative ran ${steps} layer-steps at batch ${batch}, want ${want}")
  endif()
endforeach()

# The 1.15x and 5x targets are GPU targets: null here, and the log says they do not apply.
foreach(target speculative_over_resident_max sync_over_speculative_min)
  string(JSON type TYPE "${out}" targets ${target})
  if(NOT type STREQUAL "NULL")
    message(FATAL_ERROR "targets.${target} is ${type} on the cpu backend, want null")
  endif()
endforeach()
string(JSON apply GET "${out}" targets gpu_targets_apply)
if(apply)
  message(FATAL_ERROR "targets.gpu_targets_apply is ${apply} on the cpu backend")
endif()
string(FIND "${err}" "is a GPU target, n/a on the cpu backend" at)
if(at EQUAL -1)
  message(FATAL_ERROR "the log does not say the GPU targets do not apply:\n${err}")
endif()
foreach(judged "target <= 1.15x:" "target >= 5.0x:")
  string(FIND "${err}" "${judged}" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "the log judges a GPU target (${judged}) on the cpu backend:\n${err}")
  endif()
endforeach()
