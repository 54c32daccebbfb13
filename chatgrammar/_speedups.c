/*
 * chatgrammar._speedups: the two per-token passes of the id fast path, in C.
 *
 * Optional. setup.py builds it when a C compiler and the Python headers are there; without it
 * chatgrammar.fastpath does the same work with struct + numpy (same results, ~2x slower for
 * Python-list input). CHATGRAMMAR_PURE=1 disables it at import time.
 *
 * pack_many(lists, total[, into]) -> bytearray
 *     Every int of every list, as native int64, back to back (total ints in all), in a new
 *     bytearray or written into `into` (a bytearray of at least 8 * total bytes). Only exact
 *     lists of exact ints are taken: anything else raises TypeError and the caller falls back
 *     to its general conversion, which gives the user-facing errors.
 *
 * mask_list(n, spans) -> list
 *     A list of n ints, 1 inside any span (start, end, ...) and 0 elsewhere: the mask a list
 *     caller gets back, built without a temporary per span.
 *
 * find_markers(arr, lo, lut) -> (positions: bytes, codes: bytes)
 *     arr and lut are C-contiguous int64 buffers. Position i is a marker when
 *     lo <= arr[i] < lo + len(lut) - 1 and lut[arr[i] - lo] != 0 (lut's last slot is a 0 kept
 *     for "above the range", as in the Python code). Returns the positions and their codes as
 *     native int64 bytes. Equivalent to the numpy `flatnonzero(arr >= lo)` / `lut.take` /
 *     `flatnonzero(codes)` sequence in FastMasker._lex.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The value of an int that fits one internal digit (every token id below 2**30), without a
 * call: 0 on success, -1 when the caller must use PyLong_AsLongLong. */
static inline int
compact_value(PyObject *v, int64_t *out)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)v)) {
        *out = (int64_t)PyUnstable_Long_CompactValue((PyLongObject *)v);
        return 0;
    }
    return -1;
#else
    Py_ssize_t size = Py_SIZE(v);
    if (size == 0) {
        *out = 0;
        return 0;
    }
    if (size == 1 || size == -1) {
        int64_t d = (int64_t)((PyLongObject *)v)->ob_digit[0];
        *out = size < 0 ? -d : d;
        return 0;
    }
    return -1;
#endif
}

static PyObject *
pack_many(PyObject *self, PyObject *args)
{
    PyObject *seq, *into = NULL;
    Py_ssize_t total;
    if (!PyArg_ParseTuple(args, "On|O:pack_many", &seq, &total, &into))
        return NULL;
    if (total < 0) {
        PyErr_SetString(PyExc_ValueError, "pack_many: negative total");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(seq, "pack_many: expected a sequence of lists");
    if (fast == NULL)
        return NULL;
    PyObject *out;
    if (into != NULL && into != Py_None) {
        /* a caller's reusable bytearray: no fresh pages to fault in for a long input */
        if (!PyByteArray_CheckExact(into)
            || PyByteArray_GET_SIZE(into) < total * (Py_ssize_t)sizeof(int64_t)) {
            PyErr_SetString(PyExc_ValueError, "pack_many: `into` must be a bytearray of at "
                                              "least 8 * total bytes");
            Py_DECREF(fast);
            return NULL;
        }
        out = into;
        Py_INCREF(out);
    } else {
        out = PyByteArray_FromStringAndSize(NULL, total * (Py_ssize_t)sizeof(int64_t));
    }
    if (out == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    int64_t *dst = (int64_t *)PyByteArray_AS_STRING(out);
    Py_ssize_t nlists = PySequence_Fast_GET_SIZE(fast);
    PyObject **lists = PySequence_Fast_ITEMS(fast);
    Py_ssize_t o = 0;
    for (Py_ssize_t k = 0; k < nlists; k++) {
        PyObject *lst = lists[k];
        if (!PyList_CheckExact(lst)) {
            PyErr_Format(PyExc_TypeError, "pack_many: item %zd is not a list", k);
            goto fail;
        }
        /* Nothing below runs Python code (exact ints only), so the list cannot change. */
        Py_ssize_t n = PyList_GET_SIZE(lst);
        if (n > total - o) {
            PyErr_SetString(PyExc_ValueError, "pack_many: more ints than total");
            goto fail;
        }
        PyObject **items = ((PyListObject *)lst)->ob_item;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *v = items[i];
            if (!PyLong_CheckExact(v)) {
                PyErr_Format(PyExc_TypeError, "pack_many: list %zd item %zd is not an int", k, i);
                goto fail;
            }
            int64_t x;
            if (compact_value(v, &x) < 0) {
                long long y = PyLong_AsLongLong(v);
                if (y == -1 && PyErr_Occurred())
                    goto fail;
                x = (int64_t)y;
            }
            dst[o + i] = x;
        }
        o += n;
    }
    if (o != total) {
        PyErr_SetString(PyExc_ValueError, "pack_many: fewer ints than total");
        goto fail;
    }
    Py_DECREF(fast);
    return out;
fail:
    Py_DECREF(fast);
    Py_DECREF(out);
    return NULL;
}

static int
get_int64_buffer(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->itemsize != 8 || !(strcmp(f, "q") == 0 || strcmp(f, "l") == 0)) {
        PyErr_Format(PyExc_TypeError, "find_markers: %s must be an int64 buffer", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *
find_markers(PyObject *self, PyObject *args)
{
    PyObject *arr_obj, *lut_obj;
    long long lo;
    if (!PyArg_ParseTuple(args, "OLO:find_markers", &arr_obj, &lo, &lut_obj))
        return NULL;
    Py_buffer av, lv;
    if (get_int64_buffer(arr_obj, &av, "arr") < 0)
        return NULL;
    if (get_int64_buffer(lut_obj, &lv, "lut") < 0) {
        PyBuffer_Release(&av);
        return NULL;
    }
    const int64_t *a = (const int64_t *)av.buf;
    const int64_t *lut = (const int64_t *)lv.buf;
    Py_ssize_t n = av.len / 8;
    /* ids in [lo, lo + span) can be markers; unsigned compare folds both bounds into one */
    uint64_t span = lv.len / 8 > 0 ? (uint64_t)(lv.len / 8 - 1) : 0;
    Py_ssize_t cap = 64, m = 0;
    int64_t *pos = PyMem_RawMalloc(cap * sizeof(int64_t));
    int64_t *code = PyMem_RawMalloc(cap * sizeof(int64_t));
    PyObject *res = NULL;
    if (pos == NULL || code == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t d = (uint64_t)a[i] - (uint64_t)lo;
        if (d < span && lut[d] != 0) {
            if (m == cap) {
                Py_ssize_t ncap = cap * 2;
                int64_t *p2 = PyMem_RawRealloc(pos, ncap * sizeof(int64_t));
                if (p2 == NULL) { m = -1; break; }
                pos = p2;
                int64_t *c2 = PyMem_RawRealloc(code, ncap * sizeof(int64_t));
                if (c2 == NULL) { m = -1; break; }
                code = c2;
                cap = ncap;
            }
            pos[m] = i;
            code[m] = lut[d];
            m++;
        }
    }
    Py_END_ALLOW_THREADS
    if (m < 0) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject *pb = PyBytes_FromStringAndSize((const char *)pos, m * sizeof(int64_t));
    PyObject *cb = pb ? PyBytes_FromStringAndSize((const char *)code, m * sizeof(int64_t)) : NULL;
    if (pb && cb)
        res = PyTuple_Pack(2, pb, cb);
    Py_XDECREF(pb);
    Py_XDECREF(cb);
done:
    PyMem_RawFree(pos);
    PyMem_RawFree(code);
    PyBuffer_Release(&av);
    PyBuffer_Release(&lv);
    return res;
}

static PyObject *
mask_list(PyObject *self, PyObject *args)
{
    Py_ssize_t n;
    PyObject *spans;
    if (!PyArg_ParseTuple(args, "nO:mask_list", &n, &spans))
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "mask_list: negative length");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(spans, "mask_list: expected a sequence of spans");
    if (fast == NULL)
        return NULL;
    PyObject *zero = PyLong_FromLong(0), *one = PyLong_FromLong(1);
    PyObject *out = PyList_New(n);
    if (out == NULL || zero == NULL || one == NULL)
        goto fail;
    PyObject **items = ((PyListObject *)out)->ob_item;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_INCREF(zero);
        items[i] = zero;
    }
    Py_ssize_t ns = PySequence_Fast_GET_SIZE(fast);
    PyObject **sp = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t k = 0; k < ns; k++) {
        Py_ssize_t a, b;
        PyObject *t = sp[k];
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 2) {
            PyErr_SetString(PyExc_TypeError, "mask_list: a span is not a tuple (start, end, ...)");
            goto fail;
        }
        a = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 0));
        if (a == -1 && PyErr_Occurred())
            goto fail;
        b = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 1));
        if (b == -1 && PyErr_Occurred())
            goto fail;
        if (a < 0 || b > n || a > b) {
            PyErr_Format(PyExc_ValueError, "mask_list: span (%zd, %zd) outside 0..%zd", a, b, n);
            goto fail;
        }
        for (Py_ssize_t i = a; i < b; i++) {
            if (items[i] != one) {
                Py_DECREF(items[i]);
                Py_INCREF(one);
                items[i] = one;
            }
        }
    }
    Py_DECREF(fast);
    Py_DECREF(zero);
    Py_DECREF(one);
    return out;
fail:
    Py_DECREF(fast);
    Py_XDECREF(zero);
    Py_XDECREF(one);
    Py_XDECREF(out);
    return NULL;
}

/* symbols(arr, starts, cand, codes, budget, budget1, has_values)
 *     -> (symb, meta, vals, off, B, bl)
 * FastMasker._lex after the marker pass, for formats without literal-ended headers or lstrip
 * markers (see the Python code for the meaning of each output; it is the reference). */
static PyObject *
symbols(PyObject *self, PyObject *args)
{
    PyObject *arr_o, *starts_o, *cand_o, *codes_o, *bud_o, *bud1_o;
    int has_values;
    if (!PyArg_ParseTuple(args, "OOOOOOp:symbols", &arr_o, &starts_o, &cand_o, &codes_o,
                          &bud_o, &bud1_o, &has_values))
        return NULL;
    Py_buffer av = {0}, cv = {0}, kv = {0}, bv = {0}, b1v = {0};
    PyObject *starts = NULL, *res = NULL;
    PyObject *symb = NULL, *meta = NULL, *vals = NULL, *off = NULL, *B = NULL, *bl = NULL;
    int64_t *P = NULL, *K = NULL, *mend = NULL;
    if (get_int64_buffer(arr_o, &av, "arr") < 0)
        return NULL;
    if (get_int64_buffer(cand_o, &cv, "cand") < 0 || get_int64_buffer(codes_o, &kv, "codes") < 0
        || get_int64_buffer(bud_o, &bv, "budget") < 0
        || get_int64_buffer(bud1_o, &b1v, "budget1") < 0)
        goto done;
    const int64_t *a = av.buf, *cand = cv.buf, *codes = kv.buf, *bud = bv.buf, *bud1 = b1v.buf;
    Py_ssize_t N = av.len / 8, M = cv.len / 8, nb = bv.len / 8;
    if (kv.len != cv.len || b1v.len != bv.len) {
        PyErr_SetString(PyExc_ValueError, "symbols: mismatched buffer lengths");
        goto done;
    }
    starts = PySequence_Fast(starts_o, "symbols: starts must be a sequence");
    if (starts == NULL)
        goto done;
    Py_ssize_t S = PySequence_Fast_GET_SIZE(starts) - 1;
    if (S < 1) {
        PyErr_SetString(PyExc_ValueError, "symbols: need at least one sample");
        goto done;
    }
    Py_ssize_t T = M + S;
    P = PyMem_Malloc((T + 1) * sizeof(int64_t));
    K = PyMem_Malloc((T + 1) * sizeof(int64_t));
    mend = PyMem_Malloc((T + 1) * sizeof(int64_t));
    bl = PyList_New(S + 1);
    if (P == NULL || K == NULL || mend == NULL || bl == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* merge: each sample's begin-of-input (code 0, zero width) before its markers */
    Py_ssize_t t = 0, c = 0, prev = 0;
    for (Py_ssize_t j = 0; j < S; j++) {
        Py_ssize_t s0 = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(starts, j));
        Py_ssize_t s1 = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(starts, j + 1));
        if ((s0 == -1 || s1 == -1) && PyErr_Occurred())
            goto done;
        if (s0 < prev || s1 < s0 || s1 > N || (j == 0 && s0 != 0)) {
            PyErr_SetString(PyExc_ValueError, "symbols: starts must rise from 0 to len(arr)");
            goto done;
        }
        prev = s0;
        PyList_SET_ITEM(bl, j, PyLong_FromSsize_t(t));
        P[t] = s0;
        K[t] = 0;
        mend[t] = s0;
        t++;
        while (c < M && cand[c] < s1) {
            if (cand[c] < s0 || codes[c] <= 0 || codes[c] >= nb) {
                PyErr_SetString(PyExc_ValueError, "symbols: bad marker position or code");
                goto done;
            }
            P[t] = cand[c];
            K[t] = codes[c];
            mend[t] = cand[c] + 1;
            t++;
            c++;
        }
        if (j == S - 1 && s1 != N) {
            PyErr_SetString(PyExc_ValueError, "symbols: starts must end at len(arr)");
            goto done;
        }
    }
    if (c != M) {
        PyErr_SetString(PyExc_ValueError, "symbols: a marker lies outside every sample");
        goto done;
    }
    PyList_SET_ITEM(bl, S, PyLong_FromSsize_t(T));
    P[T] = N;
    symb = PyBytes_FromStringAndSize(NULL, T * 2);
    meta = PyBytes_FromStringAndSize(NULL, T * 8);
    B = PyList_New(3 * T + 1);
    if (symb == NULL || meta == NULL || B == NULL)
        goto done;
    uint16_t *sy = (uint16_t *)PyBytes_AS_STRING(symb);
    int64_t *me = (int64_t *)PyBytes_AS_STRING(meta);
    Py_ssize_t total = 0;
    if (has_values) {
        off = PyList_New(T + 1);
        if (off == NULL)
            goto done;
        PyList_SET_ITEM(off, 0, PyLong_FromSsize_t(0));
    }
    for (t = 0; t < T; t++) {
        int64_t glen = P[t + 1] - mend[t];
        int64_t sym = K[t] * 4 + (glen > 0);
        sy[t] = (uint16_t)sym;
        if (has_values) {
            int64_t take = glen < bud[K[t]] ? glen : bud[K[t]];
            int64_t vlen = glen < bud1[K[t]] ? glen : bud1[K[t]];
            me[t] = sym * 65536 + vlen;
            total += take;
            PyList_SET_ITEM(off, t + 1, PyLong_FromSsize_t(total));
        } else {
            me[t] = sym;
        }
        PyList_SET_ITEM(B, 3 * t, PyLong_FromLongLong(P[t]));
        PyList_SET_ITEM(B, 3 * t + 1, PyLong_FromLongLong(mend[t]));
        PyList_SET_ITEM(B, 3 * t + 2, PyLong_FromLongLong(P[t + 1]));
    }
    PyList_SET_ITEM(B, 3 * T, PyLong_FromSsize_t(N));
    vals = PyBytes_FromStringAndSize(NULL, total * 8);
    if (vals == NULL)
        goto done;
    if (has_values) {
        int64_t *v = (int64_t *)PyBytes_AS_STRING(vals);
        for (t = 0; t < T; t++) {
            int64_t glen = P[t + 1] - mend[t];
            int64_t take = glen < bud[K[t]] ? glen : bud[K[t]];
            if (take > 0) {
                memcpy(v, a + mend[t], take * sizeof(int64_t));
                v += take;
            }
        }
    }
    if (PyErr_Occurred())  /* a PyLong allocation failed above */
        goto done;
    res = Py_BuildValue("(OOOOOO)", symb, meta, vals, has_values ? off : Py_None, B, bl);
done:
    Py_XDECREF(symb);
    Py_XDECREF(meta);
    Py_XDECREF(vals);
    Py_XDECREF(off);
    Py_XDECREF(B);
    Py_XDECREF(bl);
    Py_XDECREF(starts);
    PyMem_Free(P);
    PyMem_Free(K);
    PyMem_Free(mend);
    if (av.obj) PyBuffer_Release(&av);
    if (cv.obj) PyBuffer_Release(&cv);
    if (kv.obj) PyBuffer_Release(&kv);
    if (bv.obj) PyBuffer_Release(&bv);
    if (b1v.obj) PyBuffer_Release(&b1v);
    return res;
}

static PyMethodDef methods[] = {
    {"pack_many", pack_many, METH_VARARGS,
     "pack_many(lists, total[, into]) -> bytearray of native int64: the ints of every list."},
    {"find_markers", find_markers, METH_VARARGS,
     "find_markers(arr, lo, lut) -> (positions, codes) as native int64 bytes."},
    {"mask_list", mask_list, METH_VARARGS,
     "mask_list(n, spans) -> list of n ints: 1 inside any (start, end, ...) span, else 0."},
    {"symbols", symbols, METH_VARARGS,
     "symbols(arr, starts, cand, codes, budget, budget1, has_values) -> the symbol tables of "
     "FastMasker._lex (formats without literal-ended headers or lstrip markers)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "chatgrammar._speedups",
    "Optional C passes for chatgrammar.fastpath (see _speedups.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModule_Create(&module);
}
