# cmake -DPROGRAM=<executable> -DEXPECTED=<file> -P run_and_compare.cmake
# Runs PROGRAM; fails unless it exits 0 and its standard output equals EXPECTED byte for byte.
execute_process(COMMAND "${PROGRAM}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${PROGRAM} exited with ${rc}\n${out}${err}")
endif()
file(READ "${EXPECTED}" expected)
if(NOT out STREQUAL expected)
  message(FATAL_ERROR "${PROGRAM} printed\n${out}\nexpected (${EXPECTED})\n${expected}")
endif()
message(STATUS "${PROGRAM}: output as expected")
