/* The engine's optional intake fast path: engine.ingest_many's per-observation loop, for the rows
   that need nothing but bookkeeping (a known rank, a known stage, a window not judged yet).

   append_rows(observations, start, ranks, seq_mask, window_steps, collective_offset, restart_span)
   walks observations[start:] (Observation tuples; append_records reads the fixed-width records of
   an observation.ObservationRecords instead, as the C scanner wrote them) and, per observation,
   does what engine._ingest_rows does for it: de-duplicates its seq in its rank's ring, counts a
   host duration that is negative or not finite as malformed, advances its cohort's latest interval
   end, appends its row to its window's five columns (opening the window through its cohort's
   open_window where it is new) and tells the cohort when its rank reached a later window. It stops
   at the first observation that needs anything else (a rank, cohort, incarnation or stage not seen
   yet, a window its cohort will not open, a sequence restart, a value of another type than the
   decoders give, an integer beyond 64 bits) and returns (that index, accepted, duplicate, malformed); the
   engine handles that observation in Python and calls again after it. So the Python loop alone
   decides every unusual case, and where this answers, its effect on the engine's state equals the
   Python loop's (tests/detector/test_ingest_fast.py checks both on the same streams).

   Rows of one window are gathered in C buffers and appended with one array.frombytes per column,
   in arrival order, when the window changes and before returning. Nothing here keeps state between
   calls. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "observation_record.h"

enum { C_KEYS, C_HOST, C_DEVICE, C_TOKENS, C_END, N_COLUMNS };
static const char *column_names[N_COLUMNS] = {"keys", "host_ms", "device_ms", "tokens", "end_unix_nano"};
static PyObject *column_attrs[N_COLUMNS];
static PyObject *attr_cohort, *attr_cohort_name, *attr_restart, *attr_key_slot, *attr_latest_window,
    *attr_recent_seqs, *attr_stage_offsets, *attr_open_windows, *attr_latest_end, *attr_rank_reached, *attr_open_window, *attr_frombytes;

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

/* One observation's fields as the loop reads them, whichever form it came in. */
typedef struct {
    PyObject *job_id, *cohort_name, *stage; /* borrowed, exact str */
    long long epoch, rank, step, seq, end, restart;
    double host_ms, device_ms, tokens;      /* device_ms NaN: none; tokens 0: none */
    int collective;
} Row;

typedef struct {
    PyObject *ranks;
    long long seq_mask, window_steps, collective_offset, restart_span;
} Params;

enum { TAKEN, DUPLICATE, MALFORMED, STOP, FAILED };

/* What engine._ingest_rows does with one row, for the common case; STOP where it needs more. */
static int take_row(State *s, const Row *row, const Params *p) {
    /* the rank's entry: the same as the previous row's in a request from one rank */
    if (s->entry == NULL || s->epoch != row->epoch || s->rank != row->rank
        || (s->job_id != row->job_id && PyUnicode_Compare(s->job_id, row->job_id) != 0)) {
        if (leave_entry(s) < 0) return FAILED;
        PyObject *key = Py_BuildValue("(OLL)", row->job_id, row->epoch, row->rank);
        if (key == NULL) return FAILED;
        PyObject *entry = PyDict_GetItemWithError(p->ranks, key);
        Py_DECREF(key);
        if (entry == NULL) return PyErr_Occurred() ? FAILED : STOP;
        int entered = enter_entry(s, entry, row->job_id, row->epoch, row->rank, (Py_ssize_t)p->seq_mask + 1);
        if (entered != 1) return entered < 0 ? FAILED : STOP;
    }
    if (s->cohort_name != row->cohort_name && PyUnicode_Compare(s->cohort_name, row->cohort_name) != 0) return STOP;
    if (row->restart > s->restart) return STOP;

    long long *seqs = (long long *)s->seqs.buf, seq_slot = row->seq & p->seq_mask, remembered = seqs[seq_slot];
    if (remembered >= row->seq) {
        long long behind;
        if (__builtin_sub_overflow(remembered, row->seq, &behind) || behind > p->restart_span) return STOP; /* restarted? */
        return DUPLICATE;
    }
    if (!(0.0 <= row->host_ms && row->host_ms < INFINITY)) return MALFORMED;
    PyObject *offset_object = PyDict_GetItemWithError(s->stage_offsets, row->stage);
    long long stage_offset;
    if (offset_object == NULL) return PyErr_Occurred() ? FAILED : STOP;
    if (!as_ll(offset_object, &stage_offset)) return STOP;
    long long window = row->step / p->window_steps;
    if (row->step % p->window_steps != 0 && (row->step < 0) != (p->window_steps < 0)) window--; /* floor, as // */
    __int128 wide_key = (__int128)stage_offset + s->key_slot + row->step - (__int128)window * p->window_steps
                        + (row->collective ? p->collective_offset : 0);
    if (wide_key < INT64_MIN || wide_key > INT64_MAX) return STOP;
    if (s->rows == NULL || s->window != window) {
        if (flush_rows(s) < 0) return FAILED;
        Py_CLEAR(s->rows);
        PyObject *window_key = PyLong_FromLongLong(window);
        if (window_key == NULL) return FAILED;
        PyObject *rows = PyDict_GetItemWithError(s->open_windows, window_key);
        if (rows != NULL)
            Py_INCREF(rows);
        else if (!PyErr_Occurred())
            /* a window the cohort has not opened: opened as the Python loop opens it (a cohort of a
               few ranks opens one every few steps, and a stop costs a pass through the Python loop) */
            rows = PyObject_CallMethodObjArgs(s->cohort, attr_open_window, window_key, NULL);
        Py_DECREF(window_key);
        if (rows == NULL) return FAILED;
        if (rows == Py_None) {
            /* judged already, or older than every open window when as many are open as a cohort
               may hold: the row is late, which the Python loop counts (it asks again, and
               open_window answers None without changing anything) */
            Py_DECREF(rows);
            return STOP;
        }
        s->rows = rows;
        s->window = window;
    }
    if (row->end > s->latest_end) { /* the job made progress (hangs) */
        s->latest_end = row->end;
        s->latest_end_dirty = 1;
    }
    seqs[seq_slot] = row->seq;
    s->columns[C_KEYS][s->count].i = (long long)wide_key;
    s->columns[C_HOST][s->count].d = row->host_ms;
    s->columns[C_DEVICE][s->count].d = row->device_ms;
    s->columns[C_TOKENS][s->count].d = row->tokens;
    s->columns[C_END][s->count].i = row->end;
    s->count++;
    if (window > s->latest_window) {
        PyObject *window_object = PyLong_FromLongLong(window);
        if (window_object == NULL) return FAILED;
        PyObject *done = PyObject_CallMethodObjArgs(s->cohort, attr_rank_reached, s->entry, window_object, NULL);
        Py_DECREF(window_object);
        if (done == NULL) return FAILED;
        Py_DECREF(done);
        s->latest_window = window;
    }
    return TAKEN;
}

/* An Observation tuple as a Row; 0: of a type or value only the Python loop takes. */
static int row_of_tuple(PyObject *o, Row *row) {
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 14) return 0;
    /* job_id, epoch, cohort, rank, stage, step, seq, host_ms, device_ms, collective, tokens,
       samples, end_unix_nano, restart (observation.Observation) */
    PyObject *device = PyTuple_GET_ITEM(o, 8), *collective = PyTuple_GET_ITEM(o, 9), *tokens = PyTuple_GET_ITEM(o, 10);
    row->job_id = PyTuple_GET_ITEM(o, 0);
    row->cohort_name = PyTuple_GET_ITEM(o, 2);
    row->stage = PyTuple_GET_ITEM(o, 4);
    if (!PyUnicode_CheckExact(row->job_id) || !PyUnicode_CheckExact(row->cohort_name) || !PyUnicode_CheckExact(row->stage)
        || !as_ll(PyTuple_GET_ITEM(o, 1), &row->epoch) || !as_ll(PyTuple_GET_ITEM(o, 3), &row->rank)
        || !as_ll(PyTuple_GET_ITEM(o, 5), &row->step) || !as_ll(PyTuple_GET_ITEM(o, 6), &row->seq)
        || !as_double(PyTuple_GET_ITEM(o, 7), &row->host_ms) || !as_ll(PyTuple_GET_ITEM(o, 12), &row->end)
        || !as_ll(PyTuple_GET_ITEM(o, 13), &row->restart) || (collective != Py_True && collective != Py_False))
        return 0;
    row->collective = collective == Py_True;
    if (device == Py_None) row->device_ms = NAN;
    else if (!as_double(device, &row->device_ms)) return 0;
    if (tokens == Py_None) row->tokens = 0.0;
    else if (!as_double(tokens, &row->tokens)) return 0;
    else if (!(row->tokens > 0)) row->tokens = 0.0;
    return 1;
}

typedef struct {
    const char *records;            /* any alignment: each record is copied out */
    PyObject *strings, *identities; /* lists or tuples */
    int32_t identity;               /* the identity `identity_row` holds (-1: none yet) */
    Row identity_row;
} Records;

/* A record as a Row; 0: one only the Python loop takes (a value beyond what a Row holds). */
static int row_of_record(Records *from, Py_ssize_t index, Row *row) {
    Record copy;
    memcpy(&copy, from->records + index * (Py_ssize_t)sizeof(Record), sizeof copy);
    const Record *record = &copy;
    if (record->identity != from->identity) {
        if (record->identity < 0 || record->identity >= PySequence_Fast_GET_SIZE(from->identities)) return 0;
        PyObject *identity = PySequence_Fast_GET_ITEM(from->identities, record->identity);
        Row *cached = &from->identity_row;
        from->identity = -1;
        if (!PyTuple_Check(identity) || PyTuple_GET_SIZE(identity) != 5) return 0;
        cached->job_id = PyTuple_GET_ITEM(identity, 0);
        cached->cohort_name = PyTuple_GET_ITEM(identity, 2);
        if (!PyUnicode_CheckExact(cached->job_id) || !PyUnicode_CheckExact(cached->cohort_name)
            || !as_ll(PyTuple_GET_ITEM(identity, 1), &cached->epoch) || !as_ll(PyTuple_GET_ITEM(identity, 3), &cached->rank)
            || !as_ll(PyTuple_GET_ITEM(identity, 4), &cached->restart))
            return 0;
        from->identity = record->identity;
    }
    if (record->stage < 0 || record->stage >= PySequence_Fast_GET_SIZE(from->strings)
        || record->end_unix_nano > (uint64_t)INT64_MAX)
        return 0;
    *row = from->identity_row;
    row->stage = PySequence_Fast_GET_ITEM(from->strings, record->stage);
    if (!PyUnicode_CheckExact(row->stage)) return 0;
    row->step = record->step;
    row->seq = record->seq;
    row->host_ms = record->host_ms;
    row->device_ms = record->device_ms;
    row->tokens = record->tokens > 0 ? (double)record->tokens : 0.0;
    row->end = (long long)record->end_unix_nano;
    row->collective = record->collective != 0;
    return 1;
}

/* The loop of both entry points: rows [start, n) from `tuples` (a list or tuple of Observations)
   or else `records`, until one the Python loop must take. */
static PyObject *take_rows(PyObject *tuples, Records *records, Py_ssize_t n, Py_ssize_t start, const Params *p) {
    if (p->window_steps <= 0 || p->seq_mask < 0) {
        PyErr_SetString(PyExc_ValueError, "window_steps must be positive, seq_mask not negative");
        return NULL;
    }
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
        Row row;
        if (!(tuples != NULL ? row_of_tuple(PySequence_Fast_GET_ITEM(tuples, index), &row)
                             : row_of_record(records, index, &row)))
            break;
        int taken = take_row(&s, &row, p);
        if (taken == TAKEN) accepted++;
        else if (taken == DUPLICATE) duplicate++;
        else if (taken == MALFORMED) malformed++;
        else {
            failed = taken == FAILED;
            break;
        }
    }
    if (leave_entry(&s) < 0) failed = 1;
    for (int c = 0; c < N_COLUMNS; c++) PyMem_Free(s.columns[c]);
    if (failed) return NULL;
    return Py_BuildValue("(nnnn)", index, accepted, duplicate, malformed);
}

static PyObject *append_rows(PyObject *self, PyObject *args) {
    PyObject *observations;
    Py_ssize_t start;
    Params p;
    if (!PyArg_ParseTuple(args, "OnO!LLLL", &observations, &start, &PyDict_Type, &p.ranks, &p.seq_mask,
                          &p.window_steps, &p.collective_offset, &p.restart_span))
        return NULL;
    if (!PyList_Check(observations) && !PyTuple_Check(observations)) {
        PyErr_SetString(PyExc_TypeError, "observations must be a list or a tuple");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(observations, ""); /* borrowed items, a new reference to the sequence */
    if (fast == NULL) return NULL;
    PyObject *answer = take_rows(fast, NULL, PySequence_Fast_GET_SIZE(fast), start, &p);
    Py_DECREF(fast);
    return answer;
}

static PyObject *append_records(PyObject *self, PyObject *args) {
    Py_buffer buffer;
    PyObject *strings, *identities;
    Py_ssize_t start;
    Params p;
    if (!PyArg_ParseTuple(args, "y*OOnO!LLLL", &buffer, &strings, &identities, &start, &PyDict_Type, &p.ranks,
                          &p.seq_mask, &p.window_steps, &p.collective_offset, &p.restart_span))
        return NULL;
    PyObject *answer = NULL;
    if ((!PyList_Check(strings) && !PyTuple_Check(strings)) || (!PyList_Check(identities) && !PyTuple_Check(identities)))
        PyErr_SetString(PyExc_TypeError, "strings and identities must be lists or tuples");
    else if (buffer.len % (Py_ssize_t)sizeof(Record) != 0)
        PyErr_SetString(PyExc_ValueError, "records: not a whole number of records");
    else {
        /* the lists' items are borrowed while they hold them: nothing here changes either list */
        Records records = {(const char *)buffer.buf, strings, identities, -1, {0}};
        answer = take_rows(NULL, &records, buffer.len / (Py_ssize_t)sizeof(Record), start, &p);
    }
    PyBuffer_Release(&buffer);
    return answer;
}

static PyMethodDef methods[] = {
    {"append_rows", append_rows, METH_VARARGS,
     "append_rows(observations, start, ranks, seq_mask, window_steps, collective_offset, restart_span) -> "
     "(index of the first observation left to the Python loop, or len(observations); accepted, duplicate, "
     "malformed)"},
    {"append_records", append_records, METH_VARARGS,
     "append_records(records, strings, identities, start, ranks, seq_mask, window_steps, collective_offset, "
     "restart_span) -> as append_rows, for the records of an observation.ObservationRecords"},
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
    INTERN(attr_open_window, "open_window");
    INTERN(attr_frombytes, "frombytes");
#undef INTERN
    return PyModule_Create(&module_def);
}
