"""Heartbeats (CONTRACT §2b): a `train.heartbeat` span every heartbeat interval from the span
builder's thread, with the stages open on the training thread at that moment, also while that
thread is blocked in a call that releases the GIL; none once the instrumentation is shut down.
Run against both hot paths: the open stages are read from what each recorder keeps."""
from __future__ import annotations

import gc
import os
import threading
import time
import types
from typing import Iterator

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from otel_straggler import contract
from otel_straggler.instrumentation import api, heartbeat, rank_state
from otel_straggler.instrumentation import hot_path_reference as python_hot_path
from otel_straggler.instrumentation.span_builder import trace_id_for_step

try:
    from otel_straggler.instrumentation import _hot_path as c_hot_path
except ImportError:
    c_hot_path = None

INTERVAL_MS = 100.0
JOB = "job-heartbeat"


@pytest.fixture(params=["python", "c"])
def hot_path(request, monkeypatch) -> Iterator[types.ModuleType]:
    """configure() records on this implementation's recorder; the test's stages and steps are its."""
    module = {"python": python_hot_path, "c": c_hot_path}[request.param]
    if module is None:
        if os.environ.get("CI") == "true":
            pytest.fail("otel_straggler.instrumentation._hot_path is not built", pytrace=False)
        pytest.skip("the C extension is not built here")
    monkeypatch.setattr(api, "IntervalRecorder", module.IntervalRecorder)
    monkeypatch.setattr(rank_state, "hot_path", module)
    yield module
    module.install(None)


def heartbeat_attributes(span) -> dict:
    return dict(span.attributes)


def test_heartbeats_come_on_their_own_schedule_with_the_contract_attributes(in_memory, hot_path, wait_until):
    # a build interval far longer than the heartbeat's: heartbeats do not wait for builds
    handle = in_memory.configure(job_id=JOB, rank=2, world_size=4, heartbeat_interval_ms=INTERVAL_MS,
                                 build_interval_ms=60_000)
    started_ns = time.time_ns()
    hot_path.Step(7)
    assert wait_until(lambda: len(in_memory.heartbeats()) >= 4, timeout_s=10.0)
    beats = in_memory.heartbeats()
    times = [span.start_time for span in beats]
    gaps_ms = [(later - earlier) / 1e6 for earlier, later in zip(times, times[1:])]
    assert all(INTERVAL_MS * 0.8 <= gap <= INTERVAL_MS * 5 for gap in gaps_ms), gaps_ms
    for span in beats:
        assert span.name == contract.HEARTBEAT_SPAN_NAME
        assert started_ns - INTERVAL_MS * 1e6 <= span.start_time == span.end_time <= time.time_ns()
        assert span.parent is None
        assert span.context.trace_id == trace_id_for_step(JOB, 7)
        attributes = heartbeat_attributes(span)
        assert attributes[contract.STEP] == 7
        assert attributes[contract.SEQ] == 0  # nothing built yet
        assert tuple(attributes[contract.HEARTBEAT_OPEN_STAGES]) == ()
        assert tuple(attributes[contract.HEARTBEAT_OPEN_SINCE]) == ()
        # on a TracerProvider of yours the identity rides on each span, as on stage spans
        assert (attributes[contract.JOB_ID], attributes[contract.RANK], attributes[contract.WORLD_SIZE],
                attributes[contract.RESTART_COUNT]) == (JOB, 2, 4, 0)
        assert contract.STAGE not in attributes  # not a stage span: the detector keeps them apart
    assert len({span.context.span_id for span in beats}) == len(beats)
    assert handle.status()["heartbeats"] >= len(beats)
    assert handle.status()["spans_built"] == 0


@pytest.mark.parametrize("blocked_in", ["event-wait", "sleep"])
def test_open_stages_outermost_first_while_the_training_thread_is_blocked(in_memory, hot_path, wait_until,
                                                                            blocked_in):
    handle = in_memory.configure(job_id=JOB, heartbeat_interval_ms=INTERVAL_MS)
    inside = threading.Event()
    release = threading.Event()

    def train() -> None:
        hot_path.Step(3)
        with hot_path.Stage("forward-backward"):
            with hot_path.Stage("all-grads-sync", collective=True):
                inside.set()
                if blocked_in == "sleep":
                    time.sleep(2.0)  # a C call that releases the GIL, as a gloo or NCCL wait does
                else:
                    release.wait(10.0)

    trainer = threading.Thread(target=train, name="training-thread")
    trainer.start()
    try:
        assert inside.wait(5.0)
        blocked_ns = time.time_ns()
        opened = tuple(handle.recorder.open_intervals)
        expected_since = [interval[python_hot_path.START_NS] for interval in opened]

        def sampled_while_blocked() -> list:
            return [span for span in in_memory.heartbeats() if span.start_time >= blocked_ns]

        # heartbeats go on while the training thread stays blocked
        assert wait_until(lambda: len(sampled_while_blocked()) >= 3, timeout_s=5.0)
        beats = sampled_while_blocked()
        assert trainer.is_alive()
        for span in beats:
            attributes = heartbeat_attributes(span)
            assert list(attributes[contract.HEARTBEAT_OPEN_STAGES]) == ["forward-backward", "all-grads-sync"]
            since = list(attributes[contract.HEARTBEAT_OPEN_SINCE])
            assert since == expected_since and since[0] <= since[1] <= span.start_time
            assert attributes[contract.STEP] == 3
        # as a user's OTLP exporter writes them (the SDK's encoder): string and int arrays
        (encoded,) = encode_spans(beats[:1]).resource_spans[0].scope_spans[0].spans
        on_the_wire = {item.key: item.value for item in encoded.attributes}
        assert array_value(on_the_wire[contract.HEARTBEAT_OPEN_STAGES]) == ["forward-backward", "all-grads-sync"]
        assert array_value(on_the_wire[contract.HEARTBEAT_OPEN_SINCE]) == expected_since
    finally:
        release.set()
        trainer.join(10.0)
    in_memory.exporter.clear()
    assert wait_until(lambda: in_memory.heartbeats(), timeout_s=5.0)
    after = heartbeat_attributes(in_memory.heartbeats()[-1])
    assert tuple(after[contract.HEARTBEAT_OPEN_STAGES]) == () and tuple(after[contract.HEARTBEAT_OPEN_SINCE]) == ()


def test_the_seq_is_the_next_stage_spans_and_none_is_taken(in_memory, hot_path, wait_until):
    handle = in_memory.configure(job_id=JOB, heartbeat_interval_ms=INTERVAL_MS)
    hot_path.Step(0)
    for name in ("forward-compute", "backward-compute", "optimizer"):
        with hot_path.Stage(name):
            pass
    assert handle.flush(timeout_s=5.0)
    in_memory.exporter.clear()
    assert wait_until(lambda: in_memory.heartbeats(), timeout_s=5.0)
    assert heartbeat_attributes(in_memory.heartbeats()[-1])[contract.SEQ] == 3
    with hot_path.Stage("forward-compute"):
        pass
    seqs = [span.attributes[contract.SEQ] for span in in_memory.stage_spans()]
    assert seqs == [3]  # the heartbeat's seq was not consumed: stage spans stay gapless


def test_heartbeats_wait_for_a_step_or_a_record_then_start(in_memory, hot_path, wait_until):
    handle = in_memory.configure(job_id=JOB, heartbeat_interval_ms=INTERVAL_MS)
    setup = hot_path.Stage("model-and-optimizer-setup").__enter__()  # open, not completed: nothing recorded yet
    time.sleep(INTERVAL_MS * 3.5 / 1000)
    assert in_memory.heartbeats() == [] and handle._pipeline.builder is None
    hot_path.Step(0)
    assert wait_until(lambda: in_memory.heartbeats(), timeout_s=5.0)
    (first, *_) = in_memory.heartbeats()
    assert list(first.attributes[contract.HEARTBEAT_OPEN_STAGES]) == ["model-and-optimizer-setup"]
    assert first.attributes[contract.STEP] == 0
    setup.__exit__(None, None, None)


def test_a_heartbeat_before_the_first_step_has_no_step_and_a_trace_of_its_own(in_memory, hot_path, wait_until):
    in_memory.configure(job_id=JOB, heartbeat_interval_ms=INTERVAL_MS)
    with hot_path.Stage("model-and-optimizer-setup"):
        pass  # a record: heartbeats may start
    assert wait_until(lambda: len(in_memory.heartbeats()) >= 2, timeout_s=5.0)
    beats = in_memory.heartbeats()
    assert all(contract.STEP not in span.attributes for span in beats)
    assert len({span.context.trace_id for span in beats}) == len(beats)


def test_zero_turns_heartbeats_off(in_memory, hot_path):
    handle = in_memory.configure(job_id=JOB, heartbeat_interval_ms=0)
    hot_path.Step(0)
    with hot_path.Stage("forward-compute"):
        pass
    time.sleep(INTERVAL_MS * 4 / 1000)
    assert in_memory.heartbeats() == []
    assert handle.status()["heartbeats"] == 0
    assert [span.name for span in in_memory.stage_spans()] == ["forward-compute"]


def test_heartbeats_are_on_by_default_and_their_interval_comes_from_the_env(in_memory, monkeypatch):
    handle = in_memory.configure(job_id=JOB, heartbeat_interval_ms=None)  # None: the tests' default of 0 undone
    assert handle._pipeline._heartbeats.interval_s == 5.0
    handle.shutdown()
    monkeypatch.setenv("OTEL_STRAGGLER_HEARTBEAT_INTERVAL_MS", "250")
    handle = in_memory.configure(job_id=JOB, heartbeat_interval_ms=None)
    assert handle._pipeline._heartbeats.interval_s == 0.25


def test_nothing_after_shutdown(in_memory, hot_path, wait_until):
    handle = in_memory.configure(job_id=JOB, heartbeat_interval_ms=INTERVAL_MS)
    hot_path.Step(0)
    assert wait_until(lambda: in_memory.heartbeats(), timeout_s=5.0)
    handle.shutdown(timeout_s=3.0)
    sent = len(in_memory.heartbeats())
    assert not handle._pipeline._thread.is_alive()
    time.sleep(INTERVAL_MS * 4 / 1000)
    assert len(in_memory.heartbeats()) == sent == handle.status()["heartbeats"]


def test_a_failing_heartbeat_is_counted_and_training_goes_on(in_memory, hot_path, wait_until, monkeypatch):
    def broken(recorder):
        raise RuntimeError("sampling failed")

    monkeypatch.setattr(heartbeat, "sample", broken)
    handle = in_memory.configure(job_id=JOB, heartbeat_interval_ms=INTERVAL_MS)
    hot_path.Step(0)
    assert wait_until(lambda: handle.status()["lost"]["internal_error"] >= 2, timeout_s=5.0)
    with hot_path.Stage("forward-compute"):
        pass
    assert [span.name for span in in_memory.stage_spans()] == ["forward-compute"]
    assert in_memory.heartbeats() == [] and handle.status()["heartbeats"] == 0


def test_a_long_build_delays_a_heartbeat_by_a_burst_at_most(in_memory, hot_path, wait_until):
    handle = in_memory.configure(job_id=JOB, heartbeat_interval_ms=INTERVAL_MS, build_interval_ms=60_000)
    hot_path.Step(0)
    assert handle.flush(timeout_s=5.0)  # the builder, made now
    builder = handle._pipeline.builder
    build_pending = builder.build_pending
    bursts: list[float] = []

    def slow_burst(*args, **kwargs):  # 20 ms a burst: 60 bursts make a build of over a second
        time.sleep(0.02)
        bursts.append(time.monotonic())
        return build_pending(*args, **kwargs)

    builder.build_pending = slow_burst
    for _ in range(60 * 16):
        with hot_path.Stage("forward-compute"):
            pass
    in_memory.exporter.clear()
    # A full collection stops every thread, the pipeline's too, and in a test process that has
    # imported torch, megatron-core and transformers it takes about 210 ms here (over two
    # intervals): that pause is the interpreter's, not the build's, which is what this measures.
    gc.disable()
    try:
        handle._pipeline._wake.set()
        assert wait_until(lambda: not handle.recorder.completed, timeout_s=20.0)
    finally:
        gc.enable()
    during = [span.start_time / 1e9 for span in in_memory.heartbeats()]
    build_s = bursts[-1] - bursts[0]
    assert build_s >= 1.0
    assert len(during) >= build_s * 1000 / INTERVAL_MS / 2, (len(during), build_s)
    gaps_ms = [(later - earlier) * 1000 for earlier, later in zip(during, during[1:])]
    assert max(gaps_ms) < INTERVAL_MS * 3, gaps_ms


def test_sample_reads_the_open_intervals_in_order_and_the_bound_step(hot_path):
    recorder = hot_path.IntervalRecorder(64)
    hot_path.install(recorder)
    assert heartbeat.sample(recorder)[1:] == (None, [], [], {})
    hot_path.Step(4)
    outer = hot_path.Stage("outer").__enter__()
    inner = hot_path.Stage("inner").__enter__()
    sampled = heartbeat.sample(recorder)
    assert sampled.step == 4 and sampled.open_stages == ["outer", "inner"]
    assert sampled.open_since_unix_nano == [outer._open[4], inner._open[4]]
    outer.__exit__(None, None, None)  # stopped out of nesting order: inner stays open
    assert heartbeat.sample(recorder).open_stages == ["inner"]
    inner.__exit__(None, None, None)
    assert heartbeat.sample(recorder).open_stages == []


def test_the_schedule_keeps_an_interval_between_heartbeats_and_never_bursts_to_catch_up():
    schedule = heartbeat.HeartbeatSchedule(5.0, now=100.0)
    assert not schedule.due(104.9) and schedule.due(105.0)
    schedule.sent(105.2)
    assert not schedule.due(110.1) and schedule.due(110.2)
    schedule.sent(131.0)  # 20 s without a chance (the GIL held): one heartbeat, then the interval
    assert not schedule.due(135.9) and schedule.due(136.0)


def array_value(value) -> list:
    """An OTLP AnyValue holding an ArrayValue, as the list of what it holds."""
    assert value.WhichOneof("value") == "array_value"
    return [getattr(item, item.WhichOneof("value")) for item in value.array_value.values]


def received_heartbeats(receiver) -> list:
    return [item for item in receiver.spans() if item.span.name == contract.HEARTBEAT_SPAN_NAME]


def test_heartbeats_arrive_over_otlp_and_count_in_the_ranks_metrics(otlp_receiver, configure, monkeypatch,
                                                                    wait_until):
    """The rank's own provider and encoder (span_encoding writes the arrays), on either protocol;
    device timing on, its events never completing: a heartbeat does not wait behind the stage spans
    the CudaEventSpanProcessor holds for them, as it would behind a stalled GPU."""
    import otel_straggler

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    handle = configure(job_id=JOB, rank=1, endpoint=otlp_receiver.endpoint, protocol=otlp_receiver.protocol,
                       device_timing="fake", readout_timeout_ms=60_000, heartbeat_interval_ms=INTERVAL_MS)
    handle._pipeline.backend.auto_complete = False  # a GPU that never gets to the events
    otel_straggler.step(5)
    with otel_straggler.stage("forward-compute"):
        pass  # built, then held for its events
    # Built before the stages below open (a pause of this thread, a collection say, could
    # otherwise let a heartbeat that sees them come first), so the heartbeats that see them
    # carry the number after it.
    assert wait_until(lambda: handle.status()["spans_built"] == 1, timeout_s=10.0)
    outer = otel_straggler.stage("forward-backward").__enter__()
    inner = otel_straggler.stage("all-grads-sync").__enter__()
    since = [outer._open[python_hot_path.START_NS], inner._open[python_hot_path.START_NS]]

    def seeing_both_open() -> list:
        return [item for item in received_heartbeats(otlp_receiver)
                if len(array_value({attribute.key: attribute.value for attribute in item.span.attributes}
                                   [contract.HEARTBEAT_OPEN_STAGES])) == 2]

    assert wait_until(lambda: len(seeing_both_open()) >= 2, timeout_s=10.0)
    assert [item.span.name for item in otlp_receiver.spans()
            if item.span.name != contract.HEARTBEAT_SPAN_NAME] == []  # the stage span still waits
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    handle._pipeline.backend.complete_all()
    handle.shutdown(timeout_s=5.0)

    beats = received_heartbeats(otlp_receiver)
    status = handle.status()
    assert len(beats) == status["heartbeats"] and not any(status["lost"].values())
    item = seeing_both_open()[0]  # those before it (if any) were sampled with no stage open
    assert all(beat.attributes[contract.SEQ] == 1 for beat in seeing_both_open())
    open_stages = {item.key: item.value for item in item.span.attributes}
    assert array_value(open_stages[contract.HEARTBEAT_OPEN_STAGES]) == ["forward-backward", "all-grads-sync"]
    assert array_value(open_stages[contract.HEARTBEAT_OPEN_SINCE]) == since
    assert item.attributes[contract.STEP] == 5 and item.attributes[contract.SEQ] == 1
    assert item.span.start_time_unix_nano == item.span.end_time_unix_nano >= since[1]
    assert item.span.parent_span_id == b""
    assert item.span.trace_id == trace_id_for_step(JOB, 5).to_bytes(16, "big")
    assert (item.resource[contract.JOB_ID], item.resource[contract.RANK], item.resource[contract.RESTART_COUNT]) \
        == (JOB, 1, 2)
    assert status["exported"] == status["spans_built"] + status["steps_built"] + status["heartbeats"]

    points = otlp_receiver.metric_points()
    spans = {attributes["outcome"]: value for attributes, value in points["straggler.instrumentation.spans"]}
    assert spans["heartbeats"] == status["heartbeats"]
