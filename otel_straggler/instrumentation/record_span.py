"""RecordSpan: an ended span as the span builder made it, a ReadableSpan built lazily.

The builder's spans are all alike (sampled, local, INTERNAL, UNSET status, no events or links):
such a span holds its ids, name, times and attributes as they came from the interval record, and
makes the SpanContexts only when someone reads `context`, `parent` or `get_span_context()`.
Every public property of ReadableSpan answers as it would for the same span made by
ReadableSpan(...), so a user's own processor or exporter (the SDK's BatchSpanProcessor and
OTLPSpanExporter included) sees a normal span; our encoder (span_encoding) recognises the type
and writes the span from the record's fields, which is most of what the span builder saves.

Anything else ReadableSpan does (to_json, a method added by a later SDK) reads its own fields:
the first read of a field that is not here makes the span whole through ReadableSpan.__init__,
with the same values the properties give.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Optional

from opentelemetry import trace as trace_api
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind, Status, StatusCode

SAMPLED = trace_api.TraceFlags(trace_api.TraceFlags.SAMPLED)
UNSET_STATUS = Status(StatusCode.UNSET)
_EMPTY: MappingProxyType = MappingProxyType({})


class RecordSpan(ReadableSpan):
    __slots__ = ("record_trace_id", "record_span_id", "record_parent_span_id", "record_name", "record_start_ns",
                 "record_end_ns", "record_attributes", "record_resource", "record_scope")
    # not slots, but defaults set once here: a span sets its own (in its __dict__, which ReadableSpan
    # gives it) only when they change, which the span builder's path never makes them do
    record_context: Optional[trace_api.SpanContext] = None  # made at its first read
    record_whole = False

    def __init__(self, name: str, trace_id: int, span_id: int, parent_span_id: Optional[int], attributes: Any,
                 start_ns: int, end_ns: int, resource: Resource, scope: InstrumentationScope) -> None:
        # ReadableSpan.__init__ is left for when a field of its own is read (__getattr__)
        self.record_name = name
        self.record_trace_id = trace_id
        self.record_span_id = span_id
        self.record_parent_span_id = parent_span_id
        self.record_attributes = attributes  # a dict, or BoundedAttributes for odd values; the span's from here
        self.record_start_ns = start_ns
        self.record_end_ns = end_ns
        self.record_resource = resource
        self.record_scope = scope

    def __getattr__(self, name: str) -> Any:
        """Only for a field not set: one of ReadableSpan's own, read by one of its methods."""
        if name.startswith("record_") or self.record_whole or not name.startswith("_") or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        # made whole before it says so: a thread reading meanwhile makes it whole too, alike
        ReadableSpan.__init__(self, name=self.record_name, context=self.context, parent=self.parent,
                              resource=self.record_resource, attributes=self.record_attributes, kind=SpanKind.INTERNAL,
                              status=UNSET_STATUS, start_time=self.record_start_ns, end_time=self.record_end_ns,
                              instrumentation_scope=self.record_scope)
        self.record_whole = True
        return object.__getattribute__(self, name)

    # -- ReadableSpan's public properties, as ReadableSpan(...) of the same span gives them --

    @property
    def name(self) -> str:
        return self.record_name

    @property
    def context(self) -> trace_api.SpanContext:
        context = self.record_context
        if context is None:
            context = self.record_context = trace_api.SpanContext(self.record_trace_id, self.record_span_id,
                                                                   is_remote=False, trace_flags=SAMPLED)
        return context

    def get_span_context(self) -> trace_api.SpanContext:
        return self.context

    @property
    def parent(self) -> Optional[trace_api.SpanContext]:
        if self.record_parent_span_id is None:
            return None
        return trace_api.SpanContext(self.record_trace_id, self.record_parent_span_id, is_remote=False,
                                     trace_flags=SAMPLED)

    @property
    def kind(self) -> SpanKind:
        return SpanKind.INTERNAL

    @property
    def start_time(self) -> int:
        return self.record_start_ns

    @property
    def end_time(self) -> int:
        return self.record_end_ns

    @property
    def status(self) -> Status:
        return UNSET_STATUS

    @property
    def attributes(self) -> MappingProxyType:
        attributes = self.record_attributes
        return MappingProxyType(attributes) if attributes else _EMPTY

    @property
    def events(self) -> tuple:
        return ()

    @property
    def links(self) -> tuple:
        return ()

    @property
    def dropped_attributes(self) -> int:
        attributes = self.record_attributes
        return attributes.dropped if isinstance(attributes, BoundedAttributes) else 0

    @property
    def dropped_events(self) -> int:
        return 0

    @property
    def dropped_links(self) -> int:
        return 0

    @property
    def resource(self) -> Resource:
        return self.record_resource

    @property
    def instrumentation_scope(self) -> InstrumentationScope:
        return self.record_scope
