/* The engine's optional intake fast path: engine.ingest_many's per-observation loop, for the rows
   that need nothing but bookkeeping (a known rank, a known stage, an open window).

   append_rows(observations, start, ranks, seq_mask, window_steps, collective_offset, restart_span)
   walks observations[start:] and, per observation, does what engine._ingest_rows does for it:
   de-duplicates its seq in its rank's ring, counts a host duration that is negative or not finite as
   malformed, advances its cohort's latest interval end, appends its row to its open window's five
   columns and tells the cohort when its rank reached a later window. It stops at the first
   observation that needs anything else (a rank, cohort, incarnation, stage or window not seen yet,
   a sequence restart, a value of another type than the decoders give, an integer beyond 64 bits)
   and returns (that index, accepted, duplicate, malformed); the engine handles that observation in
   Python and calls again after it. So the Python loop alone decides every unusual case, and where
   this answers, its effect on the engine's state equals the Python loop's
   (tests/detector/test_ingest_fast.py checks both on the same streams).

   Rows of one window are gathered in C buffers and appended with one array.frombytes per column,
   in arrival order, when the window changes and before returning. Nothing here keeps state between
   calls. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { C_KEYS, C_HOST, C_DEVICE, C_TOKENS, C_END, N_COLUMNS };
static const char *column_names[N_COLUMNS] = {"keys", "host_ms", "device_ms", "tokens", "end_unix_nano"};
static PyObject *column_attrs[N_COLUMNS];
static PyObject *attr_cohort, *attr_cohort_name, *attr_restart, *attr_key_slot, *attr_latest_window,
    *attr_recent_seqs, *attr_stage_offsets, *attr_open_windows, *attr_latest_end, *attr_rank_reached, *attr_frombytes;

typedef struct {
    /* the current rank entry (borrowed from the ranks dict, which nothing here changes) */
    PyObject *entry, *job_id, *cohort_name, *cohort, *stage_offsets, *open_windows;
    long long epoch, rank, restart, key_slot, latest_window;
    Py_buffer seqs;
    int has_seqs;
    long long latest_end;
    int latest_end_dirty;
    /* the window being appended to and its gathered rows */
    PyObject *rows;
    long long window;
    Py_ssize_t count;
    union { long long i; double d; } *columns[N_COLUMNS];
} State;

/* A Python int as a long long; 0 with no exception set when it is not one or does not fit. */
static int as_ll(PyObject *value, long long *out) {
    if (!PyLong_Check(value)) return 0;
    int overflow;
    *out = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || (*out == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* A float or int as a double, as array('d').append converts it; 0 (no exception) otherwise. */
static int as_double(PyObject *value, double *out) {
    if (PyFloat_Check(value)) {  /* numpy's float64 too */
        *out = PyFloat_AS_DOUBLE(value);
        return 1;
    }
    if (!PyLong_Check(value)) return 0;
    *out = PyLong_AsDouble(value);
    if (*out == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

static int get_ll_attr(PyObject *object, PyObject *name, long long *out) {
    PyObject *value = PyObject_GetAttr(object, name);
    if (value == NULL) return -1;
    int ok = as_ll(value, out);
    Py_DECREF(value);
    return ok ? 1 : 0;
}

/* Appends the gathered rows to the window's columns. -1 with an exception set on failure. */
static int flush_rows(State *s) {
    if (s->rows == NULL || s->count == 0) return 0;
    for (int c = 0; c < N_COLUMNS; c++) {
        PyObject *column = PyObject_GetAttr(s->rows, column_attrs[c]);
        if (column == NULL) return -1;
        PyObject *view = PyMemoryView_FromMemory((char *)s->columns[c], s->count * 8, PyBUF_READ);
        if (view == NULL) {
            Py_DECREF(column);
            return -1;
        }
        PyObject *done = PyObject_CallMethodOneArg(column, attr_frombytes, view);
        Py_DECREF(view);
        Py_DECREF(column);
        if (done == NULL) return -1;
        Py_DECREF(done);
    }
    s->count = 0;
    return 0;
}

static int write_latest_end(State *s) {
    if (!s->latest_end_dirty) return 0;
    PyObject *value = PyLong_FromLongLong(s->latest_end);
    if (value == NULL) return -1;
    int set = PyObject_SetAttr(s->cohort, attr_latest_end, value);
    Py_DECREF(value);
    s->latest_end_dirty = 0;
    return set;
}

/* Leaves the current entry: its rows appended, its cohort's latest end written back. */
static int leave_entry(State *s) {
    int failed = flush_rows(s) < 0;
    Py_CLEAR(s->rows);
    if (s->entry != NULL && write_latest_end(s) < 0) failed = 1;
    if (s->has_seqs) PyBuffer_Release(&s->seqs);
    s->has_seqs = 0;
    Py_CLEAR(s->cohort);
    Py_CLEAR(s->cohort_name);
    Py_CLEAR(s->stage_offsets);
    Py_CLEAR(s->open_windows);
    Py_CLEAR(s->job_id);
    s->entry = NULL;
    return failed ? -1 : 0;
}

/* Makes `entry` current. 1: done; 0: not one this path reads (no exception); -1: an exception. */
static int enter_entry(State *s, PyObject *entry, PyObject *job_id, long long epoch, long long rank,
                       Py_ssize_t horizon) {
    s->entry = entry;
    s->job_id = Py_NewRef(job_id);
    s->epoch = epoch;
    s->rank = rank;
    int got;
    if ((s->cohort = PyObject_GetAttr(entry, attr_cohort)) == NULL) return -1;
    if ((s->cohort_name = PyObject_GetAttr(entry, attr_cohort_name)) == NULL) return -1;
    if ((s->stage_offsets = PyObject_GetAttr(s->cohort, attr_stage_offsets)) == NULL) return -1;
    if ((s->open_windows = PyObject_GetAttr(s->cohort, attr_open_windows)) == NULL) return -1;
    if (!PyUnicode_CheckExact(s->cohort_name) || !PyDict_CheckExact(s->stage_offsets)
        || !PyDict_CheckExact(s->open_windows))
        return 0;
    if ((got = get_ll_attr(entry, attr_restart, &s->restart)) != 1) return got;
    if ((got = get_ll_attr(entry, attr_key_slot, &s->key_slot)) != 1) return got;
    if ((got = get_ll_attr(entry, attr_latest_window, &s->latest_window)) != 1) return got;
    if ((got = get_ll_attr(s->cohort, attr_latest_end, &s->latest_end)) != 1) return got;
    PyObject *seqs = PyObject_GetAttr(entry, attr_recent_seqs);
    if (seqs == NULL) return -1;
    got = PyObject_GetBuffer(seqs, &s->seqs, PyBUF_WRITABLE | PyBUF_FORMAT);
    Py_DECREF(seqs);
    if (got < 0) return -1;
    s->has_seqs = 1;
    if (s->seqs.itemsize != 8 || s->seqs.format == NULL || strcmp(s->seqs.format, "q") != 0
        || s->seqs.len < horizon * 8)
        return 0;
    return 1;
}

static PyObject *append_rows(PyObject *self, PyObject *args) {
    PyObject *observations, *ranks;
    Py_ssize_t start;
    long long seq_mask, window_steps, collective_offset, restart_span;
    if (!PyArg_ParseTuple(args, "OnO!LLLL", &observations, &start, &PyDict_Type, &ranks, &seq_mask,
                          &window_steps, &collective_offset, &restart_span))
        return NULL;
    if (!PyList_Check(observations) && !PyTuple_Check(observations)) {
        PyErr_SetString(PyExc_TypeError, "observations must be a list or a tuple");
        return NULL;
    }
    if (window_steps <= 0 || seq_mask < 0) {
        PyErr_SetString(PyExc_ValueError, "window_steps must be positive, seq_mask not negative");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(observations, "");  /* borrowed items, a new reference to the sequence */
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    State s = {0};
    int failed = 0;
    Py_ssize_t accepted = 0, duplicate = 0, malformed = 0, index = start < 0 ? 0 : start;
    for (int c = 0; c < N_COLUMNS; c++) {
        s.columns[c] = PyMem_Malloc((n > index ? n - index : 1) * 8);
        if (s.columns[c] == NULL) {
            PyErr_NoMemory();
            failed = 1;
        }
    }
    for (; !failed && index < n; index++) {
        PyObject *o = items[index];
        if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 14) break;
        /* job_id, epoch, cohort, rank, stage, step, seq, host_ms, device_ms, collective, tokens,
           samples, end_unix_nano, restart (engine._OBSERVATION_FIELDS) */
        PyObject *job_id = PyTuple_GET_ITEM(o, 0), *cohort_name = PyTuple_GET_ITEM(o, 2);
        PyObject *stage = PyTuple_GET_ITEM(o, 4), *device = PyTuple_GET_ITEM(o, 8);
        PyObject *collective = PyTuple_GET_ITEM(o, 9), *tokens = PyTuple_GET_ITEM(o, 10);
        long long epoch, rank, step, seq, end, restart;
        double host_ms, device_ms, tokens_value;
        if (!PyUnicode_CheckExact(job_id) || !PyUnicode_CheckExact(cohort_name) || !PyUnicode_CheckExact(stage)
            || !as_ll(PyTuple_GET_ITEM(o, 1), &epoch) || !as_ll(PyTuple_GET_ITEM(o, 3), &rank)
            || !as_ll(PyTuple_GET_ITEM(o, 5), &step) || !as_ll(PyTuple_GET_ITEM(o, 6), &seq)
            || !as_double(PyTuple_GET_ITEM(o, 7), &host_ms) || !as_ll(PyTuple_GET_ITEM(o, 12), &end)
            || !as_ll(PyTuple_GET_ITEM(o, 13), &restart) || (collective != Py_True && collective != Py_False))
            break;
        if (device == Py_None) device_ms = NAN;
        else if (!as_double(device, &device_ms)) break;
        if (tokens == Py_None) tokens_value = 0.0;
        else if (!as_double(tokens, &tokens_value)) break;
        else if (!(tokens_value > 0)) tokens_value = 0.0;

        /* the rank's entry: the same as the previous observation's in a request from one rank */
        if (s.entry == NULL || s.epoch != epoch || s.rank != rank
            || (s.job_id != job_id && PyUnicode_Compare(s.job_id, job_id) != 0)) {
            if (leave_entry(&s) < 0) { failed = 1; break; }
            PyObject *key = Py_BuildValue("(OLL)", job_id, epoch, rank);
            if (key == NULL) { failed = 1; break; }
            PyObject *entry = PyDict_GetItemWithError(ranks, key);
            Py_DECREF(key);
            if (entry == NULL) {
                if (PyErr_Occurred()) failed = 1;
                break;
            }
            int entered = enter_entry(&s, entry, job_id, epoch, rank, (Py_ssize_t)seq_mask + 1);
            if (entered < 0) failed = 1;
            if (entered != 1) break;
        }
        if (s.cohort_name != cohort_name && PyUnicode_Compare(s.cohort_name, cohort_name) != 0) break;
        if (restart > s.restart) break;

        long long *seqs = (long long *)s.seqs.buf, seq_slot = seq & seq_mask, remembered = seqs[seq_slot];
        if (remembered >= seq) {
            long long behind;
            if (__builtin_sub_overflow(remembered, seq, &behind) || behind > restart_span) break;  /* restarted? */
            duplicate++;
            continue;
        }
        if (!(0.0 <= host_ms && host_ms < INFINITY)) {
            malformed++;
            continue;
        }
        PyObject *offset_object = PyDict_GetItemWithError(s.stage_offsets, stage);
        long long stage_offset;
        if (offset_object == NULL) {
            if (PyErr_Occurred()) failed = 1;
            break;
        }
        if (!as_ll(offset_object, &stage_offset)) break;
        long long window = step / window_steps;
        if (step % window_steps != 0 && (step < 0) != (window_steps < 0)) window--;  /* floor, as // */
        __int128 wide_key = (__int128)stage_offset + s.key_slot + step - (__int128)window * window_steps
                            + (collective == Py_True ? collective_offset : 0);
        if (wide_key < INT64_MIN || wide_key > INT64_MAX) break;
        if (s.rows == NULL || s.window != window) {
            if (flush_rows(&s) < 0) { failed = 1; break; }
            Py_CLEAR(s.rows);
            PyObject *window_key = PyLong_FromLongLong(window);
            if (window_key == NULL) { failed = 1; break; }
            PyObject *rows = PyDict_GetItemWithError(s.open_windows, window_key);
            Py_DECREF(window_key);
            if (rows == NULL) {
                if (PyErr_Occurred()) failed = 1;
                break;
            }
            s.rows = Py_NewRef(rows);
            s.window = window;
        }
        if (end > s.latest_end) {  /* the job made progress (hangs) */
            s.latest_end = end;
            s.latest_end_dirty = 1;
        }
        seqs[seq_slot] = seq;
        s.columns[C_KEYS][s.count].i = (long long)wide_key;
        s.columns[C_HOST][s.count].d = host_ms;
        s.columns[C_DEVICE][s.count].d = device_ms;
        s.columns[C_TOKENS][s.count].d = tokens_value;
        s.columns[C_END][s.count].i = end;
        s.count++;
        if (window > s.latest_window) {
            PyObject *window_object = PyLong_FromLongLong(window);
            if (window_object == NULL) { failed = 1; index++; break; }
            PyObject *done = PyObject_CallMethodObjArgs(s.cohort, attr_rank_reached, s.entry, window_object, NULL);
            Py_DECREF(window_object);
            if (done == NULL) { failed = 1; index++; break; }
            Py_DECREF(done);
            s.latest_window = window;
        }
        accepted++;
    }
    if (leave_entry(&s) < 0) failed = 1;
    for (int c = 0; c < N_COLUMNS; c++) PyMem_Free(s.columns[c]);
    Py_DECREF(fast);
    if (failed) return NULL;
    return Py_BuildValue("(nnnn)", index, accepted, duplicate, malformed);
}

static PyMethodDef methods[] = {
    {"append_rows", append_rows, METH_VARARGS,
     "append_rows(observations, start, ranks, seq_mask, window_steps, collective_offset, restart_span) -> "
     "(index of the first observation left to the Python loop, or len(observations); accepted, duplicate, "
     "malformed)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, .m_name = "_ingest", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__ingest(void) {
    for (int c = 0; c < N_COLUMNS; c++)
        if ((column_attrs[c] = PyUnicode_InternFromString(column_names[c])) == NULL) return NULL;
#define INTERN(variable, name) if ((variable = PyUnicode_InternFromString(name)) == NULL) return NULL
    INTERN(attr_cohort, "cohort");
    INTERN(attr_cohort_name, "cohort_name");
    INTERN(attr_restart, "restart");
    INTERN(attr_key_slot, "key_slot");
    INTERN(attr_latest_window, "latest_window");
    INTERN(attr_recent_seqs, "recent_seqs");
    INTERN(attr_stage_offsets, "stage_offsets");
    INTERN(attr_open_windows, "open_windows");
    INTERN(attr_latest_end, "latest_end_unix_nano");
    INTERN(attr_rank_reached, "rank_reached");
    INTERN(attr_frombytes, "frombytes");
#undef INTERN
    return PyModule_Create(&module_def);
}
