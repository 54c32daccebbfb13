/*
 * chatgrammar.runtime._speedups: the C executor of the id fast path's plan.
 *
 * Optional. setup.py builds it when a C compiler and the Python headers are there; without it
 * chatgrammar.runtime.fastpath runs the same plan with struct + numpy and its Python walk (same
 * results, slower). CHATGRAMMAR_PURE=1 disables it at import time.
 *
 * run(...) executes one sample end to end (see its comment below): the plan's marker table,
 * run shapes and header budgets (FastMasker.plan), the automaton's memoised table and the item
 * memo, all objects the Python engine builds and fills; it never decides anything the Python
 * engine has not memoised, and hands such a sample back. The other functions are the passes
 * the Python engine itself uses.
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
 *     native int64 bytes. Equivalent to the numpy `(arr >= lo).nonzero()` / `lut.take` /
 *     `codes.nonzero()` sequence of lexers.IdPlan.find (the plan's one marker search).
 *
 * symbols(...) and run's find_symbols merge the markers into the symbol stream as the plan's
 * one stream builder does (lexers.IdPlan.stream, which the reference lexer and the numpy fast
 * path both are): same entries, same run shapes, same item-key words. They are executors of
 * that plan, not a rule set of their own: every rule that decodes they read from the plan's
 * memos, anything else they hand back, and FastMasker.verify_lex (CHATGRAMMAR_VERIFY=1,
 * tests/test_one_engine.py) checks their tables against the builder's.
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

/* symbols(), step 1: each sample's begin-of-input (code 0, zero width) merged before its
 * markers into P / K / mend; bl[j] = the index of sample j's first symbol. -1 on error. */
static int
merge_samples(PyObject *starts, Py_ssize_t S, Py_ssize_t N, const int64_t *cand,
              const int64_t *codes, Py_ssize_t M, Py_ssize_t nb, int64_t *P, int64_t *K,
              int64_t *mend, PyObject *bl)
{
    Py_ssize_t t = 0, c = 0, prev = 0;
    for (Py_ssize_t j = 0; j < S; j++) {
        Py_ssize_t s0 = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(starts, j));
        Py_ssize_t s1 = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(starts, j + 1));
        if ((s0 == -1 || s1 == -1) && PyErr_Occurred())
            return -1;
        if (s0 < prev || s1 < s0 || s1 > N || (j == 0 && s0 != 0)) {
            PyErr_SetString(PyExc_ValueError, "symbols: starts must rise from 0 to len(arr)");
            return -1;
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
                return -1;
            }
            P[t] = cand[c];
            K[t] = codes[c];
            mend[t] = cand[c] + 1;
            t++;
            c++;
        }
        if (j == S - 1 && s1 != N) {
            PyErr_SetString(PyExc_ValueError, "symbols: starts must end at len(arr)");
            return -1;
        }
    }
    if (c != M) {
        PyErr_SetString(PyExc_ValueError, "symbols: a marker lies outside every sample");
        return -1;
    }
    return 0;
}

/* symbols(arr, starts, cand, codes, budget, budget1, has_values)
 *     -> (symb, meta, vals, off, B, bl)
 * FastMasker._lex after the marker pass (IdPlan.stream, then FastMasker._tables), for formats
 * without literal-ended headers or lstrip markers (see the Python code for the meaning of
 * each output; it is the reference). */
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
    if (merge_samples(starts, S, N, cand, codes, M, nb, P, K, mend, bl) < 0)
        goto done;
    Py_ssize_t t;
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


/* ------------------------------------------------------------------------------------------
 * run(plan, ids, memo, last_only, out[, gen_ok])
 *     -> list | True | None | (keys) | (int, mask) | bytes
 *     One sample through the memoised engine (FastMasker._lex + _walk + _fast, in one pass):
 *     the same plan, the same automaton table and the same item keys as the Python code,
 *     which is the reference. `plan` is FastMasker.plan (see there); `memo` maps an item key
 *     (bytes, fastpath._item_key) to its packed trained spans under the caller's policy;
 *     `ids` is an exact list of ints (a list mask is returned) or a C-contiguous int64 buffer
 *     (`out`, a writable int64 buffer of the same length, gets the 1s: pass zeros). A tuple of
 *     (key, w0, w1, start): the items `memo` lacks, each with the window of ids around it,
 *     from the item before to the item after, and where the item starts (the caller may
 *     fill them from its memo, or learn them from that window, and call again). A pair (int, mask): the last turn, from that
 *     position to the end, may be a generation prompt, and mask (the list, or True) is the
 *     answer when it is not; the caller checks with the driver's rule (gen_ok=True skips
 *     the question). Bytes: the automaton's table lacks an entry the walk needs: the
 *     configuration it stopped in (native int64), then the symbols from there to the end
 *     (native uint16); the caller fills them (and the end of input) and calls again. None:
 *     the sample needs the Python engine (an unknown special id, a soft marker's piece, a
 *     syntax error, a header prefix not memoised yet, ...). Never raises for input reasons.
 *     `resume` (after gen_ok): the call retries the sample the previous call handed back
 *     (the same object, as long, with the same plan object; another thread's call in between
 *     resets it): its symbol tables are still in the scratch buffers, so
 *     pass 1 (reading every id) is skipped; any other call reads the sample afresh.
 */
typedef struct {
    int64_t *P, *mend, *K, *take, *off, *meta, *split, *bounds, *spans, *key;
    Py_ssize_t cap_t, cap_b, cap_s, cap_k;
    /* walk: where the automaton's table lacks an entry (symbol index, configuration) */
    Py_ssize_t need_t;
    int64_t need_sid;
    /* the sample whose symbol tables (pass 1) the buffers above hold, while run() has handed
     * it back to Python (a strong reference, dropped at the next call): a retry on the same
     * object (`resume`) skips pass 1, the only pass that reads every id */
    PyObject *held, *held_plan;  /* (and the plan they were read with) */
    Py_ssize_t held_n, held_T;
} scratch_t;

static scratch_t S_ = {0};

static int
grow(int64_t **p, Py_ssize_t *cap, Py_ssize_t need, int nbufs, int64_t ***more)
{
    /* grow one (nbufs == 1) or several same-capacity buffers to hold `need` int64s */
    if (need <= *cap)
        return 0;
    Py_ssize_t ncap = *cap ? *cap : 256;
    while (ncap < need)
        ncap *= 2;
    for (int k = 0; k < nbufs; k++) {
        int64_t **b = k == 0 ? p : more[k - 1];
        int64_t *q = PyMem_RawRealloc(*b, ncap * sizeof(int64_t));
        if (q == NULL)
            return -1;
        *b = q;
    }
    *cap = ncap;
    return 0;
}

static inline int
read_id(PyObject **items, const int64_t *arr, Py_ssize_t i, int64_t *x)
{
    if (arr != NULL) {
        *x = arr[i];
        return 0;
    }
    PyObject *v = items[i];
    if (!PyLong_CheckExact(v))
        return -1;
    return compact_value(v, x);
}

static inline int64_t
slot_pos(const scratch_t *s, int64_t k)
{
    int64_t q = k / 3, r = k % 3;
    return r == 0 ? s->P[q] : (r == 1 ? s->mend[q] : s->split[q]);
}

typedef struct {
    int64_t lo, span, nb, unk, soft_n;
    const int64_t *lut, *bud, *bud1;
    const unsigned char *soft;
    /* NULL, or [longest prompt, length each other id adds at least, (prompt mask, text
     * length) per code] */
    const int64_t *gen;
    int has_values;
    PyObject *table, *ends;
    /* literal-ended headers: per code its split budget (0: none), and the memo
     * bytes(code, ids of a header prefix) -> 1 (the literal ends there), 0 (not in it yet),
     * -1 (it ends inside the last id); lstrip: per code 1 when the marker absorbs a
     * whitespace-only run before it, and the memo bytes(ids of the run) -> bool */
    const int64_t *sbud, *lstrip;
    PyObject *split_memo, *space_memo;
} plan_t;

static int
parse_plan(PyObject *plan, plan_t *p)
{
    PyObject *lut, *bud, *bud1, *soft, *gen, *sbud, *lstrip;
    if (!PyTuple_Check(plan)) {
        PyErr_SetString(PyExc_TypeError, "run: plan must be a tuple");
        return -1;
    }
    /* The usual types read item by item (PyArg_ParseTuple's format parser is a good part of
     * a short sample's time: this runs on every call); anything else through it. */
    PyObject **it = &PyTuple_GET_ITEM(plan, 0);
    if (PyTuple_GET_SIZE(plan) == 14 && PyLong_CheckExact(it[0]) && PyBytes_Check(it[1])
        && PyBytes_Check(it[2]) && PyBytes_Check(it[3]) && PyBool_Check(it[4])
        && PyList_Check(it[6]) && PyList_Check(it[7]) && PyLong_CheckExact(it[8])) {
        lut = it[1]; bud = it[2]; bud1 = it[3]; gen = it[5]; soft = it[9]; sbud = it[10];
        lstrip = it[12];
        p->table = it[6]; p->ends = it[7]; p->split_memo = it[11]; p->space_memo = it[13];
        p->has_values = it[4] == Py_True;
        p->lo = PyLong_AsLongLong(it[0]);
        p->unk = PyLong_AsLongLong(it[8]);
        if (PyErr_Occurred())
            return -1;
    } else if (!PyArg_ParseTuple(plan, "LSSSpOO!O!LOOOOO:plan", &p->lo, &lut, &bud, &bud1,
                                 &p->has_values, &gen, &PyList_Type, &p->table,
                                 &PyList_Type, &p->ends, &p->unk, &soft, &sbud,
                                 &p->split_memo, &lstrip, &p->space_memo)) {
        return -1;
    }
    p->lut = (const int64_t *)PyBytes_AS_STRING(lut);
    p->span = PyBytes_GET_SIZE(lut) / 8 - 1;
    if (p->span < 0)
        p->span = 0;
    p->bud = (const int64_t *)PyBytes_AS_STRING(bud);
    p->bud1 = (const int64_t *)PyBytes_AS_STRING(bud1);
    p->nb = PyBytes_GET_SIZE(bud) / 8;
    if (PyBytes_GET_SIZE(bud1) / 8 != p->nb) {
        PyErr_SetString(PyExc_ValueError, "run: budget tables differ in length");
        return -1;
    }
    p->gen = NULL;
    if (PyBytes_Check(gen)) {
        if (PyBytes_GET_SIZE(gen) != (2 + 2 * p->nb) * 8) {
            PyErr_SetString(PyExc_ValueError, "run: bad generation-prompt table");
            return -1;
        }
        p->gen = (const int64_t *)PyBytes_AS_STRING(gen);
    }
    p->soft = NULL;
    p->soft_n = 0;
    if (PyBytes_Check(soft)) {
        p->soft = (const unsigned char *)PyBytes_AS_STRING(soft);
        p->soft_n = PyBytes_GET_SIZE(soft);
    }
    p->sbud = p->lstrip = NULL;
    if (PyBytes_Check(sbud) && PyDict_Check(p->split_memo)) {
        if (PyBytes_GET_SIZE(sbud) != p->nb * 8) {
            PyErr_SetString(PyExc_ValueError, "run: bad split budget table");
            return -1;
        }
        p->sbud = (const int64_t *)PyBytes_AS_STRING(sbud);
    }
    if (PyBytes_Check(lstrip) && PyDict_Check(p->space_memo)) {
        if (PyBytes_GET_SIZE(lstrip) != p->nb * 8) {
            PyErr_SetString(PyExc_ValueError, "run: bad lstrip table");
            return -1;
        }
        p->lstrip = (const int64_t *)PyBytes_AS_STRING(lstrip);
    }
    return 0;
}

/* memo[bytes([head,] ids[s:e])]: 1/0/-1 as stored (bool: 1/0), -2 when absent (Python
 * decides and fills it), -3 on an error. */
static int
memo_get(PyObject *memo, PyObject **items, const int64_t *arr, int64_t s, int64_t e,
         int has_head, int64_t head)
{
    int64_t buf[65];
    Py_ssize_t n = (Py_ssize_t)(e - s) + (has_head ? 1 : 0);
    if (e < s || n > 65)
        return -2;
    Py_ssize_t o = 0;
    if (has_head)
        buf[o++] = head;
    for (int64_t i = s; i < e; i++)
        if (read_id(items, arr, i, &buf[o++]) < 0)
            return -2;
    PyObject *key = PyBytes_FromStringAndSize((const char *)buf, n * sizeof(int64_t));
    if (key == NULL)
        return -3;
    PyObject *v = PyDict_GetItemWithError(memo, key);
    Py_DECREF(key);
    if (v == NULL)
        return PyErr_Occurred() ? -3 : -2;
    if (PyBool_Check(v))
        return v == Py_True;
    long x = PyLong_AsLong(v);
    if (x == -1 && PyErr_Occurred())
        return -3;
    return (int)x;
}

/* Pass 1: the markers (code != 0) of the sample; 1 on a reason to leave it to Python. */
static int
find_symbols(const plan_t *p, PyObject **items, const int64_t *arr, Py_ssize_t n,
             Py_ssize_t *T_out)
{
    scratch_t *s = &S_;
    int64_t **more[6] = {&s->mend, &s->K, &s->take, &s->off, &s->meta, &s->split};
    Py_ssize_t T = 1;
    if (grow(&s->P, &s->cap_t, 64, 7, more) < 0)
        return -1;
    s->P[0] = 0; s->K[0] = 0; s->mend[0] = 0;
    uint64_t span = (uint64_t)p->span;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t x;
        if (read_id(items, arr, i, &x) < 0)
            return 1;  /* not an exact small int: the general conversion judges it */
        if (p->soft != NULL && x >= 0 && x < p->soft_n && p->soft[x])
            return 1;  /* may spell part of a soft marker: the decode fallback decides */
        uint64_t d = (uint64_t)x - (uint64_t)p->lo;
        if (d < span && p->lut[d] != 0) {
            int64_t code = p->lut[d];
            if (code == p->unk || code >= p->nb)
                return 1;  /* a special id the format does not know */
            if (T + 2 > s->cap_t && grow(&s->P, &s->cap_t, T + 2, 7, more) < 0)
                return -1;
            s->P[T] = i; s->K[T] = code; s->mend[T] = i + 1;
            T++;
        }
    }
    s->P[T] = n;
    if (p->lstrip != NULL) {
        /* IdPlan.stream's lstrip rule (IdPlan.blank, from its memo): such a marker starts
         * at the start of a whitespace-only run (at most 16 ids) right before it; the run is
         * gone. (The builder splits headers first; the two orders agree wherever no lstrip
         * marker follows a literal-ended header, which both hand back.) */
        for (Py_ssize_t t = 1; t < T; t++) {
            int64_t s0 = s->mend[t - 1], e0 = s->P[t];
            if (!p->lstrip[s->K[t]] || e0 - s0 <= 0 || e0 - s0 > 16)
                continue;
            if (p->sbud != NULL && p->sbud[s->K[t - 1]] > 0)
                return 1;  /* after a literal-ended header: the Python engine */
            int r = memo_get(p->space_memo, items, arr, s0, e0, 0, 0);
            if (r == -3)
                return -1;
            if (r < 0)
                return 1;  /* not decoded yet: Python decides (and memoises it) */
            if (r)
                s->P[t] = s0;
        }
    }
    s->off[0] = 0;
    for (Py_ssize_t t = 0; t < T; t++) {
        int64_t glen = s->P[t + 1] - s->mend[t], k = s->K[t];
        int64_t sym = k * 4 + (glen > 0);
        s->split[t] = s->P[t + 1];
        if (p->sbud != NULL && p->sbud[k] > 0 && glen > 0) {
            /* IdPlan.stream's literal-ended header (IdPlan.split_prefix, from its memo):
             * the header ends with the first id whose prefix decodes to the literal */
            int64_t a = s->mend[t], e = s->P[t + 1], lim = a + p->sbud[k], h = -1;
            if (lim > e)
                lim = e;
            for (int64_t q = a + 1; q <= lim && h < 0; q++) {
                int r = memo_get(p->split_memo, items, arr, a, q, 1, k);
                if (r == -3)
                    return -1;
                if (r == -2 || r == -1)
                    return 1;  /* not memoised, or a straddle: the Python engine */
                if (r == 1)
                    h = q;
            }
            if (h < 0)
                return 1;  /* no literal within the budget: the Python engine */
            s->split[t] = h;
            sym = k * 4 + (h < e ? 3 : 2);  /* HEAD_RUN or HEAD */
            s->meta[t] = sym * 65536 + (h - a);
            s->take[t] = h - a;
            s->off[t + 1] = s->off[t] + (h - a);
            continue;
        }
        if (p->has_values) {
            int64_t take = glen < p->bud[k] ? glen : p->bud[k];
            int64_t vlen = glen < p->bud1[k] ? glen : p->bud1[k];
            s->meta[t] = sym * 65536 + vlen;
            s->take[t] = take;
            s->off[t + 1] = s->off[t] + take;
        } else {
            s->meta[t] = sym;
            s->take[t] = 0;
            s->off[t + 1] = s->off[t];
        }
    }
    *T_out = T;
    return 0;
}

/* Pass 2: the symbols through the automaton's memoised table: item bounds (slots) and the
 * configuration a cut input ends in (-1: none). 1 when Python must decide; 3 when the table
 * lacks an entry (s->need_t, s->need_sid: the caller hands Python the symbols from there). */
static int
walk(const plan_t *p, Py_ssize_t T, Py_ssize_t *nb_out, int64_t *tail_out)
{
    scratch_t *s = &S_;
    Py_ssize_t nb = 0, sid = 0, nrows = PyList_GET_SIZE(p->table);
    if (grow(&s->bounds, &s->cap_b, 3 * T + 2, 1, NULL) < 0)
        return -1;
    for (Py_ssize_t t = 0; t < T; t++) {
        if (sid >= nrows)
            return 1;
        PyObject *row = PyList_GET_ITEM(p->table, sid);
        int64_t sym = (s->meta[t] >> (p->has_values ? 16 : 0));
        if (!PyList_Check(row) || sym >= PyList_GET_SIZE(row))
            return 1;
        PyObject *v = PyList_GET_ITEM(row, sym);
        int64_t x;
        if (v == Py_None) {
            s->need_t = t;  /* not filled yet: Python fills the rest of the walk */
            s->need_sid = sid;
            return 3;
        }
        if (!PyLong_CheckExact(v) || compact_value(v, &x) < 0 || x < 0)
            return 1;  /* a syntax error: the Python engine reports or recovers */
        for (int b = 0; b < 3; b++)
            if (x & (1 << b))
                s->bounds[nb++] = 3 * t + b;
        sid = x >> 3;
    }
    if (sid >= PyList_GET_SIZE(p->ends))
        return 1;
    PyObject *e = PyList_GET_ITEM(p->ends, sid);
    *tail_out = -1;
    if (e == Py_None) {
        s->need_t = T;  /* the end of input from this configuration: not computed yet */
        s->need_sid = sid;
        return 3;
    }
    if (e == Py_True) {
        s->bounds[nb++] = 3 * T;
    } else if (e != Py_False) {
        int64_t x;
        if (!PyLong_CheckExact(e) || compact_value(e, &x) < 0 || x != -1)
            return 1;
        if (nb && s->bounds[nb - 1] >= 3 * T)
            return 1;
        s->bounds[nb++] = 3 * T;
        *tail_out = sid;
    }
    *nb_out = nb;
    return 0;
}

/* The memo key of item [a, b) (fastpath._item_key): a new bytes object, NULL on error, or
 * Py_None (borrowed) when an id cannot be read. */
static PyObject *
item_key(PyObject **items, const int64_t *arr, int64_t a, int64_t b, int64_t tail)
{
    scratch_t *s = &S_;
    int64_t ia = a / 3, ib = (b - 1) / 3 + 1;
    Py_ssize_t len = 3 + (ib - ia) + (s->off[ib] - s->off[ia]);
    if (grow(&s->key, &s->cap_k, len, 1, NULL) < 0) {
        PyErr_NoMemory();
        return NULL;
    }
    int64_t *k = s->key;
    k[0] = a - 3 * ia; k[1] = b - a; k[2] = tail;
    memcpy(k + 3, s->meta + ia, (ib - ia) * sizeof(int64_t));
    Py_ssize_t o = 3 + (ib - ia);
    for (int64_t t = ia; t < ib; t++)
        for (int64_t i = 0; i < s->take[t]; i++)
            if (read_id(items, arr, s->mend[t] + i, &k[o++]) < 0)
                return Py_None;
    return PyBytes_FromStringAndSize((const char *)k, len * sizeof(int64_t));
}

/* Pass 3: each item's memoised spans (sample positions). 1 when Python must decide. */
static int
item_spans(const plan_t *p, PyObject *memo, PyObject **items, const int64_t *arr,
           Py_ssize_t n, Py_ssize_t T, Py_ssize_t nb, int64_t tail, int last_only, int gen_ok,
           Py_ssize_t *ns_out, PyObject **missing, int64_t *gen_at)
{
    scratch_t *s = &S_;
    /* last_only keeps keep_lo..keep: the last chosen turn with the reasoning turns right
     * before it (written ~t in the record: runtime.policy.last_run) */
    int64_t a = 0, prev = 0, nturn = 0, last_start = -1, keep = -1, keep_lo = -1;
    int keep_think = 0;
    Py_ssize_t ns = 0;
    int64_t end = nb ? s->bounds[nb - 1] : -1;
    for (Py_ssize_t q = 0; q < nb; q++) {
        int64_t b = s->bounds[q];
        if (b <= a)
            continue;
        PyObject *key = item_key(items, arr, a, b, b == end ? tail : -1);
        if (key == NULL)
            return -1;
        if (key == Py_None)
            return 1;
        PyObject *rec = PyDict_GetItemWithError(memo, key);
        if (rec == NULL) {
            /* not memoised under this policy yet: collect every such key with the window
             * around its item (from the item before to the item after), go on without it */
            Py_ssize_t q2 = q + 1;
            while (q2 < nb && s->bounds[q2] <= b)
                q2++;
            PyObject *entry = PyErr_Occurred() ? NULL : Py_BuildValue(
                "(OLLL)", key, (long long)slot_pos(s, prev),
                (long long)(q2 < nb ? slot_pos(s, s->bounds[q2]) : n),
                (long long)slot_pos(s, a));
            Py_DECREF(key);
            if (entry == NULL || (*missing == NULL && (*missing = PyList_New(0)) == NULL)
                || PyList_Append(*missing, entry) < 0) {
                Py_XDECREF(entry);
                return -1;
            }
            Py_DECREF(entry);
            prev = a;
            a = b;
            continue;
        }
        Py_DECREF(key);
        if (!PyBytes_Check(rec) || PyBytes_GET_SIZE(rec) < 32)
            return 1;
        /* [nturns, last turn's start slot, nspans, nchosen, (ra, da, rb, db, t)..., chosen...] */
        const int64_t *r = (const int64_t *)PyBytes_AS_STRING(rec);
        int64_t nt = r[0], nsp = r[2], nch = r[3];
        if (PyBytes_GET_SIZE(rec) != (Py_ssize_t)((4 + 5 * nsp + nch) * 8))
            return 1;
        if (grow(&s->spans, &s->cap_s, 3 * (ns + nsp) + 3, 1, NULL) < 0)
            return -1;
        for (int64_t k = 0; k < nsp; k++) {
            const int64_t *sp = r + 4 + 5 * k;
            s->spans[3 * ns] = slot_pos(s, a + sp[0]) + sp[1];
            s->spans[3 * ns + 1] = slot_pos(s, a + sp[2]) + sp[3];
            s->spans[3 * ns + 2] = nturn + sp[4];
            ns++;
        }
        if (nt > 0)
            last_start = slot_pos(s, a + r[1]);
        for (int64_t c = 0; c < nch; c++) {
            int64_t v = r[4 + 5 * nsp + c];
            int64_t t = nturn + (v < 0 ? ~v : v);
            if (keep < 0 || t != keep + 1 || !keep_think)
                keep_lo = t;
            keep = t;
            keep_think = v < 0;
        }
        nturn += nt;
        prev = a;
        a = b;
    }
    if (*missing != NULL)
        return 2;
    if (p->gen && !gen_ok && last_start >= 0 && n - last_start <= 64 && *gen_at == -1) {
        /* The driver joins the tail's tokens (markers by their text) and compares it with
         * each generation prompt: a marker whose text is in no prompt, or a tail longer
         * than any prompt (its markers' texts and what each other id adds at least), rule
         * that out here; else the driver's rule decides. */
        uint64_t m = ~(uint64_t)0;
        int64_t len = 0, nmark = 0;
        for (Py_ssize_t t = 1; t < T; t++)
            if (s->P[t] >= last_start) {
                m &= (uint64_t)p->gen[2 + 2 * s->K[t]];
                len += p->gen[3 + 2 * s->K[t]];
                nmark++;
            }
        len += (n - last_start - nmark) * p->gen[1];
        if (m != 0 && len <= p->gen[0])
            *gen_at = last_start;  /* the mask as if it is none, and the caller checks */
    }
    if (last_only) {
        Py_ssize_t w = 0;
        for (Py_ssize_t k = 0; k < ns; k++)
            if (s->spans[3 * k + 2] >= keep_lo && s->spans[3 * k + 2] <= keep) {
                s->spans[3 * w] = s->spans[3 * k];
                s->spans[3 * w + 1] = s->spans[3 * k + 1];
                w++;
            }
        ns = w;
    }
    for (Py_ssize_t k = 0; k < ns; k++)
        if (s->spans[3 * k] < 0 || s->spans[3 * k + 1] > n || s->spans[3 * k] > s->spans[3 * k + 1])
            return 1;
    *ns_out = ns;
    return 0;
}

static PyObject *
list_mask(Py_ssize_t n, Py_ssize_t ns)
{
    scratch_t *s = &S_;
    PyObject *zero = PyLong_FromLong(0), *one = PyLong_FromLong(1);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_XDECREF(zero);
        Py_XDECREF(one);
        return NULL;
    }
    PyObject **it = ((PyListObject *)out)->ob_item;
    Py_ssize_t ones = 0;
    /* Spans in order and disjoint (what item_spans gives, item after item): each slot is
     * written once, in one forward pass. A list of a million slots is 8 MB, past the cache:
     * writing it all with zeros and then the spans again cost ~1.5 ns per token more on a
     * 1M-token sequence than on a sample whose list stays in cache. */
    int sorted = 1;
    for (Py_ssize_t k = 1; k < ns && sorted; k++)
        if (s->spans[3 * k] < s->spans[3 * k - 2])
            sorted = 0;
    if (sorted) {
        Py_ssize_t i = 0;
        for (Py_ssize_t k = 0; k < ns; k++) {
            Py_ssize_t a = s->spans[3 * k], b = s->spans[3 * k + 1];
            for (; i < a; i++)
                it[i] = zero;
            if (b > i) {
                ones += b - i;
                for (; i < b; i++)
                    it[i] = one;
            }
        }
        for (; i < n; i++)
            it[i] = zero;
    } else {
        for (Py_ssize_t i = 0; i < n; i++)
            it[i] = zero;
        for (Py_ssize_t k = 0; k < ns; k++)
            for (int64_t i = s->spans[3 * k]; i < s->spans[3 * k + 1]; i++)
                if (it[i] != one) {
                    it[i] = one;
                    ones++;
                }
    }
    /* one reference per slot, added at once (the small ints are shared) */
#if PY_VERSION_HEX >= 0x030C0000
    for (Py_ssize_t i = 0; i < n; i++)
        Py_INCREF(it[i]);
    Py_DECREF(zero);
    Py_DECREF(one);
#else
    Py_SET_REFCNT(zero, Py_REFCNT(zero) + (n - ones) - 1);
    Py_SET_REFCNT(one, Py_REFCNT(one) + ones - 1);
#endif
    return out;
}

/* What walk() could not do: bytes of the configuration it stopped in (native int64) and the
 * symbols from there to the end (native uint16); none when only the end of input is lacking. */
static PyObject *
walk_rest(const plan_t *p, Py_ssize_t T)
{
    scratch_t *s = &S_;
    Py_ssize_t m = T - s->need_t;
    PyObject *b = PyBytes_FromStringAndSize(NULL, 8 + 2 * m);
    if (b == NULL)
        return NULL;
    char *q = PyBytes_AS_STRING(b);
    memcpy(q, &s->need_sid, 8);
    uint16_t *sy = (uint16_t *)(q + 8);
    for (Py_ssize_t t = 0; t < m; t++)
        sy[t] = (uint16_t)(s->meta[s->need_t + t] >> (p->has_values ? 16 : 0));
    return b;
}

static PyObject *
run(PyObject *self, PyObject *args)
{
    PyObject *plan_o, *ids, *memo, *out_o, *missing = NULL;
    int last_only, gen_ok = 0, resume = 0, keep = 0;
    int64_t gen_at = -1;
    if (!PyArg_ParseTuple(args, "OOO!pO|pp:run", &plan_o, &ids, &PyDict_Type, &memo,
                          &last_only, &out_o, &gen_ok, &resume))
        return NULL;
    plan_t p;
    if (parse_plan(plan_o, &p) < 0)
        return NULL;
    Py_buffer av = {0}, ov = {0};
    PyObject **items = NULL;
    const int64_t *arr = NULL;
    Py_ssize_t n;
    PyObject *res = NULL;
    int is_list = PyList_CheckExact(ids);
    if (is_list) {
        items = ((PyListObject *)ids)->ob_item;  /* (NULL for an empty list) */
        n = PyList_GET_SIZE(ids);
    } else {
        if (get_int64_buffer(ids, &av, "ids") < 0)
            return NULL;
        if (out_o == Py_None || get_int64_buffer(out_o, &ov, "out") < 0 || ov.readonly
            || ov.len != av.len) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "run: `out` must be a writable int64 buffer "
                                              "as long as `ids`");
            goto done;
        }
        arr = (const int64_t *)av.buf;
        n = av.len / 8;
    }
    /* Nothing below runs Python code (exact ints, bytes keys, dict lookups of bytes): the
     * list cannot change under us. */
    Py_ssize_t T, nb, ns;
    int64_t tail;
    int r = 0;
    if (resume && S_.held == ids && S_.held_plan == plan_o && S_.held_n == n) {
        T = S_.held_T;  /* the same sample again, handed back a moment ago: pass 1 is done */
    } else {
        Py_CLEAR(S_.held);
        Py_CLEAR(S_.held_plan);
        r = find_symbols(&p, items, arr, n, &T);
    }
    if (r == 0)
        r = walk(&p, T, &nb, &tail);
    if (r == 3) {
        res = walk_rest(&p, T);
        goto hold;
    }
    if (r == 0)
        r = item_spans(&p, memo, items, arr, n, T, nb, tail, last_only, gen_ok, &ns, &missing,
                       &gen_at);
    if (r < 0) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto done;
    }
    if (r == 2) {
        res = PyList_AsTuple(missing);
        goto hold;
    }
    if (r > 0) {
        res = Py_None;
        Py_INCREF(res);
        goto done;
    }
    if (is_list) {
        res = list_mask(n, ns);
    } else {
        int64_t *o = (int64_t *)ov.buf;
        for (Py_ssize_t k = 0; k < ns; k++)
            for (int64_t i = S_.spans[3 * k]; i < S_.spans[3 * k + 1]; i++)
                o[i] = 1;
        res = Py_True;
        Py_INCREF(res);
    }
    if (res != NULL && gen_at >= 0) {
        /* (the mask computed as if the last turn were no generation prompt, and where that
         * turn starts: the caller applies the driver's rule to it) */
        PyObject *t = Py_BuildValue("(LN)", (long long)gen_at, res);
        res = t;
    }
    goto done;
hold:
    /* handed back for Python to fill the memo or the automaton: keep pass 1 for the retry */
    if (res != NULL) {
        if (S_.held != ids) {
            Py_CLEAR(S_.held);
            Py_INCREF(ids);
            S_.held = ids;
        }
        if (S_.held_plan != plan_o) {
            Py_CLEAR(S_.held_plan);
            Py_INCREF(plan_o);
            S_.held_plan = plan_o;
        }
        S_.held_n = n;
        S_.held_T = T;
        keep = 1;
    }
done:
    if (!keep) {  /* an answer, an error or the Python engine's: nothing to resume */
        Py_CLEAR(S_.held);
        Py_CLEAR(S_.held_plan);
    }
    Py_XDECREF(missing);
    if (av.obj) PyBuffer_Release(&av);
    if (ov.obj) PyBuffer_Release(&ov);
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
    {"run", run, METH_VARARGS,
     "run(plan, ids, memo, last_only, out) -> list | True | None: one sample through the "
     "memoised engine (None: the Python engine must take it)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "chatgrammar.runtime._speedups",
    "Optional C passes for chatgrammar.runtime.fastpath (see _speedups.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModule_Create(&module);
}
