"""The training-side API: stage() and step(), binding at stop, configure()'s lifecycle, and
the bounded queue between the training thread and the span builder."""
from __future__ import annotations

import pytest

import otel_straggler
from otel_straggler import contract
from otel_straggler.instrumentation.span_builder import trace_id_for_step


def by_step_and_name(spans) -> dict:
    return {(span.attributes.get(contract.STEP), span.name): span for span in spans}


def test_stage_and_step_do_nothing_before_configure():
    otel_straggler.step(0, tokens=10)
    with otel_straggler.stage("forward-compute") as timed:
        pass
    assert timed.name == "forward-compute"
    assert otel_straggler.stage("data")(lambda x: x + 1)(1) == 2
    with otel_straggler.step(1):
        pass
    assert otel_straggler.current() is None


def test_a_decorated_function_gets_a_stage_of_its_own_at_every_call(in_memory):
    """Nested and recursive calls each time their own block: one stage object could time only one."""
    in_memory.configure()

    @otel_straggler.stage("recurse")
    def depth(levels):
        return 0 if levels == 0 else 1 + depth(levels - 1)

    otel_straggler.step(0)
    assert depth(3) == 3
    spans = [span for span in in_memory.stage_spans() if span.name == "recurse"]
    assert len(spans) == 4
    span_ids = {span.context.span_id for span in spans}
    assert sum(span.parent.span_id in span_ids for span in spans) == 3  # a chain: each inside the one before
    with pytest.raises(TypeError, match="decorates one function"):
        otel_straggler.stage("recurse")(depth, 2)


def test_stage_as_context_manager_and_decorator(in_memory):
    in_memory.configure()

    @otel_straggler.stage("batch-generator")
    def next_batch(value):
        return value * 2

    otel_straggler.step(0, tokens=64, samples=2)
    assert next_batch(21) == 42
    with otel_straggler.stage("forward-compute"):
        pass
    with otel_straggler.stage("all-grads-sync"):
        pass
    with otel_straggler.stage("my-reduce", collective=True):
        pass
    with otel_straggler.stage("params-all-gather", collective=False):
        pass

    spans = by_step_and_name(in_memory.stage_spans())
    expected = {"batch-generator": ("data", False), "forward-compute": ("forward", False),
                "all-grads-sync": ("communication", True), "my-reduce": ("other", True),
                "params-all-gather": ("communication", False)}
    for name, (group, collective) in expected.items():
        attributes = spans[0, name].attributes
        assert attributes[contract.STAGE] == name
        assert attributes[contract.STAGE_GROUP] == group
        assert attributes[contract.COLLECTIVE] is collective
        assert attributes[contract.WORKLOAD_TOKENS] == 64 and attributes[contract.WORKLOAD_SAMPLES] == 2
        assert attributes[contract.TIMING] == contract.TIMING_HOST_ONLY
        assert attributes[contract.TIMING_REASON] == "no_cuda"


def test_a_stage_raising_is_still_timed_and_the_error_propagates(in_memory):
    in_memory.configure()
    otel_straggler.step(0)
    with pytest.raises(KeyError):
        with otel_straggler.stage("forward-compute"):
            raise KeyError("model error")
    assert [span.name for span in in_memory.stage_spans()] == ["forward-compute"]


def test_step_and_workload_are_bound_when_the_interval_ends(in_memory):
    in_memory.configure(job_id="binding-job")
    timer = otel_straggler.Timers(2, "minmax")("interval-time")
    otel_straggler.step(5, tokens=500, samples=5)
    timer.start()
    across = otel_straggler.stage("forward-backward").__enter__()
    with otel_straggler.stage("forward-compute"):
        pass
    otel_straggler.step(6, tokens=600, samples=6)
    across.__exit__(None, None, None)
    timer.stop()
    with otel_straggler.stage("optimizer"):
        pass
    otel_straggler.step(7)

    spans = in_memory.spans()
    steps = {span.attributes[contract.STEP]: span for span in spans if span.name == contract.STEP_SPAN_NAME}
    stages = by_step_and_name(span for span in spans if span.name != contract.STEP_SPAN_NAME)
    assert set(stages) == {(5, "forward-compute"), (6, "forward-backward"), (6, "interval-time"), (6, "optimizer")}
    for (number, name), span in stages.items():
        assert span.attributes[contract.WORKLOAD_TOKENS] == number * 100, name
        assert span.attributes[contract.WORKLOAD_SAMPLES] == number, name
        assert span.context.trace_id == trace_id_for_step("binding-job", number), name
    # started in step 5, ended in step 6: in step 6's trace, under step 6's span, nested as started
    assert stages[6, "interval-time"].parent.span_id == steps[6].context.span_id
    assert stages[6, "forward-backward"].parent.span_id == stages[6, "interval-time"].context.span_id
    assert steps[5].attributes[contract.WORKLOAD_TOKENS] == 500
    assert steps[6].attributes[contract.WORKLOAD_TOKENS] == 600


def test_step_as_context_manager_ends_the_step_span(in_memory):
    in_memory.configure()
    with otel_straggler.step(0, tokens=8):
        with otel_straggler.stage("forward-compute"):
            pass
    with otel_straggler.stage("evaluate"):
        pass  # after the step ended, before the next: still bound to step 0, outside its span
    otel_straggler.step(1)

    spans = by_step_and_name(in_memory.spans())
    step_span = spans[0, contract.STEP_SPAN_NAME]
    assert step_span.end_time <= spans[0, "evaluate"].start_time
    assert step_span.start_time <= spans[0, "forward-compute"].start_time <= spans[0, "forward-compute"].end_time \
        <= step_span.end_time


def test_intervals_before_the_first_step_are_root_spans_without_a_step(in_memory):
    in_memory.configure()
    with otel_straggler.stage("model-and-optimizer-setup"):
        pass
    otel_straggler.step(0)
    (setup,) = in_memory.stage_spans()
    assert contract.STEP not in setup.attributes
    assert setup.parent is None
    assert setup.attributes[contract.STAGE_GROUP] == "setup"


def test_invalid_workload_is_left_out(in_memory):
    in_memory.configure()
    otel_straggler.step(0, tokens=float("nan"), samples=-3)
    with otel_straggler.stage("forward-compute"):
        pass
    (span,) = in_memory.stage_spans()
    assert contract.WORKLOAD_TOKENS not in span.attributes and contract.WORKLOAD_SAMPLES not in span.attributes


def test_configure_is_idempotent_and_starts_afresh_after_shutdown(configure, in_memory):
    first = in_memory.configure()
    assert otel_straggler.configure() is first is otel_straggler.current()
    first.shutdown()
    assert otel_straggler.current() is None
    assert first.status()["shut_down"] is True
    second = in_memory.configure()
    assert second is not first and second.enabled


def test_sdk_disabled_gives_a_handle_that_records_nothing(configure, monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    handle = configure(job_id="off")
    assert not handle.enabled
    otel_straggler.step(0)
    with otel_straggler.stage("forward-compute"):
        pass
    assert handle.status() == {"enabled": False, "intervals": 0, "spans_built": 0, "exported": 0, "lost": {}}
    assert handle.flush()


def test_a_full_queue_drops_and_counts_and_the_seq_gap_shows_it(in_memory):
    # The builder thread wakes only when flushed, so the queue fills deterministically.
    handle = in_memory.configure(queue_size=16, build_interval_ms=60_000)
    recorder = handle.recorder
    stages = ("forward-compute", "backward-compute", "optimizer")
    records = 0
    for number in range(10):
        otel_straggler.step(number)
        for name in stages:
            with otel_straggler.stage(name):
                pass
            assert len(recorder.completed) <= 16  # bounded while nothing drains it
        records += 1 + len(stages)
    lost = handle.status()["lost"]
    # the first 4 steps fill the queue; the other 6 lose their step marks and their intervals
    assert lost["queue_full"] == 6 * len(stages)
    assert lost["step_queue_full"] == 6
    assert lost["queue_full"] + lost["step_queue_full"] == records - 16

    # Seq numbers stay unique and rising, and skip one number per dropped interval: the kept
    # ones, built after the drops, come after the numbers the lost ones would have had.
    seqs = [span.attributes[contract.SEQ] for span in in_memory.stage_spans()]
    intervals_kept = 16 - 4  # the first 4 steps fill the queue: 4 step records + 12 intervals
    assert seqs == list(range(lost["queue_full"], lost["queue_full"] + intervals_kept))
    in_memory.exporter.clear()

    otel_straggler.step(10)  # drained by the flush: recording goes on
    with otel_straggler.stage("forward-compute"):
        pass
    (after,) = in_memory.stage_spans()
    assert after.attributes[contract.SEQ] == 10 * len(stages) == seqs[-1] + 1


def test_parents_that_never_end_are_remembered_up_to_a_bound(in_memory, monkeypatch):
    from otel_straggler.instrumentation import span_builder

    monkeypatch.setattr(span_builder, "MAX_OPEN_PARENTS", 4)
    handle = in_memory.configure(build_interval_ms=60_000)
    recorder = handle.recorder
    otel_straggler.step(0)
    outer = [otel_straggler.stage(f"outer-{index}").__enter__()._open for index in range(6)]  # never ended

    def child_of(index: int) -> int:
        recorder.open_intervals.remove(outer[index])  # make outer-<index> the innermost open one
        recorder.open_intervals.append(outer[index])
        with otel_straggler.stage("child"):
            pass
        handle.flush()
        (child,) = in_memory.stage_spans()
        in_memory.exporter.clear()
        return child.parent.span_id

    first = [child_of(index) for index in range(6)]
    assert len(set(first)) == 6
    assert handle.status()["parent_ids_forgotten"] == 2  # outer-0 and outer-1 made room
    assert child_of(5) == first[5] and child_of(2) == first[2]  # remembered: the same parent
    assert child_of(0) != first[0]  # forgotten: a new id, and one more forgotten to make room
    assert handle.status()["parent_ids_forgotten"] == 3


def test_stages_never_exited_stay_bounded_and_are_counted(in_memory):
    from otel_straggler.instrumentation.hot_path_reference import MAX_OPEN_INTERVALS

    handle = in_memory.configure(build_interval_ms=60_000)
    otel_straggler.step(0)
    for index in range(MAX_OPEN_INTERVALS + 4):
        otel_straggler.stage(f"never-exited-{index}").__enter__()
    assert len(handle.recorder.open_intervals) == MAX_OPEN_INTERVALS
    assert handle.status()["open_intervals_untracked"] == 4
