# kvtier_add_test(NAME name SOURCES ... [LIBS ...] [GPU])
# One GoogleTest binary = one ctest test. GPU tests get the label `gpu` (scripts/test
# excludes it when no GPU is usable; the tests also skip themselves without a device).
include(GoogleTest)
function(kvtier_add_test)
  cmake_parse_arguments(T "GPU" "NAME" "SOURCES;LIBS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest GTest::gmock GTest::gtest_main)
  target_include_directories(${T_NAME} PRIVATE ${PROJECT_SOURCE_DIR})
  kvtier_set_warnings(${T_NAME})
  add_test(NAME ${T_NAME} COMMAND ${T_NAME} --gtest_brief=1)
  set(labels unit)
  if(T_GPU)
    set(labels gpu)
  endif()
  set_tests_properties(${T_NAME} PROPERTIES LABELS "${labels}" TIMEOUT 600)
endfunction()

# kvtier_redis_testutil: a real Redis Cluster of redis-server processes
# (tests/testutil/redis_cluster_process.h), for the tests and for `kvtier-bench tier`; defined
# by whichever of tests/ and bench/ asks first.
function(kvtier_redis_testutil_library)
  if(TARGET kvtier_redis_testutil)
    return()
  endif()
  add_library(kvtier_redis_testutil STATIC
    ${PROJECT_SOURCE_DIR}/tests/testutil/redis_cluster_process.cc)
  target_include_directories(kvtier_redis_testutil PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(kvtier_redis_testutil PUBLIC kvtier_core absl::status absl::statusor
    absl::time PRIVATE PkgConfig::HIREDIS absl::strings)
  kvtier_set_warnings(kvtier_redis_testutil)
endfunction()

# kvtier_testutil (tests/testutil: random inputs, the chaos backend) and kvtier_op_cases (the op
# table, tests/kernels/op_cases.h), for the tests and for `kvtier-bench ops`, which times the
# table's cases on every backend; defined by whichever of tests/ and bench/ asks first.
function(kvtier_op_cases_library)
  if(TARGET kvtier_op_cases)
    return()
  endif()
  set(t ${PROJECT_SOURCE_DIR}/tests)
  add_library(kvtier_testutil STATIC ${t}/testutil/random_fill.cc ${t}/testutil/chaos_backend.cc)
  target_include_directories(kvtier_testutil PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(kvtier_testutil PUBLIC kvtier_core kvtier_kernels_cpu)
  kvtier_set_warnings(kvtier_testutil)
  add_library(kvtier_op_cases STATIC
    ${t}/kernels/op_cases.cc ${t}/kernels/op_cases_select.cc ${t}/kernels/op_cases_attention.cc
    ${t}/kernels/op_cases_page.cc ${t}/kernels/op_cases_errors.cc
    ${t}/kernels/op_cases_decode.cc)
  target_link_libraries(kvtier_op_cases PUBLIC kvtier_kernels kvtier_testutil GTest::gtest)
  target_include_directories(kvtier_op_cases PUBLIC ${PROJECT_SOURCE_DIR})
  kvtier_set_warnings(kvtier_op_cases)
endfunction()
