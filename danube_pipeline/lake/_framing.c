/*
 * danube_pipeline.lake._framing: the records of checked record batches, walked in C into the
 * buffers of Arrow columns (walk_records); and the schemaless Avro payloads of a flat record
 * schema decoded into Arrow columns (decode_avro, below).
 *
 * The batch and record formats are those of danube_pipeline/format/batches.py (segment format
 * version 2). The caller (danube_pipeline/lake/segment_columns.py) has already walked the batch
 * headers, checked each batch's CRC32C, magic, length and base offset, and passes for every
 * batch the byte positions of its first record and of its end and its record count. This
 * module walks the records inside, checking their framing exactly as
 * danube_pipeline.format.batches.validate_batch does (every length inside its record and batch, the
 * records ending exactly at the batch's end, key_length -1 or >= 0), and copies the keys,
 * the attribute names and values and the payloads into contiguous buffers with int64 offsets
 * (Arrow's large_string / large_binary layout). UTF-8 is not checked here: the caller
 * validates the string arrays with Arrow.
 *
 * Two passes over the records: the first checks the framing and sizes the buffers, the second
 * fills them. Nothing is allocated per record. All reads are bounds-checked against the
 * batch's end before they happen; the data buffer is only read.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define RECORD_HEADER 14 /* record_length u32, timestamp_delta_us u32, key_length i32, attribute_count u16 */
#define ATTR_HEADER 6    /* key_length u16, value_length u32 */

static inline uint16_t rd_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t rd_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline int64_t rd_i64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return (int64_t)v;
}
static inline void wr_i64(uint8_t *p, int64_t value) {
    uint64_t v = (uint64_t)value;
    for (int i = 0; i < 8; i++) { p[i] = (uint8_t)(v & 0xFF); v >>= 8; }
}
static inline void wr_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) { p[i] = (uint8_t)(v & 0xFF); v >>= 8; }
}
static inline void wr_i32(uint8_t *p, int32_t value) { wr_u32(p, (uint32_t)value); }

/* Whether the n bytes at p are all ASCII (then valid UTF-8, and the caller skips Arrow's check). */
static int is_ascii(const uint8_t *p, Py_ssize_t n) {
    uint64_t high = 0, word;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        memcpy(&word, p + i, 8);
        high |= word;
    }
    for (; i < n; i++) high |= p[i];
    return (high & 0x8080808080808080ULL) == 0;
}

typedef struct {
    int64_t records;
    int64_t key_bytes;
    int64_t attributes;
    int64_t attribute_name_bytes;
    int64_t attribute_value_bytes;
    int64_t payload_bytes;
    int unusual; /* a record repeats an attribute name, or has too many to compare */
} Sizes;

#define MAX_COMPARED_ATTRIBUTES 64

/* A framing error: (batch index, message), raised as ValueError. */
static PyObject *framing_error(int64_t batch, const char *format, ...) {
    char message[256];
    va_list args;
    va_start(args, format);
    PyOS_vsnprintf(message, sizeof(message), format, args);
    va_end(args);
    PyObject *value = Py_BuildValue("(Ls)", (long long)batch, message);
    if (value != NULL) {
        PyErr_SetObject(PyExc_ValueError, value);
        Py_DECREF(value);
    }
    return NULL;
}

/* Pass 1: check every record's framing and count what the buffers must hold. */
static int measure(const uint8_t *data, Py_ssize_t size, const uint8_t *batches, Py_ssize_t batch_count,
                   Sizes *sizes) {
    memset(sizes, 0, sizeof(*sizes));
    for (Py_ssize_t b = 0; b < batch_count; b++) {
        const uint8_t *entry = batches + b * 32;
        int64_t batch_pos = rd_i64(entry), pos = rd_i64(entry + 8), end = rd_i64(entry + 16);
        int64_t count = rd_i64(entry + 24);
        if (batch_pos < 0 || pos < batch_pos || end < pos || end > size || count < 1) {
            framing_error(b, "batch bounds %lld..%lld..%lld outside the %lld bytes", (long long)batch_pos,
                          (long long)pos, (long long)end, (long long)size);
            return -1;
        }
        for (int64_t i = 0; i < count; i++) {
            if (end - pos < RECORD_HEADER) {
                framing_error(b, "record %lld truncated at byte %lld", (long long)i, (long long)(pos - batch_pos));
                return -1;
            }
            const uint8_t *r = data + pos;
            int64_t length = rd_u32(r);
            int32_t key_len = (int32_t)rd_u32(r + 8);
            uint16_t attr_count = rd_u16(r + 12);
            int64_t record_end = pos + 4 + length;
            if (length < RECORD_HEADER - 4 || record_end > end) {
                framing_error(b, "record %lld at byte %lld: length %lld runs past the batch", (long long)i,
                              (long long)(pos - batch_pos), (long long)length);
                return -1;
            }
            int64_t field = pos + RECORD_HEADER;
            if (key_len >= 0) {
                if (field + key_len > record_end) {
                    framing_error(b, "record %lld: key of %d bytes runs past the record", (long long)i, key_len);
                    return -1;
                }
                sizes->key_bytes += key_len;
                field += key_len;
            } else if (key_len != -1) {
                framing_error(b, "record %lld: key_length %d", (long long)i, key_len);
                return -1;
            }
            int64_t names_at[MAX_COMPARED_ATTRIBUTES], names_len[MAX_COMPARED_ATTRIBUTES];
            if (attr_count > MAX_COMPARED_ATTRIBUTES) sizes->unusual = 1;
            for (uint16_t a = 0; a < attr_count; a++) {
                if (field + ATTR_HEADER > record_end) {
                    framing_error(b, "record %lld: attribute %u truncated", (long long)i, (unsigned)a);
                    return -1;
                }
                int64_t klen = rd_u16(data + field), vlen = rd_u32(data + field + 2);
                field += ATTR_HEADER;
                if (field + klen + vlen > record_end) {
                    framing_error(b, "record %lld: attribute %u runs past the record", (long long)i, (unsigned)a);
                    return -1;
                }
                if (attr_count > 1 && attr_count <= MAX_COMPARED_ATTRIBUTES) {
                    for (uint16_t e = 0; e < a; e++) {
                        if (names_len[e] == klen && memcmp(data + names_at[e], data + field, (size_t)klen) == 0) {
                            sizes->unusual = 1;
                        }
                    }
                    names_at[a] = field;
                    names_len[a] = klen;
                }
                sizes->attribute_name_bytes += klen;
                sizes->attribute_value_bytes += vlen;
                field += klen + vlen;
            }
            sizes->attributes += attr_count;
            sizes->payload_bytes += record_end - field;
            pos = record_end;
        }
        if (pos != end) {
            framing_error(b, "%lld bytes after the last of %lld records", (long long)(end - pos), (long long)count);
            return -1;
        }
        sizes->records += count;
    }
    return 0;
}

static uint8_t *bytes_data(PyObject *bytes) { return (uint8_t *)PyBytes_AS_STRING(bytes); }

/*
 * walk_records(data, batches) -> tuple
 *
 * data: the segment's bytes (any object with the buffer protocol).
 * batches: 32 bytes per batch, little endian int64s: the batch's byte position, its first
 *   record's byte position, its end (exclusive) and its record count.
 *
 * Returns (unusual, record_count, timestamp_deltas, key_validity, key_offsets, key_data, key_nulls,
 * attribute_offsets, attribute_name_offsets, attribute_name_data, attribute_value_offsets,
 * attribute_value_data, payload_offsets, payload_data, ascii): bytes objects holding a uint32 per
 * record (timestamp_delta_us), an Arrow validity bitmap of the keys, int64 offsets (n + 1, or
 * one more than the attribute count) with their data, the attribute map's int32 offsets, and
 * key_nulls as an int, ascii 1 when the keys, attribute names and values are all ASCII (valid
 * UTF-8 without Arrow's check). unusual is 1 when a record repeats an attribute name or has more than
 * 64 attributes (not compared here): the caller then reads the segment the reference way, where
 * a later value of a name replaces an earlier one.
 *
 * Raises ValueError((batch index, message)) on a record that breaks the framing, and
 * OverflowError when the attributes exceed the int32 offsets of an Arrow map.
 */
static PyObject *walk_records(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data_view, batch_view;
    if (!PyArg_ParseTuple(args, "y*y*", &data_view, &batch_view)) return NULL;
    PyObject *result = NULL;
    PyObject *out[11] = {NULL};
    if (batch_view.len % 32 != 0) {
        PyErr_SetString(PyExc_ValueError, "batches: 32 bytes per batch");
        goto done;
    }
    const uint8_t *data = (const uint8_t *)data_view.buf;
    const uint8_t *batches = (const uint8_t *)batch_view.buf;
    Py_ssize_t batch_count = batch_view.len / 32;
    Sizes sizes;
    if (measure(data, data_view.len, batches, batch_count, &sizes) < 0) goto done;
    if (sizes.attributes > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "more attributes than an Arrow map's int32 offsets hold");
        goto done;
    }
    int64_t n = sizes.records;
    Py_ssize_t lengths[11] = {
        (Py_ssize_t)(4 * n),                            /* timestamp deltas */
        (Py_ssize_t)((n + 7) / 8),                      /* key validity bitmap */
        (Py_ssize_t)(8 * (n + 1)),                      /* key offsets */
        (Py_ssize_t)sizes.key_bytes,                    /* key data */
        (Py_ssize_t)(4 * (n + 1)),                      /* attribute map offsets */
        (Py_ssize_t)(8 * (sizes.attributes + 1)),       /* attribute name offsets */
        (Py_ssize_t)sizes.attribute_name_bytes,         /* attribute name data */
        (Py_ssize_t)(8 * (sizes.attributes + 1)),       /* attribute value offsets */
        (Py_ssize_t)sizes.attribute_value_bytes,        /* attribute value data */
        (Py_ssize_t)(8 * (n + 1)),                      /* payload offsets */
        (Py_ssize_t)sizes.payload_bytes,                /* payload data */
    };
    for (int k = 0; k < 11; k++) {
        out[k] = PyBytes_FromStringAndSize(NULL, lengths[k]);
        if (out[k] == NULL) goto done;
    }
    uint8_t *deltas = bytes_data(out[0]), *validity = bytes_data(out[1]);
    uint8_t *key_offsets = bytes_data(out[2]), *key_data = bytes_data(out[3]);
    uint8_t *map_offsets = bytes_data(out[4]);
    uint8_t *name_offsets = bytes_data(out[5]), *name_data = bytes_data(out[6]);
    uint8_t *value_offsets = bytes_data(out[7]), *value_data = bytes_data(out[8]);
    uint8_t *payload_offsets = bytes_data(out[9]), *payload_data = bytes_data(out[10]);
    memset(validity, 0, (size_t)lengths[1]);

    /* Pass 2: the framing is known to be good; fill the buffers. */
    int64_t row = 0, key_at = 0, attr = 0, name_at = 0, value_at = 0, payload_at = 0, key_nulls = 0;
    wr_i64(key_offsets, 0);
    wr_i32(map_offsets, 0);
    wr_i64(name_offsets, 0);
    wr_i64(value_offsets, 0);
    wr_i64(payload_offsets, 0);
    for (Py_ssize_t b = 0; b < batch_count; b++) {
        const uint8_t *entry = batches + b * 32;
        int64_t pos = rd_i64(entry + 8), count = rd_i64(entry + 24);
        for (int64_t i = 0; i < count; i++, row++) {
            const uint8_t *r = data + pos;
            int64_t record_end = pos + 4 + (int64_t)rd_u32(r);
            int32_t key_len = (int32_t)rd_u32(r + 8);
            uint16_t attr_count = rd_u16(r + 12);
            memcpy(deltas + 4 * row, r + 4, 4);
            int64_t field = pos + RECORD_HEADER;
            if (key_len >= 0) {
                validity[row >> 3] |= (uint8_t)(1u << (row & 7));
                memcpy(key_data + key_at, data + field, (size_t)key_len);
                key_at += key_len;
                field += key_len;
            } else {
                key_nulls++;
            }
            wr_i64(key_offsets + 8 * (row + 1), key_at);
            for (uint16_t a = 0; a < attr_count; a++, attr++) {
                int64_t klen = rd_u16(data + field), vlen = rd_u32(data + field + 2);
                field += ATTR_HEADER;
                memcpy(name_data + name_at, data + field, (size_t)klen);
                name_at += klen;
                memcpy(value_data + value_at, data + field + klen, (size_t)vlen);
                value_at += vlen;
                field += klen + vlen;
                wr_i64(name_offsets + 8 * (attr + 1), name_at);
                wr_i64(value_offsets + 8 * (attr + 1), value_at);
            }
            wr_i32(map_offsets + 4 * (row + 1), (int32_t)attr);
            memcpy(payload_data + payload_at, data + field, (size_t)(record_end - field));
            payload_at += record_end - field;
            wr_i64(payload_offsets + 8 * (row + 1), payload_at);
            pos = record_end;
        }
    }
    int ascii = is_ascii(key_data, lengths[3]) && is_ascii(name_data, lengths[6]) && is_ascii(value_data, lengths[8]);
    result = Py_BuildValue("(iLOOOOLOOOOOOOi)", sizes.unusual, (long long)n, out[0], out[1], out[2], out[3],
                           (long long)key_nulls, out[4], out[5], out[6], out[7], out[8], out[9], out[10], ascii);
done:
    for (int k = 0; k < 11; k++) Py_XDECREF(out[k]);
    PyBuffer_Release(&data_view);
    PyBuffer_Release(&batch_view);
    return result;
}

/*
 * decode_avro: schemaless Avro datums of one flat record schema, decoded into Arrow buffers.
 *
 * The Python side (danube_pipeline/lake/iceberg/avro_batch.py) describes the writer schema's
 * top-level fields as a program of one byte each: the kind (AVRO_* below) in the low four bits,
 * AVRO_NULLABLE for a two-branch union with "null", AVRO_NULL_SECOND when "null" is the
 * union's second branch. Each datum is decoded within its own bytes (the payload's length from
 * the record framing), so a datum that does not fill them exactly is seen. Anything the
 * per-record path (fastavro) would read differently or refuse makes the whole batch refused
 * (None), and the caller decodes the records one by one: a union branch byte other than the
 * two canonical ones (0 and 2), a boolean byte other than 0 and 1, a varint that is not
 * canonical or longer than 9 bytes (a long beyond [-2**62, 2**62)), an int beyond 32 bits, a
 * timestamp or date outside datetime's years 1 to 9999, a length past the datum, bytes left
 * over. UTF-8 is checked by the caller (Arrow).
 */
enum {
    AVRO_INT = 1, AVRO_LONG, AVRO_FLOAT, AVRO_DOUBLE, AVRO_BOOLEAN, AVRO_STRING, AVRO_BYTES,
    AVRO_TIMESTAMP_MILLIS, AVRO_TIMESTAMP_MICROS, AVRO_DATE,
};
#define AVRO_KIND_MASK 0x0F
#define AVRO_NULLABLE 0x10
#define AVRO_NULL_SECOND 0x20
#define MIN_MICROS (-62135596800000000LL) /* 0001-01-01T00:00:00 */
#define MAX_MICROS 253402300799999999LL   /* 9999-12-31T23:59:59.999999 */
#define MIN_MILLIS (-62135596800000LL)
#define MAX_MILLIS 253402300799999LL
#define MIN_DAYS (-719162LL) /* date.min */
#define MAX_DAYS 2932896LL   /* date.max */

typedef struct {
    int kind, nullable;
    uint8_t null_byte, value_byte;     /* the union's branch index bytes */
    PyObject *validity, *values, *data; /* Arrow buffers; data for strings and bytes */
    uint8_t *valid_at, *values_at;
    Py_ssize_t data_used, data_capacity;
    int64_t null_count;
} AvroField;

static inline int64_t rd_ne64(const uint8_t *p) { /* a native int64 (numpy, Arrow) */
    int64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* A canonical zig-zag varint of at most 9 bytes (|value| < 2**62) at *p, before end. */
static inline int rd_long(const uint8_t **p, const uint8_t *end, int64_t *value) {
    const uint8_t *at = *p;
    if (at >= end) return -1;
    uint64_t b = *at++, z = b & 0x7F;
    if (b & 0x80) {
        int shift = 7;
        for (;;) {
            if (at >= end || shift > 56) return -1;
            b = *at++;
            z |= (b & 0x7F) << shift;
            if (!(b & 0x80)) {
                if (b == 0) return -1; /* an over-long encoding */
                break;
            }
            shift += 7;
        }
    }
    *p = at;
    *value = (int64_t)(z >> 1) ^ -(int64_t)(z & 1);
    return 0;
}

static int avro_grow(AvroField *f, Py_ssize_t need) {
    if (f->data_used + need <= f->data_capacity) return 0;
    Py_ssize_t capacity = f->data_capacity * 2;
    if (capacity < f->data_used + need) capacity = f->data_used + need;
    if (_PyBytes_Resize(&f->data, capacity) < 0) return -1;
    f->data_capacity = capacity;
    return 0;
}

/* One field of one datum at *p; returns 0, 1 to refuse the batch, -1 on a Python error. */
static inline int avro_field(AvroField *f, int64_t row, const uint8_t **p, const uint8_t *end) {
    const uint8_t *at = *p;
    if (f->nullable) {
        if (at >= end) return 1;
        uint8_t branch = *at++;
        if (branch == f->null_byte) {
            f->null_count++;
            if (f->kind == AVRO_STRING || f->kind == AVRO_BYTES) {
                int64_t offset = f->data_used;
                memcpy(f->values_at + 8 * (row + 1), &offset, 8);
            }
            *p = at;
            return 0;
        }
        if (branch != f->value_byte) return 1;
        f->valid_at[row >> 3] |= (uint8_t)(1u << (row & 7));
    }
    int64_t v;
    int32_t v32;
    switch (f->kind) {
    case AVRO_INT:
    case AVRO_DATE:
        if (rd_long(&at, end, &v) < 0 || v < INT32_MIN || v > INT32_MAX) return 1;
        if (f->kind == AVRO_DATE && (v < MIN_DAYS || v > MAX_DAYS)) return 1;
        v32 = (int32_t)v;
        memcpy(f->values_at + 4 * row, &v32, 4);
        break;
    case AVRO_LONG:
        if (rd_long(&at, end, &v) < 0) return 1;
        memcpy(f->values_at + 8 * row, &v, 8);
        break;
    case AVRO_TIMESTAMP_MILLIS:
        if (rd_long(&at, end, &v) < 0 || v < MIN_MILLIS || v > MAX_MILLIS) return 1;
        v *= 1000;
        memcpy(f->values_at + 8 * row, &v, 8);
        break;
    case AVRO_TIMESTAMP_MICROS:
        if (rd_long(&at, end, &v) < 0 || v < MIN_MICROS || v > MAX_MICROS) return 1;
        memcpy(f->values_at + 8 * row, &v, 8);
        break;
    case AVRO_FLOAT:
        if (end - at < 4) return 1;
        memcpy(f->values_at + 4 * row, at, 4);
        at += 4;
        break;
    case AVRO_DOUBLE:
        if (end - at < 8) return 1;
        memcpy(f->values_at + 8 * row, at, 8);
        at += 8;
        break;
    case AVRO_BOOLEAN:
        if (at >= end || *at > 1) return 1;
        if (*at++) f->values_at[row >> 3] |= (uint8_t)(1u << (row & 7));
        break;
    default: /* AVRO_STRING, AVRO_BYTES */
        if (rd_long(&at, end, &v) < 0 || v < 0 || v > end - at) return 1;
        if (avro_grow(f, (Py_ssize_t)v) < 0) return -1;
        memcpy(PyBytes_AS_STRING(f->data) + f->data_used, at, (size_t)v);
        at += v;
        f->data_used += (Py_ssize_t)v;
        v = f->data_used;
        memcpy(f->values_at + 8 * (row + 1), &v, 8);
        break;
    }
    *p = at;
    return 0;
}

/*
 * decode_avro(data, offsets, program) -> list | None
 *
 * data: the datums' bytes (buffer protocol); offsets: n + 1 native int64 positions in data,
 * datum i being data[offsets[i]:offsets[i + 1]]; program: one byte per field (above).
 *
 * Returns, per field, (null_count, validity, values, data, ascii): validity an Arrow bitmap
 * (None for a field that is not a union), values the int32 (int, date), int64 (long, timestamps
 * in µs), float32, float64 or bit-packed boolean values, or the int64 offsets of a string or
 * bytes column whose bytes are data (None otherwise), ascii 1 when data is all ASCII. None when
 * the batch is refused; ValueError on offsets outside data or an unknown kind.
 */
static PyObject *decode_avro(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data_view, offsets_view, program_view;
    if (!PyArg_ParseTuple(args, "y*y*y*", &data_view, &offsets_view, &program_view)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t field_count = program_view.len;
    int64_t n = offsets_view.len / 8 - 1;
    AvroField *fields = PyMem_Calloc(field_count > 0 ? (size_t)field_count : 1, sizeof(AvroField));
    if (fields == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const uint8_t *data = (const uint8_t *)data_view.buf;
    const uint8_t *program = (const uint8_t *)program_view.buf;
    const uint8_t *offsets = (const uint8_t *)offsets_view.buf;
    if (offsets_view.len % 8 != 0 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "offsets: int64s, one more than the datums");
        goto done;
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t start = rd_ne64(offsets + 8 * i), stop = rd_ne64(offsets + 8 * (i + 1));
        if (start < 0 || start > stop || stop > data_view.len) {
            PyErr_Format(PyExc_ValueError, "datum %lld at %lld..%lld is outside the %zd bytes", (long long)i,
                         (long long)start, (long long)stop, data_view.len);
            goto done;
        }
    }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    result = Py_NewRef(Py_None); /* Avro's fixed-width values are little endian, as copied here */
    goto done;
#endif
    Py_ssize_t bitmap = (Py_ssize_t)((n + 7) / 8);
    for (Py_ssize_t k = 0; k < field_count; k++) {
        AvroField *f = &fields[k];
        f->kind = program[k] & AVRO_KIND_MASK;
        f->nullable = (program[k] & AVRO_NULLABLE) != 0;
        int null_second = (program[k] & AVRO_NULL_SECOND) != 0;
        f->null_byte = null_second ? 2 : 0; /* zig-zag of branch index 1 or 0 */
        f->value_byte = null_second ? 0 : 2;
        Py_ssize_t width;
        switch (f->kind) {
        case AVRO_INT: case AVRO_DATE: case AVRO_FLOAT: width = (Py_ssize_t)(4 * n); break;
        case AVRO_LONG: case AVRO_DOUBLE: case AVRO_TIMESTAMP_MILLIS: case AVRO_TIMESTAMP_MICROS:
            width = (Py_ssize_t)(8 * n); break;
        case AVRO_BOOLEAN: width = bitmap; break;
        case AVRO_STRING: case AVRO_BYTES: width = (Py_ssize_t)(8 * (n + 1)); break;
        default:
            PyErr_Format(PyExc_ValueError, "field %zd: unknown kind %d", k, f->kind);
            goto done;
        }
        f->values = PyBytes_FromStringAndSize(NULL, width);
        if (f->values == NULL) goto done;
        f->values_at = (uint8_t *)PyBytes_AS_STRING(f->values);
        if (f->kind == AVRO_BOOLEAN || f->kind == AVRO_STRING || f->kind == AVRO_BYTES || f->nullable)
            memset(f->values_at, 0, (size_t)width); /* nulls' slots are zero */
        if (f->nullable) {
            f->validity = PyBytes_FromStringAndSize(NULL, bitmap);
            if (f->validity == NULL) goto done;
            f->valid_at = (uint8_t *)PyBytes_AS_STRING(f->validity);
            memset(f->valid_at, 0, (size_t)bitmap);
        }
        if (f->kind == AVRO_STRING || f->kind == AVRO_BYTES) {
            f->data_capacity = (Py_ssize_t)(8 * n + 64);
            f->data = PyBytes_FromStringAndSize(NULL, f->data_capacity);
            if (f->data == NULL) goto done;
        }
    }
    for (int64_t row = 0; row < n; row++) {
        const uint8_t *p = data + rd_ne64(offsets + 8 * row), *end = data + rd_ne64(offsets + 8 * (row + 1));
        for (Py_ssize_t k = 0; k < field_count; k++) {
            int status = avro_field(&fields[k], row, &p, end);
            if (status < 0) goto done;
            if (status > 0) {
                result = Py_NewRef(Py_None);
                goto done;
            }
        }
        if (p != end) { /* bytes left over after the datum */
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    result = PyList_New(field_count);
    if (result == NULL) goto done;
    for (Py_ssize_t k = 0; k < field_count; k++) {
        AvroField *f = &fields[k];
        if (f->data != NULL && _PyBytes_Resize(&f->data, f->data_used) < 0) {
            Py_CLEAR(result);
            goto done;
        }
        int ascii = f->data != NULL && is_ascii((const uint8_t *)PyBytes_AS_STRING(f->data), f->data_used);
        PyObject *item = Py_BuildValue("(LOOOi)", (long long)f->null_count, f->validity ? f->validity : Py_None,
                                       f->values, f->data ? f->data : Py_None, ascii);
        if (item == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, k, item);
    }
done:
    if (fields != NULL) {
        for (Py_ssize_t k = 0; k < field_count; k++) {
            Py_XDECREF(fields[k].validity);
            Py_XDECREF(fields[k].values);
            Py_XDECREF(fields[k].data);
        }
        PyMem_Free(fields);
    }
    PyBuffer_Release(&data_view);
    PyBuffer_Release(&offsets_view);
    PyBuffer_Release(&program_view);
    return result;
}

static PyMethodDef methods[] = {
    {"walk_records", walk_records, METH_VARARGS,
     "walk_records(data, batches) -> tuple: the records of checked batches as Arrow column buffers."},
    {"decode_avro", decode_avro, METH_VARARGS,
     "decode_avro(data, offsets, program) -> list | None: schemaless Avro datums as Arrow column buffers."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "danube_pipeline.lake._framing",
    "The records of checked record batches, walked in C into the buffers of Arrow columns.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__framing(void) { return PyModule_Create(&module); }
