"""Device timing through the whole rank side: stage() records events from the pool, the
builder hands them to the CudaEventSpanProcessor, and every way of losing the device
duration is named on the span and counted in status()."""
from __future__ import annotations

import otel_straggler
from otel_straggler import contract
from otel_straggler.processors.device_events import FakeDeviceEvents


def timing_of(span) -> tuple:
    attributes = span.attributes
    return (attributes[contract.TIMING], attributes.get(contract.DEVICE_DURATION_MS),
            attributes.get(contract.TIMING_REASON))


def steps_of_one_stage(handle, steps: int, flush_timeout_s: float) -> None:
    """Steps of one stage each, every one flushed (built) before the next."""
    for step in range(steps):
        otel_straggler.step(step)
        with otel_straggler.stage("forward-compute"):
            pass
        handle.flush(timeout_s=flush_timeout_s)


def test_an_exhausted_pool_times_host_only_until_events_come_back(in_memory, wait_until):
    backend = FakeDeviceEvents(kernel_ms=1.0)
    handle = in_memory.configure(device_backend=backend, event_pool_size=4)
    otel_straggler.step(0)
    for name in ("forward-compute", "backward-compute", "optimizer"):  # 2 events each, 4 in the pool
        with otel_straggler.stage(name):
            pass
    assert handle.status()["event_pool_free"] == 0
    backend.complete_all()

    spans = {span.name: span for span in in_memory.stage_spans()}
    assert timing_of(spans["forward-compute"]) == (contract.TIMING_DEVICE, 1.0, None)
    assert timing_of(spans["backward-compute"]) == (contract.TIMING_DEVICE, 1.0, None)
    assert timing_of(spans["optimizer"]) == (contract.TIMING_DEVICE_UNAVAILABLE, None, "pool_exhausted")
    status = handle.status()
    assert status["lost"]["pool_exhausted"] == 1 and status["device_timed"] == 2
    assert wait_until(lambda: handle.status()["event_pool_free"] == 4)

    in_memory.exporter.clear()
    otel_straggler.step(1)
    with otel_straggler.stage("forward-compute"):
        pass
    backend.complete_all()
    (again,) = in_memory.stage_spans()
    assert timing_of(again) == (contract.TIMING_DEVICE, 1.0, None)


def test_stages_begun_before_the_first_step_say_so_and_are_not_counted_lost(in_memory):
    """The event pool is made at the first step(): a stage begun before it (setup, a warm-up) has
    no events by design, which is not an exhausted pool."""
    backend = FakeDeviceEvents(auto_complete=True, kernel_ms=1.0)
    handle = in_memory.configure(device_backend=backend)
    with otel_straggler.stage("model-and-optimizer-setup"):
        pass
    with otel_straggler.stage("load-checkpoint"):
        otel_straggler.step(0)  # ends within it: bound to step 0, begun without events all the same
    with otel_straggler.stage("forward-compute"):
        pass
    handle.flush(timeout_s=5.0)
    spans = {span.name: span for span in in_memory.stage_spans()}
    for name in ("model-and-optimizer-setup", "load-checkpoint"):
        assert timing_of(spans[name]) == (contract.TIMING_DEVICE_UNAVAILABLE, None, "before_first_step"), name
    assert timing_of(spans["forward-compute"]) == (contract.TIMING_DEVICE, 1.0, None)
    status = handle.status()
    assert status["lost"]["pool_exhausted"] == 0 and sum(status["lost"].values()) == 0


def test_nested_stages_get_the_device_time_between_their_own_events(in_memory):
    backend = FakeDeviceEvents(auto_complete=True, kernel_ms=1.5)
    in_memory.configure(device_backend=backend)
    otel_straggler.step(0)
    with otel_straggler.stage("forward-backward"):  # its events enclose the children's four
        with otel_straggler.stage("forward-compute"):
            pass
        with otel_straggler.stage("backward-compute"):
            pass
    spans = {span.name: span for span in in_memory.stage_spans()}
    assert spans["forward-backward"].attributes[contract.DEVICE_DURATION_MS] == 5 * 1.5
    assert spans["forward-compute"].attributes[contract.DEVICE_DURATION_MS] == 1.5


def test_readout_timeouts_and_event_errors_are_named_and_counted(in_memory, wait_until):
    backend = FakeDeviceEvents()
    handle = in_memory.configure(device_backend=backend, readout_timeout_s=0.05)
    otel_straggler.step(0)
    with otel_straggler.stage("stuck-on-device"):
        pass
    assert wait_until(lambda: handle.status()["lost"]["readout_timeout"] == 1)

    backend.fail_next_query = True
    with otel_straggler.stage("device-error"):
        pass
    backend.complete_all()
    assert wait_until(lambda: handle.status()["lost"]["event_error"] == 1)

    spans = {span.name: span for span in in_memory.stage_spans()}
    assert timing_of(spans["stuck-on-device"]) == (contract.TIMING_DEVICE_UNAVAILABLE, None, "readout_timeout")
    assert timing_of(spans["device-error"]) == (contract.TIMING_DEVICE_UNAVAILABLE, None, "event_error")
    assert handle.status()["device_timed"] == 0


def test_without_a_device_backend_spans_are_host_only(in_memory):
    handle = in_memory.configure()
    otel_straggler.step(0)
    with otel_straggler.stage("forward-compute"):
        pass
    (span,) = in_memory.stage_spans()
    assert timing_of(span) == (contract.TIMING_HOST_ONLY, None, "no_cuda")
    assert handle.status()["device_timing"] == "off"


def test_numpy_steps_are_built_as_ints(in_memory, wait_until):
    """`for step in np.arange(...)`: the step is an int on every span, and nothing is lost."""
    import numpy as np  # a dependency of the package
    backend = FakeDeviceEvents(auto_complete=True)
    handle = in_memory.configure(device_backend=backend, event_pool_size=8)
    for step in np.arange(3, dtype=np.int64):
        otel_straggler.step(step, samples=np.int64(4))
        with otel_straggler.stage("forward-compute"):
            pass
    spans = in_memory.spans()
    steps = sorted((span.name, span.attributes[contract.STEP]) for span in spans)
    # each step's span ends when the next step begins: the last one is still open
    assert steps == [("forward-compute", 0), ("forward-compute", 1), ("forward-compute", 2),
                     (contract.STEP_SPAN_NAME, 0), (contract.STEP_SPAN_NAME, 1)]
    assert all(type(span.attributes[contract.STEP]) is int for span in spans)
    assert handle.status()["lost"]["internal_error"] == 0
    assert wait_until(lambda: handle.status()["event_pool_free"] == 8)


def test_a_step_on_a_device_is_not_read(in_memory):
    """A 0-d CUDA tensor as the step: reading it would wait for the device, so it is refused."""
    class DeviceStep:
        device = type("Device", (), {"type": "cuda"})()
        read = False

        def __index__(self) -> int:
            DeviceStep.read = True
            return 1

    handle = in_memory.configure()
    otel_straggler.step(DeviceStep())
    with otel_straggler.stage("forward-compute"):
        pass
    handle.flush(timeout_s=5.0)
    assert not DeviceStep.read and handle.status()["spans_built"] == 0
    assert handle.status()["lost"]["internal_error"] >= 1


def test_an_interval_that_fails_to_build_gives_its_events_back(in_memory, wait_until):
    backend = FakeDeviceEvents(auto_complete=True)
    handle = in_memory.configure(device_backend=backend, event_pool_size=4)
    for _ in range(6):  # more events than the pool holds, all failing to build
        otel_straggler.step(1.5)  # not an integer step: the builder cannot make its span
        with otel_straggler.stage("forward-compute"):
            pass
    handle.flush(timeout_s=5.0)
    status = handle.status()
    assert status["lost"]["internal_error"] >= 6 and status["spans_built"] == 0
    assert status["intervals"] == 6  # accounted for: built, failed (internal_error) or dropped
    assert wait_until(lambda: handle.status()["event_pool_free"] == 4)
    assert status["lost"]["pool_exhausted"] == 0


def test_spans_your_sampler_drops_give_their_events_back(configure, wait_until):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    from otel_straggler.processors.cuda_event_span_processor import CudaEventSpanProcessor

    provider = TracerProvider(sampler=ALWAYS_OFF)
    processor = CudaEventSpanProcessor(SimpleSpanProcessor(InMemorySpanExporter()),
                                       FakeDeviceEvents(auto_complete=True), poll_interval_s=0.001)
    provider.add_span_processor(processor)
    handle = configure(job_id="sampled", rank=0, tracer_provider=provider, device_processor=processor,
                       event_pool_size=4)
    steps_of_one_stage(handle, 6, flush_timeout_s=5.0)  # 12 events from a pool of 4: each must come back
    status = handle.status()
    assert status["sampled_out"] == 6 + 5 and status["lost"]["pool_exhausted"] == 0  # stages, and steps 0-4
    assert wait_until(lambda: handle.status()["event_pool_free"] == 4)
    assert processor.pending() == 0 and not processor._events_by_span_id
    provider.shutdown()


def test_a_span_that_fails_to_be_made_gives_its_events_back(configure, monkeypatch, unreachable_endpoint,
                                                             wait_until):
    from otel_straggler.instrumentation import span_builder

    def failing(*args, **kwargs):
        raise ValueError("a span the SDK will not make")

    monkeypatch.setattr(span_builder.ProcessorSpans, "_readable_span", failing)
    # no metrics: their exporter would retry the unreachable endpoint until shutdown's deadline
    handle = configure(job_id="unmade", rank=0, endpoint=unreachable_endpoint, protocol="grpc",
                       device_timing="fake", event_pool_size=4, export_metrics=False)
    steps_of_one_stage(handle, 6, flush_timeout_s=0.2)  # 12 events from a pool of 4: each must come back
    status = handle.status()
    assert status["spans_built"] == 0 and status["lost"]["internal_error"] >= 6
    assert status["lost"]["pool_exhausted"] == 0
    assert wait_until(lambda: handle.status()["event_pool_free"] == 4)
