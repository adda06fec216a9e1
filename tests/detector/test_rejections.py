"""rejections.py: the log line for malformed spans, one per kind at once, then one per interval at most."""
from __future__ import annotations

import logging

from otel_straggler.detector import decode
from otel_straggler.detector.decode import RejectedSpan
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.driver import EngineDriver, IntakeCounters
from otel_straggler.detector.engine import Engine
from otel_straggler.detector.rejections import RejectionLog

LOGGER = "otel_straggler.detector.rejections"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def example(rejection=decode.MISSING_JOB_ID, name="forward-compute", job=None, rank=3, host="node-0") -> RejectedSpan:
    return RejectedSpan(rejection, name, job, rank, host)


def rejected(log: RejectionLog, rejection=decode.MISSING_JOB_ID, count: int = 1, **changes) -> None:
    log.note({rejection.kind: count}, {rejection.kind: example(rejection, **changes)})


def lines(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == LOGGER]


def test_the_first_rejection_of_each_kind_is_logged_at_once_with_its_reason_example_and_advice(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    log = RejectionLog(clock=FakeClock())
    rejected(log, count=5)
    rejected(log, decode.BAD_RANK, rank="5", job="job-7")
    first, second = lines(caplog)
    assert first.startswith("5 span(s) rejected as malformed (missing_job_id): training.job.id missing or empty; "
                            "e.g. span 'forward-compute' of job unknown, rank 3, host 'node-0'. ")
    assert "OTEL_STRAGGLER_JOB_ID" in first and "TORCHELASTIC_RUN_ID" in first and "SLURM_JOB_ID" in first
    assert second.startswith("1 span(s) rejected as malformed (bad_rank): training.rank is not a non-negative int; "
                             "e.g. span 'forward-compute' of job 'job-7', rank '5', host 'node-0'")
    assert all(record.levelno == logging.WARNING for record in caplog.records)


def test_more_of_a_kind_within_the_interval_are_counted_and_logged_once_it_has_passed(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    clock = FakeClock()
    log = RejectionLog(interval_s=60.0, clock=clock)
    rejected(log)
    clock.now += 30
    rejected(log, count=4, name="backward-compute")
    log.log_due()
    assert len(lines(caplog)) == 1  # the second is not logged within the interval
    clock.now += 31
    rejected(log, count=2)
    later = lines(caplog)[1]
    assert later.startswith("6 more span(s) rejected as malformed (missing_job_id) in the 61 s since the last line")
    assert "e.g. span 'backward-compute'" in later  # the first span since the last line
    assert len(lines(caplog)) == 2


def test_the_count_since_the_last_line_comes_even_when_no_more_are_rejected(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    clock = FakeClock()
    log = RejectionLog(interval_s=60.0, clock=clock)
    rejected(log)
    rejected(log, count=9)
    clock.now += 59
    log.log_due()
    assert len(lines(caplog)) == 1
    clock.now += 1
    log.log_due()
    log.log_due()
    assert len(lines(caplog)) == 2 and lines(caplog)[1].startswith("9 more span(s)")


def test_a_sender_cannot_put_a_long_name_into_the_log(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    rejected(RejectionLog(clock=FakeClock()), name="x" * 1_000_000, job="j" * 1_000_000)
    (line,) = lines(caplog)
    assert len(line) < 1000


def test_rejections_by_kind_add_up_to_the_malformed_count_engine_refusals_included(caplog):
    class RefusingEngine(Engine):
        def ingest_many(self, observations):
            return {"accepted": 0, "malformed": len(observations)}

    caplog.set_level(logging.WARNING, LOGGER)
    counters = IntakeCounters()
    driver = EngineDriver(RefusingEngine(DetectorConfig()), counters, deliver=lambda verdicts: None)
    batch = decode.DecodedBatch()
    for _ in range(3):
        batch.reject("forward-compute", decode.MISSING_STEP, "job-1", 0, "node-0")
    batch.observations.append(object())
    driver.count_decoded(batch)
    driver.ingest(batch, now_unix_nano=1)
    snapshot = counters.snapshot()
    assert snapshot["rejections"] == {"missing_step": 3, "other": 1}
    assert sum(snapshot["rejections"].values()) == snapshot["spans"]["malformed"] == 4
    assert set(snapshot["rejections"]) <= set(decode.REJECTION_KINDS)
    assert [line.split(":")[0] for line in lines(caplog)] == [
        "3 span(s) rejected as malformed (missing_step)", "1 span(s) rejected as malformed (other)"]
