# The find_package test (ctest `consumer`), run with `cmake -P`:
#   1. install the main project's build tree into a fresh prefix,
#   2. configure tests/consumer against that prefix (find_package(kvevict REQUIRED)),
#   3. build it and run the program, which checks a few cache steps;
#   4. the same with kvevict vendored by add_subdirectory(KVEVICT_SOURCE_DIR), if given.
# Any failing step fails the test with the step's output.
#
# Variables (-D...):
#   KVEVICT_BINARY_DIR   the main project's build directory (required)
#   KVEVICT_SOURCE_DIR   the main project's source directory (optional: step 4)
#   CONSUMER_SOURCE_DIR  this directory (required)
#   CONSUMER_WORK_DIR    scratch directory, emptied first (required)
#   CONSUMER_GENERATOR   CMake generator for the consumer (default: CMake's default)
#   CONSUMER_CXX_COMPILER, CONSUMER_BUILD_TYPE (default Release), Torch_DIR  forwarded if set
#   CONSUMER_ENV_PREFIX_PATH  ':'-separated prefixes searched after the install prefix (the
#                        main build's CMAKE_PREFIX_PATH: a pip torch's), as ENV{CMAKE_PREFIX_PATH}
cmake_minimum_required(VERSION 3.18)

foreach(var KVEVICT_BINARY_DIR CONSUMER_SOURCE_DIR CONSUMER_WORK_DIR)
  if(NOT ${var})
    message(FATAL_ERROR "consumer: ${var} must be set (-D${var}=...)")
  endif()
endforeach()
if(NOT CONSUMER_BUILD_TYPE)
  set(CONSUMER_BUILD_TYPE Release)
endif()

if(CONSUMER_ENV_PREFIX_PATH)
  set(ENV{CMAKE_PREFIX_PATH} "${CONSUMER_ENV_PREFIX_PATH}")
endif()
set(prefix "${CONSUMER_WORK_DIR}/prefix")
set(build "${CONSUMER_WORK_DIR}/build")
file(REMOVE_RECURSE "${CONSUMER_WORK_DIR}")
file(MAKE_DIRECTORY "${CONSUMER_WORK_DIR}")

# Runs a command; on failure prints its output and stops with an error.
function(consumer_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer: ${what} failed (${rc})\n${out}\n${err}")
  endif()
  message(STATUS "consumer: ${what}: ok")
  set(consumer_output "${out}" PARENT_SCOPE)
endfunction()

consumer_step("install" "${CMAKE_COMMAND}" --install "${KVEVICT_BINARY_DIR}" --prefix "${prefix}")
foreach(file include/kvevict/kvevict.hpp)
  if(NOT EXISTS "${prefix}/${file}")
    message(FATAL_ERROR "consumer: ${file} was not installed into ${prefix}")
  endif()
endforeach()

set(configure_args -S "${CONSUMER_SOURCE_DIR}" -B "${build}" "-DCMAKE_PREFIX_PATH=${prefix}"
                   "-DCMAKE_BUILD_TYPE=${CONSUMER_BUILD_TYPE}")
if(CONSUMER_GENERATOR)
  list(APPEND configure_args -G "${CONSUMER_GENERATOR}")
endif()
if(CONSUMER_CXX_COMPILER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CONSUMER_CXX_COMPILER}")
endif()
if(Torch_DIR)
  list(APPEND configure_args "-DTorch_DIR=${Torch_DIR}")
endif()
consumer_step("configure" "${CMAKE_COMMAND}" ${configure_args})
# The package must come from the fresh prefix, not from a source or build tree.
file(STRINGS "${build}/CMakeCache.txt" kvevict_dir_line REGEX "^kvevict_DIR:")
string(FIND "${kvevict_dir_line}" "${prefix}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "consumer: kvevict was not found in ${prefix}: ${kvevict_dir_line}")
endif()

# Builds the configured consumer in `dir` and runs it.
function(consumer_build_and_run dir)
  consumer_step("build" "${CMAKE_COMMAND}" --build "${dir}" --config "${CONSUMER_BUILD_TYPE}")
  set(exe "${dir}/kvevict_consumer")
  if(NOT EXISTS "${exe}" AND EXISTS "${dir}/${CONSUMER_BUILD_TYPE}/kvevict_consumer")
    set(exe "${dir}/${CONSUMER_BUILD_TYPE}/kvevict_consumer")  # multi-config generators
  endif()
  consumer_step("run" "${exe}")
  message(STATUS "${consumer_output}")
endfunction()

consumer_build_and_run("${build}")

if(KVEVICT_SOURCE_DIR)
  set(vendored "${CONSUMER_WORK_DIR}/vendored")
  list(TRANSFORM configure_args REPLACE "^${build}$" "${vendored}")
  list(FILTER configure_args EXCLUDE REGEX "^-DCMAKE_PREFIX_PATH=")
  consumer_step("configure (add_subdirectory)" "${CMAKE_COMMAND}" ${configure_args}
                "-DKVEVICT_SOURCE_DIR=${KVEVICT_SOURCE_DIR}")
  consumer_build_and_run("${vendored}")
endif()
