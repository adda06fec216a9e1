"""Everything the rank side runs off the training thread, wired together:

  IntervalRecorder.completed --(builder thread)--> SpanBuilder --> TracerProvider
    --> CudaEventSpanProcessor --> BatchingSpanProcessor --> CountingSpanExporter --> our OTLP exporter

The same thread samples the recorder every heartbeat interval (heartbeat.py) and sends a
`train.heartbeat` span, on its own schedule, not the build interval's, with the rank's GPU
read through NVML just before (gpu_health.py). Once, `no_stage_warning_s`
after configure(), it also looks whether any stage was timed yet, from the counters the recorder
and the builder keep anyway, and logs one warning if none was: a rank that times nothing gives
the detector nothing to judge, and would otherwise say so nowhere.

The TracerProvider and the event pool are made lazily: the provider when there is first
something to build (so Megatron's parallel state, initialised after its timers, is in the
resource), the pool at the first step() (so CUDA events live on the device training uses).
A heartbeat makes the provider too, once step() was called or a record was queued: until then
the rank may not know its identity yet, and sends none.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Mapping, Optional

from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from otel_straggler import contract
from otel_straggler.instrumentation import gpu_health, heartbeat, identity
from otel_straggler.instrumentation.batching import BatchingSpanProcessor
from otel_straggler.instrumentation.exporting import CountingSpanExporter, span_exporter, start_rank_metrics
from otel_straggler.instrumentation.hot_path_reference import INTERVAL, IntervalRecorder
from otel_straggler.instrumentation.span_builder import (COUNTER_NAMES, DerivedIdGenerator, ProcessorSpans, SpanBuilder,
                                                        TracerSpans)
from otel_straggler.otlp_environ import check_exporter_environ, resolve_protocol
from otel_straggler.processors.cuda_event_span_processor import CudaEventSpanProcessor
from otel_straggler.processors.device_events import EventPool, make_backend

_SCOPE = "otel_straggler"
_log = logging.getLogger("otel_straggler")
# A burst builds records for this long, then hands them on (about as long again), holding the GIL
# throughout. Bounded by time, not by a count: a record costs 5 us warm and 20 cold (the
# thread wakes to cold caches), and bursts of 16 records spent more on waking and handing on than
# on building. 0.15 ms saved CPU at a 4 ms step only; at a 75 ms step each burst starts cold.
BUILD_BURST_S = 0.0003
BUILD_PAUSE_S = 0.0005  # between bursts: long enough for a thread waiting on the GIL to wake and take it
_IDENTITY_KEYS_ON_SPANS = (contract.JOB_ID, contract.RANK, contract.COHORT, contract.TOPOLOGY_EPOCH,
                           contract.RESTART_COUNT, contract.WORLD_SIZE, contract.LOCAL_RANK)


class RankPipeline:
    def __init__(
        self,
        recorder: IntervalRecorder,
        options: dict,
        attributes: dict,
        endpoint: Optional[str],
        protocol: Optional[str],
        tracer_provider: Any = None,
        device_processor: Optional[CudaEventSpanProcessor] = None,
        environ: Optional[Mapping[str, str]] = None,
    ) -> None:
        self.recorder = recorder
        self.options = options
        self.attributes = attributes
        self.environ = environ  # configure()'s: identity is re-read from the same place
        self.endpoint = endpoint
        self.protocol = protocol
        self.user_provider = tracer_provider
        self.exporter: Optional[CountingSpanExporter] = None
        self.batch_processor: Optional[BatchingSpanProcessor] = None
        self.metrics_provider = None
        self.metrics_errors = 0  # the rank's metrics could not be started: not a loss of spans
        self.heartbeat_errors = 0  # heartbeats lost to an unexpected error (counted in internal_error)
        if device_processor is not None:
            self.backend = device_processor.backend
            device_processor.release_event = self._release_event
        else:
            self.backend = make_backend(options["device_timing"]) if tracer_provider is None else None
        self.event_pool: Optional[EventPool] = None
        self.device_processor = device_processor
        self.gpu_health = self._make_gpu_health(options)
        self._detected_resource: Optional[Resource] = None  # _detect_resource()
        if tracer_provider is None:
            # Export is set up now so a bad endpoint, protocol or exporter variable fails configure(),
            # not later (the metrics exporter is made on the builder thread, where it is only counted)
            if options["export_metrics"]:
                check_exporter_environ("metrics", resolve_protocol(protocol, self._environ(), "METRICS"),
                                       self._environ())
            self.exporter = CountingSpanExporter(span_exporter(endpoint, protocol, self._environ()))
            self.batch_processor = BatchingSpanProcessor(self.exporter, environ=self._environ())
            if self.backend is not None:
                self.device_processor = CudaEventSpanProcessor(
                    self.batch_processor, self.backend,
                    readout_timeout_s=options["readout_timeout_ms"] / 1000,
                    max_pending=options["max_pending_spans"],
                    release_event=self._release_event,
                )
        if self.backend is not None:
            recorder.on_first_step = self._make_event_pool
        self.provider: Any = None  # ours (a TracerProvider), or the user's tracer_provider, whatever it is
        self.builder: Optional[SpanBuilder] = None
        self._build_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._flusher: Optional[threading.Thread] = None  # the last flush's thread
        self._wake = threading.Event()
        self._stopping = False
        interval_ms = options["heartbeat_interval_ms"]
        self._heartbeats = heartbeat.HeartbeatSchedule(interval_ms / 1000, time.monotonic()) if interval_ms else None
        warning_s = options["no_stage_warning_s"]
        # when to look whether a stage was timed yet; None: not to look (again)
        self._no_stage_look_at: Optional[float] = time.monotonic() + warning_s if warning_s else None
        self._thread = threading.Thread(target=self._run, name="otel-straggler-span-builder", daemon=True)
        self._thread.start()

    # -- lazily made parts ---------------------------------------------------------------------

    def _make_gpu_health(self, options: dict) -> Optional[gpu_health.GpuHealth]:
        """The GPU sampler; NVML is loaded at its first sample, on the builder thread. What is
        read here, on configure()'s thread, is the CUDA device current now (the builder thread's
        own would be device 0), and only where CUDA is initialised already."""
        mode = options["gpu_health"]
        if mode == "off" or not options["heartbeat_interval_ms"]:
            return None  # sampled at heartbeats only
        configure_device = gpu_health.current_cuda_device()

        def locate() -> tuple[int, str]:
            return gpu_health.cuda_device_of_rank(getattr(self.backend, "device", None), configure_device,
                                                  self.attributes.get(contract.LOCAL_RANK))

        metrics = options["gpu_metrics"] and options["export_metrics"] and self.user_provider is None
        nvml = None
        if mode == "fake":
            from otel_straggler.instrumentation.fake_nvml import FakeNvml

            nvml = FakeNvml()
        return gpu_health.GpuHealth(mode, locate, self._environ(), memory=metrics, nvml=nvml)

    def _make_event_pool(self) -> None:
        """Runs once, on the training thread, inside the first step() call."""
        try:
            self.event_pool = EventPool(self.backend, self.options["event_pool_size"])
            self.recorder.event_pool = self.event_pool
            if self.device_processor is not None:
                # the pool's own release from now on, not _release_event's look for it: one call
                # less for each of a span's two events (no event was handed out before the pool)
                self.device_processor.release_event = self.event_pool.release
        except Exception:
            self.recorder.internal_errors += 1

    def _release_event(self, event: Any) -> None:
        if self.event_pool is not None:
            self.event_pool.release(event)

    def _ensure_builder(self) -> SpanBuilder:
        if self.builder is not None:
            return self.builder
        # Re-read identity now: parallel state may have been set up since configure().
        attributes = {**identity.discover(self.options, self.environ), **self.attributes}
        attach = self.device_processor.attach_device_events if self.device_processor else None
        extra: dict = {}
        spans: ProcessorSpans | TracerSpans
        heartbeat_spans: ProcessorSpans | TracerSpans
        batch_processor = self.batch_processor
        if batch_processor is not None:  # no user's provider: configure() made our own processors
            # what Resource.create(attributes) makes, with the detectors run already
            resource = self._detect_resource().merge(Resource(attributes))
            # shut down by configure()'s exit handler, within its deadline: the SDK's own, made
            # later and so run first, would close the processors before the last build
            provider = TracerProvider(resource=resource, sampler=ALWAYS_ON, shutdown_on_exit=False)
            processor = self.device_processor or batch_processor
            provider.add_span_processor(processor)  # for flush and shutdown
            self.provider = provider
            if ProcessorSpans.applies(provider):
                spans = ProcessorSpans(processor, provider.resource, _SCOPE, attach, self._release_event)
                # past the CudaEventSpanProcessor, which keeps completion order: a heartbeat would
                # wait there behind spans whose events a stalled GPU never completes
                heartbeat_spans = ProcessorSpans(batch_processor, provider.resource, _SCOPE)
            else:
                spans = heartbeat_spans = self._tracer_spans(provider, attach)
            if self.options["export_metrics"]:
                gpu = self.gpu_health if self.options["gpu_metrics"] else None
                try:
                    self.metrics_provider = start_rank_metrics(self.status_of_recorder, provider.resource,
                                                               self.endpoint, self.protocol, self._environ(), gpu)
                except Exception:  # no rank metrics (their exporter, or a thread at exit): spans go on
                    self.metrics_errors += 1
        else:
            provider = self.user_provider
            spans = heartbeat_spans = self._tracer_spans(provider, attach)
            extra = {key: attributes[key] for key in _IDENTITY_KEYS_ON_SPANS if key in attributes}
            self.provider = provider
        self.attributes = attributes
        self.builder = SpanBuilder(
            self.recorder, spans, str(attributes.get(contract.JOB_ID, "")),
            device_timing=self.device_processor is not None, release_event=self._release_event,
            extra_attributes=extra, heartbeat_spans=heartbeat_spans,
        )
        return self.builder

    def _environ(self) -> Mapping[str, str]:
        return os.environ if self.environ is None else self.environ

    def _tracer_spans(self, provider: Any, attach) -> TracerSpans:
        """Spans through the provider's Tracer, with our derived ids in front of its id generator."""
        ids = DerivedIdGenerator()
        if hasattr(provider, "id_generator"):
            ids.fallback = provider.id_generator
            provider.id_generator = ids
        return TracerSpans(provider.get_tracer(_SCOPE), ids, attach, self._release_event)

    # -- builder thread ------------------------------------------------------------------------

    def _detect_resource(self) -> Resource:
        """The resource's detected part (OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME, the
        detectors OTEL_EXPERIMENTAL_RESOURCE_DETECTORS names), made once, by the builder thread as
        it starts: a detector may take seconds. At interpreter exit the SDK's detector pool takes
        no work; a rank making its provider then gets the env's part alone."""
        if self._detected_resource is None:
            try:
                self._detected_resource = Resource.create()
            except Exception:  # the pool refusing work at exit, or a detector failing: the env alone
                try:
                    self._detected_resource = OTELResourceDetector().detect()
                except Exception:
                    self._detected_resource = Resource.get_empty()
        return self._detected_resource

    def _run(self) -> None:
        if self.user_provider is None:
            self._detect_resource()
        interval_s = self.options["build_interval_ms"] / 1000
        next_build = time.monotonic() + interval_s
        while not self._stopping:
            # Asleep until the next build or the next heartbeat, whichever is first (or a wake-up).
            wake_at = next_build if self._heartbeats is None else min(next_build, self._heartbeats.next_due)
            if self._no_stage_look_at is not None:
                wake_at = min(wake_at, self._no_stage_look_at)
            woken = self._wake.wait(max(0.0, wake_at - time.monotonic()))
            self._wake.clear()
            self._heartbeat_if_due()
            self._warn_if_no_stage_timed()
            if not woken and time.monotonic() < next_build:
                continue  # up for a heartbeat only
            # A burst of building holds the GIL throughout, and the training thread, back from a
            # kernel or an op, waits for the rest of it: short bursts with a pause between them,
            # in which a waiting thread wakes and takes the GIL, keep that wait short. A build
            # still running half an interval after it began, or a backlog of half the queue,
            # goes on without pauses: keeping up comes first (a full queue drops records).
            # Heartbeats fall due between bursts: a long build delays one by a burst at most.
            pauses_until = time.monotonic() + interval_s / 2
            while self._build(until=time.monotonic() + BUILD_BURST_S) and not self._stopping:
                self._heartbeat_if_due()
                if time.monotonic() < pauses_until and len(self.recorder.completed) < self.recorder.capacity // 2:
                    time.sleep(BUILD_PAUSE_S)
            next_build = time.monotonic() + interval_s

    def _heartbeat_if_due(self) -> None:
        """Sends a heartbeat when one is due; any failure is counted, never raised."""
        schedule = self._heartbeats
        if schedule is None or self._stopping or not schedule.due(time.monotonic()):
            return
        try:
            recorder = self.recorder
            if self.builder is None and not recorder.completed and recorder.binding[0] is None:
                return  # nothing recorded yet (see the module doc)
            # outside the build lock: NVML's calls (and its first load) keep no flush() waiting
            gpu = self.gpu_health.sample() if self.gpu_health is not None else None
            with self._build_lock:
                if self._stopping:
                    return
                self._ensure_builder().build_heartbeat(heartbeat.sample(recorder, gpu))
        except Exception:
            self.heartbeat_errors += 1
        finally:
            schedule.sent(time.monotonic())  # a failed one too: not retried at once, in a loop

    def _warn_if_no_stage_timed(self) -> None:
        """Once, no_stage_warning_s after configure(): one warning if no stage was timed by then
        (none recorded, lost or still open). Reads counters only; never raises."""
        look_at = self._no_stage_look_at
        if look_at is None or self._stopping or time.monotonic() < look_at:
            return
        self._no_stage_look_at = None
        try:
            with self._build_lock:  # the records still queued are not built meanwhile (a flush())
                if self._stage_timed():
                    return
        except Exception:
            return  # not knowing, say nothing
        _log.warning(
            "otel-straggler: no stage timed in the %g s since configure(), so the detector has nothing of this "
            "rank to judge. If training has begun, time its loop: ots.step(n) at the start of each step and "
            "`with ots.stage(name):` around its parts, ots.instrument_ddp(model) for DistributedDataParallel, "
            "otel_straggler.integrations.megatron.install() for Megatron-LM's timers, or these calls in your "
            "framework's "
            "callbacks (docs/instrumentation.md). OTEL_STRAGGLER_NO_STAGE_WARNING_S=0 turns this warning off",
            self.options["no_stage_warning_s"])

    def _stage_timed(self) -> bool:
        recorder, builder = self.recorder, self.builder
        if recorder.open_intervals or recorder.dropped_queue_full or recorder.untracked_open_intervals:
            return True
        if builder is not None and builder.counters["intervals_taken"]:
            return True
        return any(record[0] == INTERVAL for record in tuple(recorder.completed))

    def _build(self, close_open_step: bool = False, until: Optional[float] = None) -> bool:
        """Builds queued records (none begun after `until`, as build_pending); says whether any remain."""
        with self._build_lock:
            if not self.recorder.completed and self.builder is None:
                return False
            try:
                return self._ensure_builder().build_pending(close_open_step, until)
            except Exception:
                self.recorder.internal_errors += 1
                return False

    # -- handle operations ---------------------------------------------------------------------

    def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        # Built here, on the caller's thread, but only until the deadline (a full queue takes
        # about a second): what is left then is the builder thread's, and the flush did not finish.
        while self._build(until=time.monotonic() + BUILD_BURST_S):
            if time.monotonic() >= deadline:
                self._wake.set()
                return False
        provider = self.provider
        if provider is None or not hasattr(provider, "force_flush"):
            return True
        # A processor of the chain may not keep to its timeout (the provider's flush goes through
        # CudaEventSpanProcessor, and a provider may hold others): run it aside and wait at most
        # what is left. One such thread at a time: while an earlier flush still
        # runs (its export retrying through an outage), a call waits for it, and gives up at its
        # own deadline rather than start another.
        if not self._flush_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        try:
            earlier = self._flusher
            if earlier is not None and earlier.is_alive():
                earlier.join(max(0.0, deadline - time.monotonic()))
                if earlier.is_alive():
                    return False
            result: list[bool] = []
            flusher = threading.Thread(target=lambda: result.append(provider.force_flush(int(timeout_s * 1000))),
                                       name="otel-straggler-flush", daemon=True)
            flusher.start()
            self._flusher = flusher
        finally:
            self._flush_lock.release()
        flusher.join(max(0.0, deadline - time.monotonic()))
        return bool(result and result[0])

    def shutdown(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s  # one budget for every part, not one each
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        if self.gpu_health is not None and not self._thread.is_alive():  # NVML is the builder thread's
            self.gpu_health.close()
        self._build(close_open_step=True)
        if self.batch_processor is not None:
            self.batch_processor.shutdown_deadline = deadline
        if self.user_provider is None and self.provider is not None:
            closer = threading.Thread(target=self.provider.shutdown, name="otel-straggler-shutdown", daemon=True)
            closer.start()
            closer.join(max(0.0, deadline - time.monotonic()))
        if self.metrics_provider is not None:
            try:
                self.metrics_provider.shutdown(timeout_millis=max(0.0, deadline - time.monotonic()) * 1000)
            except Exception:
                pass

    def status_of_recorder(self) -> dict:
        return self.status(self.recorder)

    def status(self, recorder: IntervalRecorder) -> dict:
        builder = self.builder
        built = dict(builder.counters) if builder is not None else dict.fromkeys(COUNTER_NAMES, 0)
        device = dict(self.device_processor.counters) if self.device_processor is not None else {}
        lost = {
            "queue_full": recorder.dropped_queue_full,
            "step_queue_full": recorder.dropped_step_records,
            "pool_exhausted": built["pool_exhausted"],
            "readout_timeout": device.get("readout_timeout", 0),
            "event_error": device.get("event_error", 0),
            "processor_full": device.get("processor_full", 0) + device.get("processor_shut_down", 0),
            "exporter_queue_full": self.batch_processor.dropped_queue_full if self.batch_processor else 0,
            "export_failed": self.exporter.export_failed if self.exporter else 0,
            "unexported_at_shutdown": self.batch_processor.unexported_at_shutdown if self.batch_processor else 0,
            "internal_error": recorder.internal_errors + built["build_errors"] + self.heartbeat_errors
            + device.get("internal_error", 0) + device.get("next_processor_error", 0),
        }
        pending = len(recorder.completed)
        return {
            "enabled": True,
            "device_timing": self.backend.name if self.backend is not None and self.device_processor else "off",
            # taken from the queue to be built, or dropped at it: both only grow, so the sum does
            # too, as a counter exported must (the queue also holds step records, so adding its
            # length would count those until built); the ones still queued are in pending_build
            "intervals": built["intervals_taken"] + recorder.dropped_queue_full,
            "spans_built": built["spans_built"],
            "steps_built": built["steps_built"],
            "heartbeats": built["heartbeats_built"],  # train.heartbeat spans built (CONTRACT §2b)
            "parent_ids_forgotten": built["parent_ids_forgotten"],  # spans kept, a parent link may dangle
            # spans a TracerProvider of yours did not record (its sampler): not a loss of ours
            "sampled_out": getattr(builder.spans, "sampled_out", 0) if builder is not None else 0,
            "metrics_errors": self.metrics_errors,  # the rank's own metrics failed to start
            # intervals nested deeper than hot_path_reference.MAX_OPEN_INTERVALS (stages never exited):
            # spans kept, each one's children point at an enclosing interval instead
            "open_intervals_untracked": recorder.untracked_open_intervals,
            "device_timed": device.get("device_timed", 0),
            "exported": self.exporter.exported if self.exporter else None,
            "pending_build": pending,
            "pending_device": self.device_processor.pending() if self.device_processor else 0,
            "event_pool_free": self.event_pool.free_count() if self.event_pool else None,
            "lost": lost,
            # GPU health sampling (CONTRACT §2c): state, why, samples taken, errors by kind
            "gpu_health": self.gpu_health.status() if self.gpu_health is not None else {
                "state": "off", "reason": "setting_off" if self.options["gpu_health"] == "off" else "no_heartbeats",
                "samples": 0, "errors": {}},
        }
