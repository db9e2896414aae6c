// Compiled as C++11 by the build (header_compiles_as_c_and_cxx): the public header must
// be usable from C++ (extern "C", no C-only constructs).
#include "kdtree.h"

int kdt_header_check_cxx();
int kdt_header_check_cxx() {
    kdt_trees trees = {};
    kdt_draft draft = {};
    kdt_status status = KDT_OK;
    const char* (*fn)(int32_t) = &kdt_status_string;
    return static_cast<int>(sizeof trees + sizeof draft) + static_cast<int>(status) + (fn ? 0 : 1);
}
