/* The C-level call path of shape-generic CPU kernels (``sparse_mlir.runtime.fast_call``).
 *
 * A cached kernel call from Python used to cost ~6-10 us before any work: keyword operands converted and
 * checked in Python, a scipy operand's structure checked by a few numpy calls, then a ctypes call that packs
 * each argument.  scipy's own ``A @ x`` costs ~2 us.  ``FastCall`` does the same checks for the common case
 * in C and calls the kernel's C entry point (``NAME(ptr, len, ..., dims, out, dims)``, see
 * ``sparse_mlir.abi.c_signature``) directly, with the GIL released.
 *
 * It only ever accelerates the happy path: for anything it does not recognise exactly (another type, dtype,
 * layout, index width, a shape mismatch, a broken structure, a non-zero status from the kernel's own checks)
 * it returns ``NotImplemented`` without side effects, and the Python path runs the call again and raises the
 * error that names the problem.  So every refusal message lives in one place (Python), and this file only has
 * to be right about what it accepts:
 *
 * - dense operands: exactly ``numpy.ndarray``, the kernel's dtype object, the operand's rank, C-contiguous,
 *   aligned;
 * - sparse operands: a ``SparseTensor`` whose ``format`` is the very object the specialization was built for
 *   (its buffers were validated when it was made), or a scipy csr/csc matrix of the declared layout whose index
 *   arrays have the specialization's width, whose ``has_canonical_format`` is true (scipy computes and caches
 *   it), and whose every index is checked in bounds here (one vectorizable pass);  the kernel's C entry point
 *   checks the rest (buffer lengths, positions from 0 without decreasing);
 * - ``out``: exactly ``numpy.ndarray``, the output dtype and shape, writeable, C-contiguous, aligned, and not
 *   overlapping any input buffer; else a new array from ``numpy.empty`` (the entry point zero-fills it);
 * - a sparse result (no ``out``): the entry point ``malloc``-s its buffers and reports them in result words,
 *   which ``make_result`` (Python) adopts into a ``SparseTensor`` without checking them again.
 *
 * Calling convention: every C parameter is a pointer or an ``int64_t``, which the x86-64 System V and AArch64
 * ABIs pass alike, so the entry point is called through a prototype of ``int64_t`` parameters of the exact
 * arity (the Python side offers this path only on those machines).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_PARAMS 48
#define MAX_OPERANDS 8
#define MAX_RANK 4
#define MAX_VIEWS 32
#define MAX_RESULT_BUFFERS 8  /* level buffers + values of a sparse result */

enum { DENSE = 0, SPARSE = 1 };

typedef struct {
    PyObject *name;          /* the keyword */
    int kind;                /* DENSE or SPARSE */
    PyObject *dtype;         /* the values' numpy dtype object (compared by identity) */
    int rank;
    PyObject *format;        /* SPARSE: the Format object a SparseTensor must carry */
    int nbuffers;            /* SPARSE: level buffers + values, as the C entry point takes them */
    int nsize;               /* SPARSE: dimensions passed as sizes */
    int size_dims[MAX_RANK];
    PyObject *scipy_types;   /* SPARSE: tuple of scipy classes taken zero-copy (may be empty) */
    PyObject *index_dtype;   /* SPARSE scipy: indptr / indices dtype object */
    int outer;               /* SPARSE scipy: the dimension indptr runs over (0: csr, 1: csc) */
} Operand;

typedef struct {
    PyObject_HEAD
    void *function;          /* the kernel's C entry point; NULL once closed */
    unsigned long long calls;  /* calls it ran: the runtime's table of loaded libraries reads it to evict fairly */
    PyObject *keep;          /* what keeps the library loaded (its NativeFunction) */
    PyObject *threads;       /* called with the call's entry count before a threaded kernel runs, or None; what it
                                returns, unless None, is called with the call's seconds after it (ThreadChoice) */
    PyObject *empty;         /* numpy.empty */
    PyObject *ndarray;       /* numpy.ndarray */
    PyObject *tensor_type;   /* sparse_mlir.tensor.host.SparseTensor */
    PyObject *out_dtype;
    int out_buffers;         /* a sparse result's buffers (the entry point malloc-s them); 0: a dense result */
    PyObject *make_result;   /* sparse result: called with (the entry point's result words, shape) */
    int out_rank;
    int out_extent[MAX_RANK];  /* which extent gives each output dimension */
    int noperands;
    Operand operands[MAX_OPERANDS];
    int nextents;
    int extent_places[MAX_OPERANDS * MAX_RANK][2];  /* (operand, dim) of each place, grouped by extent */
    int extent_start[MAX_OPERANDS * MAX_RANK + 1];
} FastCall;

/* views acquired for one call, released on every way out */
typedef struct {
    Py_buffer views[MAX_VIEWS];
    int count;
} Views;

static void release_views(Views *v) {
    for (int i = 0; i < v->count; i++) PyBuffer_Release(&v->views[i]);
    v->count = 0;
}

/* A C-contiguous, aligned view of exactly-``ndarray`` ``obj`` with dtype object ``dtype`` (NULL: any); NULL (no
 * exception) when it is anything else. */
static Py_buffer *array_view(FastCall *self, Views *v, PyObject *obj, PyObject *dtype, int writable) {
    if ((PyObject *)Py_TYPE(obj) != self->ndarray || v->count >= MAX_VIEWS) return NULL;
    if (dtype != NULL) {
        PyObject *actual = PyObject_GetAttrString(obj, "dtype");
        if (actual == NULL) { PyErr_Clear(); return NULL; }
        Py_DECREF(actual);  /* still owned by the array */
        if (actual != dtype) return NULL;
    }
    Py_buffer *view = &v->views[v->count];
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) != 0) {
        PyErr_Clear();
        return NULL;
    }
    v->count++;
    if (view->itemsize > 0 && ((uintptr_t)view->buf % (uintptr_t)view->itemsize) != 0) return NULL;
    return view;
}

static int int64_of(PyObject *obj, int64_t *value) {
    if (!PyLong_CheckExact(obj)) return 0;
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
    *value = (int64_t)v;
    return 1;
}

/* ``obj.shape`` as ``rank`` int64s; 0 when it is not a tuple of that many Python ints. */
static int shape_of(PyObject *obj, int rank, int64_t *dims) {
    PyObject *shape = PyObject_GetAttrString(obj, "shape");
    if (shape == NULL) { PyErr_Clear(); return 0; }
    int ok = PyTuple_CheckExact(shape) && PyTuple_GET_SIZE(shape) == rank;
    for (int d = 0; ok && d < rank; d++) ok = int64_of(PyTuple_GET_ITEM(shape, d), &dims[d]);
    Py_DECREF(shape);
    return ok;
}

/* Whether every index of ``view`` (int32 or int64) is below ``bound`` (compared unsigned: a negative index is
 * huge).  An or-reduction with no early exit, so the compiler vectorizes it (5 us for 84k int32 indices with
 * AVX2, 11 us with SSE2, 60 us as a scalar maximum); on x86-64 an AVX-512 or AVX2 clone is picked at load time. */
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef VECTOR_CLONES
#define VECTOR_CLONES
#endif

VECTOR_CLONES static int below32(const uint32_t *idx, Py_ssize_t n, uint32_t bound) {
    int bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) bad |= idx[i] >= bound;
    return !bad;
}

VECTOR_CLONES static int below64(const uint64_t *idx, Py_ssize_t n, uint64_t bound) {
    int bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) bad |= idx[i] >= bound;
    return !bad;
}

static int indices_below(const Py_buffer *view, int64_t bound) {
    Py_ssize_t n = view->len / view->itemsize;
    if (n == 0) return 1;
    if (bound <= 0) return 0;
    if (view->itemsize == 4) return bound > (int64_t)UINT32_MAX || below32((const uint32_t *)view->buf, n, (uint32_t)bound);
    if (view->itemsize == 8) return below64((const uint64_t *)view->buf, n, (uint64_t)bound);
    return 0;
}

static int push(int64_t *params, int *n, int64_t value) {
    if (*n >= MAX_PARAMS) return 0;
    params[(*n)++] = value;
    return 1;
}

/* A SparseTensor of the specialization's format: its buffers (validated when it was made), shape, sizes. */
static int tensor_params(FastCall *self, Views *v, const Operand *op, PyObject *obj, int64_t *dims,
                         int64_t *params, int *n, int64_t *entries) {
    PyObject *format = PyObject_GetAttrString(obj, "format");
    if (format == NULL) { PyErr_Clear(); return 0; }
    Py_DECREF(format);
    if (format != op->format || !shape_of(obj, op->rank, dims)) return 0;
    PyObject *buffers = PyObject_GetAttrString(obj, "buffers");
    if (buffers == NULL) { PyErr_Clear(); return 0; }
    int ok = PyTuple_CheckExact(buffers) && PyTuple_GET_SIZE(buffers) == op->nbuffers;
    for (int b = 0; ok && b < op->nbuffers; b++) {
        /* the format object fixes the index widths; the values' dtype is the kernel's */
        PyObject *buf = PyTuple_GET_ITEM(buffers, b);
        Py_buffer *view = array_view(self, v, buf, b == op->nbuffers - 1 ? op->dtype : NULL, 0);
        ok = view != NULL && push(params, n, (int64_t)(intptr_t)view->buf) &&
             push(params, n, (int64_t)(view->len / view->itemsize));
        if (ok && b == op->nbuffers - 1) *entries += view->len / view->itemsize;
    }
    Py_DECREF(buffers);
    return ok;
}

/* Names looked up in a scipy matrix's instance dictionary (interned once, in the module's init). */
static PyObject *k_shape, *k_sorted, *k_canonical, *k_buffers[3];

/* ``key`` from the instance dictionary ``dict`` (borrowed), else the attribute ``name`` (a new reference, kept in
 * ``*owned`` to release): scipy keeps its shape, flags and buffers as plain instance attributes, and reading the
 * dictionary skips the property calls and type lookups (about a third of a small call's cost). */
static PyObject *instance_value(PyObject *obj, PyObject *dict, PyObject *key, const char *name, PyObject **owned) {
    PyObject *value = PyDict_GetItemWithError(dict, key);
    if (value != NULL) return value;
    if (PyErr_Occurred()) { PyErr_Clear(); return NULL; }
    *owned = PyObject_GetAttrString(obj, name);
    if (*owned == NULL) PyErr_Clear();
    return *owned;
}

/* A scipy csr/csc matrix used in place: indptr, indices, data as the CSR/CSC level buffers.  Canonical means
 * what scipy's ``has_canonical_format`` property returns: false when ``_has_sorted_indices`` is false, else the
 * cached ``_has_canonical_format``; when that is not cached yet the property computes it (once per matrix). */
static int scipy_params(FastCall *self, Views *v, const Operand *op, PyObject *obj, int64_t *dims,
                        int64_t *params, int *n, int64_t *entries) {
    if (op->rank != 2) return 0;
    PyObject *dict = PyObject_GenericGetDict(obj, NULL);
    if (dict == NULL) { PyErr_Clear(); return 0; }
    int ok = 0;
    PyObject *owned[6] = {NULL, NULL, NULL, NULL, NULL, NULL};
    PyObject *shape = instance_value(obj, dict, k_shape, "shape", &owned[0]);
    if (shape == NULL || !PyTuple_CheckExact(shape) || PyTuple_GET_SIZE(shape) != 2 ||
        !int64_of(PyTuple_GET_ITEM(shape, 0), &dims[0]) || !int64_of(PyTuple_GET_ITEM(shape, 1), &dims[1]))
        goto done;
    PyObject *sorted = PyDict_GetItemWithError(dict, k_sorted);
    if (sorted == NULL && PyErr_Occurred()) { PyErr_Clear(); goto done; }
    if (sorted != NULL && PyObject_IsTrue(sorted) != 1) { PyErr_Clear(); goto done; }  /* false, or an error */
    PyObject *canonical = instance_value(obj, dict, k_canonical, "has_canonical_format", &owned[1]);
    if (canonical != Py_True) goto done;
    static const char *names[3] = {"indptr", "indices", "data"};
    Py_buffer *views[3];
    for (int b = 0; b < 3; b++) {
        PyObject *buf = instance_value(obj, dict, k_buffers[b], names[b], &owned[2 + b]);
        if (buf == NULL) goto done;
        /* the view holds the buffer's memory for the call */
        views[b] = array_view(self, v, buf, b == 2 ? op->dtype : op->index_dtype, 0);
        if (views[b] == NULL || views[b]->ndim != 1) goto done;
    }
    int64_t outer = dims[op->outer], inner = dims[1 - op->outer];
    if (views[0]->shape[0] != outer + 1 || !indices_below(views[1], inner)) goto done;
    for (int b = 0; b < 3; b++)
        if (!push(params, n, (int64_t)(intptr_t)views[b]->buf) || !push(params, n, (int64_t)views[b]->shape[0]))
            goto done;
    *entries += views[2]->shape[0];
    ok = 1;
done:
    for (int i = 0; i < 6; i++) Py_XDECREF(owned[i]);
    Py_DECREF(dict);
    return ok;
}

static int overlaps(const Views *v, const Py_buffer *out) {
    const char *lo = (const char *)out->buf, *hi = lo + out->len;
    for (int i = 0; i < v->count; i++) {
        const char *a = (const char *)v->views[i].buf, *b = a + v->views[i].len;
        if (&v->views[i] != out && a < hi && lo < b) return 1;
    }
    return 0;
}

static int32_t call_entry(void *f, const int64_t *p, int n);

/* The output's shape, from the call's extents: a new tuple, or NULL with an exception set. */
static PyObject *output_shape(const FastCall *self, const int64_t *extents) {
    PyObject *shape = PyTuple_New(self->out_rank);
    if (shape == NULL) return NULL;
    for (int d = 0; d < self->out_rank; d++) {
        PyObject *size = PyLong_FromLongLong(extents[self->out_extent[d]]);
        if (size == NULL) { Py_DECREF(shape); return NULL; }
        PyTuple_SET_ITEM(shape, d, size);
    }
    return shape;
}

/* The sparse result of a call that succeeded: make_result(words, shape) adopts the buffers the entry point
 * malloc-ed.  If the words cannot even be handed over (no memory), the buffers are freed here. */
static PyObject *sparse_result(FastCall *self, const int64_t *words, const int64_t *extents) {
    int count = 3 * self->out_buffers;
    PyObject *shape = output_shape(self, extents);
    PyObject *tuple = shape == NULL ? NULL : PyTuple_New(count);
    for (int i = 0; tuple != NULL && i < count; i++) {
        PyObject *word = PyLong_FromLongLong(words[i]);
        if (word == NULL) { Py_CLEAR(tuple); break; }
        PyTuple_SET_ITEM(tuple, i, word);
    }
    if (tuple == NULL) {
        for (int i = 0; i < self->out_buffers; i++) free((void *)(intptr_t)words[2 * self->out_buffers + i]);
        Py_XDECREF(shape);
        return NULL;
    }
    PyObject *call_args[2] = {tuple, shape};
    PyObject *result = PyObject_Vectorcall(self->make_result, call_args, 2, NULL);
    Py_DECREF(tuple);
    Py_DECREF(shape);
    return result;
}

/* fast_call(operands: dict, out) -> result, or NotImplemented for the Python path */
static PyObject *FastCall_call(FastCall *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyDict_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "FastCall(operands: dict, out)");
        return NULL;
    }
    PyObject *operands = args[0], *out = args[1];
    if (self->function == NULL || PyDict_GET_SIZE(operands) != self->noperands) Py_RETURN_NOTIMPLEMENTED;
    /* taken now: Python code runs below (numpy.empty, the thread choice, a finalizer either may trigger) and may
     * let another thread close the plan, which clears both (a call through NULL crashed an eviction test) */
    void *function = self->function;
    PyObject *keep = self->keep;
    Py_INCREF(keep);  /* the library stays mapped until this call returns, even if the plan is closed meanwhile */
    Views v;
    v.count = 0;
    int64_t params[MAX_PARAMS];
    int64_t dims[MAX_OPERANDS][MAX_RANK];
    int n = 0;
    int64_t entries = 0;
    PyObject *result = NULL;
    for (int i = 0; i < self->noperands; i++) {
        const Operand *op = &self->operands[i];
        PyObject *obj = PyDict_GetItemWithError(operands, op->name);  /* borrowed */
        if (obj == NULL) { PyErr_Clear(); goto decline; }
        if (op->kind == DENSE) {
            Py_buffer *view = array_view(self, &v, obj, op->dtype, 0);
            if (view == NULL || view->ndim != op->rank || !push(params, &n, (int64_t)(intptr_t)view->buf))
                goto decline;
            for (int d = 0; d < op->rank; d++) {
                dims[i][d] = view->shape[d];
                if (!push(params, &n, dims[i][d])) goto decline;
            }
            entries += view->len / view->itemsize;
            continue;
        }
        int ok;
        if ((PyObject *)Py_TYPE(obj) == self->tensor_type) {
            ok = tensor_params(self, &v, op, obj, dims[i], params, &n, &entries);
        } else {
            ok = 0;
            for (Py_ssize_t t = 0; t < PyTuple_GET_SIZE(op->scipy_types); t++)
                if ((PyObject *)Py_TYPE(obj) == PyTuple_GET_ITEM(op->scipy_types, t)) {
                    ok = scipy_params(self, &v, op, obj, dims[i], params, &n, &entries);
                    break;
                }
        }
        if (!ok) goto decline;
        for (int s = 0; s < op->nsize; s++)
            if (!push(params, &n, dims[i][op->size_dims[s]])) goto decline;
    }
    int64_t extents[MAX_OPERANDS * MAX_RANK];
    for (int e = 0; e < self->nextents; e++) {
        int first = self->extent_start[e];
        extents[e] = dims[self->extent_places[first][0]][self->extent_places[first][1]];
        for (int k = first + 1; k < self->extent_start[e + 1]; k++)
            if (dims[self->extent_places[k][0]][self->extent_places[k][1]] != extents[e]) goto decline;
    }
    int64_t words[3 * MAX_RESULT_BUFFERS] = {0};  /* sparse result: (data, length) per buffer, then allocations */
    if (self->out_buffers) {
        if (out != Py_None) goto decline;  /* out= with a sparse result: the Python path says why not */
        if (!push(params, &n, (int64_t)(intptr_t)words)) goto decline;
    } else {
        Py_buffer *target;
        if (out == Py_None) {
            PyObject *shape = output_shape(self, extents);
            if (shape == NULL) goto fail;
            PyObject *empty_args[2] = {shape, self->out_dtype};
            result = PyObject_Vectorcall(self->empty, empty_args, 2, NULL);
            Py_DECREF(shape);
            if (result == NULL) {  /* too large to allocate: the Python path raises the ShapeError naming it */
                if (!PyErr_ExceptionMatches(PyExc_MemoryError) && !PyErr_ExceptionMatches(PyExc_ValueError))
                    goto fail;
                PyErr_Clear();
                goto decline;
            }
            target = array_view(self, &v, result, self->out_dtype, 1);
            if (target == NULL) goto decline;
        } else {
            target = array_view(self, &v, out, self->out_dtype, 1);
            if (target == NULL || target->ndim != self->out_rank || overlaps(&v, target)) goto decline;
            for (int d = 0; d < self->out_rank; d++)
                if (target->shape[d] != extents[self->out_extent[d]]) goto decline;
            Py_INCREF(out);
            result = out;
        }
        if (!push(params, &n, (int64_t)(intptr_t)target->buf)) goto decline;
        for (int d = 0; d < self->out_rank; d++)
            if (!push(params, &n, target->shape[d])) goto decline;
    }
    PyObject *report = NULL;  /* the thread choice's report(seconds), when it wants this call timed */
    if (self->threads != Py_None) {
        PyObject *count = PyLong_FromLongLong(entries);
        if (count == NULL) goto fail;
        report = PyObject_CallOneArg(self->threads, count);
        Py_DECREF(count);
        if (report == NULL) goto fail;
        if (report == Py_None) Py_CLEAR(report);
    }
    int32_t status;
    struct timespec start = {0, 0}, stop = {0, 0};
    int timed = report != NULL;
    Py_BEGIN_ALLOW_THREADS
    if (timed) clock_gettime(CLOCK_MONOTONIC, &start);
    status = call_entry(function, params, n);
    if (timed) clock_gettime(CLOCK_MONOTONIC, &stop);
    Py_END_ALLOW_THREADS
    if (report != NULL) {  /* advisory: a failure is printed, never lost with the result the kernel made */
        if (status == 0) {
            PyObject *seconds = PyFloat_FromDouble((double)(stop.tv_sec - start.tv_sec)
                                                   + 1e-9 * (double)(stop.tv_nsec - start.tv_nsec));
            PyObject *done = seconds == NULL ? NULL : PyObject_CallOneArg(report, seconds);
            Py_XDECREF(seconds);
            if (done == NULL) PyErr_WriteUnraisable(report);
            Py_XDECREF(done);
        }
        Py_DECREF(report);
    }
    if (status != 0) goto decline;  /* refused by the entry point's own checks: the Python path says why */
    self->calls++;
    release_views(&v);
    if (self->out_buffers) result = sparse_result(self, words, extents);
    Py_DECREF(keep);
    return result;
decline:
    release_views(&v);
    Py_XDECREF(result);
    Py_DECREF(keep);
    Py_RETURN_NOTIMPLEMENTED;
fail:
    release_views(&v);
    Py_XDECREF(result);
    Py_DECREF(keep);
    return NULL;
}

/* -- construction ---------------------------------------------------------------------------------------- */

static int int_in(PyObject *tuple, Py_ssize_t i, int lo, int hi, int *value) {
    long v = PyLong_AsLong(PyTuple_GET_ITEM(tuple, i));
    if (v == -1 && PyErr_Occurred()) return 0;
    if (v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "FastCall: %ld is outside [%d, %d]", v, lo, hi);
        return 0;
    }
    *value = (int)v;
    return 1;
}

static int tuple_of(PyObject *obj, Py_ssize_t size, const char *what) {
    if (!PyTuple_Check(obj) || (size >= 0 && PyTuple_GET_SIZE(obj) != size)) {
        PyErr_Format(PyExc_TypeError, "FastCall: %s must be a tuple%s", what, size >= 0 ? " of the right size" : "");
        return 0;
    }
    return 1;
}

static void hold(PyObject **slot, PyObject *obj) {
    Py_INCREF(obj);
    *slot = obj;
}

/* FastCall(function: int, keep, threads, empty, ndarray, tensor_type, operands, extents, out)
 *   operands: ((name, kind, dtype, rank, format, nbuffers, size_dims, scipy_types, index_dtype, outer), ...)
 *   extents: (((operand, dim), ...), ...) one tuple of places per index
 *   out: (dtype, (extent of each dimension, ...)) for a dense result,
 *        (dtype, (extent of each dimension, ...), result buffers, make_result) for a sparse one */
static int FastCall_init(FastCall *self, PyObject *args, PyObject *kwds) {
    PyObject *function, *keep, *threads, *empty, *ndarray, *tensor_type, *operands, *extents, *out;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "FastCall takes positional arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OOOOOOOOO", &function, &keep, &threads, &empty, &ndarray, &tensor_type,
                          &operands, &extents, &out))
        return -1;
    if (self->function != NULL || self->keep != NULL) {
        PyErr_SetString(PyExc_TypeError, "FastCall is initialized once");
        return -1;
    }
    void *address = PyLong_AsVoidPtr(function);
    if (address == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "FastCall: NULL function");
        return -1;
    }
    if (!tuple_of(operands, -1, "operands") || PyTuple_GET_SIZE(operands) > MAX_OPERANDS ||
        !tuple_of(extents, -1, "extents") || !tuple_of(out, -1, "out"))
        return -1;
    if (PyTuple_GET_SIZE(out) != 2 && PyTuple_GET_SIZE(out) != 4) {
        PyErr_SetString(PyExc_ValueError, "FastCall: out is (dtype, extents) or (dtype, extents, buffers, make)");
        return -1;
    }
    hold(&self->keep, keep);
    hold(&self->threads, threads);
    hold(&self->empty, empty);
    hold(&self->ndarray, ndarray);
    hold(&self->tensor_type, tensor_type);
    self->noperands = (int)PyTuple_GET_SIZE(operands);
    for (int i = 0; i < self->noperands; i++) {
        PyObject *t = PyTuple_GET_ITEM(operands, i);
        Operand *op = &self->operands[i];
        if (!tuple_of(t, 10, "an operand")) return -1;
        hold(&op->name, PyTuple_GET_ITEM(t, 0));
        hold(&op->dtype, PyTuple_GET_ITEM(t, 2));
        hold(&op->format, PyTuple_GET_ITEM(t, 4));
        hold(&op->scipy_types, PyTuple_GET_ITEM(t, 7));
        hold(&op->index_dtype, PyTuple_GET_ITEM(t, 8));
        if (!PyUnicode_CheckExact(op->name) || !tuple_of(op->scipy_types, -1, "scipy_types") ||
            !int_in(t, 1, DENSE, SPARSE, &op->kind) || !int_in(t, 3, 0, MAX_RANK, &op->rank) ||
            !int_in(t, 5, 0, MAX_VIEWS, &op->nbuffers) || !int_in(t, 9, 0, 1, &op->outer))
            return -1;
        PyObject *sizes = PyTuple_GET_ITEM(t, 6);
        if (!tuple_of(sizes, -1, "size_dims") || PyTuple_GET_SIZE(sizes) > op->rank) return -1;
        op->nsize = (int)PyTuple_GET_SIZE(sizes);
        for (int s = 0; s < op->nsize; s++)
            if (!int_in(sizes, s, 0, op->rank - 1, &op->size_dims[s])) return -1;
    }
    int places = 0;
    if (PyTuple_GET_SIZE(extents) > MAX_OPERANDS * MAX_RANK) {
        PyErr_SetString(PyExc_ValueError, "FastCall: too many indices");
        return -1;
    }
    self->nextents = (int)PyTuple_GET_SIZE(extents);
    for (int e = 0; e < self->nextents; e++) {
        PyObject *group = PyTuple_GET_ITEM(extents, e);
        if (!tuple_of(group, -1, "an extent") || PyTuple_GET_SIZE(group) == 0) return -1;
        self->extent_start[e] = places;
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(group); k++) {
            PyObject *place = PyTuple_GET_ITEM(group, k);
            int operand, dim;
            if (places >= MAX_OPERANDS * MAX_RANK || !tuple_of(place, 2, "a place") ||
                !int_in(place, 0, 0, self->noperands - 1, &operand) ||
                !int_in(place, 1, 0, self->operands[operand].rank - 1, &dim))
                return places >= MAX_OPERANDS * MAX_RANK ? (PyErr_SetString(PyExc_ValueError, "too many places"), -1)
                                                         : -1;
            self->extent_places[places][0] = operand;
            self->extent_places[places][1] = dim;
            places++;
        }
    }
    self->extent_start[self->nextents] = places;
    hold(&self->out_dtype, PyTuple_GET_ITEM(out, 0));
    if (PyTuple_GET_SIZE(out) == 4) {
        if (!int_in(out, 2, 1, MAX_RESULT_BUFFERS, &self->out_buffers)) return -1;
        hold(&self->make_result, PyTuple_GET_ITEM(out, 3));
        if (!PyCallable_Check(self->make_result)) {
            PyErr_SetString(PyExc_TypeError, "FastCall: make_result must be callable");
            return -1;
        }
    }
    PyObject *out_extents = PyTuple_GET_ITEM(out, 1);
    if (!tuple_of(out_extents, -1, "the output's extents") || PyTuple_GET_SIZE(out_extents) > MAX_RANK) return -1;
    self->out_rank = (int)PyTuple_GET_SIZE(out_extents);
    for (int d = 0; d < self->out_rank; d++)
        if (!int_in(out_extents, d, 0, self->nextents - 1, &self->out_extent[d])) return -1;
    self->function = address;  /* last: a half-built plan never calls anything */
    return 0;
}

static PyObject *FastCall_close(FastCall *self, PyObject *Py_UNUSED(ignored)) {
    self->function = NULL;
    Py_CLEAR(self->keep);
    Py_RETURN_NONE;
}

static PyObject *FastCall_open(FastCall *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(self->function != NULL);
}

static PyObject *FastCall_calls(FastCall *self, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLongLong(self->calls);
}

static int FastCall_traverse(FastCall *self, visitproc visit, void *arg) {
    Py_VISIT(self->keep);
    Py_VISIT(self->threads);
    Py_VISIT(self->empty);
    Py_VISIT(self->ndarray);
    Py_VISIT(self->tensor_type);
    Py_VISIT(self->out_dtype);
    Py_VISIT(self->make_result);
    for (int i = 0; i < MAX_OPERANDS; i++) {
        Py_VISIT(self->operands[i].name);
        Py_VISIT(self->operands[i].dtype);
        Py_VISIT(self->operands[i].format);
        Py_VISIT(self->operands[i].scipy_types);
        Py_VISIT(self->operands[i].index_dtype);
    }
    return 0;
}

static int FastCall_clear(FastCall *self) {
    self->function = NULL;
    Py_CLEAR(self->keep);
    Py_CLEAR(self->threads);
    Py_CLEAR(self->empty);
    Py_CLEAR(self->ndarray);
    Py_CLEAR(self->tensor_type);
    Py_CLEAR(self->out_dtype);
    Py_CLEAR(self->make_result);
    for (int i = 0; i < MAX_OPERANDS; i++) {
        Py_CLEAR(self->operands[i].name);
        Py_CLEAR(self->operands[i].dtype);
        Py_CLEAR(self->operands[i].format);
        Py_CLEAR(self->operands[i].scipy_types);
        Py_CLEAR(self->operands[i].index_dtype);
    }
    return 0;
}

static void FastCall_dealloc(FastCall *self) {
    PyObject_GC_UnTrack(self);
    FastCall_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef FastCall_methods[] = {
    {"call", (PyCFunction)(void (*)(void))FastCall_call, METH_FASTCALL,
     "call(operands, out): the result, or NotImplemented when the Python path must run the call"},
    {"close", (PyCFunction)FastCall_close, METH_NOARGS,
     "Stop calling the kernel (its library is being unloaded); every later call returns NotImplemented"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef FastCall_getset[] = {
    {"open", (getter)FastCall_open, NULL, "Whether the plan still calls its kernel", NULL},
    {"calls", (getter)FastCall_calls, NULL, "How many calls it ran", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject FastCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sparse_mlir_fast_call.FastCall",
    .tp_doc = "The checked C-level call of one shape-generic kernel specialization",
    .tp_basicsize = sizeof(FastCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FastCall_init,
    .tp_dealloc = (destructor)FastCall_dealloc,
    .tp_traverse = (traverseproc)FastCall_traverse,
    .tp_clear = (inquiry)FastCall_clear,
    .tp_methods = FastCall_methods,
    .tp_getset = FastCall_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "sparse_mlir_fast_call", "The C-level call path of shape-generic CPU kernels", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_sparse_mlir_fast_call(void) {
    if (PyType_Ready(&FastCallType) < 0) return NULL;
    k_shape = PyUnicode_InternFromString("_shape");
    k_sorted = PyUnicode_InternFromString("_has_sorted_indices");
    k_canonical = PyUnicode_InternFromString("_has_canonical_format");
    k_buffers[0] = PyUnicode_InternFromString("indptr");
    k_buffers[1] = PyUnicode_InternFromString("indices");
    k_buffers[2] = PyUnicode_InternFromString("data");
    if (!k_shape || !k_sorted || !k_canonical || !k_buffers[0] || !k_buffers[1] || !k_buffers[2]) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&FastCallType);
    if (PyModule_AddObject(m, "FastCall", (PyObject *)&FastCallType) < 0) {
        Py_DECREF(&FastCallType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "MAX_PARAMS", MAX_PARAMS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_OPERANDS", MAX_OPERANDS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_RANK", MAX_RANK) < 0 ||
        PyModule_AddIntConstant(m, "MAX_RESULT_BUFFERS", MAX_RESULT_BUFFERS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/* -- the call, at the entry point's exact arity ------------------------------------------------------------
 * T<n> is n int64_t parameter types, P<n> the first n elements of p. */
#define T1 int64_t
#define T2 T1, int64_t
#define T3 T2, int64_t
#define T4 T3, int64_t
#define T5 T4, int64_t
#define T6 T5, int64_t
#define T7 T6, int64_t
#define T8 T7, int64_t
#define T9 T8, int64_t
#define T10 T9, int64_t
#define T11 T10, int64_t
#define T12 T11, int64_t
#define T13 T12, int64_t
#define T14 T13, int64_t
#define T15 T14, int64_t
#define T16 T15, int64_t
#define T17 T16, int64_t
#define T18 T17, int64_t
#define T19 T18, int64_t
#define T20 T19, int64_t
#define T21 T20, int64_t
#define T22 T21, int64_t
#define T23 T22, int64_t
#define T24 T23, int64_t
#define T25 T24, int64_t
#define T26 T25, int64_t
#define T27 T26, int64_t
#define T28 T27, int64_t
#define T29 T28, int64_t
#define T30 T29, int64_t
#define T31 T30, int64_t
#define T32 T31, int64_t
#define T33 T32, int64_t
#define T34 T33, int64_t
#define T35 T34, int64_t
#define T36 T35, int64_t
#define T37 T36, int64_t
#define T38 T37, int64_t
#define T39 T38, int64_t
#define T40 T39, int64_t
#define T41 T40, int64_t
#define T42 T41, int64_t
#define T43 T42, int64_t
#define T44 T43, int64_t
#define T45 T44, int64_t
#define T46 T45, int64_t
#define T47 T46, int64_t
#define T48 T47, int64_t
#define P1 p[0]
#define P2 P1, p[1]
#define P3 P2, p[2]
#define P4 P3, p[3]
#define P5 P4, p[4]
#define P6 P5, p[5]
#define P7 P6, p[6]
#define P8 P7, p[7]
#define P9 P8, p[8]
#define P10 P9, p[9]
#define P11 P10, p[10]
#define P12 P11, p[11]
#define P13 P12, p[12]
#define P14 P13, p[13]
#define P15 P14, p[14]
#define P16 P15, p[15]
#define P17 P16, p[16]
#define P18 P17, p[17]
#define P19 P18, p[18]
#define P20 P19, p[19]
#define P21 P20, p[20]
#define P22 P21, p[21]
#define P23 P22, p[22]
#define P24 P23, p[23]
#define P25 P24, p[24]
#define P26 P25, p[25]
#define P27 P26, p[26]
#define P28 P27, p[27]
#define P29 P28, p[28]
#define P30 P29, p[29]
#define P31 P30, p[30]
#define P32 P31, p[31]
#define P33 P32, p[32]
#define P34 P33, p[33]
#define P35 P34, p[34]
#define P36 P35, p[35]
#define P37 P36, p[36]
#define P38 P37, p[37]
#define P39 P38, p[38]
#define P40 P39, p[39]
#define P41 P40, p[40]
#define P42 P41, p[41]
#define P43 P42, p[42]
#define P44 P43, p[43]
#define P45 P44, p[44]
#define P46 P45, p[45]
#define P47 P46, p[46]
#define P48 P47, p[47]
#define CALL(n) case n: return ((int32_t (*)(T##n))f)(P##n);

static int32_t call_entry(void *f, const int64_t *p, int n) {
    switch (n) {
    CALL(1) CALL(2) CALL(3) CALL(4) CALL(5) CALL(6)
    CALL(7) CALL(8) CALL(9) CALL(10) CALL(11) CALL(12)
    CALL(13) CALL(14) CALL(15) CALL(16) CALL(17) CALL(18)
    CALL(19) CALL(20) CALL(21) CALL(22) CALL(23) CALL(24)
    CALL(25) CALL(26) CALL(27) CALL(28) CALL(29) CALL(30)
    CALL(31) CALL(32) CALL(33) CALL(34) CALL(35) CALL(36)
    CALL(37) CALL(38) CALL(39) CALL(40) CALL(41) CALL(42)
    CALL(43) CALL(44) CALL(45) CALL(46) CALL(47) CALL(48)
    default: return -1;  /* never: push() caps n at MAX_PARAMS */
    }
}
