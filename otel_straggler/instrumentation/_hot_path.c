/* The training thread's hot path in C: the same Recorder, Stage and Step as the Python reference
   in hot_path_reference.py, record for record (tests/instrumentation run against both).

   In training each call comes after milliseconds of kernels that evicted the interpreter's code
   and data from the caches, so what a call costs there is mostly how much it touches: in Python a
   `with stage(...)` block runs five frames and reads a dozen attributes and globals; here it is
   one C call into the type and one for each of __enter__ and __exit__
   (benchmarks/hot_path_in_situ.py measures both in a training loop).

   The rules are docs/architecture.md's training-thread budget: read the clock, take an event from
   the pool (a Python call, only when device timing is on), bind the step, append to the bounded
   `completed` deque. No lock, no I/O, no allocation beyond the records themselves. Nothing raises to the caller: an Exception is
   counted in internal_errors and the call returns as if the interval were not timed. Anything that
   is not an Exception (KeyboardInterrupt, SystemExit) goes on, as in Python.

   Records, as in hot_path_reference.py:
     open interval:  (name, collective, enclosing open interval or None, start step, start_ns, start_event)
     (INTERVAL, open_interval, end_ns, end_event, binding)
     (STEP_BEGIN, step, time_ns, tokens, samples)
     (STEP_END, step, time_ns) */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <time.h>

enum { INTERVAL = 0, STEP_BEGIN = 1, STEP_END = 2 };
/* hot_path_reference.MAX_OPEN_INTERVALS: deeper nesting is stages never exited; beyond it an interval is
   timed and recorded but not kept as a parent, so the open list stays bounded */
#define MAX_OPEN_INTERVALS 256
enum { NAME, COLLECTIVE, ENCLOSING, START_STEP, START_NS, START_EVENT, OPEN_INTERVAL_SIZE };

static PyObject *str_record, *str_release;
static PyObject *kind_interval, *kind_step_begin, *kind_step_end;

typedef struct {
    PyObject_HEAD
    PyObject *completed;        /* collections.deque of records, at most `capacity` long */
    PyObject *completed_append; /* its bound append */
    Py_ssize_t capacity;
    PyObject *event_pool;       /* None until the first step() makes it (device timing on) */
    PyObject *pool_take;        /* the pool's record() in two calls, where it offers them (EventPool */
    PyObject *pool_record_event;/* does): a Python frame less per event; else NULL */
    PyObject *open_intervals;   /* list, innermost last */
    PyObject *binding;          /* (step, tokens, samples), replaced whole */
    PyObject *on_first_step;
    Py_ssize_t dropped_queue_full, dropped_step_records, internal_errors, untracked_open_intervals;
} Recorder;

/* The recorder stage() and step() use: set by install(), None while the instrumentation is off. */
static Recorder *installed = NULL;

/* Tests only: a callable returning ns that stands in for the clock (use_clock()), else NULL. */
static PyObject *fake_clock = NULL;

/* The host's wall clock in ns, time.time_ns()'s; 0, or -1 with an error set (a fake clock's). */
static int now_ns(int64_t *ns) {
    if (fake_clock != NULL) {
        PyObject *value = PyObject_CallNoArgs(fake_clock);
        if (value == NULL) return -1;
        *ns = PyLong_AsLongLong(value);
        Py_DECREF(value);
        return *ns == -1 && PyErr_Occurred() ? -1 : 0;
    }
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    *ns = (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
    return 0;
}

/* Counts an Exception and clears it (0); leaves anything else set for the caller to raise (-1). */
static int swallow(Recorder *self) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyErr_Clear();
    self->internal_errors++;
    return 0;
}

static inline int is_set(PyObject *value) { return value != NULL && value != Py_None; }

/* len(completed) < capacity; -1 with an error set if len() failed */
static int has_room(Recorder *self) {
    Py_ssize_t length = PyObject_Length(self->completed);
    if (length < 0) return -1;
    return length < self->capacity;
}

/* Appends a record (stolen) to `completed`; 0 or -1 with an error set. */
static int enqueue(Recorder *self, PyObject *record) {
    if (record == NULL) return -1;
    PyObject *result = PyObject_CallOneArg(self->completed_append, record);
    Py_DECREF(record);
    if (result == NULL) return -1;
    Py_DECREF(result);
    return 0;
}

static int give_back(Recorder *self, PyObject *event) {
    if (!is_set(event)) return 0;
    PyObject *result = PyObject_CallMethodOneArg(self->event_pool, str_release, event);
    Py_XDECREF(result);
    return result == NULL ? -1 : 0;
}

/* give_back() while an error is set: the error stays the one to report, a failure of the
   release itself is dropped (the event is lost to the pool then, as before). */
static void give_back_on_error(Recorder *self, PyObject *event) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (give_back(self, event) < 0) PyErr_Clear();
    PyErr_Restore(type, value, traceback);
}

/* The next event, recorded on the current stream; None when the pool is exhausted (the interval
   is timed host-only, as EventPool.record does); NULL with an error set. */
static PyObject *record_event(Recorder *self) {
    if (self->pool_take == NULL) return PyObject_CallMethodNoArgs(self->event_pool, str_record);
    PyObject *event = PyObject_CallNoArgs(self->pool_take);
    if (event == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_IndexError)) return NULL;
        PyErr_Clear();
        return Py_NewRef(Py_None);
    }
    PyObject *result = PyObject_CallOneArg(self->pool_record_event, event);
    if (result == NULL) {
        give_back_on_error(self, event); /* not recorded: still the pool's */
        Py_DECREF(event);
        return NULL;
    }
    Py_DECREF(result);
    return event;
}

/* A new open interval, or None when it could not be timed; NULL only for a non-Exception error. */
static PyObject *recorder_start_interval(Recorder *self, PyObject *name, PyObject *collective) {
    PyObject *opened = self->open_intervals;
    Py_ssize_t depth = PyList_GET_SIZE(opened);
    PyObject *enclosing = depth ? PyList_GET_ITEM(opened, depth - 1) : Py_None;
    PyObject *start_step = PyTuple_GET_ITEM(self->binding, 0);
    Py_INCREF(enclosing); /* the pool's record() runs Python: hold what we read before it */
    Py_INCREF(start_step);
    /* clock first, then the event: the event sits as close as it can to the stage's kernels */
    int64_t start;
    PyObject *start_ns = NULL, *start_event = NULL, *interval = NULL;
    if (now_ns(&start) < 0 || (start_ns = PyLong_FromLongLong(start)) == NULL) goto failed;
    start_event = is_set(self->event_pool) ? record_event(self) : Py_NewRef(Py_None);
    if (start_event == NULL) goto failed;
    interval = PyTuple_Pack(OPEN_INTERVAL_SIZE, name, collective, enclosing, start_step, start_ns, start_event);
    if (interval == NULL) goto failed;
    if (PyList_GET_SIZE(opened) >= MAX_OPEN_INTERVALS) {
        self->untracked_open_intervals++;
    } else if (PyList_Append(opened, interval) < 0) {
        goto failed;
    }
    Py_DECREF(enclosing);
    Py_DECREF(start_step);
    Py_DECREF(start_ns);
    Py_DECREF(start_event);
    return interval;
failed:
    Py_DECREF(enclosing);
    Py_DECREF(start_step);
    Py_XDECREF(start_ns);
    Py_XDECREF(start_event);
    Py_XDECREF(interval);
    return swallow(self) < 0 ? NULL : Py_NewRef(Py_None);
}

/* Takes `interval` out of the open ones: the innermost, or wherever it is (timers may stop out of
   nesting order); 0 also when it is not there, -1 with an error set. */
static int close_interval(PyObject *opened, PyObject *interval) {
    Py_ssize_t depth = PyList_GET_SIZE(opened);
    if (depth && PyList_GET_ITEM(opened, depth - 1) == interval) return PyList_SetSlice(opened, depth - 1, depth, NULL);
    for (Py_ssize_t index = 0; index < PyList_GET_SIZE(opened); index++) {
        PyObject *item = Py_NewRef(PyList_GET_ITEM(opened, index));
        int equal = PyObject_RichCompareBool(item, interval, Py_EQ); /* list.remove's test */
        Py_DECREF(item);
        if (equal < 0) return -1;
        if (equal) return PyList_SetSlice(opened, index, index + 1, NULL);
    }
    return 0;
}

/* Takes `interval` itself (by identity) out of the open ones; whether it was there. Sets no error. */
static int remove_open_interval(PyObject *opened, PyObject *interval) {
    for (Py_ssize_t index = PyList_GET_SIZE(opened) - 1; index >= 0; index--) {
        if (PyList_GET_ITEM(opened, index) == interval) {
            PyObject *type, *value, *traceback;
            PyErr_Fetch(&type, &value, &traceback);
            int removed = PyList_SetSlice(opened, index, index + 1, NULL) == 0;
            if (!removed) PyErr_Clear();
            PyErr_Restore(type, value, traceback);
            return removed;
        }
    }
    return 0;
}

/* Ends an interval: its host duration in ns in *duration_ns (0 when it could not be timed);
   -1 only for a non-Exception error. */
static int recorder_stop_interval(Recorder *self, PyObject *interval, int64_t *duration_ns) {
    PyObject *end_event = NULL, *start_event = NULL; /* start_event: borrowed from the interval */
    *duration_ns = 0;
    if (!PyTuple_Check(interval) || PyTuple_GET_SIZE(interval) != OPEN_INTERVAL_SIZE) {
        PyErr_SetString(PyExc_TypeError, "not an interval start() returned");
        goto failed;
    }
    start_event = PyTuple_GET_ITEM(interval, START_EVENT);
    if (start_event == Py_None) {
        end_event = Py_NewRef(Py_None);
    } else if (is_set(self->event_pool)) {
        end_event = record_event(self);
        if (end_event == NULL) goto failed;
    } else {
        PyErr_SetString(PyExc_AttributeError, "an interval with a device event but no event pool");
        goto failed;
    }
    int64_t end;
    if (now_ns(&end) < 0) goto failed;
    long long start = PyLong_AsLongLong(PyTuple_GET_ITEM(interval, START_NS));
    if (start == -1 && PyErr_Occurred()) goto failed;
    if (close_interval(self->open_intervals, interval) < 0) goto failed;
    int room = has_room(self);
    if (room < 0) goto failed;
    if (room) {
        PyObject *end_ns = PyLong_FromLongLong(end);
        if (end_ns == NULL) goto failed;
        PyObject *record = PyTuple_Pack(5, kind_interval, interval, end_ns, end_event, self->binding);
        Py_DECREF(end_ns);
        if (enqueue(self, record) < 0) goto failed;
    } else {
        self->dropped_queue_full++;
        int released = give_back(self, start_event) < 0 || give_back(self, end_event) < 0 ? -1 : 0;
        Py_DECREF(end_event);
        if (released < 0) return swallow(self); /* given back already, or lost: not again */
        *duration_ns = end - start;
        return 0;
    }
    Py_DECREF(end_event);
    *duration_ns = end - start;
    return 0;
failed:
    /* the interval has ended all the same (left open, it would be the parent of every later
       stage), and as it is not queued its events go back to the pool (a failure must not drain
       it): the end event taken for this call, and the start event of an interval found among
       the open ones (so one start() made, not a lookalike tuple) */
    if (start_event != NULL && remove_open_interval(self->open_intervals, interval) && is_set(start_event)
        && is_set(self->event_pool))
        give_back_on_error(self, start_event);
    if (is_set(end_event)) give_back_on_error(self, end_event);
    Py_XDECREF(end_event);
    return swallow(self);
}

/* 0, or -1 only for a non-Exception error */
static int recorder_begin(Recorder *self, PyObject *step, PyObject *tokens, PyObject *samples) {
    if (is_set(self->on_first_step)) {
        /* once: the pipeline makes the event pool on the training thread's first step */
        PyObject *make_event_pool = self->on_first_step;
        self->on_first_step = Py_NewRef(Py_None);
        PyObject *result = PyObject_CallNoArgs(make_event_pool);
        Py_DECREF(make_event_pool);
        if (result == NULL) return swallow(self);
        Py_DECREF(result);
    }
    int64_t now;
    if (now_ns(&now) < 0) return swallow(self);
    PyObject *binding = PyTuple_Pack(3, step, tokens, samples);
    if (binding == NULL) return swallow(self);
    Py_SETREF(self->binding, binding);
    int room = has_room(self);
    if (room < 0) return swallow(self);
    if (!room) {
        self->dropped_step_records++;
        return 0;
    }
    PyObject *time_ns = PyLong_FromLongLong(now);
    if (time_ns == NULL) return swallow(self);
    PyObject *record = PyTuple_Pack(5, kind_step_begin, step, time_ns, tokens, samples);
    Py_DECREF(time_ns);
    return enqueue(self, record) < 0 ? swallow(self) : 0;
}

static int recorder_end(Recorder *self, PyObject *step) {
    int room = has_room(self);
    if (room < 0) return swallow(self);
    if (!room) {
        self->dropped_step_records++;
        return 0;
    }
    int64_t now;
    PyObject *time_ns = now_ns(&now) < 0 ? NULL : PyLong_FromLongLong(now);
    if (time_ns == NULL) return swallow(self);
    PyObject *record = PyTuple_Pack(3, kind_step_end, step, time_ns);
    Py_DECREF(time_ns);
    return enqueue(self, record) < 0 ? swallow(self) : 0;
}

/* -- Recorder, the Python face ------------------------------------------------------------------ */

static PyObject *deque_type;

static int Recorder_set_event_pool(Recorder *self, PyObject *pool, void *closure);

static int Recorder_init(Recorder *self, PyObject *args, PyObject *kwds) {
    static char *keywords[] = {"capacity", "event_pool", NULL};
    Py_ssize_t capacity;
    PyObject *event_pool = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|O:IntervalRecorder", keywords, &capacity, &event_pool))
        return -1;
    PyObject *completed = PyObject_CallNoArgs(deque_type);
    if (completed == NULL) return -1;
    PyObject *append = PyObject_GetAttrString(completed, "append");
    PyObject *opened = PyList_New(0);
    PyObject *binding = PyTuple_Pack(3, Py_None, Py_None, Py_None);
    if (append == NULL || opened == NULL || binding == NULL) {
        Py_DECREF(completed);
        Py_XDECREF(append);
        Py_XDECREF(opened);
        Py_XDECREF(binding);
        return -1;
    }
    Py_XSETREF(self->completed, completed);
    Py_XSETREF(self->completed_append, append);
    Py_XSETREF(self->open_intervals, opened);
    Py_XSETREF(self->binding, binding);
    if (Recorder_set_event_pool(self, event_pool, NULL) < 0) return -1;
    Py_XSETREF(self->on_first_step, Py_NewRef(Py_None));
    self->capacity = capacity;
    self->dropped_queue_full = self->dropped_step_records = self->internal_errors = 0;
    self->untracked_open_intervals = 0;
    return 0;
}

static int Recorder_traverse(Recorder *self, visitproc visit, void *arg) {
    Py_VISIT(self->completed);
    Py_VISIT(self->completed_append);
    Py_VISIT(self->event_pool);
    Py_VISIT(self->pool_take);
    Py_VISIT(self->pool_record_event);
    Py_VISIT(self->open_intervals);
    Py_VISIT(self->binding);
    Py_VISIT(self->on_first_step);
    return 0;
}

static int Recorder_clear(Recorder *self) {
    Py_CLEAR(self->completed);
    Py_CLEAR(self->completed_append);
    Py_CLEAR(self->event_pool);
    Py_CLEAR(self->pool_take);
    Py_CLEAR(self->pool_record_event);
    Py_CLEAR(self->open_intervals);
    Py_CLEAR(self->binding);
    Py_CLEAR(self->on_first_step);
    return 0;
}

static void Recorder_dealloc(Recorder *self) {
    PyObject_GC_UnTrack(self);
    Recorder_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A Recorder made with __new__ alone has no deque: refuse it rather than crash. */
static int ready(Recorder *self) {
    if (self->completed != NULL) return 1;
    self->internal_errors++;
    return 0;
}

static PyObject *Recorder_start(Recorder *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *names[] = {"name", "collective"};
    PyObject *values[2] = {NULL, Py_None};
    Py_ssize_t given = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    if (nargs > 2 || given < 1 || given > 2) goto bad_call;
    for (Py_ssize_t index = 0; index < nargs; index++) values[index] = args[index];
    for (Py_ssize_t index = 0; kwnames && index < PyTuple_GET_SIZE(kwnames); index++) {
        PyObject *keyword = PyTuple_GET_ITEM(kwnames, index);
        int slot = PyUnicode_CompareWithASCIIString(keyword, names[0]) == 0 ? 0
                 : PyUnicode_CompareWithASCIIString(keyword, names[1]) == 0 ? 1 : -1;
        if (slot < 0 || slot < nargs) goto bad_call;
        values[slot] = args[nargs + index];
    }
    if (values[0] == NULL) goto bad_call;
    if (!ready(self)) Py_RETURN_NONE;
    return recorder_start_interval(self, values[0], values[1]);
bad_call:
    PyErr_SetString(PyExc_TypeError, "start(name, collective=None)");
    return NULL;
}

static PyObject *Recorder_stop(Recorder *self, PyObject *interval) {
    int64_t duration_ns = 0;
    if (ready(self) && recorder_stop_interval(self, interval, &duration_ns) < 0) return NULL;
    return PyLong_FromLongLong(duration_ns);
}

static PyObject *Recorder_begin_step(Recorder *self, PyObject *args, PyObject *kwds) {
    static char *keywords[] = {"step", "tokens", "samples", NULL};
    PyObject *step, *tokens = Py_None, *samples = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OO:begin_step", keywords, &step, &tokens, &samples)) return NULL;
    if (ready(self) && recorder_begin(self, step, tokens, samples) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Recorder_end_step(Recorder *self, PyObject *step) {
    if (ready(self) && recorder_end(self, step) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef Recorder_methods[] = {
    {"start", (PyCFunction)(void (*)(void))Recorder_start, METH_FASTCALL | METH_KEYWORDS,
     "start(name, collective=None): opens an interval; returns it, or None if it could not be timed"},
    {"stop", (PyCFunction)Recorder_stop, METH_O,
     "stop(interval): ends it; returns its host duration in ns (0 if it could not be timed)"},
    {"begin_step", (PyCFunction)(void (*)(void))Recorder_begin_step, METH_VARARGS | METH_KEYWORDS,
     "begin_step(step, tokens=None, samples=None)"},
    {"end_step", (PyCFunction)Recorder_end_step, METH_O, "end_step(step)"},
    {NULL},
};

static PyMemberDef Recorder_members[] = {
    {"completed", T_OBJECT, offsetof(Recorder, completed), READONLY},
    {"capacity", T_PYSSIZET, offsetof(Recorder, capacity), READONLY},
    {"open_intervals", T_OBJECT, offsetof(Recorder, open_intervals), READONLY},
    {"binding", T_OBJECT, offsetof(Recorder, binding), READONLY},
    {"on_first_step", T_OBJECT, offsetof(Recorder, on_first_step), 0},
    {"dropped_queue_full", T_PYSSIZET, offsetof(Recorder, dropped_queue_full), 0},
    {"dropped_step_records", T_PYSSIZET, offsetof(Recorder, dropped_step_records), 0},
    {"internal_errors", T_PYSSIZET, offsetof(Recorder, internal_errors), 0},
    {"untracked_open_intervals", T_PYSSIZET, offsetof(Recorder, untracked_open_intervals), 0},
    {NULL},
};

static PyObject *Recorder_get_event_pool(Recorder *self, void *closure) {
    return Py_NewRef(self->event_pool ? self->event_pool : Py_None);
}

/* Sets the pool and, where it offers them, its `take` and `record_event`. */
static int Recorder_set_event_pool(Recorder *self, PyObject *pool, void *closure) {
    if (pool == NULL) pool = Py_None;
    PyObject *take = NULL, *record = NULL;
    if (pool != Py_None && PyObject_HasAttrString(pool, "take") && PyObject_HasAttrString(pool, "record_event")) {
        take = PyObject_GetAttrString(pool, "take");
        record = take ? PyObject_GetAttrString(pool, "record_event") : NULL;
        if (record == NULL) {
            Py_XDECREF(take);
            return -1;
        }
    }
    Py_XSETREF(self->event_pool, Py_NewRef(pool));
    Py_XSETREF(self->pool_take, take);
    Py_XSETREF(self->pool_record_event, record);
    return 0;
}

static PyGetSetDef Recorder_getset[] = {
    {"event_pool", (getter)Recorder_get_event_pool, (setter)Recorder_set_event_pool, NULL, NULL},
    {NULL},
};

static PyTypeObject RecorderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_straggler.instrumentation._hot_path.IntervalRecorder",
    .tp_doc = "hot_path_reference.IntervalRecorder in C: IntervalRecorder(capacity, event_pool=None)",
    .tp_basicsize = sizeof(Recorder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Recorder_init,
    .tp_traverse = (traverseproc)Recorder_traverse,
    .tp_clear = (inquiry)Recorder_clear,
    .tp_dealloc = (destructor)Recorder_dealloc,
    .tp_methods = Recorder_methods,
    .tp_members = Recorder_members,
    .tp_getset = Recorder_getset,
};

/* -- Stage: `with stage(name):` and `@stage(name)`, otel_straggler.stage ---------------------------- */

/* The public API's documentation (hot_path_reference.Stage and .Step carry the same). Stage and Step
   are otel_straggler.stage and .step themselves, not bases of Python classes: an instance of a
   class defined in Python costs more to make and free (benchmarks/hot_path_in_situ.py measured
   about 0.5 us a call in a training loop). */
#define STAGE_DOC \
    "stage(name, collective=None): times a stage, as `with stage(\"forward-compute\"):` or `@stage(\"data\")`.\n\n" \
    "`collective=True` marks a blocking collective (its duration includes waiting for peers); left as None,\n" \
    "Megatron's known names decide and anything else is not a collective."
#define STEP_DOC \
    "step(n, tokens=None, samples=None): binds optimizer step `n` and this rank's workload to every interval\n" \
    "that ENDS from now on, and starts the rank's `train.step` span. Call it at the start of each step, or use\n" \
    "it as `with step(n, tokens=...):` to end the step span explicitly. `n` is an int or converts to one\n" \
    "losslessly (a numpy integer, a 0-d integer tensor on the CPU: one on a GPU is not read, as that would\n" \
    "wait for the device); anything else loses the step's spans, counted as `internal_error`."

typedef struct {
    PyObject_HEAD
    PyObject *name;
    PyObject *collective;
    PyObject *open; /* the open interval between __enter__ and __exit__, else None */
} Stage;

static PyObject *Stage_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *keywords[] = {"name", "collective", NULL};
    PyObject *name, *collective = Py_None;
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    if (kwds == NULL && nargs == 1) { /* stage("forward-compute"): the common call, parsed by hand */
        name = PyTuple_GET_ITEM(args, 0);
    } else if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O:stage", keywords, &name, &collective)) {
        return NULL;
    }
    Stage *self = (Stage *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->name = Py_NewRef(name);
    self->collective = Py_NewRef(collective);
    self->open = Py_NewRef(Py_None);
    return (PyObject *)self;
}

static int Stage_traverse(Stage *self, visitproc visit, void *arg) {
    Py_VISIT(self->name);
    Py_VISIT(self->collective);
    Py_VISIT(self->open);
    return 0;
}

static int Stage_clear(Stage *self) {
    Py_CLEAR(self->name);
    Py_CLEAR(self->collective);
    Py_CLEAR(self->open);
    return 0;
}

static void Stage_dealloc(Stage *self) {
    PyObject_GC_UnTrack(self);
    Stage_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Stage_enter(Stage *self, PyObject *unused) {
    Recorder *recorder = installed;
    if (recorder != NULL) {
        PyObject *opened = recorder_start_interval(recorder, self->name, self->collective);
        if (opened == NULL) return NULL;
        Py_XSETREF(self->open, opened);
    }
    return Py_NewRef(self);
}

static PyObject *Stage_exit(Stage *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *opened = self->open;
    if (is_set(opened)) {
        self->open = Py_NewRef(Py_None);
        int64_t duration_ns;
        int failed = installed != NULL && recorder_stop_interval(installed, opened, &duration_ns) < 0;
        Py_DECREF(opened);
        if (failed) return NULL;
    }
    Py_RETURN_FALSE;
}

/* `@stage(name)`: hot_path_reference.timed_by does it (in Python: it runs once, at decoration,
   not per call of the hot path), imported on first use. */
static PyObject *timed_by = NULL;
static PyTypeObject StageType;

static PyObject *Stage_call(Stage *self, PyObject *args, PyObject *kwds) {
    PyObject *function;
    if ((kwds != NULL && PyDict_GET_SIZE(kwds)) || !PyArg_ParseTuple(args, "O:stage", &function)) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "a stage decorates one function: @stage(name)");
        return NULL;
    }
    if (timed_by == NULL) {
        PyObject *reference = PyImport_ImportModule("otel_straggler.instrumentation.hot_path_reference");
        if (reference == NULL) return NULL;
        timed_by = PyObject_GetAttrString(reference, "timed_by");
        Py_DECREF(reference);
        if (timed_by == NULL) return NULL;
    }
    return PyObject_CallFunctionObjArgs(timed_by, (PyObject *)&StageType, (PyObject *)self, function, NULL);
}

static PyMethodDef Stage_methods[] = {
    {"__enter__", (PyCFunction)Stage_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))Stage_exit, METH_FASTCALL, NULL},
    {NULL},
};

static PyMemberDef Stage_members[] = {
    {"name", T_OBJECT, offsetof(Stage, name), READONLY},
    {"collective", T_OBJECT, offsetof(Stage, collective), READONLY},
    {"_open", T_OBJECT, offsetof(Stage, open), READONLY},
    {NULL},
};

static PyTypeObject StageType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_straggler.stage",
    .tp_doc = STAGE_DOC,
    .tp_basicsize = sizeof(Stage),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = Stage_new,
    .tp_call = (ternaryfunc)Stage_call,
    .tp_traverse = (traverseproc)Stage_traverse,
    .tp_clear = (inquiry)Stage_clear,
    .tp_dealloc = (destructor)Stage_dealloc,
    .tp_methods = Stage_methods,
    .tp_members = Stage_members,
};

/* -- Step: `step(n, tokens=..., samples=...)`, otel_straggler.step ------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *number;
} Step;

static PyObject *Step_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *keywords[] = {"n", "tokens", "samples", NULL};
    PyObject *number, *tokens = Py_None, *samples = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OO:step", keywords, &number, &tokens, &samples)) return NULL;
    Step *self = (Step *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->number = Py_NewRef(number);
    if (installed != NULL && recorder_begin(installed, number, tokens, samples) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int Step_traverse(Step *self, visitproc visit, void *arg) {
    Py_VISIT(self->number);
    return 0;
}

static int Step_clear(Step *self) {
    Py_CLEAR(self->number);
    return 0;
}

static void Step_dealloc(Step *self) {
    PyObject_GC_UnTrack(self);
    Step_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Step_enter(Step *self, PyObject *unused) { return Py_NewRef(self); }

static PyObject *Step_exit(Step *self, PyObject *const *args, Py_ssize_t nargs) {
    if (installed != NULL && recorder_end(installed, self->number) < 0) return NULL;
    Py_RETURN_FALSE;
}

static PyMethodDef Step_methods[] = {
    {"__enter__", (PyCFunction)Step_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))Step_exit, METH_FASTCALL, NULL},
    {NULL},
};

static PyMemberDef Step_members[] = {
    {"number", T_OBJECT, offsetof(Step, number), READONLY},
    {NULL},
};

static PyTypeObject StepType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "otel_straggler.step",
    .tp_doc = STEP_DOC,
    .tp_basicsize = sizeof(Step),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = Step_new,
    .tp_traverse = (traverseproc)Step_traverse,
    .tp_clear = (inquiry)Step_clear,
    .tp_dealloc = (destructor)Step_dealloc,
    .tp_methods = Step_methods,
    .tp_members = Step_members,
};

/* -- the module ---------------------------------------------------------------------------------- */

static PyObject *install(PyObject *module, PyObject *recorder) {
    if (recorder != Py_None && (!PyObject_TypeCheck(recorder, &RecorderType) || ((Recorder *)recorder)->completed == NULL)) {
        PyErr_SetString(PyExc_TypeError, "install() takes an initialised IntervalRecorder or None");
        return NULL;
    }
    Recorder *previous = installed;
    installed = recorder == Py_None ? NULL : (Recorder *)Py_NewRef(recorder);
    Py_XDECREF(previous);
    Py_RETURN_NONE;
}

static PyObject *use_clock(PyObject *module, PyObject *clock) {
    Py_XSETREF(fake_clock, clock == Py_None ? NULL : Py_NewRef(clock));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"install", install, METH_O, "install(IntervalRecorder or None): the recorder Stage and Step record on"},
    {"use_clock", use_clock, METH_O, "use_clock(callable returning ns, or None): tests only, a fake clock"},
    {NULL},
};

static struct PyModuleDef hot_path_module = {
    PyModuleDef_HEAD_INIT, "_hot_path", "The training thread's hot path in C (see hot_path_reference.py).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__hot_path(void) {
    PyObject *collections = PyImport_ImportModule("collections");
    if (collections == NULL) return NULL;
    deque_type = PyObject_GetAttrString(collections, "deque");
    Py_DECREF(collections);
    if (deque_type == NULL) return NULL;
    str_record = PyUnicode_InternFromString("record");
    str_release = PyUnicode_InternFromString("release");
    kind_interval = PyLong_FromLong(INTERVAL);
    kind_step_begin = PyLong_FromLong(STEP_BEGIN);
    kind_step_end = PyLong_FromLong(STEP_END);
    if (!str_record || !str_release || !kind_interval || !kind_step_begin || !kind_step_end) return NULL;
    if (PyType_Ready(&RecorderType) < 0 || PyType_Ready(&StageType) < 0 || PyType_Ready(&StepType) < 0) return NULL;
    PyObject *module = PyModule_Create(&hot_path_module);
    if (module == NULL) return NULL;
    if (PyModule_AddIntConstant(module, "MAX_OPEN_INTERVALS", MAX_OPEN_INTERVALS) < 0 ||
        PyModule_AddObjectRef(module, "IntervalRecorder", (PyObject *)&RecorderType) < 0 ||
        PyModule_AddObjectRef(module, "Stage", (PyObject *)&StageType) < 0 ||
        PyModule_AddObjectRef(module, "Step", (PyObject *)&StepType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
