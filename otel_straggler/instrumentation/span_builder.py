"""The background half of the rank side: turns recorded intervals into OTel spans.

Every span of step N, on every rank, lands in one trace whose id is derived from
(training.job.id, N) (CONTRACT §2), under that rank's `train.step` span. Span ids are derived
too (from a per-process salt and a counter), and an open interval gets its id when its first
child is built, so a child can name its parent before the parent has ended: spans are built in
completion order, children first, with no buffering.

On a user's TracerProvider spans go through its Tracer (TracerSpans); on the rank's own
provider they are made directly as ended spans for its processor chain (ProcessorSpans), the
same spans at a fraction of the background thread's time.
"""
from __future__ import annotations

import hashlib
import math
import operator
import os
import threading
import time
from typing import Any, Callable, MutableMapping, Optional

from opentelemetry import trace as trace_api
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from otel_straggler import contract
from otel_straggler.instrumentation import stage_names
from otel_straggler.instrumentation.hot_path_reference import (INTERVAL, START_EVENT, START_STEP, STEP_BEGIN, STEP_END,
                                                     IntervalRecorder)
from otel_straggler.instrumentation.record_span import SAMPLED, RecordSpan
from otel_straggler.processors.device_events import give_back

_MASK64 = (1 << 64) - 1
MAX_OPEN_PARENTS = 1024  # enclosing intervals with built children, not yet ended themselves
MAX_BATCH_SPANS = 256  # spans made before they are handed on together, in a long build
DEADLINE_CHECK_RECORDS = 8  # records built between looks at the clock (build_pending's `until`)
# build_errors: records of any kind that failed to build; intervals_failed: those of them that
# were intervals; intervals_taken: interval records taken from the recorder's queue, counted as they
# are taken (spans_built and intervals_failed count a burst's spans when it is handed on, and add
# up to it once it is)
COUNTER_NAMES = ("spans_built", "steps_built", "heartbeats_built", "pool_exhausted", "build_errors",
                 "intervals_failed", "intervals_taken", "parent_ids_forgotten")


def trace_id_for_step(job_id: str, step: int) -> int:
    """One trace per (job, step): every rank derives the same id without talking to the others."""
    digest = hashlib.blake2b(f"{job_id}\x00{step}".encode(), digest_size=16).digest()
    return int.from_bytes(digest, "big") or 1


def _mix64(value: int) -> int:
    """splitmix64 finaliser: distinct inputs give well-spread, distinct 64-bit ids."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) or 1


class DerivedIdGenerator(IdGenerator):
    """Hands out the ids the builder chose for the span it is about to start, and delegates to
    the usual random ids otherwise (the user's own spans on a shared TracerProvider)."""

    def __init__(self, fallback: Optional[IdGenerator] = None) -> None:
        self.fallback = fallback or RandomIdGenerator()
        self._chosen = threading.local()

    def choose(self, span_id: int, trace_id: Optional[int] = None) -> None:
        self._chosen.span_id = span_id
        self._chosen.trace_id = trace_id

    def generate_span_id(self) -> int:
        span_id = getattr(self._chosen, "span_id", None)
        if span_id is None:
            return self.fallback.generate_span_id()
        self._chosen.span_id = None
        return span_id

    def generate_trace_id(self) -> int:
        trace_id = getattr(self._chosen, "trace_id", None)
        if trace_id is None:
            return self.fallback.generate_trace_id()
        self._chosen.trace_id = None
        return trace_id

    def is_trace_id_random(self) -> bool:
        return False


def step_number(step: Any) -> int:
    """A step as an int however it came (a numpy integer, a 0-d CPU tensor): the contract's type,
    and what the ids are derived from. A tensor on a device is refused, not read: reading it
    would wait for the device."""
    if type(step) is int:
        return step
    device = getattr(step, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise TypeError(f"step {type(step).__name__} on {device}: pass an int")
    return operator.index(step)


def workload_value(value: Any) -> Optional[int]:
    """Tokens/samples as reported; anything not a positive finite number is 'not reported'."""
    if value is None:
        return None
    if type(value) is int:  # the usual case, answered without float()
        return value if value > 0 else None
    try:
        if isinstance(value, bool) or value is None:
            return None
        number = float(value)
        if not math.isfinite(number) or number <= 0:
            return None
        return int(number)
    except (TypeError, ValueError):
        return None


def _no_device_timing(span: Any, *events: Any) -> None:
    """What a span maker made without device timing does with device events: refuses them."""
    raise TypeError(f"device events for span {getattr(span, 'name', span)!r}, made without device timing")


class TracerSpans:
    """Spans started and ended through a Tracer (on a user's TracerProvider), so that its
    sampler, span limits and processors all apply; ids come through the DerivedIdGenerator."""

    def __init__(self, tracer: trace_api.Tracer, ids: DerivedIdGenerator,
                 attach_device_events: Optional[Callable[..., None]] = None,
                 release_event: Optional[Callable[[Any], None]] = None) -> None:
        self.tracer = tracer
        self.ids = ids
        self.attach_device_events = attach_device_events or _no_device_timing
        self.release_event = release_event or (lambda event: None)
        self.sampled_out = 0  # spans the provider's sampler did not record

    def emit(self, name: str, trace_id: Optional[int], span_id: int, parent_span_id: Optional[int],
             attributes: dict, start_ns: int, end_ns: int, device_events: Optional[tuple]) -> None:
        if parent_span_id is None:
            self.ids.choose(span_id, trace_id)  # a root: of the step's trace, or a new one when None
            context = trace_api.Context()
        elif trace_id is None:  # a child is always of its step's trace
            raise ValueError(f"span {name!r}: a parent span id without a trace id")
        else:
            self.ids.choose(span_id)
            parent = trace_api.SpanContext(trace_id, parent_span_id, is_remote=False, trace_flags=SAMPLED)
            context = trace_api.set_span_in_context(trace_api.NonRecordingSpan(parent))
        try:
            span = self.tracer.start_span(name, context=context, attributes=attributes, start_time=start_ns)
        except Exception:
            give_back(self.release_event, device_events)  # not handed on: still the pool's
            raise
        if not span.is_recording():
            # the provider's sampler dropped it: no processor sees its end, so its events go back now
            self.sampled_out += 1
            give_back(self.release_event, device_events)
        elif device_events is not None:
            self.attach_device_events(span, *device_events)
        span.end(end_time=end_ns)


class ProcessorSpans:
    """Spans made as ended ReadableSpans (RecordSpan: its SpanContexts made only if read) and
    handed straight to our own provider's processor chain: what its Tracer would make (sampler
    ALWAYS_ON, default span limits) without the per-span sampler call, attribute cleaning and live
    Span object, which cost several times more. Used only where that holds (`applies()`)."""

    _PLAIN_VALUES = (str, bool, int, float)

    def __init__(self, processor: SpanProcessor, resource: Resource, scope_name: str,
                 attach_device_events: Optional[Callable[..., None]] = None,
                 release_event: Optional[Callable[[Any], None]] = None) -> None:
        self.processor = processor
        self.resource = resource
        self.scope = InstrumentationScope(scope_name)
        self.attach_device_events = attach_device_events or _no_device_timing
        self.release_event = release_event or (lambda event: None)
        self._random_ids = RandomIdGenerator()

    @staticmethod
    def applies(provider: TracerProvider) -> bool:
        """Only for a provider whose Tracer would keep every span and every attribute unchanged."""
        limits = SpanLimits()  # what the provider read from OTEL_*_LIMIT too
        return (provider.sampler is ALWAYS_ON and limits.max_span_attribute_length is None
                and (limits.max_span_attributes is None or limits.max_span_attributes >= 64))

    def emit(self, name: str, trace_id: Optional[int], span_id: int, parent_span_id: Optional[int],
             attributes: dict, start_ns: int, end_ns: int, device_events: Optional[tuple]) -> None:
        try:
            span, attributes = self._readable_span(name, trace_id, span_id, parent_span_id, attributes, start_ns,
                                                   end_ns)
        except Exception:
            give_back(self.release_event, device_events)  # not handed on: still the pool's
            raise
        if device_events is not None:  # the span and its attributes are the processor's from here
            self.attach_device_events(span, *device_events, attributes)
        self.processor.on_end(span)

    def emit_many(self, spans: list[tuple]) -> list[int]:
        """emit() of each span (its arguments as a tuple), in order, and the positions of those
        that could not be made or handed on (their events given back), for the builder to count.
        A processor with an `on_end_timed` of its own (the CudaEventSpanProcessor) or, for spans
        without device events, an `on_end_many` (the BatchingSpanProcessor) takes them all in one
        call; any other gets on_end() of each, as from emit()."""
        failed: list[int] = []
        made = []
        readable_span = self._readable_span
        for position, (name, trace_id, span_id, parent_span_id, attributes, start_ns, end_ns,
                       device_events) in enumerate(spans):
            try:
                span, attributes = readable_span(name, trace_id, span_id, parent_span_id, attributes, start_ns,
                                                 end_ns)
            except Exception:
                give_back(self.release_event, device_events)  # not handed on: still the pool's
                failed.append(position)
                continue
            if device_events is None:
                made.append((span, None, None, attributes))
            else:
                made.append((span, device_events[0], device_events[1], attributes))
        processor = self.processor
        on_end_timed = getattr(processor, "on_end_timed", None)
        if on_end_timed is not None:
            on_end_timed(made)
            return failed
        on_end_many = getattr(processor, "on_end_many", None)
        if on_end_many is not None and all(item[1] is None for item in made):
            on_end_many([item[0] for item in made])
            return failed
        positions = [position for position in range(len(spans)) if position not in failed] if failed else None
        for index, (span, start_event, end_event, attributes) in enumerate(made):
            try:
                if start_event is not None:  # the span and its attributes are the processor's from here
                    self.attach_device_events(span, start_event, end_event, attributes)
                processor.on_end(span)
            except Exception:
                failed.append(index if positions is None else positions[index])
        failed.sort()
        return failed

    def _readable_span(self, name: str, trace_id: Optional[int], span_id: int, parent_span_id: Optional[int],
                       attributes: MutableMapping[str, Any], start_ns: int, end_ns: int) -> tuple[RecordSpan, Any]:
        if trace_id is None:
            trace_id = self._random_ids.generate_trace_id()
        plain = self._PLAIN_VALUES
        for value in attributes.values():
            if type(value) not in plain:
                # an odd value (a user's step number of some other type): kept as the SDK would keep it
                attributes = BoundedAttributes(attributes=attributes, immutable=False)
                break
        return RecordSpan(name, trace_id, span_id, parent_span_id, attributes, start_ns, end_ns, self.resource,
                          self.scope), attributes


class SpanBuilder:
    """Turns an IntervalRecorder's records into spans, emitted through `spans` (TracerSpans or
    ProcessorSpans), and heartbeat samples into heartbeat spans, emitted through `heartbeat_spans`
    (by default `spans`); called from the pipeline's thread. `device_timing` says whether intervals
    are meant to carry device events; `release_event` returns events to the pool when an
    interval cannot be device-timed."""

    def __init__(
        self,
        recorder: IntervalRecorder,
        spans: Any,
        job_id: str,
        device_timing: bool = False,
        release_event: Optional[Callable[[Any], None]] = None,
        extra_attributes: Optional[dict] = None,
        heartbeat_spans: Any = None,
    ) -> None:
        self.recorder = recorder
        self.spans = spans
        self.heartbeat_spans = spans if heartbeat_spans is None else heartbeat_spans
        self.job_id = job_id
        self.device_timing = device_timing
        self.release_event = release_event or (lambda event: None)
        self.extra_attributes = extra_attributes or {}
        self.counters = dict.fromkeys(COUNTER_NAMES, 0)
        # spans' emit_many(), where they have one: a burst's spans are made, then handed on together
        self._emit_many: Optional[Callable[[list], Any]] = getattr(spans, "emit_many", None)
        self._batch_steps: list[int] = []  # positions of train.step spans in the batch being made
        salt = int.from_bytes(os.urandom(8), "big")
        self._interval_salt = salt
        self._step_salt = salt ^ 0x5DEECE66D5DEECE6
        self._heartbeat_salt = salt ^ 0x2545F4914F6CDD1D
        self._heartbeats_named = 0
        self._open_step: Optional[tuple] = None  # (step, start_ns, tokens, samples)
        self._last_end_ns = 0
        # (step, its trace id, its train.step span's id or None): spans come step by step
        self._ids_of_step: tuple = (None, 0, None)
        self._seq = 0  # intervals built: with the recorder's drops, CONTRACT's training.seq
        self._intervals_named = 0
        # id(open interval) -> (the interval, its span id), for enclosing intervals whose children
        # were built first. Holding the interval keeps its id() from being reused meanwhile.
        self._ids_of_open_parents: dict[int, tuple] = {}

    def build_pending(self, close_open_step: bool = False, until: Optional[float] = None) -> bool:
        """Builds the records queued so far, none begun after the time.monotonic() `until` (looked
        at every DEADLINE_CHECK_RECORDS records, so at least that many are built); `close_open_step`
        ends the running step's span too (at shutdown, without `until`). Says whether records
        remain. Not thread-safe: one caller at a time."""
        completed = self.recorder.completed
        deadline = math.inf if until is None else until
        next_look = DEADLINE_CHECK_RECORDS  # records to build before the next look at the clock
        # spans made but not yet emitted (emit()'s arguments), handed on together (_emit_batch);
        # None: one by one. The positions in it of train.step spans are in _batch_steps.
        batch: Optional[list] = [] if self._emit_many is not None else None
        while completed:
            if next_look == 0:
                if time.monotonic() >= deadline:
                    break
                next_look = DEADLINE_CHECK_RECORDS
            next_look -= 1
            record = completed.popleft()
            try:
                kind = record[0]
                if kind == INTERVAL:
                    self.counters["intervals_taken"] += 1
                    self._build_interval(record, batch)
                elif kind == STEP_BEGIN:
                    self._close_step(record[2], batch)
                    self._open_step = (step_number(record[1]), record[2], record[3], record[4])
                elif kind == STEP_END and self._open_step is not None and self._open_step[0] == record[1]:
                    self._close_step(record[2], batch)
            except Exception:
                self.counters["build_errors"] += 1
                if isinstance(record, tuple) and record and record[0] == INTERVAL:
                    self.counters["intervals_failed"] += 1
            if batch is not None and len(batch) >= MAX_BATCH_SPANS:
                self._emit_batch(batch)
                batch = []
        if batch:
            self._emit_batch(batch)
        if close_open_step and (until is None or not completed) and self._open_step is not None:
            self._close_step(max(self._last_end_ns, self._open_step[1]), None)
        return bool(completed)

    def _emit_batch(self, batch: list) -> None:
        """Hands the spans of `batch` on at once, and counts them as emit() one by one would
        have: built, or failed."""
        steps, self._batch_steps = self._batch_steps, []
        try:
            failed = self._emit_many(batch)  # type: ignore[misc]  # set where there is a batch
        except Exception:  # not one of them known to be handed on: all failed, as emit() raising would say
            failed = range(len(batch))
        steps_failed = sum(1 for position in failed if position in steps) if failed else 0
        counters = self.counters
        counters["spans_built"] += len(batch) - len(steps) - (len(failed) - steps_failed)
        counters["steps_built"] += len(steps) - steps_failed
        counters["build_errors"] += len(failed)
        counters["intervals_failed"] += len(failed) - steps_failed

    def build_heartbeat(self, sample: Any) -> None:
        """A `train.heartbeat` span (CONTRACT §2b) of a heartbeat.HeartbeatSample: an instant at
        the sample's time, no parent, in the trace of its step (a trace of its own before the
        first step). Not thread-safe: the caller holds the same lock as for build_pending()."""
        attributes = {
            # The number the next stage span will carry, not taken from it: stage spans built before
            # this heartbeat have lower ones, later ones this or higher, and theirs stay gapless. One
            # of them shares it; the detector de-duplicates stage spans only (by training.stage).
            contract.SEQ: self._seq + self.recorder.dropped_queue_full,
            contract.HEARTBEAT_OPEN_STAGES: sample.open_stages,
            contract.HEARTBEAT_OPEN_SINCE: sample.open_since_unix_nano,
            **sample.gpu,
            **self.extra_attributes,
        }
        step = sample.step
        if step is not None:
            attributes[contract.STEP] = step
        self._heartbeats_named += 1
        self.heartbeat_spans.emit(contract.HEARTBEAT_SPAN_NAME, None if step is None else self._trace_id(step),
                                  _mix64(self._heartbeat_salt + self._heartbeats_named), None, attributes,
                                  sample.time_ns, sample.time_ns, None)
        self.counters["heartbeats_built"] += 1

    def _trace_id(self, step: Any) -> int:
        last_step, trace_id, _ = self._ids_of_step
        if last_step is None or type(last_step) is not type(step) or last_step != step:
            trace_id = trace_id_for_step(self.job_id, step)
            self._ids_of_step = (step, trace_id, None)
        return trace_id

    def _step_ids(self, step: int) -> tuple[int, int]:
        """The trace id of an int step, and its train.step span's id (every stage span of the
        step names it as parent): made once a step, as spans come step by step."""
        last_step, trace_id, step_span_id = self._ids_of_step
        if step_span_id is None or type(last_step) is not int or last_step != step:
            trace_id = self._trace_id(step)
            step_span_id = _mix64(self._step_salt + step)
            self._ids_of_step = (step, trace_id, step_span_id)
        return trace_id, step_span_id

    def _close_step(self, end_ns: int, batch: Optional[list]) -> None:
        if self._open_step is None:
            return
        step, start_ns, tokens, samples = self._open_step
        self._open_step = None
        attributes = {contract.STEP: step, **self.extra_attributes}
        for key, value in ((contract.WORKLOAD_TOKENS, tokens), (contract.WORKLOAD_SAMPLES, samples)):
            value = workload_value(value)
            if value is not None:
                attributes[key] = value
        trace_id, span_id = self._step_ids(step)
        span = (contract.STEP_SPAN_NAME, trace_id, span_id, None, attributes, start_ns, max(end_ns, start_ns), None)
        if batch is not None:
            self._batch_steps.append(len(batch))
            batch.append(span)
            return
        self.spans.emit(*span)
        self.counters["steps_built"] += 1

    def _new_interval_span_id(self) -> int:
        """A new span id: distinct from every other this builder made (an odd multiplier and an
        xor-shift are bijections of 64-bit ints, so distinct counts give distinct ids), and well
        spread, at a fraction of _mix64's cost."""
        self._intervals_named += 1
        value = ((self._interval_salt + self._intervals_named) * 0x9E3779B97F4A7C15) & _MASK64
        return (value ^ (value >> 32)) or 1

    def _span_id(self, interval: tuple, ended: bool) -> int:
        """The span id of an interval, the same when first asked for by a child (the interval
        still open) and when the interval itself is built."""
        open_parents = self._ids_of_open_parents
        if open_parents:
            key = id(interval)
            known = open_parents.pop(key, None) if ended else open_parents.get(key)
            if known is not None and known[0] is interval:
                return known[1]
        span_id = self._new_interval_span_id()
        if not ended:
            if len(open_parents) >= MAX_OPEN_PARENTS:
                # an enclosing interval that never ended (or whose record was lost): forget the
                # oldest; if it does end after all, its span gets a new id and its children dangle
                del open_parents[next(iter(open_parents))]
                self.counters["parent_ids_forgotten"] += 1
            open_parents[id(interval)] = (interval, span_id)
        return span_id

    def _build_interval(self, record: tuple, batch: Optional[list]) -> None:
        try:
            span = self._interval_span(record)
        except Exception:
            # not handed on: its events are still the pool's (a failing build must not drain it)
            try:
                give_back(self.release_event, (record[1][START_EVENT], record[3]))
            except Exception:
                pass  # not a record the recorder makes: nothing of the pool's in it
            raise
        if span[7] is None and record[1][START_EVENT] is not None:
            self.release_event(record[1][START_EVENT])  # its end found the pool empty: timed host-only
        if record[2] > self._last_end_ns:
            self._last_end_ns = record[2]
        if batch is not None:
            batch.append(span)
            return
        self.spans.emit(*span)
        self.counters["spans_built"] += 1

    def _interval_span(self, record: tuple) -> tuple:
        """emit()'s arguments, the device events last (None: host-only)."""
        _, opened, end_ns, end_event, (step, tokens, samples) = record
        name, collective, enclosing, start_step, start_ns, start_event = opened
        if step is not None and type(step) is not int:
            step = step_number(step)
        kind = stage_names.classify(name)
        # Intervals the full queue dropped count too, so a loss shows downstream as a gap.
        seq = self._seq + self.recorder.dropped_queue_full
        self._seq += 1
        attributes = {
            contract.STAGE: name,
            contract.STAGE_GROUP: kind.group,
            contract.SEQ: seq,
            contract.COLLECTIVE: kind.collective if collective is None else bool(collective),
        }
        if self.extra_attributes:
            attributes.update(self.extra_attributes)
        if step is not None:
            attributes[contract.STEP] = step
        if tokens is not None:
            tokens = tokens if type(tokens) is int and tokens > 0 else workload_value(tokens)
            if tokens is not None:
                attributes[contract.WORKLOAD_TOKENS] = tokens
        if samples is not None:
            samples = samples if type(samples) is int and samples > 0 else workload_value(samples)
            if samples is not None:
                attributes[contract.WORKLOAD_SAMPLES] = samples
        if start_event is not None and end_event is not None:
            device_events: Optional[tuple] = (start_event, end_event)
        else:
            device_events = None
            if not self.device_timing:
                attributes[contract.TIMING] = contract.TIMING_HOST_ONLY
                attributes[contract.TIMING_REASON] = "no_cuda"
            elif kind.host_clock_only:  # instrument_ddp's hooks: no events by design, not a loss
                attributes[contract.TIMING] = contract.TIMING_HOST_ONLY
                attributes[contract.TIMING_REASON] = "host_clock_only"
            elif start_step is None:
                # begun before the first step(), which makes the event pool (on the training thread,
                # where CUDA events must be made): by design, not a loss
                attributes[contract.TIMING] = contract.TIMING_DEVICE_UNAVAILABLE
                attributes[contract.TIMING_REASON] = "before_first_step"
            else:
                attributes[contract.TIMING] = contract.TIMING_DEVICE_UNAVAILABLE
                attributes[contract.TIMING_REASON] = "pool_exhausted"
                self.counters["pool_exhausted"] += 1

        span_id = self._span_id(opened, ended=True)
        if step is None:  # before the first step(): a root span of its own trace
            return name, None, span_id, None, attributes, start_ns, end_ns, device_events
        trace_id, step_span_id = self._step_ids(step)
        # A parent only within the same step: a timer that runs across steps (Megatron's
        # interval-time) would otherwise adopt spans of traces it does not belong to.
        if enclosing is not None and enclosing[START_STEP] == start_step:
            parent_span_id = self._span_id(enclosing, ended=False)
        else:
            parent_span_id = step_span_id
        return name, trace_id, span_id, parent_span_id, attributes, start_ns, end_ns, device_events
