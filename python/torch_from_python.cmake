# LibTorch for the Python extension, taken from the torch that the Python building it imports
# (pip install .), without find_package(Torch): a CUDA build of torch from PyPI has a CMake
# config that wants a CUDA toolkit, which a CPU extension does not need. The extension links
# what torch.utils.cpp_extension links for a CPU extension (c10, torch_cpu, torch,
# torch_python), with torch's headers (its bundled pybind11 among them) and torch's C++ ABI.
#
# pip builds in an isolated environment by default: its PYTHONPATH overlay hides the target
# environment's site-packages, so `import torch` fails there. `python -I` ignores PYTHONPATH and
# the user site and sees the environment's own site-packages again: that is where the package
# will be installed, and the torch it must be built against. (A frontend that builds with
# another interpreter, e.g. one in a separate build venv, finds no torch either way: then the
# error says to install with --no-build-isolation.)
#
# Sets TORCH_LIBRARIES (the target kvevict_python_torch), KVEVICT_TORCH_DIR, KVEVICT_TORCH_VERSION,
# KVEVICT_TORCH_CUDA (torch.version.cuda, empty for a CPU build) and Python_* (FindPython: the interpreter and the extension module's development files).

find_package(Python 3.8 REQUIRED COMPONENTS Interpreter Development.Module)

set(_kvevict_probe "import os, torch; print('KVEVICT_TORCH', os.path.dirname(torch.__file__), torch.__version__, int(torch._C._GLIBCXX_USE_CXX11_ABI), torch.version.cuda or '', sep='|')")
set(_kvevict_torch_out "")
foreach(_kvevict_flags IN ITEMS "" "-I")
  execute_process(COMMAND ${Python_EXECUTABLE} ${_kvevict_flags} -c "${_kvevict_probe}"
                  OUTPUT_VARIABLE _kvevict_out ERROR_VARIABLE _kvevict_err RESULT_VARIABLE _kvevict_rc)
  if(_kvevict_rc EQUAL 0 AND _kvevict_out MATCHES "KVEVICT_TORCH\\|([^\n]*)")
    set(_kvevict_torch_out "${CMAKE_MATCH_1}")
    if(_kvevict_flags STREQUAL "-I")
      message(STATUS "kvevict: torch found by ${Python_EXECUTABLE} -I (outside the build's isolated environment)")
    endif()
    break()
  endif()
endforeach()
if(NOT _kvevict_torch_out)
  message(FATAL_ERROR "kvevict: ${Python_EXECUTABLE} cannot import torch, not even with -I (outside pip's "
                      "isolated build environment): ${_kvevict_err}\n"
                      "kvevict's extension is built against the torch of the environment it is installed into: "
                      "install torch there first (pip install torch). If torch is installed and this still "
                      "fails, your installer builds in an environment of its own: install with "
                      "`pip install --no-build-isolation .` (then scikit-build-core must be installed too).")
endif()
string(REPLACE "|" ";" _kvevict_torch_out "${_kvevict_torch_out}")
list(GET _kvevict_torch_out 0 KVEVICT_TORCH_DIR)
list(GET _kvevict_torch_out 1 KVEVICT_TORCH_VERSION)
list(GET _kvevict_torch_out 2 _kvevict_cxx11_abi)
list(GET _kvevict_torch_out 3 KVEVICT_TORCH_CUDA)  # the CUDA version of a CUDA build, else empty

add_library(kvevict_python_torch INTERFACE)
target_include_directories(kvevict_python_torch SYSTEM INTERFACE
  ${KVEVICT_TORCH_DIR}/include ${KVEVICT_TORCH_DIR}/include/torch/csrc/api/include)
target_compile_definitions(kvevict_python_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=${_kvevict_cxx11_abi})
# torch 2.10 and later need C++20 (their TorchConfig says so to find_package users).
file(STRINGS ${KVEVICT_TORCH_DIR}/include/ATen/ATen.h _kvevict_cxx20 REGEX "C\\+\\+20 or later")
if(_kvevict_cxx20)
  target_compile_features(kvevict_python_torch INTERFACE cxx_std_20)
endif()
# By path, not find_library (whose cache would keep another environment's torch in a build
# directory that two environments share).
foreach(_kvevict_lib c10 torch_cpu torch torch_python)
  set(_kvevict_path ${KVEVICT_TORCH_DIR}/lib/${CMAKE_SHARED_LIBRARY_PREFIX}${_kvevict_lib}${CMAKE_SHARED_LIBRARY_SUFFIX})
  if(NOT EXISTS ${_kvevict_path})
    message(FATAL_ERROR "kvevict: no ${_kvevict_path}")
  endif()
  target_link_libraries(kvevict_python_torch INTERFACE ${_kvevict_path})
endforeach()
if(NOT EXISTS ${KVEVICT_TORCH_DIR}/include/pybind11/pybind11.h)
  message(FATAL_ERROR "kvevict: torch in ${KVEVICT_TORCH_DIR} ships no pybind11 headers (include/pybind11)")
endif()
set(TORCH_LIBRARIES kvevict_python_torch)
message(STATUS "kvevict: Python extension for ${Python_EXECUTABLE} against torch ${KVEVICT_TORCH_VERSION} "
               "in ${KVEVICT_TORCH_DIR} (C++11 ABI ${_kvevict_cxx11_abi})")
