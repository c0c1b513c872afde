# kvtier-bench ipc end to end at a small size (cmake -P script, so the checks need nothing but
# CMake): kvtierd started as its own process, the shm path through the client library and a
# real attach, gRPC, Redis (numbers of 0 when there is no redis-server), unary round trips;
# every throughput a median with p10 <= median <= p90; the /metrics section: the replay as an
# SHM session of the daemon in ABBA order with and without a background scraper, both modes'
# medians with their spread, the ratio without / with and its target, scrapes that happened
# with a latency and an exposition size, no failed scrape, and every run's session showing
# all its layer-steps to the daemon; the daemon found next to the build's kvtier-bench
# without --kvtierd; a --kvtierd that does not exist and a bad /metrics option refused.
#   -DBENCH=<kvtier-bench> -DKVTIERD=<kvtierd>
cmake_minimum_required(VERSION 3.19)  # string(JSON)

# Runs `kvtier-bench ipc ARGN`; fails unless it exits with `want_rc`. Sets out and err.
function(ipc want_rc)
  execute_process(COMMAND "${BENCH}" ipc ${ARGN}
    RESULT_VARIABLE rc OUTPUT_VARIABLE stdout ERROR_VARIABLE stderr)
  if(NOT rc STREQUAL want_rc)
    message(FATAL_ERROR "kvtier-bench ipc ${ARGN}: exit ${rc}, want ${want_rc}\n"
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

# Fails unless <key>_p10 <= <key> <= <key>_p90 at the path ARGN (ending in the key); with
# `positive`, also 0 < <key>.
function(expect_spread positive)
  list(POP_BACK ARGN key)
  expect_number(${ARGN} ${key})
  set(median "${value}")
  expect_number(${ARGN} ${key}_p10)
  set(p10 "${value}")
  expect_number(${ARGN} ${key}_p90)
  set(p90 "${value}")
  if(p10 GREATER median OR median GREATER p90 OR (positive AND NOT median GREATER 0))
    message(FATAL_ERROR "${ARGN} ${key}: p10 ${p10}, median ${median}, p90 ${p90}")
  endif()
endfunction()

# The /metrics section: 4 layer-steps of 2 layers per replay; a scrape every 5 ms so the tiny
# replays see some.
ipc(0 --kvtierd "${KVTIERD}" --bytes 4194304 --repeats 3 --unary-calls 50 --scrape-context 512
  --scrape-steps 4 --scrape-layers 2 --scrape-budget 256 --scrape-repeats 2 --scrape-warmup 1
  --scrape-ms 5 --threads 2 --json)
message("${err}")
string(JSON daemon GET "${out}" daemon)
if(NOT daemon MATCHES "own process")
  message(FATAL_ERROR "daemon = '${daemon}', want kvtierd in its own process")
endif()
string(JSON repeats GET "${out}" repeats)
if(NOT repeats EQUAL 3)
  message(FATAL_ERROR "repeats = ${repeats}, want 3")
endif()
foreach(key shm_gbps shm_open_ms shm_close_ms grpc_offload_gbps grpc_fetch_gbps)
  expect_spread(ON ${key})
endforeach()
foreach(key redis_set_gbps redis_get_gbps)
  expect_spread(OFF ${key})
endforeach()
foreach(page 16384 131072)
  foreach(key memcpy_gbps offload_floor_gbps shm_gbps shm_open_ms shm_close_ms grpc_offload_gbps
      grpc_fetch_gbps)
    expect_spread(ON pages ${page} ${key})
  endforeach()
  foreach(key shm_fraction_of_memcpy floor_fraction_of_memcpy shm_fraction_of_floor)
    expect_number(pages ${page} ${key})
  endforeach()
endforeach()
foreach(key unary_p50_us_uds unary_p99_us_uds unary_p50_us_tcp unary_p99_us_tcp)
  expect_number(${key})
  if(NOT value GREATER 0)
    message(FATAL_ERROR "${key} = ${value}, want > 0")
  endif()
endforeach()

foreach(key device metrics_address)
  string(JSON v ERROR_VARIABLE json_error GET "${out}" scrape ${key})
  if(json_error OR v STREQUAL "")
    message(FATAL_ERROR "the JSON has no scrape.${key}:\n${out}")
  endif()
endforeach()
string(JSON address GET "${out}" scrape metrics_address)
if(NOT address MATCHES "^127\\.0\\.0\\.1:[1-9][0-9]*$")
  message(FATAL_ERROR "metrics_address = '${address}', want 127.0.0.1:PORT with the real port")
endif()
string(JSON order GET "${out}" scrape order)
if(NOT order STREQUAL "off,on,on,off")
  message(FATAL_ERROR "scrape.order = '${order}', want off,on,on,off (ABBA)")
endif()
foreach(mode off on)
  foreach(stat median p10 p90 min max)
    expect_number(scrape ${mode} wall_us ${stat})
  endforeach()
  expect_number(scrape ${mode} wall_us n)
  if(NOT value EQUAL 2)
    message(FATAL_ERROR "scrape.${mode}.wall_us.n = ${value}, want 2 (--scrape-repeats)")
  endif()
  expect_number(scrape ${mode} critical_path_us median)
endforeach()
expect_number(scrape without_over_with)
if(NOT value GREATER 0)
  message(FATAL_ERROR "scrape.without_over_with = ${value}, want > 0")
endif()
expect_number(scrape target)
string(JSON type TYPE "${out}" scrape target_met)
if(NOT type STREQUAL "BOOLEAN")
  message(FATAL_ERROR "scrape.target_met is ${type}, want a boolean")
endif()
expect_number(scrape scrape_failures)
if(NOT value EQUAL 0)
  string(JSON errors GET "${out}" scrape scrape_errors)
  message(FATAL_ERROR "scrape.scrape_failures = ${value}, want 0: ${errors}")
endif()
foreach(key scrapes exposition_bytes)
  expect_number(scrape ${key})
  if(NOT value GREATER 0)
    message(FATAL_ERROR "scrape.${key} = ${value}, want > 0")
  endif()
endforeach()
expect_number(scrape scrape_latency_us median)
string(JSON runs LENGTH "${out}" scrape runs)
if(NOT runs EQUAL 4)
  message(FATAL_ERROR "${runs} scrape runs in the JSON, want 4")
endif()
math(EXPR last "${runs} - 1")
foreach(i RANGE ${last})
  expect_number(scrape runs ${i} steps_total)
  if(NOT value EQUAL 8)  # 4 steps x 2 layers, as the daemon's /metrics saw them
    message(FATAL_ERROR "scrape.runs[${i}].steps_total = ${value}, want 8")
  endif()
endforeach()

# Without --kvtierd: the one the build made, found from kvtier-bench's own path. Without the
# /metrics section: no "scrape" in the JSON.
ipc(0 --bytes 1048576 --repeats 1 --unary-calls 10 --no-redis --no-scrape --json)
expect_spread(ON shm_gbps)
string(JSON type ERROR_VARIABLE json_error TYPE "${out}" scrape)
if(NOT json_error)
  message(FATAL_ERROR "--no-scrape, yet the JSON has a \"scrape\" (${type})")
endif()

ipc(2 --scrape-repeats 0 --json)
string(FIND "${err}" "--scrape-repeats" at)
if(at EQUAL -1)
  message(FATAL_ERROR "a bad --scrape-repeats is not named in the error:\n${err}")
endif()

ipc(1 --kvtierd "${KVTIERD}.missing" --bytes 1048576 --repeats 1 --no-scrape --json)
string(FIND "${err}" "--kvtierd ${KVTIERD}.missing" at)
if(at EQUAL -1)
  message(FATAL_ERROR "a missing --kvtierd is not named in the error:\n${err}")
endif()
