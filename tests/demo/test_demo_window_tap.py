from otel_straggler.demo.window_tap import TappedEngine, WindowMedians
from otel_straggler.detector.observation import Observation


def observation(rank, step, stage="forward-compute", host_ms=10.0, seq=None, collective=False, job="job-1"):
    return Observation(job_id=job, epoch=0, cohort="default", rank=rank, stage=stage, step=step,
                       seq=step * 10 if seq is None else seq, host_ms=host_ms, device_ms=None, collective=collective,
                       tokens=None, samples=None, end_unix_nano=0)


def test_a_window_is_complete_once_every_rank_moved_past_it():
    medians = WindowMedians(window_steps=2)
    medians.add([observation(0, 0, host_ms=1.0), observation(0, 1, host_ms=3.0), observation(0, 2, host_ms=9.0),
                 observation(1, 0, host_ms=2.0), observation(1, 1, host_ms=2.0)])
    assert medians.take_complete() == []  # rank 1 is still in window 0
    medians.add([observation(1, 2, host_ms=4.0)])
    complete = medians.take_complete()
    assert [(m.rank, m.window, m.median_ms, m.steps) for m in complete] == [(0, 0, 2.0, 2), (1, 0, 2.0, 2)]
    assert medians.take_complete() == []  # returned once
    assert [(m.rank, m.window, m.median_ms) for m in medians.finish()] == [(0, 1, 9.0), (1, 1, 4.0)]


def test_resent_spans_count_once_and_late_ones_are_ignored():
    medians = WindowMedians(window_steps=1)
    medians.add([observation(0, 0, host_ms=1.0, seq=1), observation(0, 0, host_ms=1.0, seq=1),
                 observation(0, 0, host_ms=7.0, seq=2), observation(0, 1)])
    (window_zero,) = medians.take_complete()
    assert (window_zero.median_ms, window_zero.steps) == (4.0, 2)
    medians.add([observation(0, 0, host_ms=100.0, seq=3)])  # its window was already reported
    assert [m.window for m in medians.finish()] == [1]


def test_collective_flag_is_kept_per_stage():
    medians = WindowMedians(window_steps=1)
    medians.add([observation(0, 0, stage="all-grads-sync", collective=True), observation(0, 0)])
    assert {(m.stage, m.collective) for m in medians.finish()} == {("all-grads-sync", True), ("forward-compute", False)}


class RecordingEngine:
    def __init__(self):
        self.batches = []

    def ingest_many(self, observations):
        self.batches.append(list(observations))
        return {"accepted": len(self.batches[-1])}

    def stats(self):
        return {"windows_closed": 0}


def test_tapped_engine_passes_everything_through():
    engine, medians = RecordingEngine(), WindowMedians(window_steps=1)
    tapped = TappedEngine(engine, medians)
    batch = (observation(rank, 0) for rank in range(3))  # a one-shot iterable: both must see it whole
    assert tapped.ingest_many(batch) == {"accepted": 3}
    assert len(engine.batches[0]) == 3 and len(medians.finish()) == 3
    assert tapped.stats() == {"windows_closed": 0}


def test_a_failing_tap_never_costs_the_engine_its_spans():
    class BrokenMedians:
        def add(self, observations):
            raise RuntimeError("bug")

    engine = RecordingEngine()
    tapped = TappedEngine(engine, BrokenMedians())
    assert tapped.ingest_many([observation(0, 0)]) == {"accepted": 1}
    assert tapped.tap_errors == 1


def test_stages_come_out_in_the_order_the_job_runs_them():
    medians = WindowMedians(window_steps=1)
    medians.add([observation(0, 0, stage="optimizer", seq=3), observation(1, 0, stage="forward-compute", seq=1),
                 observation(0, 0, stage="forward-compute", seq=1)])
    # first seen first, for every rank alike (not alphabetical)
    assert [(m.rank, m.stage) for m in medians.finish()] == [(0, "optimizer"), (0, "forward-compute"),
                                                            (1, "forward-compute")]
