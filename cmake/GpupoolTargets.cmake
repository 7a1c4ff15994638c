# Helpers for the test and bench executables, so that every one of them is built the
# same way: the project's warnings, private links, and one CUDA set-up for the GPU code.

# gpupool_c_program(NAME SOURCES src... [LIBS lib...]): a C executable built with
# GPUPOOL_WARN and linked privately with LIBS.
function(gpupool_c_program name)
  cmake_parse_arguments(P "" "" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${P_SOURCES})
  target_compile_options(${name} PRIVATE ${GPUPOOL_WARN})
  target_link_libraries(${name} PRIVATE ${P_LIBS})
endfunction()

# gpupool_c_test(NAME SOURCE src LABEL label [LIBS lib...]): a single-source test executable
# and its ctest entry LABEL_NAME (no arguments), labelled LABEL, 300 s at most.
function(gpupool_c_test name)
  cmake_parse_arguments(T "" "SOURCE;LABEL" "LIBS" ${ARGN})
  gpupool_c_program(${name} SOURCES ${T_SOURCE} LIBS ${T_LIBS})
  add_test(NAME ${T_LABEL}_${name} COMMAND ${name})
  set_tests_properties(${T_LABEL}_${name} PROPERTIES LABELS ${T_LABEL} TIMEOUT 300)
endfunction()

# Enables CUDA in the calling directory (a macro, since enable_language is per directory):
# nvcc from the toolkit found, and Hopper (H100/H200) sm_90 code plus compute_90 PTX for
# anything newer to JIT from unless the caller chose the architectures.
macro(gpupool_enable_cuda)
  if(NOT CMAKE_CUDA_COMPILER AND CUDAToolkit_NVCC_EXECUTABLE)
    set(CMAKE_CUDA_COMPILER ${CUDAToolkit_NVCC_EXECUTABLE})
  endif()
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  enable_language(CUDA)
endmacro()

# The kernels and the process harness of tests/gpu, shared by the GPU tests and bench/; made
# once, by whichever directory asks first.
function(gpupool_gpu_support)
  if(TARGET gpupool_gpu_support)
    return()
  endif()
  set(dir ${CMAKE_SOURCE_DIR}/tests/gpu)
  add_library(gpupool_gpu_support STATIC ${dir}/gpu_kernels.cu ${dir}/gpu_harness.c)
  target_include_directories(gpupool_gpu_support PUBLIC ${dir})
  target_compile_options(gpupool_gpu_support PRIVATE $<$<COMPILE_LANGUAGE:C>:${GPUPOOL_WARN}>)
  gpupool_test_support()
  target_link_libraries(gpupool_gpu_support PUBLIC gpupool_test_launch CUDA::cudart_static)
endfunction()

# tests/support, shared by the tests and bench/; made once, by whichever directory asks first.
# gpupool_test_launch (the daemon launcher, the uid switch) needs libc alone;
# gpupool_test_frames (raw frames) needs the wire module, which its user links: gpupool_common
# or the static client library that carries it.
function(gpupool_test_support)
  if(TARGET gpupool_test_launch)
    return()
  endif()
  set(dir ${CMAKE_SOURCE_DIR}/tests/support)
  set(launch_src ${dir}/daemon.c)
  set(frames_src ${dir}/frames.c)
  foreach(part launch frames)
    add_library(gpupool_test_${part} STATIC ${${part}_src})
    target_include_directories(gpupool_test_${part} PUBLIC ${dir})
    target_compile_options(gpupool_test_${part} PRIVATE ${GPUPOOL_WARN})
  endforeach()
  target_include_directories(gpupool_test_frames PUBLIC
    $<TARGET_PROPERTY:gpupool_common_obj,INTERFACE_INCLUDE_DIRECTORIES>)
  add_dependencies(gpupool_test_frames gpupool_common_obj)
endfunction()
