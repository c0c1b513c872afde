# Finds kvtier's dependencies (all Debian 12 packages; scripts/setup installs them).
find_package(Threads REQUIRED)
find_package(absl CONFIG REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(HWLOC REQUIRED IMPORTED_TARGET hwloc)
find_path(NUMA_INCLUDE_DIR numa.h REQUIRED)
find_library(NUMA_LIBRARY numa REQUIRED)
add_library(kvtier_numa INTERFACE)
target_include_directories(kvtier_numa INTERFACE ${NUMA_INCLUDE_DIR})
target_link_libraries(kvtier_numa INTERFACE ${NUMA_LIBRARY})

# GoogleTest: the tests, and the op table `kvtier-bench ops` times (its checks are gtest's).
if(KVTIER_BUILD_TESTS OR KVTIER_BUILD_BENCHMARKS)
  find_package(GTest CONFIG REQUIRED)
endif()
find_package(CLI11 CONFIG QUIET)
if(NOT CLI11_FOUND)
  find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp REQUIRED)
  add_library(CLI11::CLI11 INTERFACE IMPORTED)
  target_include_directories(CLI11::CLI11 INTERFACE ${CLI11_INCLUDE_DIR})
endif()

# The service: gRPC + protobuf (control), Boost.Asio (shm attach socket), spdlog (logs),
# toml++ (config).
find_package(Protobuf REQUIRED)
find_package(gRPC CONFIG REQUIRED)
find_program(KVTIER_GRPC_CPP_PLUGIN grpc_cpp_plugin REQUIRED)
find_program(KVTIER_GRPC_PYTHON_PLUGIN grpc_python_plugin)
find_package(Boost 1.74 REQUIRED)
find_package(spdlog CONFIG REQUIRED)
find_package(tomlplusplus CONFIG QUIET)
if(NOT tomlplusplus_FOUND)
  pkg_check_modules(TOMLPP REQUIRED IMPORTED_TARGET tomlplusplus)
  add_library(tomlplusplus::tomlplusplus ALIAS PkgConfig::TOMLPP)
endif()

# The engine (kvtier-run): OpenBLAS (pthread flavour, CBLAS interface) for the decoder's
# matrices on the CPU; ICU's character properties for the tokenizers' pre-tokenizer
# (Unicode letters, numbers, white space).
pkg_check_modules(OPENBLAS REQUIRED IMPORTED_TARGET openblas)
find_package(ICU REQUIRED COMPONENTS uc)

# The Redis Cluster cold tier (daemon/redis_cluster.h): hiredis parses RESP and does the socket
# I/O; Debian 12's hiredis (0.14) has no cluster support, so the routing is kvtier's own.
pkg_check_modules(HIREDIS REQUIRED IMPORTED_TARGET hiredis)
