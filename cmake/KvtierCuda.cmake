# Decides whether the CUDA backend is built. AUTO builds it whenever nvcc is found (on
# PATH, via CUDACXX, or in the toolkit's standard location), with or without a GPU, so
# every kernel at least compiles in CI. Sets KVTIER_CUDA_ENABLED.
set(KVTIER_CUDA_ENABLED OFF)
if(NOT KVTIER_WITH_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # CMake 3.25 does not know CUDA 13's defaults: name the architectures explicitly
    # (Ampere and Hopper; override with -DCMAKE_CUDA_ARCHITECTURES=...).
    if(NOT CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES "80;90")
    endif()
    enable_language(CUDA)
    # CMake 3.25 knows no C++20 flag for nvcc: the default here is C++17, and the CUDA
    # backend (kernels/cuda/CMakeLists.txt) passes -std=c++20 itself, since the headers its
    # .cu files share with host code (kernels/ops.h, the kvtier/ headers) are C++20.
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    set(KVTIER_CUDA_ENABLED ON)
  elseif(KVTIER_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "KVTIER_WITH_CUDA=ON but no nvcc was found (set CUDACXX)")
  endif()
endif()
