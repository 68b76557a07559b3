/*
 * danube_pipeline.lake._framing: the records of checked record batches, walked in C into the
 * buffers of Arrow columns.
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
 * attribute_value_data, payload_offsets, payload_data): bytes objects holding a uint32 per
 * record (timestamp_delta_us), an Arrow validity bitmap of the keys, int64 offsets (n + 1, or
 * one more than the attribute count) with their data, the attribute map's int32 offsets, and
 * key_nulls as an int. unusual is 1 when a record repeats an attribute name or has more than
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
    result = Py_BuildValue("(iLOOOOLOOOOOOO)", sizes.unusual, (long long)n, out[0], out[1], out[2], out[3], (long long)key_nulls,
                           out[4], out[5], out[6], out[7], out[8], out[9], out[10]);
done:
    for (int k = 0; k < 11; k++) Py_XDECREF(out[k]);
    PyBuffer_Release(&data_view);
    PyBuffer_Release(&batch_view);
    return result;
}

static PyMethodDef methods[] = {
    {"walk_records", walk_records, METH_VARARGS,
     "walk_records(data, batches) -> tuple: the records of checked batches as Arrow column buffers."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "danube_pipeline.lake._framing",
    "The records of checked record batches, walked in C into the buffers of Arrow columns.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__framing(void) { return PyModule_Create(&module); }
