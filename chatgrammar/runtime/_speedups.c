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
 * run's pass 1 (find_symbols) is the plan's one merge, as the plan writes it: the steps of
 * lexers.IdPlan.stream (begins, classes, split, lstrip), then the key tables of
 * FastMasker._tables, one C function each, in the same order, over the same arrays (the
 * plan's marker table, gclass, budget, lstrip_code, LSTRIP_MAX) and reading the plan's
 * memos for the two rules that decode (split_c, space_memo); anything else (a prefix or a
 * run not decoded yet, a straddle, no literal within the budget, a soft marker's piece, an
 * unknown special id) it hands back, as the numpy executor does. There is no other merge in
 * C. lex(plan, ids) returns its tables, which FastMasker.verify_lex checks against the
 * builder's (CHATGRAMMAR_VERIFY=1, tests/test_one_engine.py).
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
    int64_t *P, *mend, *K, *cls, *take, *off, *meta, *split, *bounds, *spans, *key;
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

/* The plan as FastMasker._c_plan hands it over: the lexing plan's own arrays (lexers.IdPlan:
 * the marker table restricted to the marker ids' range, gclass, budget, lstrip_code,
 * LSTRIP_MAX; the memos of its two decoding rules, split_c and space_memo), the automaton's
 * table and end flags, the generation prompts' table and value_free. Every lexing decision of
 * find_symbols is read from these: no rule is written here. */
typedef struct {
    int64_t lo, span, nb, unk, soft_n, lstrip_max;
    const int64_t *lut, *gclass, *budget;
    const unsigned char *soft;
    /* NULL, or [longest prompt, length each other id adds at least, (prompt mask, text
     * length) per code] */
    const int64_t *gen;
    int has_values;
    PyObject *table, *ends;
    /* lstrip: NULL, or per code 1 when the marker absorbs a whitespace-only run before it.
     * split_memo (IdPlan.split_c): bytes(code, ids of a header prefix) -> 1 (the literal ends
     * there), 0 (not in it yet), -1 (it ends inside the last id); space_memo
     * (IdPlan.space_memo): bytes(ids of a run) -> bool (IdPlan.blank) */
    const int64_t *lstrip;
    PyObject *split_memo, *space_memo;
    /* vfree (IdPlan.value_free): NULL, or per code 1 when nothing reads its header's text
     * (the key holds the header's length class, not its ids) */
    const int64_t *vfree;
} plan_t;

/* the gap classes of lexers.py (IdPlan.gclass) */
enum { G_BODY = 0, G_DECODE = 1, G_SPLIT = 2 };

static int
parse_plan(PyObject *plan, plan_t *p)
{
    PyObject *lut, *gcl, *bud, *lstrip, *soft, *gen, *vfree;
    if (!PyTuple_Check(plan)) {
        PyErr_SetString(PyExc_TypeError, "run: plan must be a tuple");
        return -1;
    }
    /* The usual types read item by item (PyArg_ParseTuple's format parser is a good part of
     * a short sample's time: this runs on every call); anything else through it. Layout:
     * (lo, lutr, gclass, budget, lstrip, lstrip_max, unk, soft, split_c, space_memo,
     *  has_values, gen, table, ends, vfree) */
    PyObject **it = &PyTuple_GET_ITEM(plan, 0);
    if (PyTuple_GET_SIZE(plan) == 15 && PyLong_CheckExact(it[0]) && PyBytes_Check(it[1])
        && PyBytes_Check(it[2]) && PyBytes_Check(it[3]) && PyLong_CheckExact(it[5])
        && PyLong_CheckExact(it[6]) && PyBool_Check(it[10]) && PyList_Check(it[12])
        && PyList_Check(it[13])) {
        lut = it[1]; gcl = it[2]; bud = it[3]; lstrip = it[4]; soft = it[7]; gen = it[11];
        p->split_memo = it[8]; p->space_memo = it[9];
        p->has_values = it[10] == Py_True;
        p->table = it[12]; p->ends = it[13]; vfree = it[14];
        p->lo = PyLong_AsLongLong(it[0]);
        p->lstrip_max = PyLong_AsLongLong(it[5]);
        p->unk = PyLong_AsLongLong(it[6]);
        if (PyErr_Occurred())
            return -1;
    } else if (!PyArg_ParseTuple(plan, "LSSSOLLOOOpOO!O!O:plan", &p->lo, &lut, &gcl, &bud,
                                 &lstrip, &p->lstrip_max, &p->unk, &soft, &p->split_memo,
                                 &p->space_memo, &p->has_values, &gen, &PyList_Type,
                                 &p->table, &PyList_Type, &p->ends, &vfree)) {
        return -1;
    }
    p->lut = (const int64_t *)PyBytes_AS_STRING(lut);
    p->span = PyBytes_GET_SIZE(lut) / 8 - 1;
    if (p->span < 0)
        p->span = 0;
    p->gclass = (const int64_t *)PyBytes_AS_STRING(gcl);
    p->budget = (const int64_t *)PyBytes_AS_STRING(bud);
    p->nb = PyBytes_GET_SIZE(gcl) / 8;
    if (PyBytes_GET_SIZE(bud) / 8 != p->nb) {
        PyErr_SetString(PyExc_ValueError, "run: gclass and budget differ in length");
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
    p->vfree = NULL;
    if (PyBytes_Check(vfree)) {
        if (PyBytes_GET_SIZE(vfree) != p->nb * 8) {
            PyErr_SetString(PyExc_ValueError, "run: bad value_free table");
            return -1;
        }
        p->vfree = (const int64_t *)PyBytes_AS_STRING(vfree);
    }
    p->lstrip = NULL;
    if (PyBytes_Check(lstrip)) {
        if (PyBytes_GET_SIZE(lstrip) != p->nb * 8 || !PyDict_Check(p->space_memo)) {
            PyErr_SetString(PyExc_ValueError, "run: bad lstrip table");
            return -1;
        }
        p->lstrip = (const int64_t *)PyBytes_AS_STRING(lstrip);
    }
    if (!PyDict_Check(p->split_memo))
        p->split_memo = NULL;  /* (no literal-ended header: nothing reads it) */
    for (Py_ssize_t k = 0; k < p->nb; k++)
        if (p->gclass[k] < G_BODY || p->gclass[k] > G_SPLIT
            || (p->gclass[k] == G_SPLIT && p->split_memo == NULL) || p->budget[k] < 0) {
            PyErr_SetString(PyExc_ValueError, "run: bad gap class or budget table");
            return -1;
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

/* ---- Pass 1: the plan's steps, as lexers.IdPlan.stream runs them (then FastMasker._tables),
 * one function each, in the same order, over the same arrays (the scratch buffers: P, K,
 * mend, cls, split = Stream.hend; take, off, meta = the key tables). Each returns 0, 1 (a
 * reason to hand the sample back: the Python engine decides) or -1 (an error). */

/* Steps 0 and 1: the marker search (IdPlan.find over the restricted table) and the sample's
 * begin entry (code 0, zero width) before its markers (lexers._merge_begins). The executor's
 * hand-backs are the fast path's: an id that is not an exact small int, an id of the plan's
 * soft_lut, an unknown special id (unk: FastMasker._lex). */
static int
step_begins(const plan_t *p, PyObject **items, const int64_t *arr, Py_ssize_t n,
            Py_ssize_t *T_out)
{
    scratch_t *s = &S_;
    int64_t **more[7] = {&s->mend, &s->K, &s->cls, &s->take, &s->off, &s->meta, &s->split};
    Py_ssize_t T = 1;
    if (grow(&s->P, &s->cap_t, 64, 8, more) < 0)
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
            if (T + 2 > s->cap_t && grow(&s->P, &s->cap_t, T + 2, 8, more) < 0)
                return -1;
            s->P[T] = i; s->K[T] = code; s->mend[T] = i + 1;
            T++;
        }
    }
    s->P[T] = n;
    *T_out = T;
    return 0;
}

/* Step 2: each run's gap class, gclass[K] (Stream.cls); every run ends where the next entry
 * starts (Stream.hend before the split). */
static void
step_classes(const plan_t *p, Py_ssize_t T)
{
    scratch_t *s = &S_;
    for (Py_ssize_t t = 0; t < T; t++) {
        s->cls[t] = p->gclass[s->K[t]];
        s->split[t] = s->P[t + 1];
    }
}

/* Step 3: literal-ended headers (IdPlan._split_runs): a SPLIT run's header ends with the
 * first id within budget[K] whose prefix holds the literal (IdPlan.split_prefix, read from
 * its memo split_c). As the builder for an executor, exact ends only: a straddle, no literal
 * within the budget or a prefix not memoised yet is handed back. */
static int
step_split(const plan_t *p, PyObject **items, const int64_t *arr, Py_ssize_t T)
{
    scratch_t *s = &S_;
    for (Py_ssize_t t = 0; t < T; t++) {
        int64_t a = s->mend[t], e = s->P[t + 1], k = s->K[t], h = -1;
        if (s->cls[t] != G_SPLIT || e <= a)
            continue;
        int64_t lim = a + p->budget[k] < e ? a + p->budget[k] : e;
        for (int64_t q = a + 1; q <= lim && h < 0; q++) {
            int r = memo_get(p->split_memo, items, arr, a, q, 1, k);
            if (r == -3)
                return -1;
            if (r == -2 || r == -1)
                return 1;  /* not memoised, or a straddle */
            if (r == 1)
                h = q;
        }
        if (h < 0)
            return 1;  /* no literal within the budget */
        s->split[t] = h;
    }
    return 0;
}

/* Step 4: lstrip (IdPlan._lstrip), after the split: a marker of lstrip_code starts at the
 * start of a whitespace-only run right before it (the text after a literal-ended header, or
 * the whole run after any other marker) of at most lstrip_max ids (IdPlan.blank, read from
 * its memo space_memo; not memoised yet: handed back); the run is gone. */
static int
step_lstrip(const plan_t *p, PyObject **items, const int64_t *arr, Py_ssize_t T)
{
    scratch_t *s = &S_;
    if (p->lstrip == NULL)
        return 0;
    for (Py_ssize_t t = 1; t < T; t++) {
        if (!p->lstrip[s->K[t]])
            continue;
        int64_t s0 = s->mend[t - 1], e0 = s->P[t];
        if (s->cls[t - 1] == G_SPLIT) {
            if (e0 <= s0)
                continue;  /* an empty run: nothing was split */
            s0 = s->split[t - 1];
        }
        if (e0 - s0 <= 0 || e0 - s0 > p->lstrip_max)
            continue;
        int r = memo_get(p->space_memo, items, arr, s0, e0, 0, 0);
        if (r == -3)
            return -1;
        if (r < 0)
            return 1;  /* not decoded yet: Python decides (and memoises it) */
        if (r) {
            s->P[t] = s0;
            s->split[t - 1] = s0;
        }
    }
    return 0;
}

/* Step 5: the key tables (FastMasker._tables): per entry its symbol (code * 4 + the run's
 * shape: none, run, header, header + text), its meta word (symbol << 16 | the header ids the
 * key holds) and how many of its ids the key takes: a DECODE run its first budget ids (and
 * whether it is longer: budget + 1), or none where nothing reads it (vfree: its length
 * class, 0 empty, 1 within the budget, 2 longer), a split header its ids, a content run
 * none. */
static void
step_tables(const plan_t *p, Py_ssize_t T)
{
    scratch_t *s = &S_;
    s->off[0] = 0;
    for (Py_ssize_t t = 0; t < T; t++) {
        int64_t a = s->mend[t], e = s->P[t + 1], k = s->K[t], glen = e - a;
        int64_t sym = k * 4 + (glen > 0), take = 0, vlen = 0;
        if (s->cls[t] == G_SPLIT && glen > 0) {
            int64_t h = s->split[t];
            sym = k * 4 + (h < e ? 3 : 2);  /* HEAD_RUN or HEAD */
            take = vlen = h - a;
        } else if (s->cls[t] == G_DECODE) {
            int64_t b = p->budget[k];
            if (p->vfree != NULL && p->vfree[k]) {
                vlen = (glen > 0) + (glen > b);
            } else {
                take = glen < b ? glen : b;
                vlen = glen < b + 1 ? glen : b + 1;
            }
        }
        if (!p->has_values)
            take = vlen = 0;
        s->meta[t] = p->has_values ? sym * 65536 + vlen : sym;
        s->take[t] = take;
        s->off[t + 1] = s->off[t] + take;
    }
}

/* Pass 1 (IdPlan.stream's steps, then the key tables); 1 on a reason to hand it back. */
static int
find_symbols(const plan_t *p, PyObject **items, const int64_t *arr, Py_ssize_t n,
             Py_ssize_t *T_out)
{
    Py_ssize_t T;
    int r = step_begins(p, items, arr, n, &T);
    if (r != 0)
        return r;
    step_classes(p, T);
    if ((r = step_split(p, items, arr, T)) != 0 || (r = step_lstrip(p, items, arr, T)) != 0)
        return r;
    step_tables(p, T);
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

/* lex(plan, ids) -> (symb, meta, vals, off, B) | None
 *     run's pass 1 alone (find_symbols: the plan's steps) on one sample, its tables in the
 *     form FastMasker._tables gives them (symbols as native uint16, meta words and key ids as
 *     native int64, off: a list or None, B: the slots [marker start, run start, header end]
 *     per entry and the sample's length), or None where run would hand the sample back.
 *     FastMasker.verify_lex compares them with the builder's (CHATGRAMMAR_VERIFY=1, tests). */
static PyObject *
lex(PyObject *self, PyObject *args)
{
    PyObject *plan_o, *ids;
    if (!PyArg_ParseTuple(args, "OO:lex", &plan_o, &ids))
        return NULL;
    plan_t p;
    if (parse_plan(plan_o, &p) < 0)
        return NULL;
    Py_buffer av = {0};
    PyObject **items = NULL, *res = NULL, *symb = NULL, *meta = NULL, *vals = NULL;
    PyObject *off = NULL, *B = NULL;
    const int64_t *arr = NULL;
    Py_ssize_t n, T;
    if (PyList_CheckExact(ids)) {
        items = ((PyListObject *)ids)->ob_item;
        n = PyList_GET_SIZE(ids);
    } else {
        if (get_int64_buffer(ids, &av, "ids") < 0)
            return NULL;
        arr = (const int64_t *)av.buf;
        n = av.len / 8;
    }
    Py_CLEAR(S_.held);  /* (the scratch buffers are reused: nothing to resume after this) */
    Py_CLEAR(S_.held_plan);
    int r = find_symbols(&p, items, arr, n, &T);
    if (r < 0) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto done;
    }
    if (r > 0) {
        res = Py_None;
        Py_INCREF(res);
        goto done;
    }
    scratch_t *s = &S_;
    symb = PyBytes_FromStringAndSize(NULL, T * 2);
    meta = PyBytes_FromStringAndSize((const char *)s->meta, T * 8);
    vals = PyBytes_FromStringAndSize(NULL, s->off[T] * 8);
    off = p.has_values ? PyList_New(T + 1) : Py_None;
    B = PyList_New(3 * T + 1);
    if (symb == NULL || meta == NULL || vals == NULL || off == NULL || B == NULL)
        goto done;
    if (off == Py_None)
        Py_INCREF(off);
    uint16_t *sy = (uint16_t *)PyBytes_AS_STRING(symb);
    int64_t *v = (int64_t *)PyBytes_AS_STRING(vals);
    for (Py_ssize_t t = 0; t < T; t++) {
        sy[t] = (uint16_t)(s->meta[t] >> (p.has_values ? 16 : 0));
        for (int64_t i = 0; i < s->take[t]; i++)
            if (read_id(items, arr, s->mend[t] + i, v++) < 0) {
                PyErr_SetString(PyExc_RuntimeError, "lex: an id changed");  /* (pass 1 read it) */
                goto done;
            }
        if (off != Py_None)
            PyList_SET_ITEM(off, t, PyLong_FromLongLong(s->off[t]));
        PyList_SET_ITEM(B, 3 * t, PyLong_FromLongLong(s->P[t]));
        PyList_SET_ITEM(B, 3 * t + 1, PyLong_FromLongLong(s->mend[t]));
        PyList_SET_ITEM(B, 3 * t + 2, PyLong_FromLongLong(s->split[t]));
    }
    if (off != Py_None)
        PyList_SET_ITEM(off, T, PyLong_FromLongLong(s->off[T]));
    PyList_SET_ITEM(B, 3 * T, PyLong_FromSsize_t(n));
    if (!PyErr_Occurred())  /* (a PyLong allocation may have failed above) */
        res = PyTuple_Pack(5, symb, meta, vals, off, B);
done:
    Py_XDECREF(symb);
    Py_XDECREF(meta);
    Py_XDECREF(vals);
    Py_XDECREF(off);
    Py_XDECREF(B);
    if (av.obj) PyBuffer_Release(&av);
    return res;
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
    {"lex", lex, METH_VARARGS,
     "lex(plan, ids) -> (symb, meta, vals, off, B) | None: run's pass 1 alone (the plan's "
     "steps), as FastMasker._tables gives them; None where run hands the sample back."},
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
