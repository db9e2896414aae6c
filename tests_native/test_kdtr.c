/* Tests of the KDTR reader and writer (docs/kdtr-format.md): round trips of every dtype,
 * every truncation, each corrupted field, writer validation, and the fixture written by the
 * Python writer (tools/make_kdtr_sample.py), whose expected values are hard-coded here. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "kdtree.h"

static char g_dir[256];

static void put_u32(unsigned char* p, uint32_t v) {
    for (int i = 0; i < 4; ++i) p[i] = (unsigned char)(v >> (8 * i));
}

static void put_u64(unsigned char* p, uint64_t v) {
    for (int i = 0; i < 8; ++i) p[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t get_u64(const unsigned char* p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}

static void path_in_dir(char* out, size_t cap, const char* name) {
    snprintf(out, cap, "%s/%s", g_dir, name);
}

/* Reads a whole file into a malloc'd buffer; NULL on failure. */
static unsigned char* read_file(const char* path, size_t* size) {
    FILE* fp = fopen(path, "rb");
    unsigned char* buf;
    long n;
    if (fp == NULL) return NULL;
    fseek(fp, 0, SEEK_END);
    n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    buf = (unsigned char*)malloc((size_t)n + 1);
    if (buf != NULL && fread(buf, 1, (size_t)n, fp) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(fp);
    *size = (size_t)n;
    return buf;
}

static int write_file(const char* path, const unsigned char* data, size_t size) {
    FILE* fp = fopen(path, "wb");
    int ok;
    if (fp == NULL) return 0;
    ok = fwrite(data, 1, size, fp) == size;
    return fclose(fp) == 0 && ok;
}

/* Number of directory entries whose name contains `text`. */
static int count_entries_with(const char* text) {
    DIR* d = opendir(g_dir);
    struct dirent* e;
    int n = 0;
    if (d == NULL) return -1;
    while ((e = readdir(d)) != NULL) {
        if (strstr(e->d_name, text) != NULL) ++n;
    }
    closedir(d);
    return n;
}

static void test_dtype_size(void) {
    static const size_t expected[14] = {0, 1, 1, 2, 4, 8, 1, 2, 4, 8, 2, 2, 4, 8};
    size_t bytes = 0;
    for (int32_t code = 1; code <= 13; ++code) {
        CHECK_OK(kdt_dtype_size(code, &bytes));
        CHECK_EQ(bytes, expected[code]);
    }
    CHECK_STATUS(kdt_dtype_size(0, &bytes), KDT_ERR_UNSUPPORTED);
    CHECK_STATUS(kdt_dtype_size(14, &bytes), KDT_ERR_UNSUPPORTED);
    CHECK_STATUS(kdt_dtype_size(-1, &bytes), KDT_ERR_UNSUPPORTED);
    CHECK_STATUS(kdt_dtype_size(KDT_DTYPE_INT32, NULL), KDT_ERR_NULL_POINTER);
}

/* ---- Round trip of every dtype ------------------------------------------------------- */

enum { RT_COUNT = 16 };

static void check_same_array(const kdt_kdtr_array* got, const kdt_kdtr_array* want) {
    CHECK(strcmp(got->name, want->name) == 0);
    CHECK_EQ(got->dtype, want->dtype);
    CHECK_EQ(got->ndim, want->ndim);
    for (int32_t d = 0; d < want->ndim; ++d) CHECK_EQ(got->shape[d], want->shape[d]);
    CHECK_EQ(got->nbytes, want->nbytes);
    CHECK(got->data != NULL);
    CHECK_EQ((uintptr_t)got->data % 64, 0);
    if (want->nbytes > 0) CHECK(memcmp(got->data, want->data, (size_t)want->nbytes) == 0);
}

static void test_round_trip(void) {
    static const char* names[13] = {"bool", "int8", "int16", "int32", "int64",
                                    "uint8", "uint16", "uint32", "uint64", "float16",
                                    "bfloat16", "float32", "float64"};
    static unsigned char data[RT_COUNT][7 * 8];
    int64_t shapes[RT_COUNT][3];
    kdt_kdtr_array arrays[RT_COUNT];
    kdt_kdtr_file* f = NULL;
    kdt_kdtr_array a;
    int64_t count = -1;
    char path[512];
    unsigned char* bytes;
    size_t size = 0;

    memset(arrays, 0, sizeof arrays);
    /* Arrays 0..12: one per dtype, shape [7] (odd size), deterministic bytes. */
    for (int i = 0; i < 13; ++i) {
        size_t itemsize = 0;
        CHECK_OK(kdt_dtype_size(i + 1, &itemsize));
        for (size_t k = 0; k < 7 * itemsize; ++k) {
            data[i][k] = (unsigned char)(i == 0 ? k % 2 : (k * 37u + (unsigned)i * 11u) & 0xFF);
        }
        shapes[i][0] = 7;
        arrays[i].name = names[i];
        arrays[i].dtype = i + 1;
        arrays[i].ndim = 1;
        arrays[i].shape = shapes[i];
        arrays[i].data = data[i];
        arrays[i].nbytes = 7 * itemsize;
    }
    /* 13: 0-d float64 = 1.5 */
    {
        const double v = 1.5;
        memcpy(data[13], &v, sizeof v);
        arrays[13] = (kdt_kdtr_array){"scalar", KDT_DTYPE_FLOAT64, 0, NULL, data[13], 8};
    }
    /* 14: zero-size float32 [0, 4] with NULL data */
    shapes[14][0] = 0;
    shapes[14][1] = 4;
    arrays[14] = (kdt_kdtr_array){"empty_0x4", KDT_DTYPE_FLOAT32, 2, shapes[14], NULL, 0};
    /* 15: int16 [1, 3, 1] with a non-ASCII name */
    shapes[15][0] = 1;
    shapes[15][1] = 3;
    shapes[15][2] = 1;
    for (int k = 0; k < 6; ++k) data[15][k] = (unsigned char)(200 + k);
    arrays[15] = (kdt_kdtr_array){"\xce\xb2/logw", KDT_DTYPE_INT16, 3, shapes[15], data[15], 6};

    path_in_dir(path, sizeof path, "round_trip.kdtr");
    CHECK_OK(kdt_kdtr_save(path, arrays, RT_COUNT));
    CHECK_OK(kdt_kdtr_open(path, &f));
    CHECK(f != NULL);
    if (f == NULL) return;
    CHECK_OK(kdt_kdtr_count(f, &count));
    CHECK_EQ(count, RT_COUNT);
    for (int64_t i = 0; i < RT_COUNT; ++i) {
        CHECK_OK(kdt_kdtr_get(f, i, &a));
        check_same_array(&a, &arrays[i]);
        CHECK_OK(kdt_kdtr_find(f, arrays[i].name, &a));
        check_same_array(&a, &arrays[i]);
    }
    CHECK_OK(kdt_kdtr_get(f, 13, &a));
    CHECK(a.shape == NULL);
    CHECK_STATUS(kdt_kdtr_find(f, "nope", &a), KDT_ERR_NOT_FOUND);
    CHECK_ERR_HAS("nope");
    CHECK_STATUS(kdt_kdtr_find(f, "", &a), KDT_ERR_NOT_FOUND);
    CHECK_STATUS(kdt_kdtr_find(f, "int", &a), KDT_ERR_NOT_FOUND);
    CHECK_STATUS(kdt_kdtr_get(f, -1, &a), KDT_ERR_OUT_OF_RANGE);
    CHECK_STATUS(kdt_kdtr_get(f, RT_COUNT, &a), KDT_ERR_OUT_OF_RANGE);
    CHECK_STATUS(kdt_kdtr_get(f, 0, NULL), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_kdtr_get(NULL, 0, &a), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_kdtr_find(f, NULL, &a), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_kdtr_count(NULL, &count), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_kdtr_count(f, NULL), KDT_ERR_NULL_POINTER);
    kdt_kdtr_close(f);
    f = NULL;

    /* The same bytes through kdt_kdtr_open_memory. */
    bytes = read_file(path, &size);
    CHECK(bytes != NULL);
    if (bytes != NULL) {
        CHECK_OK(kdt_kdtr_open_memory(bytes, size, &f));
        memset(bytes, 0xAB, size); /* the file object holds its own copy */
        for (int64_t i = 0; f != NULL && i < RT_COUNT; ++i) {
            CHECK_OK(kdt_kdtr_get(f, i, &a));
            check_same_array(&a, &arrays[i]);
        }
        kdt_kdtr_close(f);
        free(bytes);
    }

    /* An empty file (no arrays) is header only. */
    path_in_dir(path, sizeof path, "empty.kdtr");
    CHECK_OK(kdt_kdtr_save(path, NULL, 0));
    CHECK_OK(kdt_kdtr_open(path, &f));
    CHECK_OK(kdt_kdtr_count(f, &count));
    CHECK_EQ(count, 0);
    CHECK_STATUS(kdt_kdtr_find(f, "x", &a), KDT_ERR_NOT_FOUND);
    kdt_kdtr_close(f);
    bytes = read_file(path, &size);
    CHECK_EQ(size, 64);
    free(bytes);
    kdt_kdtr_close(NULL);
}

/* ---- A small file with a known layout (the spec's worked example plus array "m") ----- */
/*
 * record 0 "a" int32 [2]     at 64  (48 bytes), data at 256
 * record 1 "s" float64 0-d   at 112 (40 bytes), data at 320
 * record 2 "m" uint8 [2, 3]  at 152 (56 bytes), data at 384; shape[0] at 192, shape[1] at 200
 * table_size 144, table ends at 208, file_size 390.
 */
enum { REC0 = 64, REC1 = 112, REC2 = 152, SMALL_SIZE = 390 };

static unsigned char g_small[SMALL_SIZE];

static void make_small(void) {
    static const int32_t a[2] = {1, 2};
    static const double s = 1.5;
    static const uint8_t m[6] = {1, 2, 3, 4, 5, 6};
    static const int64_t a_shape[1] = {2};
    static const int64_t m_shape[2] = {2, 3};
    const kdt_kdtr_array arrays[3] = {
        {"a", KDT_DTYPE_INT32, 1, a_shape, a, 8},
        {"s", KDT_DTYPE_FLOAT64, 0, NULL, &s, 8},
        {"m", KDT_DTYPE_UINT8, 2, m_shape, m, 6},
    };
    char path[512];
    unsigned char* bytes;
    size_t size = 0;
    path_in_dir(path, sizeof path, "small.kdtr");
    CHECK_OK(kdt_kdtr_save(path, arrays, 3));
    bytes = read_file(path, &size);
    CHECK(bytes != NULL);
    CHECK_EQ(size, SMALL_SIZE);
    if (bytes == NULL || size != SMALL_SIZE) exit(1);
    memcpy(g_small, bytes, SMALL_SIZE);
    free(bytes);
    /* The layout this file's tests assume. */
    CHECK_EQ(get_u64(g_small + 32), 144);
    CHECK_EQ(get_u64(g_small + REC0), 256);
    CHECK_EQ(get_u64(g_small + REC1), 320);
    CHECK_EQ(get_u64(g_small + REC2), 384);
    CHECK_EQ(get_u64(g_small + REC2 + 40), 2);
    CHECK_EQ(get_u64(g_small + REC2 + 48), 3);
}

static void test_worked_example_bytes(void) {
    /* The first 264 bytes of spec section 8, rebuilt by kdt_kdtr_save. */
    static const int32_t a[2] = {1, 2};
    static const double s = 1.5;
    static const int64_t a_shape[1] = {2};
    const kdt_kdtr_array arrays[2] = {{"a", KDT_DTYPE_INT32, 1, a_shape, a, 8},
                                      {"s", KDT_DTYPE_FLOAT64, 0, NULL, &s, 8}};
    unsigned char want[264];
    char path[512];
    unsigned char* bytes;
    size_t size = 0;
    memset(want, 0, sizeof want);
    memcpy(want, "KDTR\r\n\x1a\n", 8);
    want[8] = 1;
    want[12] = 64;
    put_u64(want + 16, 264);
    put_u64(want + 24, 2);
    put_u64(want + 32, 88);
    put_u64(want + 64, 192);
    put_u64(want + 72, 8);
    put_u32(want + 80, 1);
    put_u32(want + 84, 4);
    put_u32(want + 88, 1);
    want[96] = 'a';
    put_u64(want + 104, 2);
    put_u64(want + 112, 256);
    put_u64(want + 120, 8);
    put_u32(want + 128, 1);
    put_u32(want + 132, 13);
    want[144] = 's';
    want[192] = 1;
    want[196] = 2;
    memcpy(want + 256, &s, 8);
    path_in_dir(path, sizeof path, "example.kdtr");
    CHECK_OK(kdt_kdtr_save(path, arrays, 2));
    bytes = read_file(path, &size);
    CHECK_EQ(size, sizeof want);
    CHECK(bytes != NULL && size == sizeof want && memcmp(bytes, want, sizeof want) == 0);
    free(bytes);
}

static void test_truncation(void) {
    kdt_kdtr_file* f = (kdt_kdtr_file*)&f; /* must be reset to NULL on failure */
    char path[512];
    path_in_dir(path, sizeof path, "truncated.kdtr");
    CHECK_OK(kdt_kdtr_open_memory(g_small, SMALL_SIZE, &f));
    kdt_kdtr_close(f);
    for (size_t n = 0; n < SMALL_SIZE; ++n) {
        f = (kdt_kdtr_file*)&f;
        CHECK_STATUS(kdt_kdtr_open_memory(g_small, n, &f), KDT_ERR_FORMAT);
        CHECK(f == NULL);
        CHECK(write_file(path, g_small, n));
        f = (kdt_kdtr_file*)&f;
        CHECK_STATUS(kdt_kdtr_open(path, &f), KDT_ERR_FORMAT);
        CHECK(f == NULL);
    }
    CHECK_STATUS(kdt_kdtr_open_memory(NULL, 0, &f), KDT_ERR_FORMAT);
    CHECK_ERR_HAS("header");
    /* Trailing bytes are detected through file_size too. */
    {
        unsigned char longer[SMALL_SIZE + 1];
        memcpy(longer, g_small, SMALL_SIZE);
        longer[SMALL_SIZE] = 0;
        CHECK_STATUS(kdt_kdtr_open_memory(longer, sizeof longer, &f), KDT_ERR_FORMAT);
        CHECK_ERR_HAS("file_size at byte offset 16");
    }
}

/* Opens a corrupted copy of g_small (from memory and from a file) and checks the status
 * and that the last error contains `text`. */
static void expect_corrupt(const unsigned char* buf, size_t size, kdt_status want,
                           const char* text, int line) {
    kdt_kdtr_file* f = NULL;
    char path[512];
    const int before = harness_failures;
    path_in_dir(path, sizeof path, "corrupt.kdtr");
    CHECK_STATUS(kdt_kdtr_open_memory(buf, size, &f), want);
    if (text != NULL) CHECK_ERR_HAS(text);
    CHECK((want == KDT_OK) == (f != NULL));
    kdt_kdtr_close(f);
    f = NULL;
    CHECK(write_file(path, buf, size));
    CHECK_STATUS(kdt_kdtr_open(path, &f), want);
    if (text != NULL) CHECK_ERR_HAS(text);
    kdt_kdtr_close(f);
    if (harness_failures != before) fprintf(stderr, "  (corruption case at line %d)\n", line);
}

#define CORRUPT(want, text)                                                                  \
    expect_corrupt(b, SMALL_SIZE, (want), (text), __LINE__);                                 \
    memcpy(b, g_small, SMALL_SIZE)

static void test_corruptions(void) {
    unsigned char b[SMALL_SIZE];
    memcpy(b, g_small, SMALL_SIZE);
    expect_corrupt(b, SMALL_SIZE, KDT_OK, NULL, __LINE__);

    b[0] = 'X';
    CORRUPT(KDT_ERR_FORMAT, "magic at byte offset 0");
    b[7] = 0;
    CORRUPT(KDT_ERR_FORMAT, "magic");
    b[8] = 2; /* major 2 */
    CORRUPT(KDT_ERR_UNSUPPORTED, "major version at byte offset 8");
    b[9] = 1; /* major 257 */
    CORRUPT(KDT_ERR_UNSUPPORTED, "major version");
    b[10] = 7; /* a newer minor version is readable */
    CORRUPT(KDT_OK, NULL);
    b[40] = 0xFF; /* reserved header bytes are ignored */
    CORRUPT(KDT_OK, NULL);
    put_u32(b + 12, 60);
    CORRUPT(KDT_ERR_FORMAT, "header_size at byte offset 12");
    put_u32(b + 12, 0xFFFFFFFFu);
    CORRUPT(KDT_ERR_FORMAT, "header_size");
    put_u64(b + 16, SMALL_SIZE + 1);
    CORRUPT(KDT_ERR_FORMAT, "file_size at byte offset 16");
    put_u64(b + 16, UINT64_MAX);
    CORRUPT(KDT_ERR_FORMAT, "file_size");
    put_u64(b + 24, UINT64_MAX); /* huge count */
    CORRUPT(KDT_ERR_FORMAT, "array_count at byte offset 24");
    put_u64(b + 24, (uint64_t)1 << 61);
    CORRUPT(KDT_ERR_FORMAT, "array_count");
    put_u64(b + 24, 4); /* 4 * 40 > 144 */
    CORRUPT(KDT_ERR_FORMAT, "array_count");
    put_u64(b + 24, 2); /* two records end before the table does */
    CORRUPT(KDT_ERR_FORMAT, "table_size at byte offset 32");
    put_u64(b + 32, UINT64_MAX - 7); /* huge table_size */
    CORRUPT(KDT_ERR_FORMAT, "table_size at byte offset 32");
    put_u64(b + 32, 140); /* not a multiple of 8 */
    CORRUPT(KDT_ERR_FORMAT, "table_size");
    put_u64(b + 32, 136); /* record 2 runs past the table */
    CORRUPT(KDT_ERR_FORMAT, "array 2: record at byte offset 152");

    put_u32(b + REC1 + 16, 0xFFFFFFFFu); /* huge name length */
    CORRUPT(KDT_ERR_FORMAT, "array 1: name_len at byte offset 128");
    put_u32(b + REC1 + 16, 65535); /* in range but past the table */
    CORRUPT(KDT_ERR_FORMAT, "array 1: record at byte offset 112");
    put_u32(b + REC1 + 16, 0);
    CORRUPT(KDT_ERR_FORMAT, "name_len");
    put_u32(b + REC2 + 24, 33);
    CORRUPT(KDT_ERR_FORMAT, "array 2: ndim at byte offset 176");
    put_u32(b + REC2 + 24, 0xFFFFFFFFu);
    CORRUPT(KDT_ERR_FORMAT, "ndim");
    put_u32(b + REC2 + 24, 3); /* one more extent than the table holds */
    CORRUPT(KDT_ERR_FORMAT, "array 2: record at byte offset 152");
    b[REC0 + 32] = 0; /* NUL in a name */
    CORRUPT(KDT_ERR_FORMAT, "array 0: name at byte offset 96: contains a NUL");
    b[REC0 + 32] = 0xFF; /* ill-formed UTF-8 */
    CORRUPT(KDT_ERR_FORMAT, "name at byte offset 96: not well-formed UTF-8");
    b[REC0 + 32] = 0xC3; /* a truncated two-byte sequence */
    CORRUPT(KDT_ERR_FORMAT, "UTF-8");

    put_u32(b + REC1 + 20, 14); /* unknown dtype */
    CORRUPT(KDT_ERR_UNSUPPORTED, "array 1 ('s'): dtype at byte offset 132: unknown dtype code 14");
    put_u32(b + REC1 + 20, 0);
    CORRUPT(KDT_ERR_UNSUPPORTED, "dtype");
    put_u64(b + REC2 + 40, (uint64_t)1 << 62); /* 2^62 * 3 bytes overflows */
    CORRUPT(KDT_ERR_FORMAT, "array 2 ('m'): shape[1] at byte offset 200: shape product overflows");
    put_u64(b + REC2 + 40, UINT64_MAX); /* -1 */
    CORRUPT(KDT_ERR_FORMAT, "array 2 ('m'): shape[0] at byte offset 192: negative extent -1");
    put_u64(b + REC2 + 40, 0); /* [0, 3] with nbytes 6 */
    CORRUPT(KDT_ERR_FORMAT, "array 2 ('m'): nbytes at byte offset 160");
    put_u64(b + REC2 + 8, 7);
    CORRUPT(KDT_ERR_FORMAT, "nbytes");
    /* [0, 2^62] is a valid empty array; [2^62, 0, 4]'s non-zero extents overflow. */
    put_u64(b + REC2 + 40, 0);
    put_u64(b + REC2 + 48, (uint64_t)1 << 62);
    put_u64(b + REC2 + 8, 0);
    expect_corrupt(b, SMALL_SIZE, KDT_OK, NULL, __LINE__);
    {
        kdt_kdtr_file* f = NULL;
        kdt_kdtr_array a;
        CHECK_OK(kdt_kdtr_open_memory(b, SMALL_SIZE, &f));
        CHECK_OK(kdt_kdtr_find(f, "m", &a));
        CHECK_EQ(a.nbytes, 0);
        CHECK_EQ(a.shape[1], (int64_t)1 << 62);
        kdt_kdtr_close(f);
    }
    memcpy(b, g_small, SMALL_SIZE);

    put_u64(b + REC2 + 0, 448); /* aligned, past the end */
    CORRUPT(KDT_ERR_FORMAT, "array 2 ('m'): data_offset at byte offset 152");
    put_u64(b + REC2 + 0, UINT64_MAX - 63); /* offset + nbytes overflows */
    CORRUPT(KDT_ERR_FORMAT, "past the end of the file");
    put_u64(b + REC2 + 8, UINT64_MAX); /* huge nbytes */
    CORRUPT(KDT_ERR_FORMAT, "nbytes");
    put_u64(b + REC0 + 0, 260); /* misaligned */
    CORRUPT(KDT_ERR_FORMAT,
            "array 0 ('a'): data_offset at byte offset 64: 260 is not a multiple of 64");
    put_u64(b + REC1 + 0, 256); /* overlaps array 0 */
    CORRUPT(KDT_ERR_FORMAT, "array 1 ('s'): data_offset at byte offset 112: 256 overlaps");
    put_u64(b + REC0 + 0, 192); /* inside the record table */
    CORRUPT(KDT_ERR_FORMAT, "inside the header or record table");
    put_u64(b + REC0 + 0, 0);
    CORRUPT(KDT_ERR_FORMAT, "data_offset");
    b[REC2 + 32] = 'a'; /* duplicate names */
    CORRUPT(KDT_ERR_FORMAT,
            "array 2 ('a'): name at byte offset 184: duplicates the name of array 0");
    b[REC0 + 33] = 0xEE; /* padding after a name is ignored */
    CORRUPT(KDT_OK, NULL);
}

/* Deterministic random corruption: whatever the bytes, no crash, and a file that opens
 * exposes only ranges inside itself. */
static void test_random_corruptions(void) {
    uint64_t state = 0x9E3779B97F4A7C15ull;
    unsigned char b[SMALL_SIZE];
    int opened = 0;
    for (int iter = 0; iter < 20000; ++iter) {
        kdt_kdtr_file* f = NULL;
        kdt_status s;
        int flips;
        memcpy(b, g_small, SMALL_SIZE);
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        flips = 1 + (int)((state >> 33) % 4);
        for (int k = 0; k < flips; ++k) {
            state = state * 6364136223846793005ull + 1442695040888963407ull;
            b[(state >> 33) % 208] ^= (unsigned char)(1u << ((state >> 20) % 8));
        }
        s = kdt_kdtr_open_memory(b, SMALL_SIZE, &f);
        CHECK(s == KDT_OK || s == KDT_ERR_FORMAT || s == KDT_ERR_UNSUPPORTED);
        if (s == KDT_OK) {
            int64_t count = 0;
            ++opened;
            CHECK_OK(kdt_kdtr_count(f, &count));
            for (int64_t i = 0; i < count; ++i) {
                kdt_kdtr_array a;
                CHECK_OK(kdt_kdtr_get(f, i, &a));
                CHECK(strlen(a.name) > 0);
                CHECK(a.ndim >= 0 && a.ndim <= KDT_KDTR_MAX_NDIM);
                CHECK(a.nbytes <= SMALL_SIZE);
                CHECK_OK(kdt_kdtr_find(f, a.name, &a));
            }
        } else {
            CHECK(f == NULL);
            CHECK(strlen(kdt_last_error()) > 0);
        }
        kdt_kdtr_close(f);
    }
    CHECK(opened > 0);
}

static void test_open_errors(void) {
    kdt_kdtr_file* f = NULL;
    char path[512];
    path_in_dir(path, sizeof path, "does_not_exist.kdtr");
    CHECK_STATUS(kdt_kdtr_open(path, &f), KDT_ERR_IO);
    CHECK_ERR_HAS("does_not_exist.kdtr");
    CHECK(f == NULL);
    CHECK_STATUS(kdt_kdtr_open(g_dir, &f), KDT_ERR_IO); /* a directory */
    CHECK_STATUS(kdt_kdtr_open(NULL, &f), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_kdtr_open(path, NULL), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_kdtr_open_memory(NULL, 10, &f), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_kdtr_open_memory(g_small, SMALL_SIZE, NULL), KDT_ERR_NULL_POINTER);
}

/* ---- Writer validation ---------------------------------------------------------------- */

static void expect_save_fails(const kdt_kdtr_array* arrays, int64_t count, kdt_status want,
                              const char* text, int line) {
    char path[512];
    struct stat st;
    const int before = harness_failures;
    path_in_dir(path, sizeof path, "rejected.kdtr");
    CHECK_STATUS(kdt_kdtr_save(path, arrays, count), want);
    if (text != NULL) CHECK_ERR_HAS(text);
    CHECK(stat(path, &st) != 0); /* nothing created */
    if (harness_failures != before) fprintf(stderr, "  (save case at line %d)\n", line);
}

static void test_save_rejects(void) {
    static const int32_t v[6] = {0, 1, 2, 3, 4, 5};
    static const uint8_t bad_bool[3] = {0, 1, 2};
    int64_t shape[2] = {2, 3};
    kdt_kdtr_array a[2];
    char path[512];
    const kdt_kdtr_array good = {"x", KDT_DTYPE_INT32, 2, shape, v, 24};
    const kdt_kdtr_array other = {"y", KDT_DTYPE_INT32, 2, shape, v, 24};

    path_in_dir(path, sizeof path, "rejected.kdtr");
    CHECK_STATUS(kdt_kdtr_save(NULL, &good, 1), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_kdtr_save(path, NULL, 1), KDT_ERR_NULL_POINTER);
    CHECK_STATUS(kdt_kdtr_save(path, &good, -1), KDT_ERR_INVALID_ARGUMENT);

#define SAVE_FAILS(arr, n, want, text) expect_save_fails((arr), (n), (want), (text), __LINE__)
    a[0] = good;
    a[1] = good; /* duplicate names */
    SAVE_FAILS(a, 2, KDT_ERR_INVALID_ARGUMENT,
               "array 1 ('x'): name duplicates the name of array 0");
    a[1] = other;
    a[1].name = "";
    SAVE_FAILS(a, 2, KDT_ERR_INVALID_ARGUMENT, "array 1: name is empty");
    a[1].name = NULL;
    SAVE_FAILS(a, 2, KDT_ERR_NULL_POINTER, "array 1: name is NULL");
    a[1].name = "bad\xff";
    SAVE_FAILS(a, 2, KDT_ERR_INVALID_ARGUMENT, "UTF-8");
    a[1].name = "\xed\xa0\x80"; /* an encoded surrogate */
    SAVE_FAILS(a, 2, KDT_ERR_INVALID_ARGUMENT, "UTF-8");
    {
        char* long_name = (char*)malloc(65537);
        memset(long_name, 'n', 65536);
        long_name[65536] = '\0';
        a[1] = other;
        a[1].name = long_name;
        SAVE_FAILS(a, 2, KDT_ERR_INVALID_ARGUMENT, "longer than 65535");
        long_name[65535] = '\0'; /* exactly 65535 bytes is fine */
        CHECK_OK(kdt_kdtr_save(path, a, 2));
        {
            kdt_kdtr_file* f = NULL;
            kdt_kdtr_array got;
            CHECK_OK(kdt_kdtr_open(path, &f));
            CHECK_OK(kdt_kdtr_find(f, long_name, &got));
            CHECK_EQ(strlen(got.name), 65535);
            kdt_kdtr_close(f);
        }
        unlink(path);
        free(long_name);
    }
    a[1] = other;
    a[1].dtype = 0;
    SAVE_FAILS(a, 2, KDT_ERR_UNSUPPORTED, "array 1 ('y'): unknown dtype code 0");
    a[1].dtype = 14;
    SAVE_FAILS(a, 2, KDT_ERR_UNSUPPORTED, "dtype");
    a[1] = other;
    a[1].ndim = 33;
    SAVE_FAILS(a, 2, KDT_ERR_INVALID_ARGUMENT, "ndim");
    a[1].ndim = -1;
    SAVE_FAILS(a, 2, KDT_ERR_INVALID_ARGUMENT, "ndim");
    a[1] = other;
    a[1].shape = NULL;
    SAVE_FAILS(a, 2, KDT_ERR_NULL_POINTER, "shape is NULL");
    {
        int64_t neg[2] = {2, -3};
        int64_t huge[2] = {INT64_MAX, 2};
        a[1] = other;
        a[1].shape = neg;
        SAVE_FAILS(a, 2, KDT_ERR_INVALID_ARGUMENT, "shape[1] is negative");
        a[1].shape = huge;
        SAVE_FAILS(a, 2, KDT_ERR_OVERFLOW, "shape product overflows");
    }
    a[1] = other;
    a[1].nbytes = 23;
    SAVE_FAILS(a, 2, KDT_ERR_INVALID_ARGUMENT, "nbytes is 23, but dtype and shape give 24");
    a[1] = other;
    a[1].data = NULL;
    SAVE_FAILS(a, 2, KDT_ERR_NULL_POINTER, "data is NULL");
    {
        int64_t three[1] = {3};
        a[1] = (kdt_kdtr_array){"mask", KDT_DTYPE_BOOL, 1, three, bad_bool, 3};
        SAVE_FAILS(a, 2, KDT_ERR_INVALID_ARGUMENT, "bool element 2 is 2");
    }
#undef SAVE_FAILS

    /* A failed save leaves an existing file untouched and no temporary files behind. */
    {
        kdt_kdtr_file* f = NULL;
        int64_t count = 0;
        path_in_dir(path, sizeof path, "keep.kdtr");
        CHECK_OK(kdt_kdtr_save(path, &good, 1));
        a[0] = good;
        a[1] = good;
        CHECK_STATUS(kdt_kdtr_save(path, a, 2), KDT_ERR_INVALID_ARGUMENT);
        CHECK_OK(kdt_kdtr_open(path, &f));
        CHECK_OK(kdt_kdtr_count(f, &count));
        CHECK_EQ(count, 1);
        kdt_kdtr_close(f);
        /* Replacing works. */
        a[1] = other;
        CHECK_OK(kdt_kdtr_save(path, a, 2));
        CHECK_OK(kdt_kdtr_open(path, &f));
        CHECK_OK(kdt_kdtr_count(f, &count));
        CHECK_EQ(count, 2);
        kdt_kdtr_close(f);
        CHECK_EQ(count_entries_with(".tmp-"), 0);
    }
    /* A folder that does not exist: KDT_ERR_IO. */
    path_in_dir(path, sizeof path, "no/such/folder/x.kdtr");
    CHECK_STATUS(kdt_kdtr_save(path, &good, 1), KDT_ERR_IO);
    CHECK_ERR_HAS("no/such/folder");
}

/* ---- The fixture written by the Python writer (tools/make_kdtr_sample.py) ------------- */

static void check_fixture_array(kdt_kdtr_file* f, const char* name, int32_t dtype, int32_t ndim,
                                const int64_t* shape, const void* data, uint64_t nbytes) {
    kdt_kdtr_array a;
    CHECK_OK(kdt_kdtr_find(f, name, &a));
    if (kdt_kdtr_find(f, name, &a) != KDT_OK) {
        fprintf(stderr, "  fixture array '%s' missing\n", name);
        return;
    }
    CHECK_EQ(a.dtype, dtype);
    CHECK_EQ(a.ndim, ndim);
    for (int32_t d = 0; d < ndim && d < a.ndim; ++d) CHECK_EQ(a.shape[d], shape[d]);
    CHECK_EQ(a.nbytes, nbytes);
    if (a.nbytes == nbytes && nbytes > 0) CHECK(memcmp(a.data, data, (size_t)nbytes) == 0);
}

static void test_fixture(void) {
    static const char* order[8] = {"int32_2x3", "bf16_bits", "f64_scalar", "empty_0x4",
                                   "bool_mask", "f16_pair", "u16_\xce\xb2", "i64_neg"};
    const char* path = KDT_FIXTURES_DIR "/kdtr_sample.kdtr";
    kdt_kdtr_file* f = NULL;
    int64_t count = 0;
    struct stat st;
    if (stat(path, &st) != 0) {
        printf("skipped: %s not found (run tools/make_kdtr_sample.py)\n", path);
        return;
    }
    CHECK_OK(kdt_kdtr_open(path, &f));
    if (f == NULL) return;
    CHECK_OK(kdt_kdtr_count(f, &count));
    CHECK_EQ(count, 8);
    for (int64_t i = 0; i < count && i < 8; ++i) {
        kdt_kdtr_array a;
        CHECK_OK(kdt_kdtr_get(f, i, &a));
        CHECK(strcmp(a.name, order[i]) == 0);
    }
    {
        static const int32_t v[6] = {0, 1, 2, 3, 4, 5};
        static const int64_t shape[2] = {2, 3};
        check_fixture_array(f, "int32_2x3", KDT_DTYPE_INT32, 2, shape, v, sizeof v);
    }
    {
        static const uint16_t v[5] = {0x3F80, 0xC000, 0x7F80, 0x0001, 0x7FC0};
        static const int64_t shape[1] = {5};
        check_fixture_array(f, "bf16_bits", KDT_DTYPE_BFLOAT16, 1, shape, v, sizeof v);
    }
    {
        static const double v = 1.5;
        check_fixture_array(f, "f64_scalar", KDT_DTYPE_FLOAT64, 0, NULL, &v, 8);
    }
    {
        static const int64_t shape[2] = {0, 4};
        check_fixture_array(f, "empty_0x4", KDT_DTYPE_FLOAT32, 2, shape, NULL, 0);
    }
    {
        static const uint8_t v[3] = {1, 0, 1};
        static const int64_t shape[1] = {3};
        check_fixture_array(f, "bool_mask", KDT_DTYPE_BOOL, 1, shape, v, 3);
    }
    {
        static const uint16_t v[2] = {0x3800, 0xBC00};
        static const int64_t shape[1] = {2};
        check_fixture_array(f, "f16_pair", KDT_DTYPE_FLOAT16, 1, shape, v, 4);
    }
    {
        static const uint16_t v[2] = {1, 65535};
        static const int64_t shape[1] = {2};
        check_fixture_array(f, "u16_\xce\xb2", KDT_DTYPE_UINT16, 1, shape, v, 4);
    }
    {
        static const int64_t v[3] = {INT64_MIN, -1, INT64_MAX};
        static const int64_t shape[1] = {3};
        check_fixture_array(f, "i64_neg", KDT_DTYPE_INT64, 1, shape, v, sizeof v);
    }
    kdt_kdtr_close(f);
}

/* Peak resident memory of this process in KiB (Linux reports ru_maxrss in KiB). */
static long peak_rss_kib(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return -1;
    return ru.ru_maxrss;
}

/* A sparse file of `size` bytes holding `head` (its first `head_size` bytes) and `tail`
 * (`tail_size` bytes at `tail_at`); 0 when the file cannot be made. */
static int make_sparse(const char* path, uint64_t size, const unsigned char* head,
                       size_t head_size, const unsigned char* tail, size_t tail_size,
                       uint64_t tail_at) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    int ok;
    if (fd < 0) return 0;
    ok = ftruncate(fd, (off_t)size) == 0 &&
         pwrite(fd, head, head_size, 0) == (ssize_t)head_size &&
         (tail_size == 0 || pwrite(fd, tail, tail_size, (off_t)tail_at) == (ssize_t)tail_size);
    return close(fd) == 0 && ok;
}

/* A header declaring file_size, array_count and table_size. */
static void make_header(unsigned char* h, uint64_t file_size, uint64_t count, uint64_t table_size) {
    static const unsigned char magic[8] = {0x4B, 0x44, 0x54, 0x52, 0x0D, 0x0A, 0x1A, 0x0A};
    memset(h, 0, 64);
    memcpy(h, magic, 8);
    h[8] = 1;
    put_u32(h + 12, 64);
    put_u64(h + 16, file_size);
    put_u64(h + 24, count);
    put_u64(h + 32, table_size);
}

/* Runs `body` in a child process, whose peak memory starts near this small process's, and
 * fails unless it passes and its peak grows by less than 64 MiB. Each case gets its own
 * child, so an earlier case's peak cannot hide a later one's. */
static void in_child_with_small_peak(void (*body)(const char*), const char* path) {
    pid_t pid;
    int status = 0;
    fflush(stdout);
    fflush(stderr);
    pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        const long before = peak_rss_kib();
        body(path);
        CHECK(peak_rss_kib() - before < 64 * 1024);
        fflush(stderr);
        _exit(harness_failures == 0 ? 0 : 1);
    }
    if (pid > 0) {
        CHECK(waitpid(pid, &status, 0) == pid);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
}

static const uint64_t k_gib = (uint64_t)1 << 30;

/* No arrays, then a 1 GiB hole: valid, and nothing past the header is read. */
static void sparse_no_arrays(const char* path) {
    unsigned char buf[64];
    kdt_kdtr_file* f = NULL;
    int64_t count = -1;
    make_header(buf, k_gib, 0, 0);
    CHECK(make_sparse(path, k_gib, buf, 64, NULL, 0, 0));
    CHECK_OK(kdt_kdtr_open(path, &f));
    CHECK_OK(kdt_kdtr_count(f, &count));
    CHECK_EQ(count, 0);
    kdt_kdtr_close(f);
}

/* One int32 [2] array just before the end of a 1 GiB file: its 8 bytes are read, the gap
 * before it is not. */
static void sparse_one_array_at_the_end(const char* path) {
    static const unsigned char data[8] = {7, 0, 0, 0, 0xFE, 0xFF, 0xFF, 0xFF};
    unsigned char buf[112];
    kdt_kdtr_file* f = NULL;
    kdt_kdtr_array a;
    make_header(buf, k_gib, 1, 48);
    put_u64(buf + 64, k_gib - 64);
    put_u64(buf + 72, 8);
    put_u32(buf + 80, 1);
    put_u32(buf + 84, KDT_DTYPE_INT32);
    put_u32(buf + 88, 1);
    put_u32(buf + 92, 0);
    memset(buf + 96, 0, 16);
    buf[96] = 'a';
    put_u64(buf + 104, 2);
    CHECK(make_sparse(path, k_gib, buf, 112, data, 8, k_gib - 64));
    CHECK_OK(kdt_kdtr_open(path, &f));
    CHECK_OK(kdt_kdtr_find(f, "a", &a));
    CHECK_EQ(a.nbytes, 8);
    CHECK_EQ(((const int32_t*)a.data)[0], 7);
    CHECK_EQ(((const int32_t*)a.data)[1], -2);
    CHECK_EQ((uintptr_t)a.data % 64, 0);
    kdt_kdtr_close(f);
}

/* A record table of 512 MiB whose first record is zeros: rejected after reading the first
 * piece of the table. */
static void sparse_huge_table(const char* path) {
    unsigned char buf[64];
    kdt_kdtr_file* f = NULL;
    make_header(buf, k_gib, 8192, (uint64_t)512 << 20);
    CHECK(make_sparse(path, k_gib, buf, 64, NULL, 0, 0));
    CHECK_STATUS(kdt_kdtr_open(path, &f), KDT_ERR_FORMAT);
    CHECK_ERR_HAS("array 0: name_len at byte offset 80: 0 is outside 1..65535");
    CHECK(f == NULL);
}

/* Files that declare 1 GiB which their arrays do not hold: the reader reads only the
 * header, the records and the arrays' bytes (bytes after the last array are allowed by
 * section 5 of the spec and never read), so its peak memory stays far below 1 GiB. */
static void test_sparse_files(void) {
    char path[512];
    kdt_kdtr_file* f = NULL;
    int64_t count = -1;
    unsigned char* big;
    path_in_dir(path, sizeof path, "sparse.kdtr");
    in_child_with_small_peak(sparse_no_arrays, path);
    in_child_with_small_peak(sparse_one_array_at_the_end, path);
    in_child_with_small_peak(sparse_huge_table, path);
    unlink(path);

    /* From memory: 16 MiB declared and present, no arrays: accepted. */
    big = (unsigned char*)calloc(1, (size_t)1 << 24);
    CHECK(big != NULL);
    if (big != NULL) {
        make_header(big, (uint64_t)1 << 24, 0, 0);
        CHECK_OK(kdt_kdtr_open_memory(big, (size_t)1 << 24, &f));
        CHECK_OK(kdt_kdtr_count(f, &count));
        CHECK_EQ(count, 0);
        kdt_kdtr_close(f);
        free(big);
    }
}

static void remove_dir(void) {
    DIR* d = opendir(g_dir);
    struct dirent* e;
    char path[512];
    if (d == NULL) return;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        path_in_dir(path, sizeof path, e->d_name);
        unlink(path);
    }
    closedir(d);
    rmdir(g_dir);
}

int main(void) {
    const char* tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/kdtr_test_XXXXXX", tmp != NULL && *tmp ? tmp : "/tmp");
    if (mkdtemp(g_dir) == NULL) {
        fprintf(stderr, "cannot create a temporary folder under %s\n", g_dir);
        return 1;
    }
    test_dtype_size();
    test_round_trip();
    make_small();
    test_worked_example_bytes();
    test_truncation();
    test_corruptions();
    test_random_corruptions();
    test_open_errors();
    test_save_rejects();
    test_fixture();
    test_sparse_files();
    remove_dir();
    HARNESS_EXIT();
}
