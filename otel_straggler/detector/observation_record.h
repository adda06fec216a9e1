/* One stage span as the C scanner (_otlp_scan.c) writes it and the engine's C intake (_ingest.c)
   reads it: observation.RECORD_FORMAT, field for field (decode.py checks the size at import). */
#ifndef OTEL_STRAGGLER_OBSERVATION_RECORD_H
#define OTEL_STRAGGLER_OBSERVATION_RECORD_H

#include <stdint.h>

typedef struct {
    int32_t identity, stage;   /* indexes into the request's identities and strings lists */
    int64_t step, seq;
    double host_ms, device_ms; /* device_ms NaN: None (a device duration is finite) */
    int64_t tokens, samples;   /* 0: None (a count is positive) */
    uint64_t end_unix_nano;
    int64_t collective;        /* 0 or 1 */
} Record;

#endif
