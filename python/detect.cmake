# Whether the pytest suite (python/tests) can run as ctests here: Python3_EXECUTABLE (setup.sh
# passes the project venv's python) imports torch, that torch is the LibTorch this build found
# (the same libc10, so kvevict_reference and the extension agree), and it imports the installed
# package kvevict (`pip install .`; the tests run against the installed package, not a build
# tree). Sets KVEVICT_PYTHON_FOUND, KVEVICT_PYTHON_WHY (when not found) and
# KVEVICT_PYTHON_PRE_LATENT (the overlay venv's python for the transformers-5.14 test, when it
# exists: ${venv}-tf5.14/bin/python beside the venv of Python3_EXECUTABLE, or as given).
set(KVEVICT_PYTHON_FOUND OFF)
find_package(Python3 COMPONENTS Interpreter QUIET)
if(NOT Python3_FOUND)
  set(KVEVICT_PYTHON_WHY "no Python 3 interpreter (set Python3_EXECUTABLE)")
  return()
endif()
# From the build directory, so that the source tree's python/kvevict cannot shadow the package.
execute_process(COMMAND ${Python3_EXECUTABLE} -c
                  "import os, torch; print('KVEVICT_TORCH|' + os.path.dirname(torch.__file__)); import kvevict; print('KVEVICT_PKG|' + os.path.dirname(kvevict.__file__))"
                WORKING_DIRECTORY ${CMAKE_BINARY_DIR}
                OUTPUT_VARIABLE _kvevict_out ERROR_VARIABLE _kvevict_err RESULT_VARIABLE _kvevict_rc)
if(NOT _kvevict_out MATCHES "KVEVICT_TORCH\\|([^\n]*)")
  set(KVEVICT_PYTHON_WHY "${Python3_EXECUTABLE} cannot import torch")
  return()
endif()
set(_kvevict_torch_dir "${CMAKE_MATCH_1}")
file(REAL_PATH "${_kvevict_torch_dir}/lib/libc10.so" _kvevict_py_c10)
if(c10_LIBRARY)
  file(REAL_PATH "${c10_LIBRARY}" _kvevict_cxx_c10)
else()
  set(_kvevict_cxx_c10 "<no c10_LIBRARY from LibTorch's config>")
endif()
if(NOT _kvevict_py_c10 STREQUAL _kvevict_cxx_c10)
  set(KVEVICT_PYTHON_WHY "the torch of ${Python3_EXECUTABLE} (${_kvevict_py_c10}) is not this build's LibTorch (${_kvevict_cxx_c10})")
  return()
endif()
if(NOT _kvevict_out MATCHES "KVEVICT_PKG\\|([^\n]*)")
  string(STRIP "${_kvevict_err}" _kvevict_err)
  string(REGEX REPLACE ".*\n" "" _kvevict_err "${_kvevict_err}")
  set(KVEVICT_PYTHON_WHY "${Python3_EXECUTABLE} cannot import kvevict (${_kvevict_err}): `pip install .` into it first (scripts/setup.sh does)")
  return()
endif()
set(KVEVICT_PYTHON_PACKAGE "${CMAKE_MATCH_1}")
set(KVEVICT_PYTHON_FOUND ON)

get_filename_component(_kvevict_venv "${Python3_EXECUTABLE}" DIRECTORY)  # <venv>/bin
get_filename_component(_kvevict_venv "${_kvevict_venv}" DIRECTORY)
set(KVEVICT_PYTHON_PRE_LATENT "${_kvevict_venv}-tf5.14/bin/python" CACHE FILEPATH
    "A Python with transformers 5.14 (before DeepSeek caches the latent) and kvevict: runs python/tests/test_hf.py (ctest python_hf_pre_latent) when it exists")
