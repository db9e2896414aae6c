/* Status strings, the thread-local last error, and version queries. */
#include <stdarg.h>
#include <stdio.h>

#include "internal.h"

#if defined(_MSC_VER)
#  define KDT_THREAD_LOCAL __declspec(thread)
#else
#  define KDT_THREAD_LOCAL _Thread_local
#endif

static KDT_THREAD_LOCAL char g_last_error[512];

kdt_status kdt_fail(kdt_status status, const char* fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(g_last_error, sizeof g_last_error, fmt, args);
    va_end(args);
    return status;
}

kdt_status kdt_ok(void) {
    g_last_error[0] = '\0';
    return KDT_OK;
}

const char* kdt_last_error(void) { return g_last_error; }

const char* kdt_status_string(int32_t status) {
    switch (status) {
        case KDT_OK: return "KDT_OK: success";
        case KDT_ERR_INVALID_ARGUMENT: return "KDT_ERR_INVALID_ARGUMENT: invalid argument";
        case KDT_ERR_NULL_POINTER: return "KDT_ERR_NULL_POINTER: required pointer is NULL";
        case KDT_ERR_SHAPE: return "KDT_ERR_SHAPE: sizes do not match";
        case KDT_ERR_VALUE: return "KDT_ERR_VALUE: invalid value in input data";
        case KDT_ERR_OUT_OF_RANGE: return "KDT_ERR_OUT_OF_RANGE: index or token id out of range";
        case KDT_ERR_OVERFLOW: return "KDT_ERR_OVERFLOW: size computation overflows";
        case KDT_ERR_OUT_OF_MEMORY: return "KDT_ERR_OUT_OF_MEMORY: allocation failed";
        case KDT_ERR_IO: return "KDT_ERR_IO: file input/output failed";
        case KDT_ERR_FORMAT: return "KDT_ERR_FORMAT: malformed KDTR file";
        case KDT_ERR_UNSUPPORTED: return "KDT_ERR_UNSUPPORTED: unsupported version, dtype or feature";
        case KDT_ERR_NOT_FOUND: return "KDT_ERR_NOT_FOUND: no such array";
        case KDT_ERR_BUFFER_TOO_SMALL: return "KDT_ERR_BUFFER_TOO_SMALL: workspace too small";
        case KDT_ERR_NO_DEVICE: return "KDT_ERR_NO_DEVICE: no CUDA device or driver";
        case KDT_ERR_CUDA: return "KDT_ERR_CUDA: CUDA runtime error";
        case KDT_ERR_INTERNAL: return "KDT_ERR_INTERNAL: internal error";
        default: return "unknown status";
    }
}

#define KDT_STR2(x) #x
#define KDT_STR(x) KDT_STR2(x)

const char* kdt_version(void) {
    return KDT_STR(KDT_VERSION_MAJOR) "." KDT_STR(KDT_VERSION_MINOR) "." KDT_STR(KDT_VERSION_PATCH);
}

int32_t kdt_abi_version(void) { return KDT_ABI_VERSION; }
