/* A test program that runs no checks: the harness must fail it (ctest expects it to fail,
 * WILL_FAIL), so that a test whose checks were all skipped or removed cannot pass. */
#include "harness.h"

int main(void) { HARNESS_EXIT(); }
