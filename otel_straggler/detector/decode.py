"""OTLP trace requests (protobuf or JSON) -> Observations, the detector's hot path.

A span is ours when it carries `training.stage` (CONTRACT §2), or is a `train.heartbeat` (§2b: a
Heartbeat, liveness and open stages, not an observation). Everything else, including the
per-rank `train.step` spans, is counted as ignored: the engine derives whole-step compute from the
stage spans (docs/detection.md), so the step span adds nothing. A stage span that lacks a required field
(job id, rank, step, seq, timestamps) or has one of the wrong type is counted as malformed, with a
Rejection: its kind, one of the few of REJECTION_KINDS (a metric attribute), and a reason for people;
the rest of its request still counts. A payload that cannot be parsed at all raises MalformedPayload.

Resource attributes (CONTRACT §1) may also arrive on the span itself, e.g. from an exporter that
flattens resources; the span's value is used only when the resource has none. A missing cohort means
"every rank plays the same role" (plain data parallelism) and maps to DEFAULT_COHORT; a missing
topology epoch or restart count is 0. Workload values that are not positive numbers degrade to None
("not reported"). Where a rank runs (host.name, training.local_rank) and how many ranks its job has
(training.world_size) are read from the resource only, once per resource, as a Placement; a value of
the wrong type there is "unknown", not a rejection.

Speed: the protobuf path parses with a *view* of the OTLP schema that keeps only the fields read
here and declares attributes as `map<string, bytes>` (a map entry has the same wire format as
KeyValue). That parses in C, answers each attribute by one lookup instead of a Python walk over
KeyValue objects, and leaves each value as its raw AnyValue bytes, which repeat heavily across spans
(stage names, steps, workload), so a small bounded cache turns most of them into one dict lookup.
Fields the view leaves out (ids, events, status, scope) are skipped as unknown fields: their wire
format is checked, their content is not.

Faster still, when the optional C extension `_otlp_scan` is built (setup.py; it needs a C
compiler): it walks the wire format once and writes each stage span as a fixed-width record
(observation.ObservationRecords, which the engine's C intake reads without making a Python object
per span), for payloads it fully understands (canonical encoding, valid stage spans). It declines
everything else, malformed or rejected spans included, and the Python decoder below then decides,
so both give the same answer.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any, Callable, Optional, final

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from otel_straggler import contract
from otel_straggler.detector.observation import (DEFAULT_COHORT, RECORD_FORMAT, GpuSample, Heartbeat, Observation,
                                                 ObservationRecords, Placement)

_VALUE_CACHE_ENTRIES = 4096  # distinct AnyValue encodings kept; cleared when full, so always bounded
# Only raw values up to this size are cached: an entry keeps the raw bytes and the value, so a bound on
# entries alone would let a few thousand large values (distinct stage names of 1 MiB, say) hold gigabytes.
# Values that repeat across spans are short; a long one is decoded again each time.
_VALUE_CACHE_MAX_RAW_BYTES = 256
_MAX_RESOURCES_CACHED = 4096  # distinct raw resources (about one per rank); cleared when full


class MalformedPayload(ValueError):
    """The request as a whole cannot be decoded; the message says why in one line."""


# final: the decoder tells a rejection by `type(x) is Rejection`, quicker than isinstance
@final
@dataclass(frozen=True)
class Rejection:
    """Why a stage span is malformed: `kind` for machines, `reason` for people."""

    kind: str
    reason: str


MISSING_JOB_ID = Rejection("missing_job_id", f"{contract.JOB_ID} missing or empty")
BAD_JOB_ID = Rejection("bad_job_id", f"{contract.JOB_ID} is not a string")
MISSING_RANK = Rejection("missing_rank", f"{contract.RANK} missing")
BAD_RANK = Rejection("bad_rank", f"{contract.RANK} is not a non-negative int")
BAD_EPOCH = Rejection("bad_epoch", f"{contract.TOPOLOGY_EPOCH} is not a non-negative int")
BAD_COHORT = Rejection("bad_cohort", f"{contract.COHORT} is not a string")
BAD_STAGE = Rejection("bad_stage", f"{contract.STAGE} is not a non-empty string")
MISSING_STEP = Rejection("missing_step", f"{contract.STEP} missing")
BAD_STEP = Rejection("bad_step", f"{contract.STEP} is not a non-negative int")
MISSING_SEQ = Rejection("missing_seq", f"{contract.SEQ} missing")
BAD_SEQ = Rejection("bad_seq", f"{contract.SEQ} is not a non-negative int")
BAD_TIMESTAMPS = Rejection("bad_timestamps", "start/end time missing or end before start")
BAD_RESTART = Rejection("bad_restart_count", f"{contract.RESTART_COUNT} is not a non-negative int")
BAD_HEARTBEAT = Rejection("bad_heartbeat", f"{contract.HEARTBEAT_OPEN_STAGES} and {contract.HEARTBEAT_OPEN_SINCE} "
                                           "are not a string[] and an int[] of one length, or its time is missing")
BAD_ATTRIBUTES_KIND = "bad_attributes"  # OTLP/JSON attributes that are not a list of keyed values
OTHER_KIND = "other"  # a span the engine refused after decoding (driver.py counts those)
# every kind, in the order of the checks: a bounded set, so a metric attribute
REJECTION_KINDS = (
    MISSING_JOB_ID.kind, BAD_JOB_ID.kind, MISSING_RANK.kind, BAD_RANK.kind, BAD_EPOCH.kind, BAD_COHORT.kind,
    BAD_STAGE.kind, MISSING_STEP.kind, BAD_STEP.kind, MISSING_SEQ.kind, BAD_SEQ.kind, BAD_TIMESTAMPS.kind,
    BAD_RESTART.kind, BAD_HEARTBEAT.kind, BAD_ATTRIBUTES_KIND, OTHER_KIND,
)


@dataclass(frozen=True)
class RejectedSpan:
    """The first span of a kind rejected in a request: what the detector's log shows of it. Identity
    values are as they arrived (None when absent)."""

    rejection: Rejection
    span_name: Optional[str]  # None: only the reason is known (a span the engine refused after decoding)
    job_id: Any
    rank: Any
    host: Any


@dataclass
class DecodedBatch:
    """What one OTLP request held."""

    # a list from the reference decoder, ObservationRecords from the C scanner
    observations: Sequence[Observation] = field(default_factory=list)
    heartbeats: list[Heartbeat] = field(default_factory=list)
    placements: list[Placement] = field(default_factory=list)  # one per resource that gave any of them
    ignored: int = 0  # spans that are neither stage spans nor heartbeats
    gpu_fields_invalid: int = 0  # heartbeats' GPU health fields (§2c) of a wrong type or range, left out
    malformed: int = 0  # stage spans rejected for a missing or invalid field
    first_error: str = ""  # the first rejection, for OTLP partial success
    rejections: dict[str, int] = field(default_factory=dict)  # malformed by kind (a dict: made per request)
    first_rejected: dict[str, RejectedSpan] = field(default_factory=dict)  # by kind

    def reject(self, span_name: str, rejection: Rejection, job_id: Any = None, rank: Any = None,
               host: Any = None) -> None:
        self.malformed += 1
        self.rejections[rejection.kind] = self.rejections.get(rejection.kind, 0) + 1
        if rejection.kind not in self.first_rejected:
            self.first_rejected[rejection.kind] = RejectedSpan(rejection, span_name, job_id, rank, host)
        if not self.first_error:
            self.first_error = f"span {span_name!r}: {rejection.reason}"

    @property
    def span_count(self) -> int:
        return len(self.observations) + len(self.heartbeats) + self.ignored + self.malformed


class _Invalid:
    """A value that is present but not a string, bool, int or double (array, kvlist, bytes)."""

    def __repr__(self) -> str:
        return "<unsupported value>"


INVALID = _Invalid()


# ---------------------------------------------------------------- shared validation

def _positive_count(value: Any) -> Optional[int]:
    if type(value) is int:
        return value if value > 0 else None
    if type(value) is float and math.isfinite(value) and value >= 1:
        return int(value)
    return None


def _identity(job_id: Any, epoch: Any, cohort: Any, rank: Any, restart: Any = None) -> tuple | Rejection:
    """A rank's identity (CONTRACT §1) validated, defaults applied, or why it is rejected:
    (job, epoch, cohort, rank, restart count). `type(x) is int` on purpose: a bool is an int
    subclass and is not a valid rank."""
    if type(job_id) is not str or not job_id:
        return MISSING_JOB_ID if job_id is None or job_id == "" else BAD_JOB_ID
    if type(rank) is not int or rank < 0:
        return MISSING_RANK if rank is None else BAD_RANK
    if epoch is None:
        epoch = 0
    elif type(epoch) is not int or epoch < 0:
        return BAD_EPOCH
    if not cohort:
        cohort = DEFAULT_COHORT
    elif type(cohort) is not str:
        return BAD_COHORT
    if restart is None:
        restart = 0
    elif type(restart) is not int or restart < 0:
        return BAD_RESTART
    return job_id, epoch, cohort, rank, restart


def _placement(identity: tuple | Rejection, host: Any, local_rank: Any, world_size: Any = None, node: Any = None,
               pod: Any = None, namespace: Any = None) -> Optional[Placement]:
    """Where a rank runs; on Kubernetes its host is the node (k8s.node.name: the one to cordon),
    not host.name (the pod's name there)."""
    if type(identity) is not tuple:
        return None
    job_id, epoch, cohort, rank, restart = identity
    if type(node) is str and node:
        host = node
    else:
        node = None
    return Placement(job_id, epoch, restart, rank, host if type(host) is str and host else None,
                     local_rank if type(local_rank) is int and local_rank >= 0 else None,
                     cohort, world_size if type(world_size) is int and world_size > 0 else None,
                     pod if type(pod) is str and pod else None,
                     namespace if type(namespace) is str and namespace else None, node)


def _shown_host(where: tuple) -> Any:
    """The host a rejection names: the node where the resource has one, else host.name."""
    return where[3] if where[3] is not None else where[0]


def _heartbeat(identity: tuple | Rejection, step: Any, open_stages: Any, open_since: Any,
               end: Any) -> Heartbeat | Rejection:
    """A heartbeat span's typed values (arrays as tuples, absent ones as ()) -> its Heartbeat."""
    if type(identity) is Rejection:
        return identity
    if step is not None and (type(step) is not int or step < 0):
        return BAD_STEP
    if (type(open_stages) is not tuple or type(open_since) is not tuple or len(open_stages) != len(open_since)
            or not all(type(name) is str and name for name in open_stages)
            or not all(type(since) is int and since >= 0 for since in open_since)
            or type(end) is not int or end <= 0):
        return BAD_HEARTBEAT
    job_id, epoch, cohort, rank, restart = identity
    return Heartbeat(job_id, epoch, cohort, rank, restart, step, end, open_stages, open_since)


# GPU health fields (CONTRACT §2c): attribute, the GpuSample field, its kind, the largest valid value.
# A field out of its type or range is left out of the sample and counted: the heartbeat stays good.
_GPU_FIELDS = (
    (contract.GPU_INDEX, "int", 1 << 16),
    (contract.GPU_UUID, "str", 128),  # its length
    (contract.GPU_SM_CLOCK_MHZ, "int", 100_000),
    (contract.GPU_SM_CLOCK_MAX_MHZ, "int", 100_000),
    (contract.GPU_CLOCK_EVENT_REASONS, "int", (1 << 63) - 1),
    (contract.GPU_TEMPERATURE_C, "int", 1000),
    (contract.GPU_POWER_W, "double", 100_000.0),
    (contract.GPU_UTILIZATION, "double", 1.0),
    (contract.GPU_ECC_UNCORRECTED, "int", (1 << 63) - 1),
    (contract.GPU_PCIE_REPLAY, "int", (1 << 63) - 1),
)
GPU_KEYS = tuple(key for key, _, _ in _GPU_FIELDS)


def _gpu_sample(values: tuple) -> tuple[Optional[GpuSample], int]:
    """A heartbeat's GPU_KEYS values (None: absent) -> (its GpuSample, None when it has none of
    them; how many present values were invalid)."""
    fields, invalid = [], 0
    for value, (_, kind, largest) in zip(values, _GPU_FIELDS, strict=True):
        if value is not None:
            if kind == "int":
                ok = type(value) is int and 0 <= value <= largest
            elif kind == "double":
                if type(value) is int:
                    value = float(value)
                ok = type(value) is float and 0.0 <= value <= largest  # NaN compares false
            else:
                ok = type(value) is str and 0 < len(value) <= largest
            if not ok:
                invalid += 1
                value = None
        fields.append(value)
    return (GpuSample(*fields) if any(value is not None for value in fields) else None), invalid


def _observation(
    identity: tuple | Rejection, stage: Any, step: Any, seq: Any, timing: Any, device_ms: Any, collective: Any,
    tokens: Any, samples: Any, start: int, end: int,
) -> Observation | Rejection:
    """One stage span's typed values -> its Observation, or why it is rejected."""
    if type(identity) is Rejection:
        return identity
    if type(stage) is not str or not stage:
        return BAD_STAGE
    if type(step) is not int or step < 0:
        return MISSING_STEP if step is None else BAD_STEP
    if type(seq) is not int or seq < 0:
        return MISSING_SEQ if seq is None else BAD_SEQ
    if type(start) is not int or type(end) is not int or start <= 0 or end < start:
        return BAD_TIMESTAMPS
    if timing == contract.TIMING_DEVICE and type(device_ms) in (float, int) and 0 <= device_ms < math.inf:
        device_ms = float(device_ms)
    else:
        device_ms = None
    job_id, epoch, cohort, rank, restart = identity
    return Observation(
        job_id, epoch, cohort, rank, stage, step, seq, (end - start) / 1e6, device_ms,
        collective is True, _positive_count(tokens), _positive_count(samples), end, restart,
    )


_IDENTITY_KEYS = (contract.JOB_ID, contract.TOPOLOGY_EPOCH, contract.COHORT, contract.RANK, contract.RESTART_COUNT)
# read once per resource, in _placement's order
_PLACEMENT_KEYS = (contract.HOST_NAME, contract.LOCAL_RANK, contract.WORLD_SIZE, contract.K8S_NODE_NAME,
                   contract.K8S_POD_NAME, contract.K8S_NAMESPACE_NAME)
_new_observation = tuple.__new__  # Observation(...) without its Python-level __new__: decode's hot path


# ---------------------------------------------------------------- protobuf

def _view_classes() -> tuple[Any, ...]:  # message classes built at run time: no static fields
    """Builds the OTLP view schema described in the module doc: its Request, Resource and Span classes."""
    F = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="otel_straggler_otlp_view.proto", package="otlp_view",
                                               syntax="proto3")

    def message(name: str, *fields: tuple, attributes_field: int = 0) -> None:
        descriptor = proto.message_type.add(name=name)
        for field_name, number, kind, label, type_name in fields:
            added = descriptor.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                added.type_name = type_name
        if attributes_field:
            entry = descriptor.nested_type.add(name="AttributesEntry")
            entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
            entry.field.add(name="value", number=2, type=F.TYPE_BYTES, label=F.LABEL_OPTIONAL)
            entry.options.map_entry = True
            descriptor.field.add(name="attributes", number=attributes_field, type=F.TYPE_MESSAGE,
                                 label=F.LABEL_REPEATED, type_name=f".otlp_view.{name}.AttributesEntry")

    one, many = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    # Field numbers are those of opentelemetry/proto/trace/v1/trace.proto and resource.proto.
    message("Span", ("name", 5, F.TYPE_STRING, one, ""),
            ("start_time_unix_nano", 7, F.TYPE_FIXED64, one, ""),
            ("end_time_unix_nano", 8, F.TYPE_FIXED64, one, ""), attributes_field=9)
    message("Resource", attributes_field=1)
    message("ScopeSpans", ("spans", 2, F.TYPE_MESSAGE, many, ".otlp_view.Span"))
    message("ResourceSpans", ("resource", 1, F.TYPE_MESSAGE, one, ".otlp_view.Resource"),
            ("scope_spans", 2, F.TYPE_MESSAGE, many, ".otlp_view.ScopeSpans"))
    message("Request", ("resource_spans", 1, F.TYPE_MESSAGE, many, ".otlp_view.ResourceSpans"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"otlp_view.{name}"))
                 for name in ("Request", "Resource", "Span"))


_RequestView, _ResourceView, _SpanView = _view_classes()
_SCALAR_KINDS = {"string_value", "bool_value", "int_value", "double_value"}


def _any_value(raw: Optional[bytes]) -> Any:
    """Raw AnyValue bytes -> str/bool/int/float; None when absent or empty; INVALID for other kinds."""
    if raw is None:
        return None
    try:
        value = AnyValue.FromString(raw)
    except DecodeError:
        return INVALID
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    return getattr(value, kind) if kind in _SCALAR_KINDS else INVALID


def _array_any_value(raw: Optional[bytes]) -> Any:
    """Raw AnyValue bytes of an array of scalars -> a tuple; () when absent; INVALID otherwise."""
    if raw is None:
        return ()
    try:
        value = AnyValue.FromString(raw)
    except DecodeError:
        return INVALID
    kind = value.WhichOneof("value")
    if kind is None:
        return ()
    if kind != "array_value":
        return INVALID
    items = []
    for item in value.array_value.values:
        item_kind = item.WhichOneof("value")
        items.append(getattr(item, item_kind) if item_kind in _SCALAR_KINDS else INVALID)
    return tuple(items)


_unpack_double = struct.Struct("<d").unpack_from
_INT_VALUE_TAG, _DOUBLE_VALUE_TAG = 0x18, 0x21  # AnyValue.int_value (varint), double_value (fixed64)


def _int_any_value(raw: Optional[bytes]) -> Any:
    """_any_value for values expected to be ints, with a fast path for the canonical encoding
    (tag, then a varint of at most 8 bytes that ends the message), unrolled for varints of up to 4 bytes."""
    if not raw or raw[0] != _INT_VALUE_TAG:
        return _any_value(raw)
    size = len(raw)
    if size == 2 and raw[1] < 0x80:
        return raw[1]
    if size == 3 and raw[1] >= 0x80 > raw[2]:
        return (raw[1] & 0x7F) | (raw[2] << 7)
    if size == 4 and raw[1] >= 0x80 and raw[2] >= 0x80 > raw[3]:
        return (raw[1] & 0x7F) | ((raw[2] & 0x7F) << 7) | (raw[3] << 14)
    if size == 5 and raw[1] >= 0x80 and raw[2] >= 0x80 and raw[3] >= 0x80 > raw[4]:
        return (raw[1] & 0x7F) | ((raw[2] & 0x7F) << 7) | ((raw[3] & 0x7F) << 14) | (raw[4] << 21)
    if 2 <= size <= 9 and raw[-1] < 0x80:
        value, shift = 0, 0
        for byte in raw[1:-1]:
            if byte < 0x80:
                return _any_value(raw)  # the varint ends early: more fields follow
            value |= (byte & 0x7F) << shift
            shift += 7
        return value | (raw[-1] << shift)
    return _any_value(raw)


def _double_any_value(raw: Optional[bytes]) -> Any:
    """_any_value for values expected to be doubles, with a fast path for the canonical encoding."""
    if raw is not None and len(raw) == 9 and raw[0] == _DOUBLE_VALUE_TAG:
        return _unpack_double(raw, 1)[0]
    return _any_value(raw)


def _load_scanner() -> Optional[Callable[[bytes], Optional[tuple]]]:
    try:
        from otel_straggler.detector import _otlp_scan
    except ImportError:  # not built: no C compiler where the package was installed
        return None
    keys = (contract.STAGE, contract.STEP, contract.SEQ, contract.TIMING, contract.COLLECTIVE,
            contract.WORKLOAD_TOKENS, contract.WORKLOAD_SAMPLES, contract.DEVICE_DURATION_MS, *_IDENTITY_KEYS)
    try:
        if getattr(_otlp_scan, "RECORD_SIZE", None) != struct.calcsize(RECORD_FORMAT):
            raise ValueError("records of another layout")
        _otlp_scan.configure(tuple(key.encode() for key in keys), DEFAULT_COHORT,
                             contract.TIMING_DEVICE.encode(), contract.HEARTBEAT_SPAN_NAME.encode())
    except (TypeError, ValueError):  # built from an older source: its answers would differ, so unused
        return None
    return _otlp_scan.scan


_scan = _load_scanner()  # None: decode in Python only


def scanner_built() -> bool:
    return _scan is not None


class ProtobufDecoder:
    """Decodes serialized ExportTraceServiceRequests. Safe to share between threads: its only state
    is the value cache, whose worst race is a miss."""

    def __init__(self) -> None:
        self._value_cache: dict[Optional[bytes], Any] = {}  # never holds None: looked up with it
        # raw Resource bytes -> (its identity values, its Placement or None): a rank sends the same
        # resource with every request
        self._resource_cache: dict[bytes, tuple] = {}

    def _value(self, raw: Optional[bytes]) -> Any:
        value = self._value_cache.get(raw)
        if value is None and raw is not None:
            value = _any_value(raw)
            if len(raw) <= _VALUE_CACHE_MAX_RAW_BYTES:
                if len(self._value_cache) >= _VALUE_CACHE_ENTRIES:
                    self._value_cache.clear()
                self._value_cache[raw] = value
        return value

    def decode(self, payload: bytes) -> DecodedBatch:
        if _scan is not None:
            scanned = _scan(payload)
            if scanned is not None:
                records, strings, identities, ignored, resources, heartbeats = scanned
                batch = DecodedBatch(observations=ObservationRecords(records, strings, identities), ignored=ignored)
                for raw in resources:
                    placement = self._resource(raw)[1]
                    if placement is not None:
                        batch.placements.append(placement)
                for raw_resource, raw_span in heartbeats:
                    self._scanned_heartbeat(batch, raw_resource, raw_span)
                return batch
        return self.decode_in_python(payload)

    def _resource(self, raw: bytes) -> tuple:
        """(identity values as on the resource, its Placement or None) of raw Resource bytes."""
        known = self._resource_cache.get(raw)
        if known is None:
            attributes = _ResourceView.FromString(raw).attributes
            values = [self._value(attributes.get(key)) for key in _IDENTITY_KEYS]
            where = tuple(self._value(attributes.get(key)) for key in _PLACEMENT_KEYS)
            known = (values, _placement(_identity(*values), *where), where)
            if len(raw) <= 64 * _VALUE_CACHE_MAX_RAW_BYTES:
                if len(self._resource_cache) >= _MAX_RESOURCES_CACHED:
                    self._resource_cache.clear()
                self._resource_cache[raw] = known
        return known

    def _scanned_heartbeat(self, batch: DecodedBatch, raw_resource: bytes, raw_span: bytes) -> None:
        """A heartbeat the scanner found, decoded as decode_in_python decodes it (the scanner has
        checked the wire format of both already)."""
        values, _, where = self._resource(raw_resource)
        self._heartbeat_span(batch, _SpanView.FromString(raw_span), values, where)

    def _heartbeat_span(self, batch: DecodedBatch, span: Any, resource_values: list, where: tuple) -> None:
        """`where`: the resource's values of _PLACEMENT_KEYS (None: absent)."""
        get = span.attributes.get
        values = [value if value is not None else self._value(get(key))
                  for key, value in zip(_IDENTITY_KEYS, resource_values, strict=True)]
        identity = _identity(*values)
        result = _heartbeat(identity, _int_any_value(get(contract.STEP)),
                            _array_any_value(get(contract.HEARTBEAT_OPEN_STAGES)),
                            _array_any_value(get(contract.HEARTBEAT_OPEN_SINCE)), span.end_time_unix_nano)
        where = tuple(value if value is not None else self._value(get(key))
                      for value, key in zip(where, _PLACEMENT_KEYS, strict=True))
        if type(result) is Rejection:
            batch.reject(span.name, result, values[0], values[3], _shown_host(where))
            return
        gpu, invalid = _gpu_sample(tuple(self._value(get(key)) for key in GPU_KEYS))
        batch.gpu_fields_invalid += invalid
        batch.heartbeats.append(result if gpu is None else result._replace(gpu=gpu))
        placement = _placement(identity, *where)
        if placement is not None:
            batch.placements.append(placement)

    def decode_in_python(self, payload: bytes) -> DecodedBatch:
        """The reference decoder: every payload, every rejection and its reason."""
        try:
            request = _RequestView.FromString(payload)
        except DecodeError as error:
            raise MalformedPayload(f"not an OTLP ExportTraceServiceRequest: {error}") from None
        observations: list[Observation] = []
        batch = DecodedBatch(observations=observations)
        append = observations.append
        cached = self._value_cache.get
        value_of = self._value
        # attribute names as locals: the span loop would otherwise look each one up per span
        STAGE, STEP, TIMING, COLLECTIVE = contract.STAGE, contract.STEP, contract.TIMING, contract.COLLECTIVE
        TOKENS, SAMPLES, SEQ = contract.WORKLOAD_TOKENS, contract.WORKLOAD_SAMPLES, contract.SEQ
        DEVICE, DEVICE_DURATION_MS = contract.TIMING_DEVICE, contract.DEVICE_DURATION_MS
        HEARTBEAT = contract.HEARTBEAT_SPAN_NAME
        for resource_spans in request.resource_spans:
            resource = resource_spans.resource.attributes
            resource_identity = [value_of(resource.get(key)) for key in _IDENTITY_KEYS]
            # keys the resource lacks are looked up on each span (see the module doc)
            from_span = [index for index, value in enumerate(resource_identity) if value is None]
            identity = _identity(*resource_identity)
            if type(identity) is tuple:
                job, epoch, cohort, rank, restart = identity
            where = tuple(value_of(resource.get(key)) for key in _PLACEMENT_KEYS)
            host = _shown_host(where)
            placement = _placement(identity, *where)
            observed = len(batch.observations)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    get = span.attributes.get
                    raw = get(STAGE)
                    if raw is None:
                        if span.name == HEARTBEAT:
                            self._heartbeat_span(batch, span, resource_identity, where)
                        else:
                            batch.ignored += 1
                        continue
                    # Inlined cache lookups: this loop runs once per span.
                    stage = cached(raw)
                    if stage is None:
                        stage = value_of(raw)
                    raw = get(STEP)
                    step = cached(raw)
                    if step is None and raw is not None:
                        step = value_of(raw)
                    raw = get(TIMING)
                    timing = cached(raw)
                    if timing is None and raw is not None:
                        timing = value_of(raw)
                    raw = get(COLLECTIVE)
                    collective = cached(raw)
                    if collective is None and raw is not None:
                        collective = value_of(raw)
                    raw = get(TOKENS)
                    tokens = cached(raw)
                    if tokens is None and raw is not None:
                        tokens = value_of(raw)
                    raw = get(SAMPLES)
                    samples = cached(raw)
                    if samples is None and raw is not None:
                        samples = value_of(raw)
                    # seq and device duration are unique per span: caching them would only evict others
                    seq = _int_any_value(get(SEQ))
                    device_ms = (_double_any_value(get(DEVICE_DURATION_MS))
                                 if timing == DEVICE else None)
                    if from_span:
                        merged = list(resource_identity)
                        for index in from_span:
                            merged[index] = value_of(get(_IDENTITY_KEYS[index]))
                        identity = _identity(*merged)
                        if type(identity) is tuple:
                            job, epoch, cohort, rank, restart = identity
                    start, end = span.start_time_unix_nano, span.end_time_unix_nano
                    if (type(identity) is tuple and type(stage) is str and stage and type(step) is int
                            and step >= 0 and type(seq) is int and seq >= 0 and 0 < start <= end):
                        # The common case, checked as _observation checks it, without its calls.
                        if device_ms is not None and not (type(device_ms) in (float, int)
                                                          and 0 <= device_ms < math.inf):
                            device_ms = None
                        append(_new_observation(Observation, (
                            job, epoch, cohort, rank, stage, step, seq, (end - start) / 1e6,
                            None if device_ms is None else float(device_ms), collective is True,
                            None if tokens is None else _positive_count(tokens),
                            None if samples is None else _positive_count(samples), end, restart)))
                        continue
                    result = _observation(identity, stage, step, seq, timing, device_ms, collective, tokens,
                                          samples, start, end)
                    if type(result) is Rejection:
                        values = merged if from_span else resource_identity
                        batch.reject(span.name, result, values[0], values[3],
                                     host if host is not None else value_of(get(contract.HOST_NAME)))
                    else:
                        append(result)
            if placement is not None and len(batch.observations) > observed:
                batch.placements.append(placement)
        return batch


# ---------------------------------------------------------------- JSON

_JSON_DOUBLE_WORDS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1  # AnyValue.int_value
_UINT64_MAX = (1 << 64) - 1  # Span.start/end_time_unix_nano (fixed64)


def _json_int(value: Any, low: int = _INT64_MIN, high: int = _INT64_MAX) -> Any:
    """ProtoJSON writes int64 as a decimal string; plain numbers are accepted too. A number outside the
    field's range is INVALID, as protobuf cannot carry it (and Python ints are unbounded)."""
    if type(value) is str:
        try:
            value = int(value)
        except ValueError:
            return INVALID
    elif type(value) is not int:
        return INVALID
    return value if low <= value <= high else INVALID


def _json_time(value: Any) -> Any:
    return _json_int(value, 0, _UINT64_MAX)


def _json_double(number: Any) -> Any:
    if type(number) is float:
        return number
    if type(number) is int:
        try:
            return float(number)
        except OverflowError:  # beyond any double
            return INVALID
    return _JSON_DOUBLE_WORDS.get(number, INVALID) if type(number) is str else INVALID


def _json_string(text: Any) -> Any:
    """A protobuf string is valid UTF-8; JSON can still hold lone surrogates (\\ud800), which no
    encoder downstream (Prometheus, OTLP metrics) accepts. Only non-ASCII text needs the check."""
    if type(text) is not str:
        return INVALID
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return INVALID
    return text


def _json_any_value(value: Any) -> Any:
    if not isinstance(value, dict) or not value:
        return None
    if "stringValue" in value:
        return _json_string(value["stringValue"])
    if "intValue" in value:
        return _json_int(value["intValue"])
    if "doubleValue" in value:
        return _json_double(value["doubleValue"])
    if "boolValue" in value:
        flag = value["boolValue"]
        return flag if type(flag) is bool else INVALID
    return INVALID


def _json_array_value(value: Any) -> Any:
    """An OTLP/JSON arrayValue of scalars -> a tuple; () when absent; INVALID otherwise."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        return INVALID
    if not value:
        return ()
    array = value.get("arrayValue")
    if not isinstance(array, dict):
        return INVALID
    items = array.get("values", [])
    if not isinstance(items, list):
        return INVALID
    return tuple(_json_any_value(item) for item in items)


_JSON_ARRAY_KEYS = frozenset((contract.HEARTBEAT_OPEN_STAGES, contract.HEARTBEAT_OPEN_SINCE))


def _json_attributes(attributes: Any) -> dict[str, Any]:
    if not isinstance(attributes, list):
        raise MalformedPayload("attributes is not a list")
    typed = {}
    for pair in attributes:
        if not isinstance(pair, dict) or type(pair.get("key")) is not str:
            raise MalformedPayload("attribute without a string key")
        key = pair["key"]
        typed[key] = (_json_array_value if key in _JSON_ARRAY_KEYS else _json_any_value)(pair.get("value"))
    return typed


def _json_list(container: dict, key: str) -> list:
    value = container.get(key, [])
    if not isinstance(value, list):
        raise MalformedPayload(f"{key} is not a list")
    return value


def _json_object(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise MalformedPayload(f"{what} is not a JSON object")
    return value


def decode_json_request(request: Any) -> DecodedBatch:
    """Decodes an already-parsed OTLP/JSON ExportTraceServiceRequest (lowerCamelCase keys, int64 as
    strings). Trace and span ids (hex in OTLP/JSON, not base64) are never read: the detector
    de-duplicates by (job, epoch, rank, seq), so no id is decoded or trusted."""
    observations: list[Observation] = []
    batch = DecodedBatch(observations=observations)
    for resource_spans in _json_list(_json_object(request, "request"), "resourceSpans"):
        resource_spans = _json_object(resource_spans, "resourceSpans[]")
        resource = _json_attributes(_json_object(resource_spans.get("resource", {}), "resource").get("attributes", []))
        placement = _placement(_identity(*(resource.get(key) for key in _IDENTITY_KEYS)),
                               *(resource.get(key) for key in _PLACEMENT_KEYS))
        found = len(batch.observations) + len(batch.heartbeats)
        for scope_spans in _json_list(resource_spans, "scopeSpans"):
            for span in _json_list(_json_object(scope_spans, "scopeSpans[]"), "spans"):
                span = _json_object(span, "span")
                name = str(span.get("name", ""))
                try:
                    attributes = _json_attributes(span.get("attributes", []))
                except MalformedPayload as error:
                    batch.reject(name, Rejection(BAD_ATTRIBUTES_KIND, str(error)), resource.get(contract.JOB_ID),
                                 resource.get(contract.RANK),
                                 resource.get(contract.K8S_NODE_NAME) or resource.get(contract.HOST_NAME))
                    continue
                values = [attributes.get(key) if resource.get(key) is None else resource[key]
                          for key in (*_IDENTITY_KEYS, contract.HOST_NAME)]
                if contract.STAGE not in attributes:
                    if name != contract.HEARTBEAT_SPAN_NAME:
                        batch.ignored += 1
                        continue
                    result = _heartbeat(
                        _identity(*values[:-1]), attributes.get(contract.STEP),
                        attributes.get(contract.HEARTBEAT_OPEN_STAGES, ()),
                        attributes.get(contract.HEARTBEAT_OPEN_SINCE, ()), _json_time(span.get("endTimeUnixNano", 0)))
                    if type(result) is Rejection:
                        batch.reject(name, result, values[0], values[3], values[-1])
                        continue
                    gpu, invalid = _gpu_sample(tuple(attributes.get(key) for key in GPU_KEYS))
                    batch.gpu_fields_invalid += invalid
                    batch.heartbeats.append(result if gpu is None else result._replace(gpu=gpu))
                    continue
                identity = _identity(*values[:-1])
                observation = _observation(
                    identity, attributes[contract.STAGE], attributes.get(contract.STEP), attributes.get(contract.SEQ),
                    attributes.get(contract.TIMING), attributes.get(contract.DEVICE_DURATION_MS),
                    attributes.get(contract.COLLECTIVE), attributes.get(contract.WORKLOAD_TOKENS),
                    attributes.get(contract.WORKLOAD_SAMPLES),
                    _json_time(span.get("startTimeUnixNano", 0)), _json_time(span.get("endTimeUnixNano", 0)),
                )
                if type(observation) is Rejection:
                    batch.reject(name, observation, values[0], values[3], values[-1])
                else:
                    observations.append(observation)
        if placement is not None and len(batch.observations) + len(batch.heartbeats) > found:
            batch.placements.append(placement)
    return batch


def decode_json(payload: bytes) -> DecodedBatch:
    """Decodes an OTLP/JSON request body."""
    try:
        request = json.loads(payload)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise MalformedPayload(f"not JSON: {error}") from None
    return decode_json_request(request)
