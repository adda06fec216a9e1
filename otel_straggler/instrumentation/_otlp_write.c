/* The rank's optional fast path for OTLP/protobuf: one span's fields -> the encoded Span, as a
   field of its ScopeSpans (spans, field 2), ready to be joined into a request.

   span_encoding.SpanEncoder calls span(...) for the common span (no events, links, trace state,
   dropped counts or status description) and writes the span in Python whenever span returns
   None. span answers only when every value has a type the Python encoder writes the same way:
   ids and times ints in range, the name and keys str, attribute values str, bool, int within
   int64 or float, each of exactly that type. Anything else is declined, so the Python encoder alone decides the odd cases;
   where span answers, its bytes equal the Python encoder's (tests/equivalence/test_span_encoding.py).

   The span is written into a buffer on the stack, grown on the heap only for large spans, after
   room for the field's header, and copied once into the bytes returned. Field numbers are those of
   opentelemetry/proto/trace/v1/trace.proto and common/v1/common.proto.

   span() keeps the GIL: nearly all of its work is reading the Python values (ids, times, the
   attribute dict), which needs it, and the byte writing left (well under a microsecond for a
   span of ~300 bytes) is shorter than releasing and retaking the GIL, which, with a training
   thread running Python, waits for that thread's next switch (up to sys.getswitchinterval())
   on every span: the builder would fall behind. join() releases it for the copying of a whole
   request, where that pays. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Span.flags (field 16, fixed32): SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK, and _IS_REMOTE_MASK */
#define FLAGS_HAS_IS_REMOTE 0x100u
#define FLAGS_IS_REMOTE 0x200u

typedef struct {
    uint8_t *data;
    Py_ssize_t len, cap;
    uint8_t stack[1024];
} Buffer;

/* A buffer on its own stack, with `len` bytes reserved at its start. Not an initializer: that
   would zero the whole stack array, on every span and every attribute. */
#define BUFFER_INIT(b, reserved) ((b).len = (reserved), (b).cap = sizeof (b).stack, (b).data = (b).stack)

/* The small writers below are called a few dozen times a span: inlined, each is a bounds check
   and a store or two, where a call each cost several times the writing (the writer took about
   8000 instructions a span before). */
#if defined(__GNUC__)
#define HOT static inline __attribute__((always_inline))
#else
#define HOT static inline
#endif

static int grow(Buffer *b, Py_ssize_t more);

/* Room for `more` bytes; -1 with MemoryError set when there is none. */
HOT int reserve(Buffer *b, Py_ssize_t more) {
    if (b->len + more <= b->cap) return 0;
    return grow(b, more);
}

static int grow(Buffer *b, Py_ssize_t more) {
    if (more > PY_SSIZE_T_MAX / 4 - b->len) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t cap = b->cap;
    while (cap < b->len + more) cap *= 2;
    uint8_t *data = PyMem_Malloc(cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(data, b->data, b->len);
    if (b->data != b->stack) PyMem_Free(b->data);
    b->data = data;
    b->cap = cap;
    return 0;
}

HOT int put(Buffer *b, const void *bytes, Py_ssize_t n) {
    if (reserve(b, n)) return -1;
    memcpy(b->data + b->len, bytes, n);
    b->len += n;
    return 0;
}

HOT int put_varint(Buffer *b, uint64_t value) {
    uint8_t out[10];
    int n = 0;
    while (value > 0x7F) {
        out[n++] = (uint8_t)((value & 0x7F) | 0x80);
        value >>= 7;
    }
    out[n++] = (uint8_t)value;
    return put(b, out, n);
}

HOT int varint_size(uint64_t value) {
    int n = 1;
    for (; value > 0x7F; value >>= 7) n++;
    return n;
}

HOT int put_big_endian(Buffer *b, uint64_t value, int n) {
    uint8_t out[8];
    for (int i = n - 1; i >= 0; i--, value >>= 8) out[i] = (uint8_t)value;
    return put(b, out, n);
}

HOT int put_little_endian(Buffer *b, uint64_t value, int n) {
    uint8_t out[8];
    for (int i = 0; i < n; i++, value >>= 8) out[i] = (uint8_t)value;
    return put(b, out, n);
}

/* A length-delimited field: tag, the length, the bytes. */
HOT int put_bytes_field(Buffer *b, uint8_t tag, const char *bytes, Py_ssize_t n) {
    return put(b, &tag, 1) || put_varint(b, (uint64_t)n) || put(b, bytes, n);
}

/* Declines (returns 1, no exception set) where the Python encoder would fail or differ. */
#define DECLINE 1
#define FAILED (-1) /* with an exception set: out of memory, or a Python call that failed */

/* The UTF-8 bytes of a str; a str that has no UTF-8 form (lone surrogates) declines. */
HOT int utf8(PyObject *text, const char **bytes, Py_ssize_t *n) {
    if (!PyUnicode_CheckExact(text)) return DECLINE;
    *bytes = PyUnicode_AsUTF8AndSize(text, n);
    if (*bytes == NULL) {
        PyErr_Clear();
        return DECLINE;
    }
    return 0;
}

/* An unsigned int of at most 64 bits; anything else (negative, larger, not an int) declines. */
HOT int as_u64(PyObject *number, uint64_t *out) {
    if (!PyLong_CheckExact(number)) return DECLINE;
    *out = PyLong_AsUnsignedLongLong(number);
    if (*out == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return DECLINE;
    }
    return 0;
}

/* A trace id: an int in [0, 2**128), written as 16 big-endian bytes. */
static int put_trace_id(Buffer *b, PyObject *trace_id) {
    static PyObject *sixty_four;
    uint64_t high, low;
    if (!PyLong_CheckExact(trace_id)) return DECLINE;
    if (sixty_four == NULL && (sixty_four = PyLong_FromLong(64)) == NULL) return FAILED;
    PyObject *shifted = PyNumber_Rshift(trace_id, sixty_four);
    if (shifted == NULL) return FAILED;
    int declined = as_u64(shifted, &high); /* negative or >= 2**128 */
    Py_DECREF(shifted);
    if (declined) return DECLINE;
    low = PyLong_AsUnsignedLongLongMask(trace_id);
    if (PyErr_Occurred()) return FAILED;
    return put(b, "\x0a\x10", 2) || put_big_endian(b, high, 8) || put_big_endian(b, low, 8) ? FAILED : 0;
}

/* A span time (fixed64 field); None or 0 is left out, as the Python encoder does. */
static int put_time(Buffer *b, uint8_t tag, PyObject *time) {
    uint64_t value;
    if (time == Py_None) return 0;
    int declined = as_u64(time, &value);
    if (declined || value == 0) return declined;
    return put(b, &tag, 1) || put_little_endian(b, value, 8) ? FAILED : 0;
}

/* A double as 8 little-endian bytes (protobuf's `double`); 0, or -1 with an error set. */
static int pack_double_le(double x, uint8_t *p) {
#if PY_VERSION_HEX >= 0x030B0000
    return PyFloat_Pack8(x, (char *)p, 1);
#else
    return _PyFloat_Pack8(x, p, 1); /* the same function, public from 3.11 */
#endif
}

/* An AnyValue of a bool, an int within int64, a float or a str; subclasses decline (Python
   calls their own methods to encode them). */
static int put_any_value(Buffer *b, PyObject *value) {
    if (PyBool_Check(value)) {
        uint8_t field[2] = {0x10, value == Py_True};
        return put(b, field, 2) ? FAILED : 0;
    }
    if (PyLong_CheckExact(value)) {
        int overflow;
        long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (overflow) return DECLINE;
        if (number == -1 && PyErr_Occurred()) return FAILED;
        return put(b, "\x18", 1) || put_varint(b, (uint64_t)number) ? FAILED : 0;
    }
    if (PyFloat_CheckExact(value)) {
        uint8_t field[9] = {0x21};
        if (pack_double_le(PyFloat_AS_DOUBLE(value), field + 1)) return FAILED;
        return put(b, field, 9) ? FAILED : 0;
    }
    const char *text;
    Py_ssize_t n;
    int declined = utf8(value, &text, &n);
    if (declined) return declined;
    return put_bytes_field(b, 0x0a, text, n) ? FAILED : 0;
}

/* Span.attributes (field 9): a KeyValue {key (1), value (2): AnyValue} for each item. */
static int put_attribute(Buffer *b, PyObject *key, PyObject *value) {
    const char *key_text;
    Py_ssize_t key_n;
    int result = utf8(key, &key_text, &key_n);
    if (result) return result;
    Buffer any;
    BUFFER_INIT(any, 0);
    if ((result = put_any_value(&any, value)) == 0) {
        uint64_t pair_n = 1 + varint_size(key_n) + key_n + 1 + varint_size(any.len) + any.len;
        result = put(b, "\x4a", 1) || put_varint(b, pair_n) || put_bytes_field(b, 0x0a, key_text, key_n)
                 || put_bytes_field(b, 0x12, (const char *)any.data, any.len) ? FAILED : 0;
    }
    if (any.data != any.stack) PyMem_Free(any.data);
    return result;
}

/* The attributes: None or a dict (the span builder's own); any other mapping declines. */
static int put_attributes(Buffer *b, PyObject *attributes) {
    if (attributes == Py_None) return 0;
    if (!PyDict_CheckExact(attributes)) return DECLINE;
    Py_ssize_t position = 0;
    PyObject *key, *value;
    int result = 0;
    while (result == 0 && PyDict_Next(attributes, &position, &key, &value)) {
        Py_INCREF(key); /* a str's or float's encoding runs no Python code, but stay safe */
        Py_INCREF(value);
        result = put_attribute(b, key, value);
        Py_DECREF(key);
        Py_DECREF(value);
    }
    return result;
}

static int write_span(Buffer *b, PyObject *const *args) {
    PyObject *trace_id = args[0], *span_id = args[1], *parent_span_id = args[2], *parent_is_remote = args[3],
             *name = args[4], *kind = args[5], *start = args[6], *end = args[7], *attributes = args[8],
             *status_code = args[9];
    uint64_t id, kind_value, code;
    const char *name_text;
    Py_ssize_t name_n;
    int result;
    if ((result = put_trace_id(b, trace_id))) return result;
    if ((result = as_u64(span_id, &id))) return result;
    if (put(b, "\x12\x08", 2) || put_big_endian(b, id, 8)) return FAILED;
    if (parent_span_id != Py_None) {
        if ((result = as_u64(parent_span_id, &id))) return result;
        if (put(b, "\x22\x08", 2) || put_big_endian(b, id, 8)) return FAILED;
    }
    if ((result = utf8(name, &name_text, &name_n))) return result;
    if ((result = as_u64(kind, &kind_value)) || (result = as_u64(status_code, &code))) return result;
    if (put_bytes_field(b, 0x2a, name_text, name_n) || put(b, "\x30", 1) || put_varint(b, kind_value)) return FAILED;
    if ((result = put_time(b, 0x39, start)) || (result = put_time(b, 0x41, end))) return result;
    if ((result = put_attributes(b, attributes))) return result;
    /* Span.status (field 15): its code (field 3) when set; the message even when empty */
    if (code == 0 ? put(b, "\x7a\x00", 2)
                  : put(b, "\x7a", 1) || put_varint(b, 1 + varint_size(code)) || put(b, "\x18", 1) || put_varint(b, code))
        return FAILED;
    int remote = PyObject_IsTrue(parent_is_remote);
    if (remote < 0) return FAILED;
    uint32_t flags = FLAGS_HAS_IS_REMOTE | (parent_span_id != Py_None && remote ? FLAGS_IS_REMOTE : 0);
    return put(b, "\x85\x01", 2) || put_little_endian(b, flags, 4) ? FAILED : 0;
}

/* The header of ScopeSpans.spans (field 2) goes before the Span: at most a tag and 5 bytes. */
#define HEADER_ROOM 6

static PyObject *span(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "span(trace_id, span_id, parent_span_id, parent_is_remote, name, kind, start_time, end_time,"
                        " attributes, status_code) takes 10 arguments");
        return NULL;
    }
    Buffer b;
    BUFFER_INIT(b, HEADER_ROOM);
    int result = write_span(&b, args);
    PyObject *written = NULL;
    if (result == 0 && b.len - HEADER_ROOM >= INT32_MAX) result = DECLINE; /* beyond what protobuf takes */
    if (result == 0) {
        uint64_t body_n = (uint64_t)(b.len - HEADER_ROOM);
        int header_n = 1 + varint_size(body_n);
        Buffer header;
        BUFFER_INIT(header, 0);
        put(&header, "\x12", 1); /* cannot fail: the stack holds it */
        put_varint(&header, body_n);
        uint8_t *start = b.data + HEADER_ROOM - header_n;
        memcpy(start, header.data, header_n);
        written = PyBytes_FromStringAndSize((char *)start, b.len - HEADER_ROOM + header_n);
    } else if (result == DECLINE) {
        written = Py_NewRef(Py_None);
    }
    if (b.data != b.stack) PyMem_Free(b.data);
    return written;
}

/* The fields of the span builder's spans (record_span.RecordSpan), read by name: interned once. */
static PyObject *record_field_names[9];
static const char *const RECORD_FIELDS[9] = {"record_trace_id", "record_span_id", "record_parent_span_id",
                                             "record_name", "record_start_ns", "record_end_ns",
                                             "record_attributes", "record_resource", "record_scope"};
enum { TRACE_ID, SPAN_ID, PARENT_SPAN_ID, NAME, START_NS, END_NS, ATTRIBUTES, RESOURCE, SCOPE };

/* One RecordSpan as span() writes it (local, SPAN_KIND_INTERNAL, UNSET status), read from its
   fields: the (index, bytes) that SpanEncoder.prewrite makes of it, a new reference; None (a new
   reference) where span() declines it, its resource or scope is not the pair given, or its
   attributes are not a plain dict; NULL with an exception set where something failed. */
static PyObject *record_item(PyObject *record, PyObject *resource, PyObject *scope, PyObject *index) {
    PyObject *fields[9] = {NULL};
    PyObject *item = NULL;
    for (int i = 0; i < 9; i++) {
        /* the slots themselves: RecordSpan's __getattr__ (for ReadableSpan's own fields) would make
           every read go through its hook, several times the read. A slot not set declines. */
        fields[i] = PyObject_GenericGetAttr(record, record_field_names[i]);
        if (fields[i] == NULL) {
            PyErr_Clear();
            item = Py_NewRef(Py_None);
            goto done;
        }
    }
    if (fields[RESOURCE] != resource || fields[SCOPE] != scope
        || (fields[ATTRIBUTES] != Py_None && !PyDict_CheckExact(fields[ATTRIBUTES]))) {
        item = Py_NewRef(Py_None);
        goto done;
    }
    static PyObject *one, *zero;
    if (one == NULL && (one = PyLong_FromLong(1)) == NULL) goto done;
    if (zero == NULL && (zero = PyLong_FromLong(0)) == NULL) goto done;
    PyObject *args[10] = {fields[TRACE_ID], fields[SPAN_ID], fields[PARENT_SPAN_ID], Py_False, fields[NAME], one,
                          fields[START_NS], fields[END_NS], fields[ATTRIBUTES], zero};
    PyObject *written = span(NULL, args, 10);
    if (written == NULL) goto done;
    if (written == Py_None) {
        item = written;
        goto done;
    }
    item = PyTuple_Pack(2, index, written);
    Py_DECREF(written);
done:
    for (int i = 0; i < 9; i++) Py_XDECREF(fields[i]);
    return item;
}

/* record_spans(spans, span_type, resource, scope, index): for each of a list of spans, what
   SpanEncoder.prewrite makes of a RecordSpan (span_type) of that resource and scope, the group
   `index` of which is given: (index, the encoded Span field); None for a span of another type,
   resource or scope, or one span() declines, for the Python encoder to decide. */
static PyObject *record_spans(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "record_spans(spans: list, span_type, resource, scope, index)");
        return NULL;
    }
    PyObject *spans = args[0], *span_type = args[1], *resource = args[2], *scope = args[3], *index = args[4];
    Py_ssize_t count = PyList_GET_SIZE(spans);
    PyObject *items = PyList_New(count);
    if (items == NULL) return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *record = PyList_GET_ITEM(spans, i);
        PyObject *item;
        if ((PyObject *)Py_TYPE(record) != span_type) {
            item = Py_NewRef(Py_None);
        } else {
            Py_INCREF(record); /* reading its fields runs no code of its own, but the list is not ours */
            item = record_item(record, resource, scope, index);
            Py_DECREF(record);
            if (item == NULL) {
                Py_DECREF(items);
                return NULL;
            }
        }
        PyList_SET_ITEM(items, i, item);
    }
    return items;
}

/* Below this many bytes a request is copied with the GIL held: releasing it and taking it back
   would cost more than the copy. */
#define JOIN_WITHOUT_GIL_FROM 16384

/* join(parts): b"".join(parts) for a list of bytes objects (a request's pieces, in order). The
   pieces are found and the result made while holding the GIL; the copying, the bulk of the work
   for a request of hundreds of spans, runs with the GIL released, so a training thread waiting
   for it need not wait for the copy. The pieces are held by a tuple of our own meanwhile, so the
   list may change under us without harm. */
static PyObject *join(PyObject *Py_UNUSED(module), PyObject *parts) {
    if (!PyList_CheckExact(parts)) {
        PyErr_SetString(PyExc_TypeError, "join(parts) takes a list of bytes");
        return NULL;
    }
    PyObject *held = PyList_AsTuple(parts);
    if (held == NULL) return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(held), total = 0;
    const char **sources = PyMem_Malloc(sizeof *sources * (count ? count : 1));
    Py_ssize_t *sizes = PyMem_Malloc(sizeof *sizes * (count ? count : 1));
    PyObject *joined = NULL;
    if (sources == NULL || sizes == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *part = PyTuple_GET_ITEM(held, i);
        if (!PyBytes_CheckExact(part)) {
            PyErr_Format(PyExc_TypeError, "join(parts): item %zd is %.100s, not bytes", i, Py_TYPE(part)->tp_name);
            goto done;
        }
        sources[i] = PyBytes_AS_STRING(part);
        sizes[i] = PyBytes_GET_SIZE(part);
        if (sizes[i] > PY_SSIZE_T_MAX - total) {
            PyErr_NoMemory();
            goto done;
        }
        total += sizes[i];
    }
    joined = PyBytes_FromStringAndSize(NULL, total);
    if (joined == NULL) goto done;
    char *to = PyBytes_AS_STRING(joined);
    if (total < JOIN_WITHOUT_GIL_FROM) {
        for (Py_ssize_t i = 0; i < count; to += sizes[i], i++) memcpy(to, sources[i], sizes[i]);
    } else {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < count; to += sizes[i], i++) memcpy(to, sources[i], sizes[i]);
        Py_END_ALLOW_THREADS
    }
done:
    PyMem_Free(sources);
    PyMem_Free(sizes);
    Py_DECREF(held);
    return joined;
}

static PyMethodDef methods[] = {
    {"join", join, METH_O,
     "join(parts) -> b''.join(parts) for a list of bytes, copied without holding the GIL when large"},
    {"record_spans", (PyCFunction)(void (*)(void))record_spans, METH_FASTCALL,
     "record_spans(spans, span_type, resource, scope, index) -> for each span of the list, (index, its encoded"
     " Span field) where it is a span_type of that resource and scope that span() writes, else None"},
    {"span", (PyCFunction)(void (*)(void))span, METH_FASTCALL,
     "span(trace_id, span_id, parent_span_id, parent_is_remote, name, kind, start_time, end_time, attributes,"
     " status_code) -> the Span as an encoded field of ScopeSpans, or None where the Python encoder must write it"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_otlp_write", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__otlp_write(void) {
    for (int i = 0; i < 9; i++) {
        if (record_field_names[i] == NULL && (record_field_names[i] = PyUnicode_InternFromString(RECORD_FIELDS[i])) == NULL)
            return NULL;
    }
    return PyModule_Create(&module_def);
}
