# kvtier-bench scrape end to end at a tiny size (cmake -P script, so the checks need nothing but
# CMake): kvtierd started as its own process with metrics on a loopback port, the replay run
# as an SHM session of it in ABBA order with and without a background scraper, and the JSON
# keys the report promises: both modes' medians with their spread, the ratio without / with
# and its target, scrapes that happened with a latency and an exposition size, no failed
# scrape, and every run's session showing all its layer-steps to the daemon. A --kvtierd
# that does not exist is refused, naming it.
#   -DBENCH=<kvtier-bench> -DKVTIERD=<kvtierd>
cmake_minimum_required(VERSION 3.19)  # string(JSON)

# Runs `kvtier-bench scrape ARGN`; fails unless it exits with `want_rc`. Sets out and err.
function(scrape want_rc)
  execute_process(COMMAND "${BENCH}" scrape ${ARGN}
    RESULT_VARIABLE rc OUTPUT_VARIABLE stdout ERROR_VARIABLE stderr)
  if(NOT rc STREQUAL want_rc)
    message(FATAL_ERROR "kvtier-bench scrape ${ARGN}: exit ${rc}, want ${want_rc}\n"
      "stderr:\n${stderr}\nstdout:\n${stdout}")
  endif()
  set(out "${stdout}" PARENT_SCOPE)
  set(err "${stderr}" PARENT_SCOPE)
endfunction()

# Fails unless the JSON in `out` has a number at the path ARGN; sets `value` to it.
function(expect_number)
  string(JSON type ERROR_VARIABLE json_error TYPE "${out}" ${ARGN})
  if(json_error OR NOT type STREQUAL "NUMBER")
    message(FATAL_ERROR "JSON ${ARGN} is not a number (${type} ${json_error}):\n${out}")
  endif()
  string(JSON got GET "${out}" ${ARGN})
  set(value "${got}" PARENT_SCOPE)
endfunction()

# 4 layer-steps of 2 layers per replay; a scrape every 5 ms so the tiny replays see some.
scrape(0 --kvtierd "${KVTIERD}" --context 512 --steps 4 --model-layers 2 --layers 2
  --q-heads 4 --kv-heads 2 --head-dim 32 --page-size 16 --budget 256 --repeats 2 --warmup 1
  --scrape-ms 5 --threads 2 --json)
message("${err}")

foreach(key bench commit host device metrics_address)
  string(JSON v ERROR_VARIABLE json_error GET "${out}" ${key})
  if(json_error OR v STREQUAL "")
    message(FATAL_ERROR "the JSON has no \"${key}\":\n${out}")
  endif()
endforeach()
string(JSON address GET "${out}" metrics_address)
if(NOT address MATCHES "^127\\.0\\.0\\.1:[1-9][0-9]*$")
  message(FATAL_ERROR "metrics_address = '${address}', want 127.0.0.1:PORT with the real port")
endif()
string(JSON order GET "${out}" order)
if(NOT order STREQUAL "off,on,on,off")
  message(FATAL_ERROR "order = '${order}', want off,on,on,off (ABBA)")
endif()
foreach(mode off on)
  foreach(stat median p10 p90 min max)
    expect_number(${mode} wall_us ${stat})
  endforeach()
  expect_number(${mode} wall_us n)
  if(NOT value EQUAL 2)
    message(FATAL_ERROR "${mode}.wall_us.n = ${value}, want 2 (--repeats)")
  endif()
  expect_number(${mode} critical_path_us median)
endforeach()
expect_number(without_over_with)
if(NOT value GREATER 0)
  message(FATAL_ERROR "without_over_with = ${value}, want > 0")
endif()
expect_number(target)
string(JSON type TYPE "${out}" target_met)
if(NOT type STREQUAL "BOOLEAN")
  message(FATAL_ERROR "target_met is ${type}, want a boolean")
endif()
expect_number(scrape_failures)
if(NOT value EQUAL 0)
  string(JSON errors GET "${out}" scrape_errors)
  message(FATAL_ERROR "scrape_failures = ${value}, want 0: ${errors}")
endif()
foreach(key scrapes exposition_bytes)
  expect_number(${key})
  if(NOT value GREATER 0)
    message(FATAL_ERROR "${key} = ${value}, want > 0")
  endif()
endforeach()
expect_number(scrape_latency_us median)
string(JSON runs LENGTH "${out}" runs)
if(NOT runs EQUAL 4)
  message(FATAL_ERROR "${runs} runs in the JSON, want 4")
endif()
math(EXPR last "${runs} - 1")
foreach(i RANGE ${last})
  expect_number(runs ${i} steps_total)
  if(NOT value EQUAL 8)  # 4 steps x 2 layers, as the daemon's /metrics saw them
    message(FATAL_ERROR "runs[${i}].steps_total = ${value}, want 8")
  endif()
endforeach()

scrape(1 --kvtierd "${KVTIERD}.missing" --repeats 1 --json)
string(FIND "${err}" "--kvtierd ${KVTIERD}.missing" at)
if(at EQUAL -1)
  message(FATAL_ERROR "a missing --kvtierd is not named in the error:\n${err}")
endif()
