"""instrument_ddp: per backward and rank one `ddp-grads-ready` span (the rank's own backward,
micro-steps under no_sync included) and per step one `ddp-grads-sync` span (a collective: the wait
for the slowest rank), bound to the step; a rank slow inside backward, synchronizing or not, has
the longer compute and the shorter wait; time between forward and backward is in neither. Its hooks fail open: a full
queue counts drops, a failure of our own is counted, and training goes on unchanged; a model that
already has a communication hook is refused in one line.

The spans come from real gloo ranks (tests/ddp_ranks.py); the rest runs on a one-rank group here.
"""
from __future__ import annotations

import collections
import statistics
import types

import pytest

torch = pytest.importorskip("torch")
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import otel_straggler as ots  # noqa: E402
from otel_straggler import contract  # noqa: E402
from ddp_ranks import SLOW_BACKWARD_S, STEPS, WARMUP_STEPS, build_model, run_ranks  # noqa: E402
from megatron_on_cpu import one_rank_group  # noqa: E402
from otel_straggler.instrumentation import hot_path, hot_path_reference, rank_state  # noqa: E402
from otel_straggler.integrations import ddp  # noqa: E402
from otel_straggler.processors.device_events import FakeDeviceEvents  # noqa: E402

RECORDERS = {"python": hot_path_reference.IntervalRecorder, hot_path.IMPLEMENTATION: hot_path.IntervalRecorder}


@pytest.fixture(scope="module")
def slow_backward_ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(["slow-backward", "accumulate-slow", "fetch-between"], tmp_path_factory.mktemp("ddp-ranks"),
                     world_size=2, slow_rank=1)


def ddp_spans(result: dict, name: str, arm: str = "slow-backward") -> list[dict]:
    return [span for span in result[arm]["spans"] if span["name"] == name]


def per_step_ms(result: dict, name: str, arm: str) -> dict[int, float]:
    """A stage's time per step, its intervals summed."""
    totals: dict[int, float] = collections.defaultdict(float)
    for span in ddp_spans(result, name, arm):
        totals[span["attributes"]["training.step"]] += duration_ms(span)
    return totals


def steady_median_ms(result: dict, name: str, arm: str) -> float:
    """The median over the arm's steps after its first WARMUP_STEPS of a stage's time per step."""
    totals = per_step_ms(result, name, arm)
    return statistics.median(totals[step] for step in sorted(totals)[WARMUP_STEPS:])


def duration_ms(span: dict) -> float:
    return (span["end_ns"] - span["start_ns"]) / 1e6


@pytest.mark.child_processes
def test_each_step_has_one_compute_and_one_sync_span_per_rank(slow_backward_ranks):
    for rank, result in enumerate(slow_backward_ranks):
        ready, sync = ddp_spans(result, ddp.GRADS_READY), ddp_spans(result, ddp.GRADS_SYNC)
        assert sorted(span["attributes"]["training.step"] for span in ready) == list(range(STEPS))
        assert sorted(span["attributes"]["training.step"] for span in sync) == list(range(STEPS))
        steps = {span["attributes"]["training.step"]: span["span_id"]
                 for span in result["slow-backward"]["spans"] if span["name"] == "train.step"}
        for compute, wait in zip(sorted(ready, key=lambda span: span["start_ns"]),
                                 sorted(sync, key=lambda span: span["start_ns"])):
            assert compute["attributes"]["training.stage.collective"] is False
            assert compute["attributes"]["training.stage.group"] == "backward"
            assert wait["attributes"]["training.stage.collective"] is True
            assert wait["attributes"]["training.stage.group"] == "communication"
            assert wait["attributes"]["training.step"] == compute["attributes"]["training.step"]
            # the wait starts at the last bucket, right after the last gradient the compute ends at
            assert 0 <= wait["start_ns"] - compute["end_ns"] < 20e6, "the wait starts when the last bucket is ready"
            step = compute["attributes"]["training.step"]
            if step in steps:  # the last step's span closes at shutdown, after the results were taken
                assert compute["parent"] == wait["parent"] == steps[step]
        assert result["slow-backward"]["hook_errors"] == 0
        assert not any(result["slow-backward"]["lost"].values()), f"rank {rank}"


@pytest.mark.child_processes
def test_the_rank_slow_in_backward_computes_longer_and_waits_less(slow_backward_ranks):
    fast, slow = slow_backward_ranks
    compute = [steady_median_ms(rank, ddp.GRADS_READY, "slow-backward") for rank in (fast, slow)]
    wait = [steady_median_ms(rank, ddp.GRADS_SYNC, "slow-backward") for rank in (fast, slow)]
    slow_ms = SLOW_BACKWARD_S * 1000
    assert compute[1] - compute[0] > 0.75 * slow_ms, f"compute ms per rank: {compute}"
    assert wait[0] - wait[1] > 0.75 * slow_ms, f"wait ms per rank: {wait}"


@pytest.mark.child_processes
def test_every_micro_step_backward_is_timed_and_a_slow_one_under_no_sync_shows(slow_backward_ranks):
    fast, slow = slow_backward_ranks
    for result in (fast, slow):
        ready = ddp_spans(result, ddp.GRADS_READY, "accumulate-slow")
        sync = ddp_spans(result, ddp.GRADS_SYNC, "accumulate-slow")
        steps = [span["attributes"]["training.step"] for span in ready]
        assert sorted(collections.Counter(steps).values()) == [2] * STEPS, "one interval per micro-step backward"
        assert len(sync) == STEPS, "one wait per synchronizing backward"
        assert result["accumulate-slow"]["hook_errors"] == 0
    compute = [steady_median_ms(rank, ddp.GRADS_READY, "accumulate-slow") for rank in (fast, slow)]
    wait = [steady_median_ms(rank, ddp.GRADS_SYNC, "accumulate-slow") for rank in (fast, slow)]
    slow_ms = SLOW_BACKWARD_S * 1000
    assert compute[1] - compute[0] > 0.75 * slow_ms, f"compute ms per step and rank: {compute}"
    assert wait[0] - wait[1] > 0.75 * slow_ms, f"wait ms per step and rank: {wait}"


@pytest.mark.child_processes
def test_time_between_forward_and_backward_is_not_backward_compute(slow_backward_ranks):
    fast, slow = slow_backward_ranks
    compute = [steady_median_ms(rank, ddp.GRADS_READY, "fetch-between") for rank in (fast, slow)]
    wait = [steady_median_ms(rank, ddp.GRADS_SYNC, "fetch-between") for rank in (fast, slow)]
    slow_ms = SLOW_BACKWARD_S * 1000
    assert abs(compute[1] - compute[0]) < 0.25 * slow_ms, f"compute ms per step and rank: {compute}"
    # the fast rank waits out the pause less its own timing noise (steady medians 33-41 ms here, a
    # CI run 29): half the pause still says the slow rank arrives last, which a pause counted as
    # compute or wait on the wrong rank would not
    assert wait[0] - wait[1] > 0.5 * slow_ms, f"the slow rank still arrives last: wait ms {wait}"


# -- on a one-rank group in this process ---------------------------------------------------------------

@pytest.fixture
def one_rank():
    with one_rank_group():
        yield


def train(model, steps: int = 3) -> list:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        ots.step(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(torch.randn(4, 32, generator=data)), torch.zeros(4, 8)).backward()
        optimizer.step()
    return [parameter.detach().clone() for parameter in model.parameters()]


def ddp_model():
    return DistributedDataParallel(build_model(slow=False), bucket_cap_mb=0.01)


def same(first: list, second: list) -> bool:
    return len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second))


def test_a_model_with_a_communication_hook_is_refused_in_one_line(one_rank):
    model = ddp_model()
    model.register_comm_hook(None, lambda state, bucket: None)
    with pytest.raises(RuntimeError) as refused:
        ots.instrument_ddp(model)
    assert "\n" not in str(refused.value)
    assert "instrument_ddp(model, hook=..., state=...)" in str(refused.value)

    instrumented = ots.instrument_ddp(ddp_model())
    with pytest.raises(RuntimeError, match="already instrumented"):
        ots.instrument_ddp(instrumented)


def test_without_the_instrumentation_nothing_is_recorded_or_counted(one_rank):
    assert rank_state.current_recorder() is None
    before = ddp.hook_counts()["hook_errors"]
    assert same(train(ots.instrument_ddp(ddp_model())), train(ddp_model()))
    assert ddp.hook_counts()["hook_errors"] == before


@pytest.mark.parametrize("implementation", sorted(RECORDERS))
def test_a_full_queue_counts_drops_and_training_is_unchanged(one_rank, monkeypatch, implementation):
    full = RECORDERS[implementation](16)
    for _ in range(16):
        full.completed.append(None)
    monkeypatch.setattr(rank_state, "_recorder", full)
    assert same(train(ots.instrument_ddp(ddp_model()), steps=3), train(ddp_model(), steps=3))
    assert full.dropped_queue_full == 2 * 3  # one compute and one sync interval per step
    assert len(full.completed) == 16


class SyncRecordsFail(collections.deque):
    def append(self, record) -> None:
        if record[1][0] == ddp.GRADS_SYNC:
            raise RuntimeError("the queue failed")
        super().append(record)


def test_a_failure_of_our_own_is_counted_and_training_is_unchanged(one_rank, monkeypatch):
    failing = types.SimpleNamespace(completed=SyncRecordsFail(), capacity=100, binding=(0, None, None),
                                    dropped_queue_full=0)
    monkeypatch.setattr(rank_state, "_recorder", failing)
    before = ddp.hook_counts()["hook_errors"]
    assert same(train(ots.instrument_ddp(ddp_model()), steps=3), train(ddp_model(), steps=3))
    assert ddp.hook_counts()["hook_errors"] == before + 3  # each step's sync record
    assert [record[1][0] for record in failing.completed] == [ddp.GRADS_READY] * 3


def test_with_device_timing_on_the_spans_are_host_only_by_design_not_lost(one_rank, in_memory):
    handle = in_memory.configure(device_backend=FakeDeviceEvents(auto_complete=True, kernel_ms=1.0))
    train(ots.instrument_ddp(ddp_model()), steps=2)
    spans = [span for span in in_memory.stage_spans() if span.name.startswith("ddp-")]
    assert len(spans) == 4
    for span in spans:
        assert span.attributes[contract.TIMING] == contract.TIMING_HOST_ONLY
        assert span.attributes[contract.TIMING_REASON] == "host_clock_only"
    assert handle.status()["lost"]["pool_exhausted"] == 0


def test_status_shows_the_hooks_counters(configure):
    assert configure(job_id="job", rank=0).status()["ddp"] == ddp.hook_counts()
