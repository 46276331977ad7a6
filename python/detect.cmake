# Whether the Python module can be built here: a Python 3 with torch, pybind11's CMake config, and
# that torch being the LibTorch this build found (the same libc10), so the extension links one
# consistent libtorch. Sets KVEVICT_PYTHON_FOUND, KVEVICT_PYTHON_WHY (when not found),
# Python3_* (FindPython3) and KVEVICT_TORCH_PYTHON_LIBRARY (torch's libtorch_python).
# Debian: /usr/bin/python3 (python3-torch), not another python3 earlier on PATH.
set(KVEVICT_PYTHON_FOUND OFF)
if(NOT Python3_EXECUTABLE AND EXISTS /usr/bin/python3)
  set(Python3_EXECUTABLE /usr/bin/python3 CACHE FILEPATH "The Python the kvevict module is built for")
endif()
find_package(Python3 COMPONENTS Interpreter Development QUIET)
find_package(pybind11 CONFIG QUIET)
if(NOT Python3_FOUND)
  set(KVEVICT_PYTHON_WHY "no Python 3 with its headers (apt-get install python3-dev)")
elseif(NOT pybind11_FOUND)
  set(KVEVICT_PYTHON_WHY "no pybind11 CMake config (apt-get install pybind11-dev)")
else()
  execute_process(COMMAND ${Python3_EXECUTABLE} -c "import os, torch; print(os.path.dirname(torch.__file__))"
                  OUTPUT_VARIABLE _kvevict_torch_dir OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE _kvevict_torch_rc ERROR_QUIET)
  if(NOT _kvevict_torch_rc EQUAL 0)
    set(KVEVICT_PYTHON_WHY "${Python3_EXECUTABLE} cannot import torch (apt-get install python3-torch)")
  else()
    find_library(KVEVICT_TORCH_PYTHON_LIBRARY torch_python HINTS ${_kvevict_torch_dir}/lib NO_DEFAULT_PATH)
    file(REAL_PATH "${_kvevict_torch_dir}/lib/libc10.so" _kvevict_py_c10)
    if(c10_LIBRARY)
      file(REAL_PATH "${c10_LIBRARY}" _kvevict_cxx_c10)
    else()
      set(_kvevict_cxx_c10 "<no c10_LIBRARY from LibTorch's config>")
    endif()
    if(NOT KVEVICT_TORCH_PYTHON_LIBRARY)
      set(KVEVICT_PYTHON_WHY "no libtorch_python in ${_kvevict_torch_dir}/lib")
    elseif(NOT _kvevict_py_c10 STREQUAL _kvevict_cxx_c10)
      set(KVEVICT_PYTHON_WHY "the Python torch (${_kvevict_py_c10}) is not this build's LibTorch (${_kvevict_cxx_c10})")
    else()
      set(KVEVICT_PYTHON_FOUND ON)
    endif()
  endif()
endif()
