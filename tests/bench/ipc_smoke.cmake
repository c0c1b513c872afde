# kvtier-bench ipc end to end at a small size (cmake -P script, so the checks need nothing but
# CMake): kvtierd started as its own process, the shm path through the client library and a
# real attach, gRPC, Redis (numbers of 0 when there is no redis-server), unary round trips;
# every throughput a median with p10 <= median <= p90; the daemon found next to the build's
# kvtier-bench without --kvtierd; a --kvtierd that does not exist refused, naming it.
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

ipc(0 --kvtierd "${KVTIERD}" --bytes 4194304 --repeats 3 --unary-calls 50 --json)
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

# Without --kvtierd: the one the build made, found from kvtier-bench's own path.
ipc(0 --bytes 1048576 --repeats 1 --unary-calls 10 --no-redis --json)
expect_spread(ON shm_gbps)

ipc(1 --kvtierd "${KVTIERD}.missing" --bytes 1048576 --repeats 1 --json)
string(FIND "${err}" "--kvtierd ${KVTIERD}.missing" at)
if(at EQUAL -1)
  message(FATAL_ERROR "a missing --kvtierd is not named in the error:\n${err}")
endif()
