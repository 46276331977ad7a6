# kvevict_cuda_kernels(target INCLUDE_DIRS dirs... [REQUIRED]): adds the tier's CUDA kernels
# (src/kernels/cuda.cu) to `target`, which compiles src/kernels/ops.cpp, and defines
# KVEVICT_KERNELS_CUDA=1 there; sets KVEVICT_CUDA_KERNELS in the caller to ON or OFF. cuda.cu is
# compiled by nvcc directly, not through CMake's CUDA language: it needs c10's macros (from
# INCLUDE_DIRS, LibTorch's headers) and the CUDA runtime only, while LibTorch's targets carry the
# host compiler's C++ standard (C++20 for torch 2.10 and later), which CMake cannot always ask
# of nvcc. nvcc: KVEVICT_NVCC, else from the CUDA toolkit, CUDA_HOME or PATH. Architectures:
# KVEVICT_CUDA_ARCHITECTURES (default 80;90: machine code for A100 and the sm_8x cards, H100
# and H200), plus PTX of the last one, which newer GPUs (Blackwell) compile when they load it.
# Without nvcc or the CUDA runtime: OFF, or a fatal error with REQUIRED.
function(kvevict_cuda_kernels target)
  cmake_parse_arguments(ARG "REQUIRED" "" "INCLUDE_DIRS" ${ARGN})
  set(KVEVICT_CUDA_KERNELS OFF PARENT_SCOPE)
  find_package(CUDAToolkit QUIET)
  find_program(KVEVICT_NVCC nvcc HINTS ${CUDAToolkit_BIN_DIR} ENV CUDA_HOME /usr/local/cuda PATH_SUFFIXES bin)
  if(NOT KVEVICT_NVCC OR NOT TARGET CUDA::cudart_static)
    if(ARG_REQUIRED)
      message(FATAL_ERROR "kvevict: CUDA kernels asked for, but no nvcc or CUDA runtime found (set KVEVICT_NVCC, CUDA_HOME)")
    endif()
    return()
  endif()
  set(KVEVICT_CUDA_ARCHITECTURES "80;90" CACHE STRING
      "CUDA architectures of kvevict's kernels (machine code for each, PTX of the last)")
  set(_dir ${PROJECT_SOURCE_DIR}/src/kernels)
  set(_flags -std=c++17 -O3 -Xcompiler=-fPIC -I${PROJECT_SOURCE_DIR}/include)
  foreach(_include IN LISTS ARG_INCLUDE_DIRS)
    list(APPEND _flags -isystem ${_include})
  endforeach()
  foreach(_arch IN LISTS KVEVICT_CUDA_ARCHITECTURES)
    list(APPEND _flags -gencode=arch=compute_${_arch},code=sm_${_arch})
  endforeach()
  list(GET KVEVICT_CUDA_ARCHITECTURES -1 _last)
  list(APPEND _flags -gencode=arch=compute_${_last},code=compute_${_last})
  set(_object ${CMAKE_CURRENT_BINARY_DIR}/${target}_cuda.o)
  add_custom_command(OUTPUT ${_object}
    COMMAND ${KVEVICT_NVCC} ${_flags} -c ${_dir}/cuda.cu -o ${_object}
    DEPENDS ${_dir}/cuda.cu ${_dir}/launch.hpp ${PROJECT_SOURCE_DIR}/include/kvevict/detail/tier/ops/bodies.hpp
    COMMENT "nvcc: kvevict's CUDA kernels (src/kernels/cuda.cu)" VERBATIM)
  get_target_property(_type ${target} TYPE)
  if(_type STREQUAL "OBJECT_LIBRARY")
    # An OBJECT library keeps only the objects it compiles: the nvcc object and the CUDA runtime
    # go on the link line of what links it.
    add_custom_target(${target}_cuda_object DEPENDS ${_object})
    add_dependencies(${target} ${target}_cuda_object)
    target_link_libraries(${target} INTERFACE ${_object} CUDA::cudart_static)
  else()
    set_source_files_properties(${_object} PROPERTIES EXTERNAL_OBJECT TRUE GENERATED TRUE)
    target_sources(${target} PRIVATE ${_object})
    target_link_libraries(${target} PRIVATE CUDA::cudart_static)
  endif()
  target_compile_definitions(${target} PRIVATE KVEVICT_KERNELS_CUDA=1)
  # The CUDA headers for c10/cuda in ops.cpp.
  target_include_directories(${target} SYSTEM PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
  message(STATUS "kvevict: ${target} with CUDA kernels (${KVEVICT_NVCC}, architectures ${KVEVICT_CUDA_ARCHITECTURES})")
  set(KVEVICT_CUDA_KERNELS ON PARENT_SCOPE)
endfunction()
