/*
 * danube_pipeline.format._batch_builder: records with no key and no attributes, framed in C
 * into the bytearray of a danube_pipeline.format.batches.BatchBuilder (the producer's hot path).
 *
 * The record format is that of danube_pipeline/format/batches.py (segment format version 2):
 *
 *     record_length u32 | timestamp_delta_us u32 | key_length i32 = -1 | attribute_count u16 = 0 | payload
 *
 * little endian, record_length counting the bytes after itself (10 + the payload's length).
 * The pure-Python BatchBuilder.append_payload writes the same bytes; tests/test_batch_builder.py
 * compares the two over random inputs.
 *
 * frame_payloads checks every payload (a bytes-like object, at most 4 GiB - 11 bytes) before it
 * writes anything, so a refused call leaves the bytearray unchanged; the caller checks the
 * timestamp delta (0 .. 2^32 - 1). The bytearray is grown once per call (CPython over-allocates
 * it, so a run of one-payload calls grows it amortized).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define RECORD_HEADER 14 /* record_length u32, timestamp_delta_us u32, key_length i32, attribute_count u16 */
#define MAX_U32 0xFFFFFFFFULL

static inline void wr_u32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

/* Write one record (header and payload) at p; return the byte after it. */
static inline uint8_t *put_record(uint8_t *p, const char *payload, Py_ssize_t size, uint32_t delta) {
    wr_u32(p, (uint32_t)(RECORD_HEADER - 4 + size));
    wr_u32(p + 4, delta);
    p[8] = p[9] = p[10] = p[11] = 0xFF; /* key_length -1: no key */
    p[12] = p[13] = 0;                  /* attribute_count 0 */
    memcpy(p + RECORD_HEADER, payload, (size_t)size);
    return p + RECORD_HEADER + size;
}

static int check_size(Py_ssize_t index, Py_ssize_t size) {
    if ((unsigned long long)size + (RECORD_HEADER - 4) > MAX_U32) {
        PyErr_Format(PyExc_OverflowError, "payload %zd: a record of %zd bytes, at most %llu", index,
                     size + (RECORD_HEADER - 4), MAX_U32);
        return -1;
    }
    return 0;
}

/* Check that records is a bytearray and read the delta (0 .. 2^32 - 1) into *delta. */
static int check_args(PyObject *records, PyObject *delta_us, uint32_t *delta) {
    if (!PyByteArray_Check(records)) {
        PyErr_SetString(PyExc_TypeError, "records must be a bytearray");
        return -1;
    }
    unsigned long value = PyLong_AsUnsignedLong(delta_us);
    if (value == (unsigned long)-1 && PyErr_Occurred()) return -1;
    if (value > MAX_U32) {
        PyErr_SetString(PyExc_OverflowError, "delta_us over 2^32 - 1");
        return -1;
    }
    *delta = (uint32_t)value;
    return 0;
}

/* Grow records by extra bytes; return where they start, or NULL with an exception set. */
static uint8_t *grow(PyObject *records, Py_ssize_t extra) {
    Py_ssize_t old = PyByteArray_GET_SIZE(records);
    if (extra > PY_SSIZE_T_MAX - old) {
        PyErr_NoMemory();
        return NULL;
    }
    if (PyByteArray_Resize(records, old + extra) < 0) return NULL;
    return (uint8_t *)PyByteArray_AS_STRING(records) + old;
}

static PyObject *frame_payload(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "frame_payload(records, payload, delta_us) takes 3 arguments");
        return NULL;
    }
    PyObject *records = args[0], *payload = args[1];
    uint32_t delta;
    if (check_args(records, args[2], &delta) < 0) return NULL;
    Py_buffer view;
    const char *data;
    Py_ssize_t size;
    int release = 0;
    if (PyBytes_CheckExact(payload)) {
        data = PyBytes_AS_STRING(payload);
        size = PyBytes_GET_SIZE(payload);
    } else {
        if (PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE) < 0) return NULL;
        data = view.buf;
        size = view.len;
        release = 1;
    }
    uint8_t *p = NULL;
    if (check_size(0, size) == 0) p = grow(records, RECORD_HEADER + size);
    if (p != NULL) put_record(p, data, size, delta);
    if (release) PyBuffer_Release(&view);
    if (p == NULL) return NULL;
    return PyLong_FromSsize_t(RECORD_HEADER + size);
}

static PyObject *frame_payloads(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "frame_payloads(records, payloads, delta_us) takes 3 arguments");
        return NULL;
    }
    PyObject *records = args[0];
    uint32_t delta;
    if (check_args(records, args[2], &delta) < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[1], "payloads must be a sequence of bytes-like objects");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_buffer *views = NULL;
    PyObject *result = NULL;
    Py_ssize_t total = 0, i, held = 0;
    views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* First pass: every payload's buffer and size, checked before anything is written. */
    for (i = 0; i < n; i++) {
        if (PyBytes_CheckExact(items[i])) {
            views[i].buf = PyBytes_AS_STRING(items[i]);
            views[i].len = PyBytes_GET_SIZE(items[i]);
            views[i].obj = NULL;
        } else {
            if (PyObject_GetBuffer(items[i], &views[i], PyBUF_SIMPLE) < 0) goto done;
            held = i + 1;
        }
        if (check_size(i, views[i].len) < 0) goto done;
        if (views[i].len > PY_SSIZE_T_MAX - RECORD_HEADER - total) {
            PyErr_NoMemory();
            goto done;
        }
        total += RECORD_HEADER + views[i].len;
        held = i + 1;
    }
    uint8_t *p = grow(records, total);
    if (p == NULL) goto done;
    for (i = 0; i < n; i++) p = put_record(p, views[i].buf, views[i].len, delta);
    result = PyLong_FromSsize_t(total);
done:
    if (views != NULL) {
        for (i = 0; i < held; i++)
            if (views[i].obj != NULL) PyBuffer_Release(&views[i]);
        PyMem_Free(views);
    }
    Py_DECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"frame_payload", (PyCFunction)(void (*)(void))frame_payload, METH_FASTCALL,
     "frame_payload(records, payload, delta_us) -> int: append one record with no key and no "
     "attributes to the bytearray records; return the bytes added."},
    {"frame_payloads", (PyCFunction)(void (*)(void))frame_payloads, METH_FASTCALL,
     "frame_payloads(records, payloads, delta_us) -> int: append one record with no key and no "
     "attributes per payload, all with the same timestamp delta; return the bytes added."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "danube_pipeline.format._batch_builder",
    "Records with no key and no attributes, framed in C into a record batch's bytearray.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__batch_builder(void) { return PyModule_Create(&module); }
