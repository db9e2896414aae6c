/* KDTR reader and writer: the container of named arrays specified in docs/kdtr-format.md.
 *
 * Reader: the 64-byte header is checked against the size that fstat reports (or the
 * buffer's size); the record table is then read and validated record by record (section 6
 * of the spec), in pieces that grow with the records checked; only then are the index
 * (arrays, shapes, names) and one 64-byte aligned data buffer allocated, and each array's
 * bytes read from its data_offset into that buffer. Nothing else of the file is read, so a
 * file_size or table_size that the records do not back costs nothing.
 * Writer: validates every array, then writes a temporary file next to the destination,
 * fsyncs it and renames it over the destination. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "internal.h"

#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__)
#  define KDTR_HOST_LITTLE_ENDIAN (__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__)
#else
#  define KDTR_HOST_LITTLE_ENDIAN kdtr_runtime_little_endian()
#endif

enum {
    KDTR_MAJOR = 1,
    KDTR_MINOR = 0,
    KDTR_HEADER_SIZE = 64, /* fixed header of version 1.0                      */
    KDTR_RECORD_FIXED = 32,/* fixed part of a record                           */
    KDTR_MIN_RECORD = 40,  /* fixed part + the smallest padded name            */
    KDTR_ALIGN = 64,       /* alignment of array data                          */
    KDTR_MAX_NAME = 65535  /* longest name in bytes                            */
};

/* Byte offsets of header fields and record fields (spec sections 3 and 4). */
enum {
    HDR_MAGIC = 0, HDR_MAJOR = 8, HDR_MINOR = 10, HDR_HEADER_SIZE = 12, HDR_FILE_SIZE = 16,
    HDR_ARRAY_COUNT = 24, HDR_TABLE_SIZE = 32,
    REC_DATA_OFFSET = 0, REC_NBYTES = 8, REC_NAME_LEN = 16, REC_DTYPE = 20, REC_NDIM = 24,
    REC_NAME = 32
};

static const unsigned char kdtr_magic[8] = {0x4B, 0x44, 0x54, 0x52, 0x0D, 0x0A, 0x1A, 0x0A};

#define KDTR_I64_MAX ((uint64_t)INT64_MAX)

struct kdtr_name_entry {
    const char* name;
    int64_t index;
    uint64_t name_offset; /* byte offset of the name in the file (reader) */
};

struct kdt_kdtr_file {
    unsigned char* buf;               /* the whole file, 64-byte aligned         */
    uint64_t size;                    /* file_size                               */
    int64_t count;                    /* number of arrays                        */
    kdt_kdtr_array* arrays;           /* [count], file order                     */
    int64_t* shapes;                  /* every shape back to back                */
    char* names;                      /* every name, NUL-terminated, back to back */
    struct kdtr_name_entry* by_name;  /* [count], sorted by name                 */
};

/* Header fields after section 6 steps 1-5. */
struct kdtr_header {
    uint64_t header_size;
    uint64_t file_size;
    uint64_t count;
    uint64_t table_size;
};

#if !(defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__))
static int kdtr_runtime_little_endian(void) {
    const uint16_t one = 1;
    unsigned char first;
    memcpy(&first, &one, 1);
    return first == 1;
}
#endif

/* ---- Little-endian field access ------------------------------------------------------ */

static uint16_t rd_u16(const unsigned char* p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static uint32_t rd_u32(const unsigned char* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

static uint64_t rd_u64(const unsigned char* p) {
    return (uint64_t)rd_u32(p) | ((uint64_t)rd_u32(p + 4) << 32);
}

static void wr_u16(unsigned char* p, uint16_t v) {
    p[0] = (unsigned char)(v & 0xFFu);
    p[1] = (unsigned char)(v >> 8);
}

static void wr_u32(unsigned char* p, uint32_t v) {
    for (int i = 0; i < 4; ++i) p[i] = (unsigned char)((v >> (8 * i)) & 0xFFu);
}

static void wr_u64(unsigned char* p, uint64_t v) {
    for (int i = 0; i < 8; ++i) p[i] = (unsigned char)((v >> (8 * i)) & 0xFFu);
}

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + (a - 1)) / a * a; }

/* ---- Shared rules ------------------------------------------------------------------------ */

kdt_status kdt_dtype_size(int32_t dtype, size_t* bytes) {
    size_t size;
    if (bytes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "kdt_dtype_size: bytes is NULL");
    switch (dtype) {
        case KDT_DTYPE_BOOL: case KDT_DTYPE_INT8: case KDT_DTYPE_UINT8: size = 1; break;
        case KDT_DTYPE_INT16: case KDT_DTYPE_UINT16: case KDT_DTYPE_FLOAT16:
        case KDT_DTYPE_BFLOAT16: size = 2; break;
        case KDT_DTYPE_INT32: case KDT_DTYPE_UINT32: case KDT_DTYPE_FLOAT32: size = 4; break;
        case KDT_DTYPE_INT64: case KDT_DTYPE_UINT64: case KDT_DTYPE_FLOAT64: size = 8; break;
        default: return kdt_fail(KDT_ERR_UNSUPPORTED, "unknown dtype code %d", (int)dtype);
    }
    *bytes = size;
    return kdt_ok();
}

/* Element size of a dtype code, 0 when unknown. */
static uint64_t kdtr_itemsize(uint32_t code) {
    size_t size = 0;
    if (code > 13u) return 0;
    if (kdt_dtype_size((int32_t)code, &size) != KDT_OK) return 0;
    return size;
}

/* 0: the n bytes at s are well-formed UTF-8 (Unicode Table 3-7) without NUL; 1: a NUL at
 * *where; 2: an ill-formed sequence whose first bad byte is at *where. */
static int kdtr_utf8_check(const unsigned char* s, size_t n, size_t* where) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        unsigned lo = 0x80u, hi = 0xBFu;
        size_t len;
        if (c == 0) {
            *where = i;
            return 1;
        }
        if (c < 0x80u) {
            ++i;
            continue;
        }
        if (c >= 0xC2u && c <= 0xDFu) {
            len = 2;
        } else if (c >= 0xE0u && c <= 0xEFu) {
            len = 3;
            if (c == 0xE0u) lo = 0xA0u;
            if (c == 0xEDu) hi = 0x9Fu;
        } else if (c >= 0xF0u && c <= 0xF4u) {
            len = 4;
            if (c == 0xF0u) lo = 0x90u;
            if (c == 0xF4u) hi = 0x8Fu;
        } else {
            *where = i;
            return 2;
        }
        if (n - i < len) {
            *where = i;
            return 2;
        }
        if (s[i + 1] < lo || s[i + 1] > hi) {
            *where = i + 1;
            return 2;
        }
        for (size_t k = 2; k < len; ++k) {
            if ((s[i + k] & 0xC0u) != 0x80u) {
                *where = i + k;
                return 2;
            }
        }
        i += len;
    }
    return 0;
}

static int kdtr_entry_cmp(const void* a, const void* b) {
    const struct kdtr_name_entry* x = (const struct kdtr_name_entry*)a;
    const struct kdtr_name_entry* y = (const struct kdtr_name_entry*)b;
    int c = strcmp(x->name, y->name);
    if (c != 0) return c;
    return (x->index > y->index) - (x->index < y->index);
}

/* Sorts entries by name (then index); returns the position of the second entry of the
 * first duplicate pair in index order, or -1 when all names differ. */
static int64_t kdtr_sort_find_duplicate(struct kdtr_name_entry* entries, int64_t count) {
    int64_t dup = -1;
    if (count > 1) qsort(entries, (size_t)count, sizeof *entries, kdtr_entry_cmp);
    for (int64_t i = 1; i < count; ++i) {
        if (strcmp(entries[i - 1].name, entries[i].name) == 0 &&
            (dup < 0 || entries[i].index < entries[dup].index)) {
            dup = i;
        }
    }
    return dup;
}

/* ---- Reader ------------------------------------------------------------------------------ */

/* Section 6 steps 1-5 on the first 64 bytes of a file whose actual length is `actual`. */
static kdt_status kdtr_check_header(const unsigned char* p, uint64_t actual,
                                    struct kdtr_header* h) {
    unsigned major, minor;
    if (actual < KDTR_HEADER_SIZE) {
        return kdt_fail(KDT_ERR_FORMAT,
                        "header at byte offset 0: the file is %llu bytes, shorter than the "
                        "%d-byte KDTR header",
                        (unsigned long long)actual, KDTR_HEADER_SIZE);
    }
    if (memcmp(p + HDR_MAGIC, kdtr_magic, sizeof kdtr_magic) != 0) {
        return kdt_fail(KDT_ERR_FORMAT,
                        "magic at byte offset 0: not a KDTR file (expected "
                        "4B 44 54 52 0D 0A 1A 0A, found %02X %02X %02X %02X %02X %02X %02X %02X)",
                        p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]);
    }
    major = rd_u16(p + HDR_MAJOR);
    minor = rd_u16(p + HDR_MINOR);
    if (major != KDTR_MAJOR) {
        return kdt_fail(KDT_ERR_UNSUPPORTED,
                        "major version at byte offset %d: version %u.%u is not supported "
                        "(this reader knows major version %d)",
                        HDR_MAJOR, major, minor, KDTR_MAJOR);
    }
    h->header_size = rd_u32(p + HDR_HEADER_SIZE);
    h->file_size = rd_u64(p + HDR_FILE_SIZE);
    h->count = rd_u64(p + HDR_ARRAY_COUNT);
    h->table_size = rd_u64(p + HDR_TABLE_SIZE);
    if (h->header_size < KDTR_HEADER_SIZE || h->header_size % 8 != 0 ||
        h->header_size > actual) {
        return kdt_fail(KDT_ERR_FORMAT,
                        "header_size at byte offset %d: %llu must be a multiple of 8, at "
                        "least %d and at most the file size (%llu bytes)",
                        HDR_HEADER_SIZE, (unsigned long long)h->header_size, KDTR_HEADER_SIZE,
                        (unsigned long long)actual);
    }
    if (h->file_size != actual) {
        return kdt_fail(KDT_ERR_FORMAT,
                        "file_size at byte offset %d: the header records %llu bytes but the "
                        "file has %llu (truncated or extended)",
                        HDR_FILE_SIZE, (unsigned long long)h->file_size,
                        (unsigned long long)actual);
    }
    if (h->table_size % 8 != 0 || h->table_size > actual - h->header_size) {
        return kdt_fail(KDT_ERR_FORMAT,
                        "table_size at byte offset %d: %llu must be a multiple of 8 and fit "
                        "between the header (%llu bytes) and the end of the file (%llu bytes)",
                        HDR_TABLE_SIZE, (unsigned long long)h->table_size,
                        (unsigned long long)h->header_size, (unsigned long long)actual);
    }
    if (h->count > h->table_size / KDTR_MIN_RECORD) {
        return kdt_fail(KDT_ERR_FORMAT,
                        "array_count at byte offset %d: %llu arrays cannot fit in a record "
                        "table of %llu bytes (each record is at least %d bytes)",
                        HDR_ARRAY_COUNT, (unsigned long long)h->count,
                        (unsigned long long)h->table_size, KDTR_MIN_RECORD);
    }
    return KDT_OK;
}

/* Where the reader's bytes come from: an open file (pread) or the caller's buffer. */
struct kdtr_source {
    int fd;                   /* >= 0: read from this file                     */
    const unsigned char* mem; /* fd < 0: the caller's bytes (file_size of them) */
    const char* path;         /* the file's path, for messages                 */
};

/* The part of the record table read so far: bytes header_size .. header_size + have. */
struct kdtr_table {
    unsigned char* p;
    uint64_t have;
};

/* What the index and the data need, from the validation pass. */
struct kdtr_sizes {
    uint64_t ndims;      /* shape extents of all arrays              */
    uint64_t name_bytes; /* name bytes, one NUL per name included     */
    uint64_t data_bytes; /* data of all arrays, each rounded up to 64 */
};

static void kdtr_errno_text(int err, char* buf, size_t size) {
    if (strerror_r(err, buf, size) != 0) snprintf(buf, size, "errno %d", err);
}

/* Copies n bytes at byte offset `offset` of the source to dst (offset + n has been checked
 * against file_size). */
static kdt_status kdtr_source_read(const struct kdtr_source* src, uint64_t offset,
                                   unsigned char* dst, uint64_t n) {
    char why[128];
    uint64_t done = 0;
    if (src->fd < 0) {
        if (n > 0) memcpy(dst, src->mem + offset, (size_t)n);
        return KDT_OK;
    }
    while (done < n) {
        const uint64_t left = n - done;
        const size_t chunk = left > ((uint64_t)1 << 30) ? ((size_t)1 << 30) : (size_t)left;
        const ssize_t got = pread(src->fd, dst + done, chunk, (off_t)(offset + done));
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            kdtr_errno_text(got < 0 ? errno : EIO, why, sizeof why);
            return kdt_fail(KDT_ERR_IO, "%s: cannot read %llu bytes at byte offset %llu: %s",
                            src->path, (unsigned long long)n, (unsigned long long)offset, why);
        }
        done += (uint64_t)got;
    }
    return KDT_OK;
}

/* Makes the table bytes before byte offset `end` (<= header_size + table_size) available
 * in t. The table is read in growing pieces (at least 64 KiB, then doubling), so a table
 * whose first records are bad is rejected after reading little more than those records,
 * whatever table_size the header claims. */
static kdt_status kdtr_table_need(const struct kdtr_source* src, const struct kdtr_header* h,
                                  struct kdtr_table* t, uint64_t end) {
    const uint64_t want = end - h->header_size;
    uint64_t grow;
    unsigned char* p;
    kdt_status s;
    if (want <= t->have) return KDT_OK;
    grow = t->have < ((uint64_t)1 << 16) ? ((uint64_t)1 << 16) : 2u * t->have;
    if (grow < want) grow = want;
    if (grow > h->table_size) grow = h->table_size;
    if (grow > SIZE_MAX) {
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "cannot allocate a record table of %llu bytes",
                        (unsigned long long)grow);
    }
    p = (unsigned char*)realloc(t->p, (size_t)grow);
    if (p == NULL) {
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "cannot allocate a record table of %llu bytes",
                        (unsigned long long)grow);
    }
    t->p = p;
    s = kdtr_source_read(src, h->header_size + t->have, p + t->have, grow - t->have);
    if (s != KDT_OK) return s;
    t->have = grow;
    return KDT_OK;
}

/* Section 6 steps 6 and 7 over the records. With f == NULL, validates only, reading the
 * table into t as far as the records reach, and returns the total number of shape extents,
 * name bytes (NUL included) and data bytes (each array rounded up to 64) in *sizes. With
 * f != NULL (after a successful validation pass over the whole table), fills f's index and
 * reads each array's data from src into f->buf. */
static kdt_status kdtr_walk(const struct kdtr_source* src, struct kdtr_table* t,
                            const struct kdtr_header* h, kdt_kdtr_file* f,
                            struct kdtr_sizes* sizes) {
    const uint64_t table_end = h->header_size + h->table_size;
    uint64_t pos = h->header_size;
    uint64_t prev_end = table_end;
    uint64_t shape_at = 0, name_at = 0, data_at = 0;
    kdt_status s;
    for (uint64_t i = 0; i < h->count; ++i) {
        const long long ai = (long long)i;
        uint64_t data_offset, nbytes, itemsize, rec_size, size = 1, name_pad;
        uint32_t name_len, dtype, ndim;
        int zero = 0;
        size_t bad = 0;
        int utf8;
        char label[96];
        const unsigned char* rec;
        if (table_end - pos < KDTR_RECORD_FIXED) {
            return kdt_fail(KDT_ERR_FORMAT,
                            "array %lld: record at byte offset %llu: its %d fixed bytes run "
                            "past the end of the record table (byte offset %llu)",
                            ai, (unsigned long long)pos, KDTR_RECORD_FIXED,
                            (unsigned long long)table_end);
        }
        s = kdtr_table_need(src, h, t, pos + KDTR_RECORD_FIXED);
        if (s != KDT_OK) return s;
        rec = t->p + (pos - h->header_size);
        data_offset = rd_u64(rec + REC_DATA_OFFSET);
        nbytes = rd_u64(rec + REC_NBYTES);
        name_len = rd_u32(rec + REC_NAME_LEN);
        dtype = rd_u32(rec + REC_DTYPE);
        ndim = rd_u32(rec + REC_NDIM);
        if (name_len == 0 || name_len > KDTR_MAX_NAME) {
            return kdt_fail(KDT_ERR_FORMAT,
                            "array %lld: name_len at byte offset %llu: %u is outside 1..%d",
                            ai, (unsigned long long)(pos + REC_NAME_LEN), name_len,
                            KDTR_MAX_NAME);
        }
        if (ndim > KDT_KDTR_MAX_NDIM) {
            return kdt_fail(KDT_ERR_FORMAT,
                            "array %lld: ndim at byte offset %llu: %u exceeds the maximum of %d",
                            ai, (unsigned long long)(pos + REC_NDIM), ndim, KDT_KDTR_MAX_NDIM);
        }
        name_pad = align_up(name_len, 8);
        rec_size = KDTR_RECORD_FIXED + name_pad + 8u * (uint64_t)ndim;
        if (rec_size > table_end - pos) {
            return kdt_fail(KDT_ERR_FORMAT,
                            "array %lld: record at byte offset %llu: its %llu bytes (name_len "
                            "%u, ndim %u) run past the end of the record table (byte offset "
                            "%llu)",
                            ai, (unsigned long long)pos, (unsigned long long)rec_size, name_len,
                            ndim, (unsigned long long)table_end);
        }
        s = kdtr_table_need(src, h, t, pos + rec_size);
        if (s != KDT_OK) return s;
        rec = t->p + (pos - h->header_size);
        utf8 = kdtr_utf8_check(rec + REC_NAME, name_len, &bad);
        if (utf8 != 0) {
            return kdt_fail(KDT_ERR_FORMAT, "array %lld: name at byte offset %llu: %s at byte "
                            "offset %llu",
                            ai, (unsigned long long)(pos + REC_NAME),
                            utf8 == 1 ? "contains a NUL byte" : "not well-formed UTF-8",
                            (unsigned long long)(pos + REC_NAME + bad));
        }
        snprintf(label, sizeof label, "array %lld ('%.*s%s')", ai,
                 (int)(name_len > 48 ? 48 : name_len), (const char*)(rec + REC_NAME),
                 name_len > 48 ? "..." : "");
        itemsize = kdtr_itemsize(dtype);
        if (itemsize == 0) {
            return kdt_fail(KDT_ERR_UNSUPPORTED,
                            "%s: dtype at byte offset %llu: unknown dtype code %u", label,
                            (unsigned long long)(pos + REC_DTYPE), dtype);
        }
        size = itemsize;
        for (uint32_t d = 0; d < ndim; ++d) {
            const uint64_t at = pos + REC_NAME + name_pad + 8u * (uint64_t)d;
            const uint64_t extent = rd_u64(rec + REC_NAME + name_pad + 8u * (uint64_t)d);
            if (extent > KDTR_I64_MAX) {
                return kdt_fail(KDT_ERR_FORMAT,
                                "%s: shape[%u] at byte offset %llu: negative extent %lld", label,
                                d, (unsigned long long)at, (long long)(int64_t)extent);
            }
            if (extent == 0) {
                zero = 1;
            } else if (size > KDTR_I64_MAX / extent) {
                return kdt_fail(KDT_ERR_FORMAT,
                                "%s: shape[%u] at byte offset %llu: shape product overflows "
                                "(extent %llu times %llu exceeds 2^63 - 1 bytes)",
                                label, d, (unsigned long long)at, (unsigned long long)extent,
                                (unsigned long long)size);
            } else {
                size *= extent;
            }
        }
        if (zero) size = 0;
        if (nbytes != size) {
            return kdt_fail(KDT_ERR_FORMAT,
                            "%s: nbytes at byte offset %llu: %llu, but dtype and shape give "
                            "%llu bytes",
                            label, (unsigned long long)(pos + REC_NBYTES),
                            (unsigned long long)nbytes, (unsigned long long)size);
        }
        if (data_offset % KDTR_ALIGN != 0) {
            return kdt_fail(KDT_ERR_FORMAT,
                            "%s: data_offset at byte offset %llu: %llu is not a multiple of %d",
                            label, (unsigned long long)(pos + REC_DATA_OFFSET),
                            (unsigned long long)data_offset, KDTR_ALIGN);
        }
        if (data_offset < table_end) {
            return kdt_fail(KDT_ERR_FORMAT,
                            "%s: data_offset at byte offset %llu: %llu lies inside the header "
                            "or record table (which end at byte offset %llu)",
                            label, (unsigned long long)(pos + REC_DATA_OFFSET),
                            (unsigned long long)data_offset, (unsigned long long)table_end);
        }
        if (data_offset < prev_end) {
            return kdt_fail(KDT_ERR_FORMAT,
                            "%s: data_offset at byte offset %llu: %llu overlaps or precedes the "
                            "data of array %lld (which ends at byte offset %llu)",
                            label, (unsigned long long)(pos + REC_DATA_OFFSET),
                            (unsigned long long)data_offset, ai - 1,
                            (unsigned long long)prev_end);
        }
        if (data_offset > h->file_size || nbytes > h->file_size - data_offset) {
            return kdt_fail(KDT_ERR_FORMAT,
                            "%s: data_offset at byte offset %llu: %llu bytes at byte offset "
                            "%llu run past the end of the file (%llu bytes)",
                            label, (unsigned long long)(pos + REC_DATA_OFFSET),
                            (unsigned long long)nbytes, (unsigned long long)data_offset,
                            (unsigned long long)h->file_size);
        }
        if (f != NULL) {
            kdt_kdtr_array* a = &f->arrays[i];
            char* name = f->names + name_at;
            int64_t* shape = f->shapes + shape_at;
            memcpy(name, rec + REC_NAME, name_len);
            name[name_len] = '\0';
            for (uint32_t d = 0; d < ndim; ++d) {
                shape[d] = (int64_t)rd_u64(rec + REC_NAME + name_pad + 8u * (uint64_t)d);
            }
            a->name = name;
            a->dtype = (int32_t)dtype;
            a->ndim = (int32_t)ndim;
            a->shape = ndim > 0 ? shape : NULL;
            a->data = f->buf + data_at;
            a->nbytes = nbytes;
            f->by_name[i].name = name;
            f->by_name[i].index = (int64_t)i;
            f->by_name[i].name_offset = pos + REC_NAME;
            s = kdtr_source_read(src, data_offset, f->buf + data_at, nbytes);
            if (s != KDT_OK) return s;
        }
        shape_at += ndim;
        name_at += (uint64_t)name_len + 1u;
        data_at += align_up(nbytes, KDTR_ALIGN); /* nbytes <= file_size < 2^63: no overflow */
        prev_end = data_offset + nbytes;
        pos += rec_size;
    }
    if (pos != table_end) {
        return kdt_fail(KDT_ERR_FORMAT,
                        "table_size at byte offset %d: the %llu records end at byte offset "
                        "%llu, but the record table ends at byte offset %llu",
                        HDR_TABLE_SIZE, (unsigned long long)h->count, (unsigned long long)pos,
                        (unsigned long long)table_end);
    }
    if (sizes != NULL) {
        sizes->ndims = shape_at;
        sizes->name_bytes = name_at;
        sizes->data_bytes = data_at;
    }
    return KDT_OK;
}

void kdt_kdtr_close(kdt_kdtr_file* file) {
    if (file == NULL) return;
    free(file->by_name);
    free(file->names);
    free(file->shapes);
    free(file->arrays);
    free(file->buf);
    free(file);
}

/* Validates the file behind src (whose 64-byte header `head` has been read) and builds
 * the index. Nothing is read that the header and the records do not point at: the record
 * table piece by piece as the records are checked, then each array's nbytes at its
 * data_offset. Bytes between arrays, after the last one (a file_size beyond the last
 * array's end is allowed by the spec, section 5) or between byte 64 and header_size are
 * never read, so a sparse or crafted file costs what its arrays hold, not its size. */
static kdt_status kdtr_load(const struct kdtr_source* src, const unsigned char* head,
                            uint64_t size, kdt_kdtr_file** out) {
    struct kdtr_header h;
    struct kdtr_table t = {NULL, 0};
    struct kdtr_sizes sz = {0, 0, 0};
    kdt_kdtr_file* f = NULL;
    int64_t dup;
    kdt_status s = kdtr_check_header(head, size, &h);
    if (s != KDT_OK) return s;
    s = kdtr_walk(src, &t, &h, NULL, &sz);
    if (s != KDT_OK) goto fail;
    /* Bounded by the file: count <= table_size / 40, ndims <= table_size / 8,
     * name_bytes <= table_size + count, data_bytes <= file_size + 63 * count. */
    f = (kdt_kdtr_file*)calloc(1, sizeof *f);
    if (f == NULL || sz.data_bytes > SIZE_MAX - KDTR_ALIGN) {
        s = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "cannot allocate the index of %llu arrays",
                     (unsigned long long)h.count);
        goto fail;
    }
    f->size = size;
    f->count = (int64_t)h.count;
    f->buf = (unsigned char*)aligned_alloc(KDTR_ALIGN, (size_t)sz.data_bytes + KDTR_ALIGN);
    f->arrays = (kdt_kdtr_array*)calloc((size_t)h.count + 1u, sizeof *f->arrays);
    f->shapes = (int64_t*)calloc((size_t)sz.ndims + 1u, sizeof *f->shapes);
    f->names = (char*)malloc((size_t)sz.name_bytes + 1u);
    f->by_name = (struct kdtr_name_entry*)calloc((size_t)h.count + 1u, sizeof *f->by_name);
    if (f->buf == NULL || f->arrays == NULL || f->shapes == NULL || f->names == NULL ||
        f->by_name == NULL) {
        s = kdt_fail(KDT_ERR_OUT_OF_MEMORY,
                     "cannot allocate the index of %llu arrays and %llu bytes of data",
                     (unsigned long long)h.count, (unsigned long long)sz.data_bytes);
        goto fail;
    }
    s = kdtr_walk(src, &t, &h, f, NULL);
    if (s != KDT_OK) goto fail;
    free(t.p);
    t.p = NULL;
    dup = kdtr_sort_find_duplicate(f->by_name, f->count);
    if (dup >= 0) {
        const struct kdtr_name_entry* e = &f->by_name[dup];
        s = kdt_fail(KDT_ERR_FORMAT,
                     "array %lld ('%.48s'): name at byte offset %llu: duplicates the name of "
                     "array %lld",
                     (long long)e->index, e->name, (unsigned long long)e->name_offset,
                     (long long)f->by_name[dup - 1].index);
        goto fail;
    }
    *out = f;
    return kdt_ok();

fail:
    free(t.p);
    kdt_kdtr_close(f);
    return s;
}

kdt_status kdt_kdtr_open(const char* path, kdt_kdtr_file** out) {
    unsigned char head[KDTR_HEADER_SIZE];
    struct kdtr_source src;
    struct stat st;
    kdt_status s;
    char why[128];
    int fd;
    uint64_t size;
    if (out == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "kdt_kdtr_open: out is NULL");
    *out = NULL;
    if (path == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "kdt_kdtr_open: path is NULL");
    if (!KDTR_HOST_LITTLE_ENDIAN) {
        return kdt_fail(KDT_ERR_UNSUPPORTED, "KDTR needs a little-endian host");
    }
    /* O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below. */
    fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        kdtr_errno_text(errno, why, sizeof why);
        return kdt_fail(KDT_ERR_IO, "%s: cannot open: %s", path, why);
    }
    if (fstat(fd, &st) != 0) {
        kdtr_errno_text(errno, why, sizeof why);
        close(fd);
        return kdt_fail(KDT_ERR_IO, "%s: cannot stat: %s", path, why);
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return kdt_fail(KDT_ERR_IO, "%s: not a regular file", path);
    }
    size = st.st_size < 0 ? 0 : (uint64_t)st.st_size;
    src.fd = fd;
    src.mem = NULL;
    src.path = path;
    memset(head, 0, sizeof head);
    s = kdtr_source_read(&src, 0, head, size < KDTR_HEADER_SIZE ? size : KDTR_HEADER_SIZE);
    if (s == KDT_OK) s = kdtr_load(&src, head, size, out);
    close(fd);
    return s;
}

kdt_status kdt_kdtr_open_memory(const void* data, size_t size, kdt_kdtr_file** out) {
    static const unsigned char empty[KDTR_HEADER_SIZE] = {0};
    struct kdtr_source src;
    if (out == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "kdt_kdtr_open_memory: out is NULL");
    *out = NULL;
    if (data == NULL && size > 0) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "kdt_kdtr_open_memory: data is NULL");
    }
    if (!KDTR_HOST_LITTLE_ENDIAN) {
        return kdt_fail(KDT_ERR_UNSUPPORTED, "KDTR needs a little-endian host");
    }
    src.fd = -1;
    src.mem = data != NULL ? (const unsigned char*)data : empty;
    src.path = "";
    return kdtr_load(&src, src.mem, size, out);
}

kdt_status kdt_kdtr_count(const kdt_kdtr_file* file, int64_t* count) {
    if (file == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "kdt_kdtr_count: file is NULL");
    if (count == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "kdt_kdtr_count: count is NULL");
    *count = file->count;
    return kdt_ok();
}

kdt_status kdt_kdtr_get(const kdt_kdtr_file* file, int64_t index, kdt_kdtr_array* out) {
    if (file == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "kdt_kdtr_get: file is NULL");
    if (out == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "kdt_kdtr_get: out is NULL");
    if (index < 0 || index >= file->count) {
        return kdt_fail(KDT_ERR_OUT_OF_RANGE, "kdt_kdtr_get: index %lld outside 0..%lld",
                        (long long)index, (long long)file->count - 1);
    }
    *out = file->arrays[index];
    return kdt_ok();
}

kdt_status kdt_kdtr_find(const kdt_kdtr_file* file, const char* name, kdt_kdtr_array* out) {
    int64_t lo = 0, hi;
    if (file == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "kdt_kdtr_find: file is NULL");
    if (name == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "kdt_kdtr_find: name is NULL");
    if (out == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "kdt_kdtr_find: out is NULL");
    hi = file->count;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        const int c = strcmp(file->by_name[mid].name, name);
        if (c == 0) {
            *out = file->arrays[file->by_name[mid].index];
            return kdt_ok();
        }
        if (c < 0) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return kdt_fail(KDT_ERR_NOT_FOUND, "no array named '%.200s'", name);
}

/* ---- Writer ------------------------------------------------------------------------------ */

/* Writes n bytes; 0 on success, else an errno value. */
static int kdtr_write_all(int fd, const unsigned char* p, uint64_t n) {
    while (n > 0) {
        const size_t chunk = n > ((uint64_t)1 << 30) ? ((size_t)1 << 30) : (size_t)n;
        const ssize_t put = write(fd, p, chunk);
        if (put < 0) {
            if (errno == EINTR) continue;
            return errno != 0 ? errno : EIO;
        }
        if (put == 0) return EIO;
        p += put;
        n -= (uint64_t)put;
    }
    return 0;
}

/* Checks one array for kdt_kdtr_save; *record_size gets the size of its record. */
static kdt_status kdtr_check_array(const kdt_kdtr_array* a, int64_t i, uint64_t* record_size) {
    const long long ai = (long long)i;
    size_t name_len, bad = 0;
    size_t itemsize = 0;
    uint64_t size;
    int zero = 0, utf8;
    if (a->name == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "array %lld: name is NULL", ai);
    name_len = strnlen(a->name, (size_t)KDTR_MAX_NAME + 1u);
    if (name_len == 0) return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "array %lld: name is empty", ai);
    if (name_len > KDTR_MAX_NAME) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "array %lld: name is longer than %d bytes", ai,
                        KDTR_MAX_NAME);
    }
    utf8 = kdtr_utf8_check((const unsigned char*)a->name, name_len, &bad);
    if (utf8 != 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "array %lld: name is not well-formed UTF-8 (byte %llu)", ai,
                        (unsigned long long)bad);
    }
    if (a->dtype < 1 || a->dtype > 13 || kdt_dtype_size(a->dtype, &itemsize) != KDT_OK) {
        return kdt_fail(KDT_ERR_UNSUPPORTED, "array %lld ('%.48s'): unknown dtype code %d", ai,
                        a->name, (int)a->dtype);
    }
    if (a->ndim < 0 || a->ndim > KDT_KDTR_MAX_NDIM) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "array %lld ('%.48s'): ndim %d is outside 0..%d", ai, a->name,
                        (int)a->ndim, KDT_KDTR_MAX_NDIM);
    }
    if (a->ndim > 0 && a->shape == NULL) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "array %lld ('%.48s'): shape is NULL", ai,
                        a->name);
    }
    size = itemsize;
    for (int32_t d = 0; d < a->ndim; ++d) {
        const int64_t extent = a->shape[d];
        if (extent < 0) {
            return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                            "array %lld ('%.48s'): shape[%d] is negative (%lld)", ai, a->name,
                            (int)d, (long long)extent);
        }
        if (extent == 0) {
            zero = 1;
        } else if (size > KDTR_I64_MAX / (uint64_t)extent) {
            return kdt_fail(KDT_ERR_OVERFLOW,
                            "array %lld ('%.48s'): shape[%d]: shape product overflows", ai,
                            a->name, (int)d);
        } else {
            size *= (uint64_t)extent;
        }
    }
    if (zero) size = 0;
    if (a->nbytes != size) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "array %lld ('%.48s'): nbytes is %llu, but dtype and shape give %llu",
                        ai, a->name, (unsigned long long)a->nbytes, (unsigned long long)size);
    }
    if (size > 0 && a->data == NULL) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "array %lld ('%.48s'): data is NULL", ai, a->name);
    }
    if (a->dtype == KDT_DTYPE_BOOL) {
        const unsigned char* b = (const unsigned char*)a->data;
        for (uint64_t k = 0; k < size; ++k) {
            if (b[k] > 1u) {
                return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                                "array %lld ('%.48s'): bool element %llu is %u, not 0 or 1", ai,
                                a->name, (unsigned long long)k, (unsigned)b[k]);
            }
        }
    }
    *record_size = KDTR_RECORD_FIXED + align_up(name_len, 8) + 8u * (uint64_t)a->ndim;
    return KDT_OK;
}

kdt_status kdt_kdtr_save(const char* path, const kdt_kdtr_array* arrays, int64_t count) {
    static const unsigned char zeros[KDTR_ALIGN] = {0};
    static _Thread_local unsigned tmp_counter = 0;
    struct kdtr_name_entry* entries = NULL;
    unsigned char* head = NULL;
    uint64_t* offsets = NULL;
    char* tmp = NULL;
    uint64_t table_size = 0, table_end, end, pos;
    size_t path_len, tmp_cap;
    int fd = -1, err = 0;
    const char* what = "";
    kdt_status s = KDT_OK;
    int64_t dup;
    char why[128];

    if (path == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "kdt_kdtr_save: path is NULL");
    if (count < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "kdt_kdtr_save: count %lld is negative",
                        (long long)count);
    }
    if (arrays == NULL && count > 0) {
        return kdt_fail(KDT_ERR_NULL_POINTER, "kdt_kdtr_save: arrays is NULL");
    }
    if (!KDTR_HOST_LITTLE_ENDIAN) {
        return kdt_fail(KDT_ERR_UNSUPPORTED, "KDTR needs a little-endian host");
    }
    if ((uint64_t)count > SIZE_MAX / sizeof *entries) {
        return kdt_fail(KDT_ERR_OVERFLOW, "kdt_kdtr_save: %lld arrays", (long long)count);
    }
    for (int64_t i = 0; i < count; ++i) {
        uint64_t record_size = 0;
        s = kdtr_check_array(&arrays[i], i, &record_size);
        if (s != KDT_OK) return s;
        if (record_size > UINT64_MAX - table_size) {
            return kdt_fail(KDT_ERR_OVERFLOW, "kdt_kdtr_save: the record table overflows");
        }
        table_size += record_size;
    }

    entries = (struct kdtr_name_entry*)calloc((size_t)count + 1u, sizeof *entries);
    offsets = (uint64_t*)calloc((size_t)count + 1u, sizeof *offsets);
    if (entries == NULL || offsets == NULL) {
        s = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_kdtr_save: cannot allocate %lld entries",
                     (long long)count);
        goto done;
    }
    for (int64_t i = 0; i < count; ++i) {
        entries[i].name = arrays[i].name;
        entries[i].index = i;
    }
    dup = kdtr_sort_find_duplicate(entries, count);
    if (dup >= 0) {
        s = kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                     "array %lld ('%.48s'): name duplicates the name of array %lld",
                     (long long)entries[dup].index, entries[dup].name,
                     (long long)entries[dup - 1].index);
        goto done;
    }

    /* Layout (spec section 5): data of array i at align64(end of array i - 1). */
    if (table_size > KDTR_I64_MAX - KDTR_HEADER_SIZE - KDTR_ALIGN) {
        s = kdt_fail(KDT_ERR_OVERFLOW, "kdt_kdtr_save: the record table overflows");
        goto done;
    }
    table_end = KDTR_HEADER_SIZE + table_size;
    end = table_end;
    for (int64_t i = 0; i < count; ++i) {
        const uint64_t off = align_up(end, KDTR_ALIGN);
        if (arrays[i].nbytes > KDTR_I64_MAX - KDTR_ALIGN - off) {
            s = kdt_fail(KDT_ERR_OVERFLOW, "array %lld ('%.48s'): the file size overflows",
                         (long long)i, arrays[i].name);
            goto done;
        }
        offsets[i] = off;
        end = off + arrays[i].nbytes;
    }
    if (table_end > SIZE_MAX) {
        s = kdt_fail(KDT_ERR_OVERFLOW, "kdt_kdtr_save: the record table overflows");
        goto done;
    }

    head = (unsigned char*)calloc((size_t)table_end, 1);
    path_len = strlen(path);
    tmp_cap = path_len + 64u;
    tmp = (char*)malloc(tmp_cap);
    if (head == NULL || tmp == NULL) {
        s = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_kdtr_save: cannot allocate %llu bytes",
                     (unsigned long long)table_end);
        goto done;
    }
    memcpy(head + HDR_MAGIC, kdtr_magic, sizeof kdtr_magic);
    wr_u16(head + HDR_MAJOR, KDTR_MAJOR);
    wr_u16(head + HDR_MINOR, KDTR_MINOR);
    wr_u32(head + HDR_HEADER_SIZE, KDTR_HEADER_SIZE);
    wr_u64(head + HDR_FILE_SIZE, end);
    wr_u64(head + HDR_ARRAY_COUNT, (uint64_t)count);
    wr_u64(head + HDR_TABLE_SIZE, table_size);
    pos = KDTR_HEADER_SIZE;
    for (int64_t i = 0; i < count; ++i) {
        const kdt_kdtr_array* a = &arrays[i];
        const size_t name_len = strlen(a->name);
        const uint64_t name_pad = align_up(name_len, 8);
        unsigned char* r = head + pos;
        wr_u64(r + REC_DATA_OFFSET, offsets[i]);
        wr_u64(r + REC_NBYTES, a->nbytes);
        wr_u32(r + REC_NAME_LEN, (uint32_t)name_len);
        wr_u32(r + REC_DTYPE, (uint32_t)a->dtype);
        wr_u32(r + REC_NDIM, (uint32_t)a->ndim);
        memcpy(r + REC_NAME, a->name, name_len);
        for (int32_t d = 0; d < a->ndim; ++d) {
            wr_u64(r + REC_NAME + name_pad + 8u * (uint64_t)d, (uint64_t)a->shape[d]);
        }
        pos += KDTR_RECORD_FIXED + name_pad + 8u * (uint64_t)a->ndim;
    }

    /* Temporary file next to the destination, created exclusively (mode 0666 & ~umask). */
    for (int attempt = 0; attempt < 100; ++attempt) {
        snprintf(tmp, tmp_cap, "%s.tmp-%ld-%u", path, (long)getpid(), tmp_counter++);
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd >= 0 || errno != EEXIST) break;
    }
    if (fd < 0) {
        kdtr_errno_text(errno, why, sizeof why);
        s = kdt_fail(KDT_ERR_IO, "%s: cannot create a temporary file: %s", path, why);
        goto done;
    }
    what = "write";
    err = kdtr_write_all(fd, head, table_end);
    pos = table_end;
    for (int64_t i = 0; err == 0 && i < count; ++i) {
        err = kdtr_write_all(fd, zeros, offsets[i] - pos);
        if (err == 0) err = kdtr_write_all(fd, (const unsigned char*)arrays[i].data,
                                           arrays[i].nbytes);
        pos = offsets[i] + arrays[i].nbytes;
    }
    if (err == 0 && fsync(fd) != 0) {
        err = errno;
        what = "fsync";
    }
    if (close(fd) != 0 && err == 0) {
        err = errno;
        what = "close";
    }
    fd = -1;
    if (err == 0 && rename(tmp, path) != 0) {
        err = errno;
        what = "rename the temporary file onto it";
    }
    if (err != 0) {
        kdtr_errno_text(err, why, sizeof why);
        unlink(tmp);
        s = kdt_fail(KDT_ERR_IO, "%s: cannot %s: %s", path, what, why);
        goto done;
    }
    s = kdt_ok();

done:
    free(tmp);
    free(head);
    free(offsets);
    free(entries);
    return s;
}
