# find_package(SparseMLIR) support, shipped inside the sparse_mlir wheel.
# `sparse-mlir --cmake-dir` prints this folder: pass it as SparseMLIR_DIR.
#
#   sparse_mlir_add_kernel(<name>
#       EXPR "C[i,j] = A[i,k] * B[k,j]"
#       FORMATS A=csr [B=...]
#       [SHAPES A=4096x4096 ...]          # optional for shape-generic kernels (hand-scheduled CPU ones:
#                                         # CSR SpMV, CSR/N:M/BSR SpMM, Linear, SDDMM; TARGET cuda: CSR
#                                         # SpMV/SpMM/Linear, COO/CSC/DCSR products, total reductions, CSF
#                                         # fibers), which then take every size at run time
#                                         # (A_d0, A_d1 after A's buffers); required for the others
#                                         # (sparsifier; TARGET cuda: every input), whose shapes are compiled in
#       [DTYPE float32] [OUT_DTYPE float32] [TARGET cpu] [CPU x86-64-v2] [THREADS])
#
# generates the kernel at build time (like Halide's add_halide_library) and
# makes <name> a static library target: link it, include "<name>.h", call
# int32_t <name>(...).  Needs the sparse-mlir command at build time only.
#
# With TARGET cuda (SHAPES for every input unless shape-generic), <name> is an interface target
# instead: "<name>.h" is a launcher over the CUDA Driver API (links
# CUDA::cuda_driver when the toolkit is found) and <NAME>_CODE_DIR names the
# folder of <name>.<chip>.cubin / .ptx to pass to <name>_load.
include_guard(GLOBAL)

find_program(SPARSE_MLIR_EXECUTABLE NAMES sparse-mlir
             HINTS "${CMAKE_CURRENT_LIST_DIR}/../../../../../bin" ENV PATH
             DOC "the sparse-mlir command that generates kernels")
if(NOT SPARSE_MLIR_EXECUTABLE)
  set(SparseMLIR_FOUND FALSE)
  set(SparseMLIR_NOT_FOUND_MESSAGE "the sparse-mlir command was not found; pip install sparse-mlir")
  return()
endif()
find_library(SPARSE_MLIR_LIBM m)
# the OpenMP runtime THREADS kernels link (libiomp5 from pip intel-openmp, or LLVM's libomp)
execute_process(COMMAND "${SPARSE_MLIR_EXECUTABLE}" info --openmp-library
                OUTPUT_VARIABLE SPARSE_MLIR_OPENMP_LIBRARY OUTPUT_STRIP_TRAILING_WHITESPACE)

function(sparse_mlir_add_kernel name)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "THREADS" "EXPR;DTYPE;OUT_DTYPE;TARGET;CPU" "FORMATS;SHAPES")
  if(NOT ARG_EXPR)
    message(FATAL_ERROR "sparse_mlir_add_kernel(${name}): EXPR is required")
  endif()
  if(NOT ARG_DTYPE)
    set(ARG_DTYPE float64)
  endif()
  if(NOT ARG_TARGET)
    set(ARG_TARGET cpu)
  endif()
  if(NOT ARG_CPU)
    set(ARG_CPU x86-64-v2)
  endif()
  set(flags)
  foreach(item IN LISTS ARG_FORMATS)
    list(APPEND flags --format "${item}")
  endforeach()
  foreach(item IN LISTS ARG_SHAPES)
    list(APPEND flags --shape "${item}")
  endforeach()
  if(ARG_OUT_DTYPE)  # a float16 kernel's float32 sums as its result
    list(APPEND flags --out-dtype "${ARG_OUT_DTYPE}")
  endif()
  if(ARG_THREADS)
    if(NOT SPARSE_MLIR_OPENMP_LIBRARY)
      message(FATAL_ERROR "sparse_mlir_add_kernel(${name} THREADS): no OpenMP runtime (pip install intel-openmp)")
    endif()
    list(APPEND flags --threads)
  endif()
  set(out "${CMAKE_CURRENT_BINARY_DIR}/sparse_mlir/${name}")
  if(ARG_TARGET STREQUAL "cuda")
    add_custom_command(
      OUTPUT "${out}/${name}.h" "${out}/${name}.json"
      COMMAND "${SPARSE_MLIR_EXECUTABLE}" export "${ARG_EXPR}" ${flags} --dtype "${ARG_DTYPE}" --target cuda
              --name "${name}" -o "${out}"
      COMMENT "sparse-mlir: generating ${name} = ${ARG_EXPR} (PTX, cubin, launcher)"
      VERBATIM)
    add_custom_target(${name}_generated DEPENDS "${out}/${name}.h" "${out}/${name}.json")
    add_library(${name} INTERFACE)
    add_dependencies(${name} ${name}_generated)
    target_include_directories(${name} INTERFACE "${out}")
    string(TOUPPER "${name}" upper)
    target_compile_definitions(${name} INTERFACE "${upper}_CODE_DIR=\"${out}\"")
    find_package(CUDAToolkit QUIET)
    if(CUDAToolkit_FOUND)
      target_include_directories(${name} INTERFACE ${CUDAToolkit_INCLUDE_DIRS})
    endif()
    if(TARGET CUDA::cuda_driver)
      target_link_libraries(${name} INTERFACE CUDA::cuda_driver)
    endif()
    return()
  endif()
  add_custom_command(
    OUTPUT "${out}/${name}.o" "${out}/${name}.h"
    COMMAND "${SPARSE_MLIR_EXECUTABLE}" export "${ARG_EXPR}" ${flags} --dtype "${ARG_DTYPE}"
            --target "${ARG_TARGET}" --cpu "${ARG_CPU}" --name "${name}" -o "${out}"
    COMMENT "sparse-mlir: generating ${name} = ${ARG_EXPR}"
    VERBATIM)
  add_library(${name} STATIC "${out}/${name}.o" "${out}/${name}.h")
  set_source_files_properties("${out}/${name}.o" PROPERTIES EXTERNAL_OBJECT TRUE GENERATED TRUE)
  set_target_properties(${name} PROPERTIES LINKER_LANGUAGE C)
  target_include_directories(${name} INTERFACE "${out}")
  if(SPARSE_MLIR_LIBM)
    target_link_libraries(${name} INTERFACE "${SPARSE_MLIR_LIBM}")
  endif()
  if(ARG_THREADS)
    target_link_libraries(${name} INTERFACE "${SPARSE_MLIR_OPENMP_LIBRARY}")
  endif()
endfunction()

set(SparseMLIR_FOUND TRUE)
