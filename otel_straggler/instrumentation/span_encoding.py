"""OTLP/protobuf encoding of ended spans, written directly as wire bytes.

The SDK's encoder makes a protobuf object for every span, attribute and value: about 40 µs a
span in Python, on a thread that holds the GIL the training thread may be waiting for. This one
writes the same message (same fields and values; tested against the SDK's encoder): the resource
and scope of a batch are encoded once, and a span's own fields are written by the optional C
extension _otlp_write or, where it is not built or declines a span, in Python at several times
the cost (benchmarks/rank_background.py compares the two), with key/value pairs that repeat
(stage names, groups, flags) from a bounded cache. The span builder's spans (RecordSpan) are
written from their record's fields, without making their SpanContexts. A request is joined once
from its pieces (the extension's join copies a large one without holding the GIL). A span
neither covers (events, links, attribute values other than str, bool, int, float and tuples or
lists of these, which only the Python writer takes) goes through the SDK's encoder.
"""
from __future__ import annotations

import operator
import struct
from typing import Any, Callable, Optional, Sequence

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PB2Span
from opentelemetry.proto.trace.v1.trace_pb2 import SpanFlags
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

from otel_straggler.instrumentation.record_span import RecordSpan

_MASK64 = (1 << 64) - 1
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_SMALL_VARINTS = [bytes((value,)) for value in range(0x80)]
_FIXED64 = struct.Struct("<Q").pack
_DOUBLE = struct.Struct("<d").pack
_KIND = {
    SpanKind.INTERNAL: PB2Span.SpanKind.SPAN_KIND_INTERNAL, SpanKind.SERVER: PB2Span.SpanKind.SPAN_KIND_SERVER,
    SpanKind.CLIENT: PB2Span.SpanKind.SPAN_KIND_CLIENT, SpanKind.PRODUCER: PB2Span.SpanKind.SPAN_KIND_PRODUCER,
    SpanKind.CONSUMER: PB2Span.SpanKind.SPAN_KIND_CONSUMER,
}
# Span.flags (field 16, fixed32): tag 133 as a varint, then the 4 bytes of the flags
_FLAGS_LOCAL = b"\x85\x01" + struct.pack("<I", SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK)
_FLAGS_REMOTE = b"\x85\x01" + struct.pack(
    "<I", SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK | SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK)
_ONLY_TUPLES = {tuple}
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
# the head of a KeyValue's value field holding an int_value of a varint of n bytes, by n
_INT_VALUE_HEADS = [b"\x12" + bytes((1 + n,)) + b"\x18" for n in range(11)]
_CACHE_LIMIT = 4096  # encoded key/value pairs and keys kept; the cache starts over beyond it
_MAX_GROUPS = 64  # resource and scope pairs remembered; a rank's own provider has one


def _varint(value: int) -> bytes:
    if 0 <= value < 0x80:
        return _SMALL_VARINTS[value]
    value &= _MASK64  # int64: negative numbers as their two's complement, 10 bytes
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte(s), the payload's length, the payload."""
    return tag + _varint(len(payload)) + payload


def _load_writer() -> tuple[Optional[Callable[..., Optional[bytes]]], Callable[[list], bytes],
                            Optional[Callable[..., list]]]:
    """The C writer's span(), join() and record_spans(), where built; join() copies a large
    request without holding the GIL."""
    try:
        from otel_straggler.instrumentation import _otlp_write
    except ImportError:  # not built: no C compiler where the package was installed
        return None, b"".join, None
    return _otlp_write.span, _otlp_write.join, _otlp_write.record_spans


# _write_span None: spans are written in Python only (_write_records is used only with _write_span)
_write_span, _join, _write_records = _load_writer()


def writer_built() -> bool:
    return _write_span is not None


class _Unsupported(Exception):
    """A value this encoder leaves to the SDK's."""


class SpanEncoder:
    """ReadableSpans to a serialized ExportTraceServiceRequest. One per exporter; its caches
    only ever hold encodings of values it has seen, so concurrent use is harmless."""

    def __init__(self) -> None:
        self._pairs: dict[tuple, bytes] = {}  # (key, type, value) -> encoded KeyValue, for str/bool values
        self._keys: dict[str, bytes] = {}  # key -> its encoded field 1 of a KeyValue
        # resource and scope pairs seen, never evicted (an index in prewritten spans stays valid);
        # a _Group holds its resource and scope, so their ids cannot be reused meanwhile
        self._groups: list[_Group] = []
        self._group_index: dict[tuple[int, int], int] = {}
        self._last_group: tuple = (None, None, None)  # (resource, scope, index): a rank's spans share one

    def prewrite(self, span: ReadableSpan) -> Any:
        """The span as (group index, its encoded Span field): a tuple of atoms, which the garbage
        collector stops tracking, where a span kept for seconds in a batch queue is tracked and
        promoted to the oldest generation, and so brings on full collections. The span itself
        when its resource and scope are one pair too many to remember."""
        if type(span) is RecordSpan:  # the span builder's: the common case, answered first
            last_resource, last_scope, index = self._last_group
            if span.record_resource is last_resource and span.record_scope is last_scope:
                if _write_span is not None:
                    written = _write_record_span(span)
                    if written is not None:
                        return index, written
                return index, self._span_field(span)
        index = self._index_of_group(span)
        return span if index is None else (index, self._span_field(span))

    def prewrite_many(self, spans: list[ReadableSpan]) -> list:
        """prewrite() of each span, in order: the span builder's, of the resource and scope of
        the spans before them, written by the C writer in one call."""
        last_resource, last_scope, index = self._last_group
        if _write_span is not None and _write_records is not None and last_resource is not None:
            items = _write_records(spans, RecordSpan, last_resource, last_scope, index)
            if None in items:  # another span, another group, or one the C writer declines
                prewrite = self.prewrite
                items = [prewrite(span) if item is None else item for span, item in zip(spans, items, strict=True)]
            return items
        return [self.prewrite(span) for span in spans]

    def encode(self, items: Sequence[Any]) -> bytes:
        """A request from ReadableSpans and prewritten spans, grouped as the SDK groups them: by
        resource, then scope, in order of first appearance."""
        spans_by_group: dict[_Group, list[bytes]] = {}
        if set(map(type, items)) == _ONLY_TUPLES:  # all prewritten: a rank's batch, found without a loop of ours
            indexes = set(map(_FIRST, items))
            if len(indexes) == 1:  # of one resource and scope, as a rank's own provider makes them
                spans_by_group[self._groups[indexes.pop()]] = list(map(_SECOND, items))
                return self._request(spans_by_group)
        unremembered: dict[tuple[int, int], _Group] = {}
        for item in items:
            if type(item) is tuple:
                group, encoded = self._groups[item[0]], item[1]
            else:
                index = self._index_of_group(item)
                if index is None:
                    key = (id(item.resource), id(item.instrumentation_scope))
                    group = unremembered.get(key) or unremembered.setdefault(key, _Group(item))
                else:
                    group = self._groups[index]
                encoded = self._span_field(item)
            spans_by_group.setdefault(group, []).append(encoded)
        return self._request(spans_by_group)

    @staticmethod
    def _request(spans_by_group: dict[_Group, list[bytes]]) -> bytes:
        """The request of encoded spans by group, the groups in order of first appearance."""
        groups_by_resource: dict[int, list[_Group]] = {}
        for group in spans_by_group:
            groups_by_resource.setdefault(id(group.resource), []).append(group)
        # one flat list of pieces, each length computed, joined once: the spans' bytes are copied
        # once, not once for every message that encloses them
        request: list[bytes] = []
        for groups in groups_by_resource.values():
            resource_parts = [groups[0].resource_fields]
            for group in groups:
                spans = spans_by_group[group]
                scope_n = len(group.scope_fields_head) + sum(map(len, spans)) + len(group.scope_fields_tail)
                resource_parts += (b"\x12", _varint(scope_n), group.scope_fields_head)
                resource_parts += spans
                resource_parts.append(group.scope_fields_tail)
            resource_parts.append(groups[0].resource_fields_tail)
            request += (b"\x0a", _varint(sum(map(len, resource_parts))))
            request += resource_parts
        return _join(request)

    def _index_of_group(self, span: ReadableSpan) -> Optional[int]:
        """Index of the span's resource and scope, encoded once by the SDK's encoder."""
        resource, scope = span.resource, span.instrumentation_scope
        last_resource, last_scope, index = self._last_group
        if resource is last_resource and scope is last_scope:
            return index
        key = (id(resource), id(scope))
        index = self._group_index.get(key)
        if index is None and len(self._groups) < _MAX_GROUPS:
            self._groups.append(_Group(span))
            index = self._group_index[key] = len(self._groups) - 1
        if index is not None:
            self._last_group = (resource, scope, index)
        return index

    def _span_field(self, span: ReadableSpan) -> bytes:
        """The span as a field of its ScopeSpans (spans, 2)."""
        if type(span) is RecordSpan:
            if _write_span is not None:
                written = _write_record_span(span)
                if written is not None:
                    return written
            try:
                return _field(b"\x12", self._record_fields(span))
            except Exception:
                pass  # an odd value: the general path decides
        elif _write_span is not None and type(span) is ReadableSpan:
            written = _write_plain_span(span)
            if written is not None:
                return written
        try:
            return _field(b"\x12", self._span_fields(span))
        except Exception:  # anything unusual (events, links, arrays, odd values): the SDK decides
            return _field(b"\x12", encode_spans([span]).resource_spans[0].scope_spans[0].spans[0].SerializeToString())

    def _span_fields(self, span: ReadableSpan) -> bytes:
        """The reference for what _otlp_write.span writes, and the path for what it declines."""
        if span.events or span.links:
            raise _Unsupported
        context, parent = span.context, span.parent
        out = [b"\x0a\x10", context.trace_id.to_bytes(16, "big"), b"\x12\x08", context.span_id.to_bytes(8, "big")]
        if context.trace_state:
            trace_state = ",".join(f"{key}={value}" for key, value in context.trace_state.items())
            out.append(_field(b"\x1a", trace_state.encode()))
        if parent is not None:
            out += (b"\x22\x08", parent.span_id.to_bytes(8, "big"))
        out += (_field(b"\x2a", span.name.encode()), b"\x30", _varint(_KIND[span.kind]))
        if span.start_time:
            out += (b"\x39", _FIXED64(span.start_time))
        if span.end_time:
            out += (b"\x41", _FIXED64(span.end_time))
        attribute = self._attribute
        out += [attribute(key, value) for key, value in (span.attributes or {}).items()]
        for tag, dropped in ((b"\x50", span.dropped_attributes), (b"\x60", span.dropped_events),
                             (b"\x70", span.dropped_links)):
            if dropped:
                out += (tag, _varint(dropped))
        status = span.status
        status_body = b""
        if status.description:
            status_body += _field(b"\x12", status.description.encode())
        if status.status_code.value:
            status_body += b"\x18" + _varint(status.status_code.value)
        out += (_field(b"\x7a", status_body),
                _FLAGS_REMOTE if parent is not None and parent.is_remote else _FLAGS_LOCAL)
        return b"".join(out)

    def _record_fields(self, span: RecordSpan) -> bytes:
        """What _span_fields writes for a RecordSpan (local, INTERNAL, UNSET, no events or links),
        from the record's fields, without making its SpanContexts."""
        out = [b"\x0a\x10", span.record_trace_id.to_bytes(16, "big"),
               b"\x12\x08", span.record_span_id.to_bytes(8, "big")]
        if span.record_parent_span_id is not None:
            out += (b"\x22\x08", span.record_parent_span_id.to_bytes(8, "big"))
        out += (_field(b"\x2a", span.record_name.encode()), b"\x30\x01")  # kind: SPAN_KIND_INTERNAL
        if span.record_start_ns:
            out += (b"\x39", _FIXED64(span.record_start_ns))
        if span.record_end_ns:
            out += (b"\x41", _FIXED64(span.record_end_ns))
        attributes = span.record_attributes
        if attributes:
            attribute = self._attribute
            out += [attribute(key, value) for key, value in attributes.items()]
            dropped = span.dropped_attributes
            if dropped:
                out += (b"\x50", _varint(dropped))
        out += (b"\x7a\x00", _FLAGS_LOCAL)  # an empty status; flags: a local parent
        return b"".join(out)

    def _attribute(self, key: str, value: Any) -> bytes:
        """Span.attributes field (9) holding one KeyValue."""
        value_type = type(value)
        if value_type is str or value_type is bool:
            pair = (key, value_type, value)  # the type too: True == 1, but they encode apart
            encoded = self._pairs.get(pair)
            if encoded is None:
                if len(self._pairs) >= _CACHE_LIMIT:
                    self._pairs.clear()
                encoded = self._pairs[pair] = _field(b"\x4a", self._key(key) + _field(b"\x12", _any_value(value)))
            return encoded
        if value_type is int and 0 <= value <= _INT64_MAX:  # seq, step, workload: written inline
            number = _varint(value)
            # KeyValue {key, value (2): AnyValue {int_value (3)}}: the AnyValue is 1 + at most 10 bytes
            key_value = self._key(key) + _INT_VALUE_HEADS[len(number)] + number
            return b"\x4a" + _varint(len(key_value)) + key_value
        if value_type is float:
            key_value = self._key(key) + b"\x12\x09\x21" + _DOUBLE(value)
            return b"\x4a" + _varint(len(key_value)) + key_value
        return _field(b"\x4a", self._key(key) + _field(b"\x12", _any_value(value)))

    def _key(self, key: str) -> bytes:
        encoded = self._keys.get(key)
        if encoded is None:
            if len(self._keys) >= _CACHE_LIMIT:
                self._keys.clear()
            encoded = self._keys[key] = _field(b"\x0a", key.encode())
        return encoded


def _write_plain_span(span: ReadableSpan) -> Optional[bytes]:
    """A ReadableSpan from elsewhere (a user's own provider and processors) written by _otlp_write
    from its public properties. None where it has more than the C writer covers (events, links,
    trace state, a status description, dropped attributes) or a value it declines: the Python
    writer decides those."""
    write_span = _write_span
    if write_span is None:
        return None
    try:
        if span.events or span.links or span.dropped_attributes:
            return None
        context, parent, status = span.context, span.parent, span.status
        if context is None or context.trace_state or status.description:
            return None
        attributes = dict(span.attributes) if span.attributes else None
        code = status.status_code
        return write_span(context.trace_id, context.span_id, None if parent is None else parent.span_id,
                          parent is not None and parent.is_remote, span.name, _KIND[span.kind],
                          span.start_time, span.end_time, attributes, 0 if code is StatusCode.UNSET else code.value)
    except Exception:  # a property another SDK release lacks, an odd value: the Python writer decides
        return None


def _write_record_span(span: RecordSpan) -> Optional[bytes]:
    """A RecordSpan written by _otlp_write from the record's fields; None where the attributes
    are not a plain dict (BoundedAttributes, for odd values) or hold a value it declines, and
    where the C writer is not built."""
    write_span = _write_span
    if write_span is None:
        return None
    attributes = span.record_attributes
    if attributes is not None and type(attributes) is not dict:
        return None
    return write_span(span.record_trace_id, span.record_span_id, span.record_parent_span_id, False, span.record_name,
                      1, span.record_start_ns, span.record_end_ns, attributes, 0)


class _Group:
    """A resource and a scope, and the fields around their spans, as the SDK encodes them."""

    __slots__ = ("resource", "scope", "resource_fields", "resource_fields_tail", "scope_fields_head",
                 "scope_fields_tail")

    def __init__(self, span: ReadableSpan) -> None:
        self.resource, self.scope = span.resource, span.instrumentation_scope
        resource_spans = encode_spans([span]).resource_spans[0]
        scope_spans = resource_spans.scope_spans[0]
        self.resource_fields = _field(b"\x0a", resource_spans.resource.SerializeToString())
        self.resource_fields_tail = (_field(b"\x1a", resource_spans.schema_url.encode())
                                     if resource_spans.schema_url else b"")
        self.scope_fields_head = _field(b"\x0a", scope_spans.scope.SerializeToString())
        self.scope_fields_tail = _field(b"\x1a", scope_spans.schema_url.encode()) if scope_spans.schema_url else b""


def _any_value(value: Any) -> bytes:
    """AnyValue of a str, bool, int or float (bool before int, as in the SDK's encoder), or an
    ArrayValue of a tuple or list of them (a heartbeat's open stages)."""
    value_type = type(value)
    if value_type is int or (isinstance(value, int) and value_type is not bool):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise _Unsupported  # the SDK drops it, with a log line
        return b"\x18" + _varint(value)
    if value_type is float or isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if isinstance(value, bool):
        return b"\x10" + _SMALL_VARINTS[int(value)]
    if isinstance(value, str):
        return _field(b"\x0a", value.encode())
    if value_type is tuple or value_type is list:  # array_value (5): ArrayValue, its values (1) in order
        return _field(b"\x2a", b"".join([_field(b"\x0a", _any_value(item)) for item in value]))
    raise _Unsupported
