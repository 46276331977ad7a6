# The find_package consumer test: include this from tests/CMakeLists.txt
# (include(${CMAKE_CURRENT_SOURCE_DIR}/consumer/register.cmake)) after the per-tag tests.
# It installs this build tree into a scratch prefix, builds tests/consumer against it with
# find_package(kvevict REQUIRED) and runs it (see run.cmake). Needs the install rules
# (KVEVICT_INSTALL, on by default at top level).
if(KVEVICT_INSTALL)
  # This build's CMAKE_PREFIX_PATH (a pip torch's prefix: see the top-level CMakeLists.txt), in
  # the environment variable's form (':'), which survives add_test's argument list.
  string(REPLACE ";" ":" _kvevict_consumer_prefixes "${CMAKE_PREFIX_PATH}")
  add_test(NAME consumer
    COMMAND ${CMAKE_COMMAND}
      -DKVEVICT_BINARY_DIR=${PROJECT_BINARY_DIR}
      -DKVEVICT_SOURCE_DIR=${PROJECT_SOURCE_DIR}
      -DCONSUMER_SOURCE_DIR=${CMAKE_CURRENT_LIST_DIR}
      -DCONSUMER_WORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/consumer
      -DCONSUMER_GENERATOR=${CMAKE_GENERATOR}
      -DCONSUMER_CXX_COMPILER=${CMAKE_CXX_COMPILER}
      -DCONSUMER_BUILD_TYPE=$<CONFIG>
      -DTorch_DIR=${Torch_DIR}
      "-DCONSUMER_ENV_PREFIX_PATH=${_kvevict_consumer_prefixes}"
      -P ${CMAKE_CURRENT_LIST_DIR}/run.cmake)
  # Configures Torch and compiles one ATen translation unit: tens of seconds.
  set_tests_properties(consumer PROPERTIES TIMEOUT 900 LABELS "consumer" COST 52)
endif()
