/*
 * broker.storage.wal._commit_round: one WAL commit round (broker/storage/wal/sync_thread.py) with
 * the GIL released ONCE for all of its system calls.
 *
 * The pure-Python round (sync_thread.run_round) makes about four system calls per WAL: the write
 * record, the pwritev of the batches, the fdatasync (or one syncfs for all), the closing write
 * record. Each call releases the GIL and must take it back from the event loop's thread, which
 * holds it while it works: under load the sync thread waited for the GIL after nearly every call,
 * and a round of 32 WALs took about 15 ms where its system calls take about 1.5 ms
 * (benchmarks/README.md, "One GIL release per commit round"). Here the calls of the whole round
 * run between one Py_BEGIN_ALLOW_THREADS and its Py_END_ALLOW_THREADS.
 *
 * commit_round(jobs, syncfs_min_files) -> (errors, used_syncfs, sync_ms)
 *
 *   jobs: a list of (fd, header, header_at, buffers, position, closing) tuples: for each WAL,
 *       `header` is pwritten at `header_at`, then `buffers` (a list of bytes-like objects) one
 *       after the other from byte `position` (pwritev, in chunks of at most IOV_MAX, continued
 *       after partial writes), and, once durable, `closing` at `header_at` (best effort).
 *   syncfs_min_files: when at least this many jobs wrote (and more than 0) and their files are
 *       on one file system (fstat st_dev), one syncfs(2) makes them durable; else one fdatasync
 *       per file. The caller passes 0 where syncfs does not report write-back errors.
 *
 *   errors: one errno per job, 0 when it is durable: its write's, else its sync's (a failed
 *       syncfs fails every job it covered).
 *   used_syncfs: whether the round was made durable by syncfs.
 *   sync_ms: how long each sync took, in milliseconds (one for syncfs, one per fdatasync).
 *
 * Raises TypeError or ValueError (nothing written) when a job is not of that shape.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define IOV_CHUNK 1024 /* IOV_MAX on Linux */

typedef struct {
    int fd;
    Py_buffer header;
    Py_ssize_t header_at;
    Py_buffer *buffers;
    struct iovec *iov; /* one per buffer, for pwritev */
    Py_ssize_t buffer_count;
    Py_ssize_t position;
    Py_buffer closing;
    int error;
    int written;
} job_t;

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1000.0 + (double)ts.tv_nsec / 1e6;
}

/* pwritev every byte of src[0..count) from off on, in chunks of IOV_CHUNK, continuing after
 * partial writes; 0 or an errno. */
static int pwritev_all(int fd, const struct iovec *src, Py_ssize_t count, off_t off) {
    struct iovec iov[IOV_CHUNK];
    Py_ssize_t i = 0;
    size_t skip = 0; /* bytes of src[i] already written */
    while (i < count) {
        int used = 0;
        size_t total = 0;
        for (Py_ssize_t j = i; j < count && used < IOV_CHUNK; j++) {
            size_t from = j == i ? skip : 0;
            iov[used].iov_base = (char *)src[j].iov_base + from;
            iov[used].iov_len = src[j].iov_len - from;
            total += iov[used].iov_len;
            used++;
        }
        if (total == 0)
            return 0; /* only empty buffers left */
        ssize_t n = pwritev(fd, iov, used, off);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (n == 0)
            return EIO;
        off += n;
        size_t left = (size_t)n;
        while (i < count && left >= src[i].iov_len - skip) {
            left -= src[i].iov_len - skip;
            skip = 0;
            i++;
        }
        skip += left;
    }
    return 0;
}

/* pwrite all of a Py_buffer at off; 0 or an errno. */
static int pwrite_buffer(int fd, const Py_buffer *buffer, off_t off) {
    struct iovec one = {buffer->buf, (size_t)buffer->len};
    return pwritev_all(fd, &one, 1, off);
}

static void release_job(job_t *job) {
    if (job->header.obj != NULL)
        PyBuffer_Release(&job->header);
    if (job->closing.obj != NULL)
        PyBuffer_Release(&job->closing);
    for (Py_ssize_t k = 0; k < job->buffer_count; k++)
        PyBuffer_Release(&job->buffers[k]);
    PyMem_Free(job->buffers);
    PyMem_Free(job->iov);
}

/* Fill job from the tuple item; -1 with an exception set (job is released by the caller). */
static int load_job(PyObject *item, job_t *job) {
    PyObject *header, *buffers, *closing;
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 6) {
        PyErr_SetString(PyExc_TypeError, "a job is a (fd, header, header_at, buffers, position, closing) tuple");
        return -1;
    }
    if (!PyArg_ParseTuple(item, "iOnOnO", &job->fd, &header, &job->header_at, &buffers, &job->position, &closing))
        return -1;
    if (job->header_at < 0 || job->position < 0) {
        PyErr_SetString(PyExc_ValueError, "negative file position");
        return -1;
    }
    if (PyObject_GetBuffer(header, &job->header, PyBUF_SIMPLE) < 0)
        return -1;
    if (PyObject_GetBuffer(closing, &job->closing, PyBUF_SIMPLE) < 0)
        return -1;
    if (!PyList_Check(buffers)) {
        PyErr_SetString(PyExc_TypeError, "a job's buffers must be a list");
        return -1;
    }
    Py_ssize_t count = PyList_GET_SIZE(buffers);
    job->buffers = PyMem_Calloc((size_t)(count > 0 ? count : 1), sizeof(Py_buffer));
    job->iov = PyMem_Calloc((size_t)(count > 0 ? count : 1), sizeof(struct iovec));
    if (job->buffers == NULL || job->iov == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(buffers, k), &job->buffers[k], PyBUF_SIMPLE) < 0)
            return -1;
        job->buffer_count = k + 1;
        job->iov[k].iov_base = job->buffers[k].buf;
        job->iov[k].iov_len = (size_t)job->buffers[k].len;
    }
    return 0;
}

static PyObject *commit_round(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "commit_round(jobs: list, syncfs_min_files: int)");
        return NULL;
    }
    Py_ssize_t syncfs_min_files = PyLong_AsSsize_t(args[1]);
    if (syncfs_min_files == -1 && PyErr_Occurred())
        return NULL;
    PyObject *items = args[0];
    Py_ssize_t count = PyList_GET_SIZE(items);
    job_t *jobs = PyMem_Calloc((size_t)(count > 0 ? count : 1), sizeof(job_t));
    double *sync_ms = PyMem_Calloc((size_t)(count > 0 ? count : 1), sizeof(double));
    PyObject *result = NULL;
    Py_ssize_t loaded = 0;
    if (jobs == NULL || sync_ms == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; loaded < count; loaded++) {
        if (load_job(PyList_GET_ITEM(items, loaded), &jobs[loaded]) < 0) {
            loaded++; /* its buffers taken so far are released below */
            goto done;
        }
    }

    int used_syncfs = 0;
    Py_ssize_t syncs = 0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t written = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        job_t *job = &jobs[i];
        job->error = pwrite_buffer(job->fd, &job->header, (off_t)job->header_at);
        if (job->error == 0)
            job->error = pwritev_all(job->fd, job->iov, job->buffer_count, (off_t)job->position);
        job->written = job->error == 0;
        written += job->written;
    }
    int one_fs = syncfs_min_files > 0 && written >= syncfs_min_files;
    dev_t device = 0;
    int first = -1;
    for (Py_ssize_t i = 0; one_fs && i < count; i++) {
        if (!jobs[i].written)
            continue;
        struct stat st;
        if (fstat(jobs[i].fd, &st) != 0) {
            one_fs = 0;
            break;
        }
        if (first < 0) {
            first = (int)i;
            device = st.st_dev;
        } else if (st.st_dev != device) {
            one_fs = 0;
        }
    }
    if (one_fs) {
        used_syncfs = 1;
        double started = now_ms();
        int error = syncfs(jobs[first].fd) == 0 ? 0 : errno;
        sync_ms[syncs++] = now_ms() - started;
        if (error != 0) {
            for (Py_ssize_t i = 0; i < count; i++) {
                if (jobs[i].written) {
                    jobs[i].error = error;
                    jobs[i].written = 0;
                }
            }
        }
    } else {
        for (Py_ssize_t i = 0; i < count; i++) {
            if (!jobs[i].written)
                continue;
            double started = now_ms();
            if (fdatasync(jobs[i].fd) != 0) {
                jobs[i].error = errno;
                jobs[i].written = 0;
            }
            sync_ms[syncs++] = now_ms() - started;
        }
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (jobs[i].written) /* durable either way: an error is ignored */
            (void)pwrite_buffer(jobs[i].fd, &jobs[i].closing, (off_t)jobs[i].header_at);
    }
    Py_END_ALLOW_THREADS

    PyObject *errors = PyList_New(count);
    PyObject *times = PyList_New(syncs);
    if (errors == NULL || times == NULL) {
        Py_XDECREF(errors);
        Py_XDECREF(times);
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++)
        PyList_SET_ITEM(errors, i, PyLong_FromLong(jobs[i].error)); /* small ints: cached */
    for (Py_ssize_t i = 0; i < syncs; i++) {
        PyObject *ms = PyFloat_FromDouble(sync_ms[i]);
        if (ms == NULL) {
            Py_DECREF(errors);
            Py_DECREF(times);
            goto done;
        }
        PyList_SET_ITEM(times, i, ms);
    }
    result = Py_BuildValue("(NON)", errors, used_syncfs ? Py_True : Py_False, times);

done:
    if (jobs != NULL) {
        for (Py_ssize_t i = 0; i < loaded && i < count; i++)
            release_job(&jobs[i]);
    }
    PyMem_Free(jobs);
    PyMem_Free(sync_ms);
    return result;
}

static PyMethodDef methods[] = {
    {"commit_round", (PyCFunction)(void (*)(void))commit_round, METH_FASTCALL,
     "commit_round(jobs, syncfs_min_files) -> (errors, used_syncfs, sync_ms): one WAL commit round "
     "with the GIL released once (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "broker.storage.wal._commit_round",
    "One WAL commit round (writes, syncfs or fdatasync, closing writes) with the GIL released once.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__commit_round(void) { return PyModule_Create(&module); }
