# libkvtier.so and the installable package:
#   <prefix>/lib/libkvtier.so{,.0,.<version>}    the one shared library engines link
#   <prefix>/include/kvtier/*.h                  the public API (include/kvtier)
#   <prefix>/bin/kvtierd, <prefix>/share/kvtier  (daemon/CMakeLists.txt)
#   <prefix>/lib/cmake/kvtier/                   find_package(kvtier) -> kvtier::kvtier
#   <prefix>/lib/pkgconfig/kvtier.pc             pkg-config kvtier (the C API)
# Every installed file locates the rest relative to itself, so the prefix can be moved.
# Included from the top level after the subdirectories (it needs their targets).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(KVTIER_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/kvtier")
set(KVTIER_INSTALL_PKGCONFIGDIR "${CMAKE_INSTALL_LIBDIR}/pkgconfig")

# ---- kvtier: libkvtier.so ---------------------------------------------------------------------
# What include/kvtier declares is defined in whole: the client and the C API (kvtier_client,
# linked whole-archive), the vocabulary (kvtier_core), CreateDevice (kvtier_kernels) and the
# local sequence (kvtier_offload), whose objects go in directly (they are also dependencies of
# the other pieces, where a second --whole-archive would define them twice). So every declared
# function is in the library whether or not the client calls it; the rest of kvtier
# (backends, policies, protocol) only as far as it is used. Only the API is exported
# (client/libkvtier.map): the gRPC, protobuf and abseil code the static pieces carry stays
# private to the library.
set(KVTIER_VERSION_SCRIPT "${PROJECT_SOURCE_DIR}/client/libkvtier.map")
add_library(kvtier SHARED
  $<TARGET_OBJECTS:kvtier_core> $<TARGET_OBJECTS:kvtier_kernels> $<TARGET_OBJECTS:kvtier_offload>)
add_library(kvtier::kvtier ALIAS kvtier)
target_link_libraries(kvtier PRIVATE "$<LINK_LIBRARY:WHOLE_ARCHIVE,kvtier_client>")
target_link_options(kvtier PRIVATE "LINKER:--version-script=${KVTIER_VERSION_SCRIPT}"
  "LINKER:--no-undefined")
# What an engine compiling against include/kvtier needs: the headers, C++20, and the abseil
# types they use (absl::Status, absl::StatusOr, absl::Duration).
target_include_directories(kvtier PUBLIC
  $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
  $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
target_link_libraries(kvtier PUBLIC absl::status absl::statusor absl::time)
target_compile_features(kvtier PUBLIC cxx_std_20)
set_target_properties(kvtier PROPERTIES
  LINKER_LANGUAGE CXX
  VERSION ${PROJECT_VERSION}
  SOVERSION ${PROJECT_VERSION_MAJOR}
  LINK_DEPENDS "${KVTIER_VERSION_SCRIPT}")
# Installed binaries find the prefix's libraries relative to themselves, and dependencies
# outside the system's directories (the CUDA runtime) where they were at build time.
set_target_properties(kvtier PROPERTIES INSTALL_RPATH "$ORIGIN" INSTALL_RPATH_USE_LINK_PATH ON)
set_target_properties(kvtierd PROPERTIES INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR}"
  INSTALL_RPATH_USE_LINK_PATH ON)

# ---- install: library, headers, CMake package, pkg-config file -------------------------------
install(TARGETS kvtier EXPORT kvtierTargets LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/kvtier/"
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kvtier
  FILES_MATCHING PATTERN "*.h")

install(EXPORT kvtierTargets NAMESPACE kvtier:: FILE kvtierTargets.cmake
  DESTINATION ${KVTIER_INSTALL_CMAKEDIR})
configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/kvtierConfig.cmake.in"
  "${CMAKE_CURRENT_BINARY_DIR}/kvtierConfig.cmake"
  INSTALL_DESTINATION ${KVTIER_INSTALL_CMAKEDIR})
write_basic_package_version_file("${CMAKE_CURRENT_BINARY_DIR}/kvtierConfigVersion.cmake"
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/kvtierConfig.cmake"
  "${CMAKE_CURRENT_BINARY_DIR}/kvtierConfigVersion.cmake"
  DESTINATION ${KVTIER_INSTALL_CMAKEDIR})

# kvtier.pc finds the prefix from its own directory (${pcfiledir}/../.. for lib/pkgconfig);
# directories given as absolute paths stay absolute.
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}")
  set(KVTIER_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
else()
  file(RELATIVE_PATH kvtier_pc_up "/${KVTIER_INSTALL_PKGCONFIGDIR}" "/")
  string(REGEX REPLACE "/$" "" kvtier_pc_up "${kvtier_pc_up}")
  set(KVTIER_PC_PREFIX "\${pcfiledir}/${kvtier_pc_up}")
endif()
foreach(dir LIBDIR INCLUDEDIR)
  if(IS_ABSOLUTE "${CMAKE_INSTALL_${dir}}")
    set(KVTIER_PC_${dir} "${CMAKE_INSTALL_${dir}}")
  else()
    set(KVTIER_PC_${dir} "\${prefix}/${CMAKE_INSTALL_${dir}}")
  endif()
endforeach()
configure_file("${PROJECT_SOURCE_DIR}/cmake/kvtier.pc.in"
  "${CMAKE_CURRENT_BINARY_DIR}/kvtier.pc" @ONLY)
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/kvtier.pc" DESTINATION ${KVTIER_INSTALL_PKGCONFIGDIR})
