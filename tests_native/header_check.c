/* Compiled as strict C99 by the build (header_compiles_as_c_and_cxx): the public header
 * must need nothing beyond C99. */
#include "kdtree.h"

int kdt_header_check_c(void);
int kdt_header_check_c(void) {
    kdt_trees trees = {0};
    kdt_draft draft = {0};
    kdt_kdtr_array array = {0};
    return (int)sizeof trees + (int)sizeof draft + (int)sizeof array + KDT_OK;
}
