/* The detector's optional fast path: serialized ExportTraceServiceRequest -> observation records.

   Each stage span becomes one fixed-width Record (observation.RECORD_FORMAT) in one bytes buffer,
   its strings and identity given as indexes into two lists made once per request, so no Python
   object is made per span: the engine's C intake (_ingest.append_records) reads the buffer, and
   observation.ObservationRecords makes Observations of it where Python needs them. Besides the
   records it returns, for decode.py to read in Python (they are few): the raw Resource of each
   ResourceSpans that gave a record (where its ranks run), and the raw Resource and Span of each
   heartbeat span (CONTRACT §2b).

   decode.py calls scan(payload) first and falls back to its own protobuf decoder whenever scan
   returns None. scan answers only for payloads it fully understands: canonical wire encoding of
   every field it reads, each wanted attribute at most once, ASCII attribute keys and span names,
   every value a single scalar AnyValue, and every stage span valid by CONTRACT §1-2 (as
   decode._observation judges it). Anything else, including every malformed or rejected span, is
   declined, so the reference decoder alone decides what is malformed and why; where scan answers,
   its answer equals the reference decoder's (tests/detector/test_decode_fast.py checks both ways).

   Every read is bounds-checked against the payload; nothing is written outside Python objects.
   Field numbers are those of opentelemetry/proto/{collector/trace,trace,resource,common}/v1. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "observation_record.h"

enum { K_STAGE, K_STEP, K_SEQ, K_TIMING, K_COLLECTIVE, K_TOKENS, K_SAMPLES, K_DEVICE_MS,
       K_JOB, K_EPOCH, K_COHORT, K_RANK, K_RESTART, N_KEYS };
#define N_IDENTITY 5 /* K_JOB .. K_RESTART */
enum { V_ABSENT, V_STR, V_BOOL, V_INT, V_DOUBLE };

typedef struct { const uint8_t *p, *end; } Reader;
typedef struct { const uint8_t *p; Py_ssize_t n; int found; } Slice; /* raw AnyValue bytes */
typedef struct { int kind; const uint8_t *s; Py_ssize_t n; int64_t i; double d; } Value;

/* set once by configure() */
static PyObject *key_names[N_KEYS];          /* bytes */
static int configured;
static PyObject *heartbeat_name;             /* bytes: the heartbeat span's name */
static PyObject *default_cohort;             /* str */
static PyObject *device_timing;              /* bytes: training.stage.timing's "device" */

/* The readers below are called for every field of every span: inline, with the one-byte varint
   (most tags and lengths) read first. */
static inline int read_varint(Reader *r, uint64_t *out) {
    if (r->p < r->end && *r->p < 0x80) {
        *out = *r->p++;
        return 0;
    }
    uint64_t value = 0;
    for (int shift = 0; shift < 64 && r->p < r->end; shift += 7) {
        uint8_t byte = *r->p++;
        if (shift == 63 && byte > 1) return -1; /* more than 64 bits */
        value |= (uint64_t)(byte & 0x7F) << shift;
        if (byte < 0x80) { *out = value; return 0; }
    }
    return -1;
}

/* Tags and lengths: upb refuses varints of more than 5 bytes there, so longer ones decline. */
static inline int read_varint32(Reader *r, uint64_t *out) {
    if (r->p < r->end && *r->p < 0x80) {
        *out = *r->p++;
        return 0;
    }
    uint64_t value = 0;
    for (int shift = 0; shift < 35 && r->p < r->end; shift += 7) {
        uint8_t byte = *r->p++;
        value |= (uint64_t)(byte & 0x7F) << shift;
        if (byte < 0x80) { *out = value; return 0; }
    }
    return -1;
}

static inline int read_fixed64(Reader *r, uint64_t *out) {
    if (r->end - r->p < 8) return -1;
    uint64_t value;
    memcpy(&value, r->p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    value = __builtin_bswap64(value); /* the wire is little-endian */
#endif
    r->p += 8;
    *out = value;
    return 0;
}

/* A length-delimited field's body as its own reader. */
static inline int read_len(Reader *r, Reader *body) {
    uint64_t n;
    if (read_varint32(r, &n) || n >= INT32_MAX || n > (uint64_t)(r->end - r->p)) return -1;
    body->p = r->p;
    body->end = r->p + n;
    r->p += n;
    return 0;
}

static inline int read_tag(Reader *r, uint32_t *field, uint32_t *wire_type) {
    uint64_t key;
    if (read_varint32(r, &key) || key > UINT32_MAX || (key >> 3) == 0) return -1;
    *field = (uint32_t)(key >> 3);
    *wire_type = (uint32_t)(key & 7);
    return 0;
}

static inline int skip(Reader *r, uint32_t wire_type) {
    uint64_t ignored;
    Reader body;
    switch (wire_type) {
    case 0: return read_varint(r, &ignored);
    case 1: return read_fixed64(r, &ignored);
    case 2: return read_len(r, &body);
    case 5:
        if (r->end - r->p < 4) return -1;
        r->p += 4;
        return 0;
    default: return -1; /* groups and reserved wire types: the reference decoder decides */
    }
}

static inline int is_ascii(const uint8_t *p, Py_ssize_t n) {
    uint64_t high = 0, word;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) { /* eight bytes at a time: keys are some 20 bytes long */
        memcpy(&word, p + i, 8);
        high |= word;
    }
    if (i < n && n >= 8) { /* the last eight bytes, overlapping */
        memcpy(&word, p + n - 8, 8);
        high |= word;
    } else {
        for (; i < n; i++) high |= p[i];
    }
    return (high & 0x8080808080808080ULL) == 0;
}

/* Wanted keys by length: a key is found by its length, its last 8 bytes (keys share long
   prefixes, "training.") and one compare of the rest, word by word, without a call. Every wanted
   key is ASCII (configure checks), so a key that is one of them needs no check of its own. */
#define MAX_KEY_LENGTH 64
static uint64_t key_tails[N_KEYS];
static int8_t keys_of_length[MAX_KEY_LENGTH + 1][N_KEYS + 1]; /* each list ends with -1 */

static inline uint64_t tail_of(const uint8_t *p, Py_ssize_t n) {
    uint64_t tail = 0;
    if (n >= 8) memcpy(&tail, p + n - 8, 8);
    else memcpy(&tail, p, (size_t)n);
    return tail;
}

/* Whether a and b, both n bytes long with equal last 8 bytes (tail_of), are equal: the words
   before the tail compared (the last one overlapping it where n is not a multiple of 8). */
static inline int same_before_tail(const uint8_t *a, const uint8_t *b, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n - 8; i += 8) {
        uint64_t x, y;
        memcpy(&x, a + i, 8);
        memcpy(&y, b + i, 8);
        if (x != y) return 0;
    }
    return 1;
}

static inline int key_index(const uint8_t *p, Py_ssize_t n, int first, int last) {
    if (n > MAX_KEY_LENGTH) return -1;
    uint64_t tail = tail_of(p, n);
    for (const int8_t *k = keys_of_length[n]; *k >= 0; k++)
        if (*k >= first && *k < last && key_tails[*k] == tail
            && same_before_tail((const uint8_t *)PyBytes_AS_STRING(key_names[*k]), p, n))
            return *k;
    return -1;
}

/* One attribute (a KeyValue, which has a map entry's wire format): keeps the raw value of wanted
   key k (first <= k < last) in slices[k - first]. -1: decline. */
static int read_attribute(Reader *r, Slice *slices, int first, int last) {
    Reader entry, key = {NULL, NULL}, value = {NULL, NULL};
    int has_key = 0, has_value = 0;
    if (read_len(r, &entry)) return -1;
    while (entry.p < entry.end) {
        uint32_t field, wire_type;
        if (read_tag(&entry, &field, &wire_type) || wire_type != 2) return -1;
        if (field == 1 && !has_key) { if (read_len(&entry, &key)) return -1; has_key = 1; }
        else if (field == 2 && !has_value) { if (read_len(&entry, &value)) return -1; has_value = 1; }
        else return -1;
    }
    if (!has_key) return -1;
    int k = key_index(key.p, key.end - key.p, first, last);
    if (k < 0) return is_ascii(key.p, key.end - key.p) ? 0 : -1; /* a wanted key is ASCII already */
    Slice *slot = &slices[k - first];
    if (slot->found || !has_value) return -1;
    slot->p = value.p;
    slot->n = value.end - value.p;
    slot->found = 1;
    return 0;
}

/* A single scalar AnyValue, canonically encoded; absent when the attribute is. -1: decline. */
static int read_value(const Slice *slice, Value *v) {
    v->kind = V_ABSENT;
    if (!slice->found) return 0;
    Reader r = {slice->p, slice->p + slice->n};
    uint64_t key, raw;
    Reader body;
    if (read_varint32(&r, &key)) return -1;
    switch (key) {
    case 0x0A: /* string_value */
        if (read_len(&r, &body)) return -1;
        v->kind = V_STR; v->s = body.p; v->n = body.end - body.p;
        break;
    case 0x10: /* bool_value */
        if (read_varint(&r, &raw)) return -1;
        v->kind = V_BOOL; v->i = raw != 0;
        break;
    case 0x18: /* int_value */
        if (read_varint(&r, &raw)) return -1;
        v->kind = V_INT; v->i = (int64_t)raw;
        break;
    case 0x21: /* double_value */
        if (read_fixed64(&r, &raw)) return -1;
        v->kind = V_DOUBLE; memcpy(&v->d, &raw, sizeof v->d);
        break;
    default: return -1;
    }
    return r.p == r.end ? 0 : -1;
}

/* Strings that come again in every request (stage names, job ids, cohorts): the latest ones
   decoded, handed out again for the same bytes, which saves decoding and allocating one per span and
   lets the engine compare them by identity. Bounded: STR_CACHE entries replaced in turn, each at
   most STR_CACHE_MAX_BYTES long; a stream of ever new names only misses. */
#define STR_CACHE 64
#define STR_CACHE_MAX_BYTES 64
static struct { Py_ssize_t n; char bytes[STR_CACHE_MAX_BYTES]; PyObject *str; } str_cache[STR_CACHE];
static int str_cache_next;

static PyObject *new_str(const Value *v) {
    if (v->n > STR_CACHE_MAX_BYTES) return PyUnicode_DecodeUTF8((const char *)v->s, v->n, NULL);
    for (int i = 0; i < STR_CACHE; i++)
        if (str_cache[i].str != NULL && str_cache[i].n == v->n && memcmp(str_cache[i].bytes, v->s, v->n) == 0)
            return Py_NewRef(str_cache[i].str);
    PyObject *str = PyUnicode_DecodeUTF8((const char *)v->s, v->n, NULL);
    if (str == NULL) return NULL;
    int slot = str_cache_next;
    str_cache_next = (slot + 1) % STR_CACHE;
    Py_XSETREF(str_cache[slot].str, Py_NewRef(str));
    memcpy(str_cache[slot].bytes, v->s, v->n);
    str_cache[slot].n = v->n;
    return str;
}

/* decode._positive_count: a positive int, a finite float >= 1 truncated, else 0 (None). -1: a
   count beyond a record's 64 bits, declined. */
static int positive_count(const Value *v, int64_t *out) {
    *out = 0;
    if (v->kind == V_INT && v->i > 0) *out = v->i;
    if (v->kind == V_DOUBLE && isfinite(v->d) && v->d >= 1.0) {
        if (v->d >= 9223372036854775808.0) return -1;
        *out = (int64_t)v->d; /* truncated, as int(float) */
    }
    return 0;
}

/* What a request gives: records with their strings and identities, a count of ignored spans,
   heartbeats as (resource, span) raw bytes; per ResourceSpans, whether any record came from it. */
#define STAGE_TABLE 32
typedef struct {
    Record *records;
    Py_ssize_t n_records, records_capacity;
    PyObject *strings, *identities, *heartbeats; /* lists */
    Py_ssize_t ignored;
    Slice resource; /* raw Resource bytes (found: 0 when the ResourceSpans has none) */
    int observed;
    /* the latest span's identity values and its index: the spans of a request mostly share one
       (their rank's resource) */
    int has_identity;
    Value identity_values[N_IDENTITY];
    int32_t identity;
    int32_t resource_identity; /* the current ResourceSpans' identity index (span_identity); -1: not read yet */
    /* stage names seen in this request and their index in strings (the first STAGE_TABLE) */
    struct { const uint8_t *p; Py_ssize_t n; uint64_t tail; int32_t index; } stages[STAGE_TABLE];
    int n_stages;
} Scan;

static int same_value(const Value *a, const Value *b) {
    if (a->kind != b->kind) return 0;
    if (a->kind == V_STR) return a->n == b->n && memcmp(a->s, b->s, a->n) == 0;
    return a->kind == V_ABSENT || a->i == b->i;
}

/* The index of a span's identity (resource values first) in scan->identities, where a new one
   is appended as (job, epoch, cohort, rank, restart count). -1: decline. */
static int read_identity(Scan *scan, const Value *given, int32_t *out) {
    if (scan->has_identity) {
        int same = 1;
        for (int i = 0; i < N_IDENTITY && same; i++) same = same_value(&given[i], &scan->identity_values[i]);
        if (same) {
            *out = scan->identity;
            return 0;
        }
    }
    const Value *job = &given[0], *epoch = &given[1], *cohort = &given[2], *rank = &given[3], *restart = &given[4];
    if (job->kind != V_STR || job->n == 0 || rank->kind != V_INT || rank->i < 0) return -1;
    if (!(epoch->kind == V_ABSENT || (epoch->kind == V_INT && epoch->i >= 0))) return -1;
    if (!(restart->kind == V_ABSENT || (restart->kind == V_INT && restart->i >= 0))) return -1;
    if (!(cohort->kind == V_ABSENT || cohort->kind == V_STR)) return -1;
    Py_ssize_t index = PyList_GET_SIZE(scan->identities);
    if (index >= INT32_MAX) return -1;
    PyObject *cohort_name = cohort->kind == V_ABSENT || cohort->n == 0 ? Py_NewRef(default_cohort) : new_str(cohort);
    if (cohort_name == NULL) return -1;
    PyObject *identity = Py_BuildValue("(NLNLL)", new_str(job), (long long)(epoch->kind == V_ABSENT ? 0 : epoch->i),
                                       cohort_name, (long long)rank->i,
                                       (long long)(restart->kind == V_ABSENT ? 0 : restart->i));
    if (identity == NULL) return -1;
    int appended = PyList_Append(scan->identities, identity);
    Py_DECREF(identity);
    if (appended < 0) return -1;
    for (int i = 0; i < N_IDENTITY; i++) scan->identity_values[i] = given[i];
    scan->has_identity = 1;
    scan->identity = *out = (int32_t)index;
    return 0;
}

/* The index of a stage name in scan->strings, appended there when new. -1: decline. */
static int stage_index(Scan *scan, const Value *v, int32_t *out) {
    uint64_t tail = tail_of(v->s, v->n);
    for (int i = 0; i < scan->n_stages; i++)
        if (scan->stages[i].n == v->n && scan->stages[i].tail == tail && same_before_tail(scan->stages[i].p, v->s, v->n)) {
            *out = scan->stages[i].index;
            return 0;
        }
    Py_ssize_t index = PyList_GET_SIZE(scan->strings);
    if (index >= INT32_MAX) return -1;
    PyObject *name = new_str(v);
    if (name == NULL) return -1;
    int appended = PyList_Append(scan->strings, name);
    Py_DECREF(name);
    if (appended < 0) return -1;
    if (scan->n_stages < STAGE_TABLE) {
        scan->stages[scan->n_stages].p = v->s;
        scan->stages[scan->n_stages].n = v->n;
        scan->stages[scan->n_stages].tail = tail;
        scan->stages[scan->n_stages].index = (int32_t)index;
        scan->n_stages++;
    }
    *out = (int32_t)index;
    return 0;
}

static Record *new_record(Scan *scan) {
    if (scan->n_records == scan->records_capacity) {
        Py_ssize_t capacity = scan->records_capacity ? 2 * scan->records_capacity : 64;
        Record *grown = PyMem_Realloc(scan->records, capacity * sizeof(Record));
        if (grown == NULL) return NULL;
        scan->records = grown;
        scan->records_capacity = capacity;
    }
    return &scan->records[scan->n_records++];
}

static PyObject *slice_bytes(const uint8_t *p, Py_ssize_t n) { return PyBytes_FromStringAndSize((const char *)p, n); }

/* A heartbeat span: (raw Resource, raw Span) appended for decode.py. */
static int keep_heartbeat(Scan *scan, const uint8_t *span_p, Py_ssize_t span_n) {
    PyObject *pair = Py_BuildValue("(NN)", scan->resource.found ? slice_bytes(scan->resource.p, scan->resource.n)
                                                                : PyBytes_FromStringAndSize(NULL, 0),
                                   slice_bytes(span_p, span_n));
    if (pair == NULL) return -1;
    int appended = PyList_Append(scan->heartbeats, pair);
    Py_DECREF(pair);
    return appended;
}

/* The index of a span's identity. Where each identity key the span names is named by its resource
too (whose values win), the identity is the resource's alone: read once per ResourceSpans, not
once per span (the usual span names none; its rank's resource names them all). -1: decline. */
static int span_identity(Scan *scan, const Slice *slices, const Slice *resource_identity, int32_t *out) {
    int resource_alone = 1;
    for (int i = 0; i < N_IDENTITY; i++)
        if (slices[K_JOB + i].found && !resource_identity[i].found) resource_alone = 0;
    if (resource_alone && scan->resource_identity >= 0) {
        *out = scan->resource_identity;
        return 0;
    }
    Value given[N_IDENTITY];
    for (int i = 0; i < N_IDENTITY; i++)
        if (read_value(resource_identity[i].found ? &resource_identity[i] : &slices[K_JOB + i], &given[i])) return -1;
    if (read_identity(scan, given, out)) return -1;
    if (resource_alone) scan->resource_identity = *out;
    return 0;
}

/* One span: appends its Observation, keeps it as a heartbeat, counts it ignored, or declines (-1). */
static int read_span(Reader *span, const Slice *resource_identity, Scan *scan) {
    Slice slices[N_KEYS] = {{0}};
    uint64_t start = 0, end = 0;
    int has_start = 0, has_end = 0, heartbeat = 0;
    const uint8_t *span_p = span->p;
    Py_ssize_t span_n = span->end - span->p;
    while (span->p < span->end) {
        uint32_t field, wire_type;
        Reader name;
        if (read_tag(span, &field, &wire_type)) return -1;
        if (field == 5) { /* name: a string, which the reference decoder checks for UTF-8 */
            if (wire_type != 2 || read_len(span, &name) || !is_ascii(name.p, name.end - name.p)) return -1;
            heartbeat = name.end - name.p == PyBytes_GET_SIZE(heartbeat_name)
                        && memcmp(name.p, PyBytes_AS_STRING(heartbeat_name), name.end - name.p) == 0;
        } else if (field == 7 || field == 8) { /* start / end time, fixed64 */
            int *seen = field == 7 ? &has_start : &has_end;
            if (wire_type != 1 || *seen || read_fixed64(span, field == 7 ? &start : &end)) return -1;
            *seen = 1;
        } else if (field == 9) { /* attributes */
            if (wire_type != 2 || read_attribute(span, slices, 0, N_KEYS)) return -1;
        } else if (skip(span, wire_type)) {
            return -1;
        }
    }
    if (!slices[K_STAGE].found) {
        if (heartbeat) return keep_heartbeat(scan, span_p, span_n);
        scan->ignored++;
        return 0;
    }

    Value v[K_JOB]; /* the span's own keys; its identity is span_identity's */
    for (int k = 0; k < K_JOB; k++)
        if (read_value(&slices[k], &v[k])) return -1;
    if (v[K_STAGE].kind != V_STR || v[K_STAGE].n == 0 || v[K_STEP].kind != V_INT || v[K_STEP].i < 0
        || v[K_SEQ].kind != V_INT || v[K_SEQ].i < 0 || start == 0 || end < start)
        return -1;
    if (!(v[K_TIMING].kind == V_ABSENT || v[K_TIMING].kind == V_STR)) return -1;
    int device = v[K_TIMING].kind == V_STR && v[K_TIMING].n == PyBytes_GET_SIZE(device_timing)
                 && memcmp(v[K_TIMING].s, PyBytes_AS_STRING(device_timing), v[K_TIMING].n) == 0;
    int has_device_ms = 0;
    double device_ms = 0;
    if (device && v[K_DEVICE_MS].kind == V_DOUBLE && isfinite(v[K_DEVICE_MS].d) && v[K_DEVICE_MS].d >= 0) {
        device_ms = v[K_DEVICE_MS].d;
        has_device_ms = 1;
    }
    if (device && v[K_DEVICE_MS].kind == V_INT && v[K_DEVICE_MS].i >= 0) {
        device_ms = (double)v[K_DEVICE_MS].i;
        has_device_ms = 1;
    }

    int32_t identity, stage;
    int64_t tokens, samples;
    if (span_identity(scan, slices, resource_identity, &identity) || stage_index(scan, &v[K_STAGE], &stage)
        || positive_count(&v[K_TOKENS], &tokens) || positive_count(&v[K_SAMPLES], &samples))
        return -1;
    Record *record = new_record(scan);
    if (record == NULL) return -1;
    *record = (Record){identity, stage, v[K_STEP].i, v[K_SEQ].i, (double)(end - start) / 1e6,
                       has_device_ms ? device_ms : NAN, tokens, samples, end,
                       v[K_COLLECTIVE].kind == V_BOOL && v[K_COLLECTIVE].i};
    scan->observed = 1;
    return 0;
}

static int read_resource(Reader *resource, Slice *identity) {
    while (resource->p < resource->end) {
        uint32_t field, wire_type;
        if (read_tag(resource, &field, &wire_type)) return -1;
        if (field == 1) {
            if (wire_type != 2 || read_attribute(resource, identity, K_JOB, N_KEYS)) return -1;
        } else if (skip(resource, wire_type)) {
            return -1;
        }
    }
    return 0;
}

static int read_resource_spans(Reader body, Scan *scan, PyObject *resources) {
    Slice identity[N_IDENTITY] = {{0}};
    int has_resource = 0;
    scan->resource.found = 0;
    scan->observed = 0;
    scan->resource_identity = -1;
    /* first the resource, wherever it is, then the spans */
    for (Reader r = body; r.p < r.end;) {
        uint32_t field, wire_type;
        Reader resource;
        if (read_tag(&r, &field, &wire_type)) return -1;
        if (field == 1) { /* a second resource would be merged into the first: declined */
            if (wire_type != 2 || has_resource || read_len(&r, &resource)) return -1;
            scan->resource = (Slice){resource.p, resource.end - resource.p, 1};
            if (read_resource(&resource, identity)) return -1;
            has_resource = 1;
        } else if (field == 2 && wire_type != 2) {
            return -1;
        } else if (skip(&r, wire_type)) {
            return -1;
        }
    }
    for (Reader r = body; r.p < r.end;) {
        uint32_t field, wire_type;
        Reader scope_spans, span;
        if (read_tag(&r, &field, &wire_type)) return -1;
        if (field != 2) { if (skip(&r, wire_type)) return -1; continue; }
        if (read_len(&r, &scope_spans)) return -1;
        while (scope_spans.p < scope_spans.end) {
            if (read_tag(&scope_spans, &field, &wire_type)) return -1;
            if (field != 2) { if (skip(&scope_spans, wire_type)) return -1; continue; }
            if (wire_type != 2 || read_len(&scope_spans, &span) || read_span(&span, identity, scan)) return -1;
        }
    }
    if (scan->observed && scan->resource.found) {
        PyObject *raw = slice_bytes(scan->resource.p, scan->resource.n);
        if (raw == NULL) return -1;
        int appended = PyList_Append(resources, raw);
        Py_DECREF(raw);
        return appended;
    }
    return 0;
}

static void release(Scan *scan) {
    PyMem_Free(scan->records);
    Py_XDECREF(scan->strings);
    Py_XDECREF(scan->identities);
    Py_XDECREF(scan->heartbeats);
}

static PyObject *scan(PyObject *Py_UNUSED(module), PyObject *payload) {
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "_otlp_scan.configure() was not called");
        return NULL;
    }
    if (!PyBytes_Check(payload)) Py_RETURN_NONE;
    Reader request = {(const uint8_t *)PyBytes_AS_STRING(payload),
                      (const uint8_t *)PyBytes_AS_STRING(payload) + PyBytes_GET_SIZE(payload)};
    Scan scan = {0};
    scan.strings = PyList_New(0);
    scan.identities = PyList_New(0);
    scan.heartbeats = PyList_New(0);
    PyObject *resources = PyList_New(0);
    if (scan.strings == NULL || scan.identities == NULL || scan.heartbeats == NULL || resources == NULL) goto decline;
    while (request.p < request.end) {
        uint32_t field, wire_type;
        Reader resource_spans;
        if (read_tag(&request, &field, &wire_type)) goto decline;
        if (field != 1) { if (skip(&request, wire_type)) goto decline; continue; }
        if (wire_type != 2 || read_len(&request, &resource_spans)
            || read_resource_spans(resource_spans, &scan, resources))
            goto decline;
    }
    PyObject *records = PyBytes_FromStringAndSize((const char *)scan.records, scan.n_records * (Py_ssize_t)sizeof(Record));
    if (records == NULL) goto decline;
    /* takes the lists */
    PyObject *answer = Py_BuildValue("(NOOnNO)", records, scan.strings, scan.identities, scan.ignored, resources,
                                     scan.heartbeats);
    release(&scan);
    if (answer != NULL) return answer;
    PyErr_Clear();
    Py_RETURN_NONE;
decline:
    release(&scan);
    Py_XDECREF(resources);
    PyErr_Clear(); /* a failed allocation declines too: the reference decoder meets it again */
    Py_RETURN_NONE;
}

static PyObject *configure(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *keys, *cohort, *device, *heartbeat;
    if (!PyArg_ParseTuple(args, "O!UO!O!", &PyTuple_Type, &keys, &cohort, &PyBytes_Type, &device, &PyBytes_Type,
                          &heartbeat))
        return NULL;
    if (PyTuple_GET_SIZE(keys) != N_KEYS) {
        PyErr_SetString(PyExc_ValueError, "configure(keys, default_cohort, device_timing, heartbeat_name): "
                                          "13 attribute names");
        return NULL;
    }
    for (int k = 0; k < N_KEYS; k++) {
        PyObject *key = PyTuple_GET_ITEM(keys, k);
        if (!PyBytes_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "attribute names must be bytes");
            return NULL;
        }
        Py_ssize_t n = PyBytes_GET_SIZE(key);
        if (n == 0 || n > MAX_KEY_LENGTH || !is_ascii((const uint8_t *)PyBytes_AS_STRING(key), n)) {
            PyErr_SetString(PyExc_ValueError, "attribute names must be ASCII, 1 to 64 bytes long");
            return NULL;
        }
    }
    memset(keys_of_length, -1, sizeof keys_of_length);
    for (int k = 0; k < N_KEYS; k++) {
        Py_XSETREF(key_names[k], Py_NewRef(PyTuple_GET_ITEM(keys, k)));
        Py_ssize_t n = PyBytes_GET_SIZE(key_names[k]);
        key_tails[k] = tail_of((const uint8_t *)PyBytes_AS_STRING(key_names[k]), n);
        int8_t *same_length = keys_of_length[n];
        while (*same_length >= 0) same_length++; /* room for every key: N_KEYS + 1 entries */
        *same_length = (int8_t)k;
    }
    Py_XSETREF(default_cohort, Py_NewRef(cohort));
    Py_XSETREF(device_timing, Py_NewRef(device));
    Py_XSETREF(heartbeat_name, Py_NewRef(heartbeat));
    configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(keys, default_cohort, device_timing, heartbeat_name): keys are the 13 attribute "
     "names as bytes, in the order stage, step, seq, timing, collective, tokens, samples, device_ms, job, epoch, "
     "cohort, rank, restart count."},
    {"scan", scan, METH_O,
     "scan(payload) -> (records, [stage names], [(job, epoch, cohort, rank, restart)], ignored spans, raw resources "
     "of the records, [(raw resource, raw span) of each heartbeat]), or None: decode with the reference decoder."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, .m_name = "_otlp_scan", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__otlp_scan(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module != NULL && PyModule_AddIntConstant(module, "RECORD_SIZE", (long)sizeof(Record)) < 0) Py_CLEAR(module);
    return module;
}
