# ctest's example_installed: installs the build BUILD_DIR into a prefix under WORK_DIR,
# builds examples/ there as a separate project found through find_package(kdtree) with
# CMAKE_PREFIX_PATH, checks the package's kdtree_CUDA and the target's KDT_WITH_CUDA
# definition against EXPECT_CUDA, and runs the program (run_and_compare.cmake).
file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
set(build "${WORK_DIR}/build")

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " command "${ARGN}")
    message(FATAL_ERROR "${command}: exit ${rc}\n${out}${err}")
  endif()
  set(run_output "${out}" PARENT_SCOPE)
endfunction()

set(config_args)
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()
run("${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${prefix}" ${config_args})
run("${CMAKE_COMMAND}" -S "${SOURCE_DIR}/examples" -B "${build}" -G "${GENERATOR}"
    "-DCMAKE_C_COMPILER=${C_COMPILER}" "-DCMAKE_PREFIX_PATH=${prefix}" -DCMAKE_BUILD_TYPE=Release)
if(EXPECT_CUDA)
  set(want ON)
  set(want_define 1)
else()
  set(want OFF)
  set(want_define 0)
endif()
if(NOT run_output MATCHES "CUDA kernels: ${want}\n")
  message(FATAL_ERROR "find_package(kdtree) did not report kdtree_CUDA ${want}:\n${run_output}")
endif()
if(NOT run_output MATCHES "from ${prefix}/")
  message(FATAL_ERROR "find_package(kdtree) did not find the installed package under ${prefix}:\n${run_output}")
endif()
file(GLOB targets_file "${prefix}/lib*/cmake/kdtree/kdtreeTargets.cmake")
file(READ "${targets_file}" targets)
if(NOT targets MATCHES "INTERFACE_COMPILE_DEFINITIONS \"KDT_WITH_CUDA=${want_define}\"")
  message(FATAL_ERROR "${targets_file} does not give kdtree::kdtree KDT_WITH_CUDA=${want_define}")
endif()
run("${CMAKE_COMMAND}" --build "${build}" ${config_args})
execute_process(COMMAND "${CMAKE_COMMAND}" -DPROGRAM=${build}/quickstart
                        -DEXPECTED=${SOURCE_DIR}/examples/quickstart.out
                        -P "${SOURCE_DIR}/examples/run_and_compare.cmake" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the installed example's output differs (above)")
endif()
