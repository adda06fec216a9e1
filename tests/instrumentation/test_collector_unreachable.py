"""A collector that is down costs training nothing: the loop runs at full speed, shutdown
keeps to its timeout, and status() accounts for every span that did not get out."""
from __future__ import annotations

import time

import pytest

import otel_straggler

STAGES = ("forward-compute", "backward-compute", "optimizer")
STEPS = 300
SHUTDOWN_TIMEOUT_S = 1.5


def train(steps: int = STEPS) -> float:
    """A loop of steps with stages; returns how long it took."""
    started = time.monotonic()
    for number in range(steps):
        otel_straggler.step(number, tokens=1024)
        for name in STAGES:
            with otel_straggler.stage(name):
                pass
    return time.monotonic() - started


def shut_down(handle) -> float:
    started = time.monotonic()
    handle.shutdown(timeout_s=SHUTDOWN_TIMEOUT_S)
    return time.monotonic() - started


def export_accounting(status: dict) -> dict:
    lost = status["lost"]
    return {"built": status["spans_built"] + status["steps_built"],
            "accounted": status["exported"] + lost["export_failed"] + lost["exporter_queue_full"]
            + lost["unexported_at_shutdown"]}


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_training_goes_on_and_status_counts_what_never_got_out(configure, unreachable_endpoint, protocol):
    endpoint = unreachable_endpoint if protocol == "grpc" else f"http://{unreachable_endpoint}"
    handle = configure(job_id="collector-down", rank=0, endpoint=endpoint, protocol=protocol, device_timing="fake")

    assert train() < 5.0  # generous: a behaviour check, not a speed test
    # the scene: a full batch is being retried (backoff ~1 s within its 10 s deadline) when shutdown
    # begins. On a loaded machine the builder can lag the loop; had no export begun by shutdown,
    # every batch would fail at once by the shutdown deadline and none would be left unexported
    built = time.monotonic() + 10.0
    while handle.status()["spans_built"] < STEPS * len(STAGES) and time.monotonic() < built:
        time.sleep(0.05)
    time.sleep(0.3)  # the worker takes the first full batch within milliseconds of it filling
    assert shut_down(handle) < SHUTDOWN_TIMEOUT_S + 0.5

    status = handle.status()
    assert status["spans_built"] == STEPS * len(STAGES) and status["steps_built"] == STEPS
    assert status["exported"] == 0
    # the batch being retried when shutdown gave up failed; what queued behind it never left
    assert status["lost"]["export_failed"] > 0 and status["lost"]["unexported_at_shutdown"] > 0
    assert export_accounting(status)["accounted"] == export_accounting(status)["built"]
    assert status["lost"]["queue_full"] == 0 and status["lost"]["internal_error"] == 0


def test_a_full_exporter_queue_drops_and_counts(configure, unreachable_endpoint, monkeypatch):
    batch_size = 50
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "100")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", str(batch_size))
    handle = configure(job_id="collector-down", rank=0, endpoint=unreachable_endpoint, protocol="grpc",
                       device_timing="off")

    assert train() < 5.0
    assert shut_down(handle) < SHUTDOWN_TIMEOUT_S + 0.5

    status = handle.status()
    lost = status["lost"]
    assert lost["exporter_queue_full"] > 0
    assert lost["unexported_at_shutdown"] <= 100  # memory bounded by the queue, whatever the backlog
    # Nothing is lost uncounted. The full-queue check races with the exporter dequeuing its one
    # batch, so a drop may be counted that the dequeue just avoided: never fewer, at most a batch.
    accounting = export_accounting(status)
    assert accounting["built"] <= accounting["accounted"] < accounting["built"] + batch_size


def test_a_full_exporter_queue_drops_the_oldest_and_makes_no_log_record_per_drop(
        configure, unreachable_endpoint, monkeypatch):
    """As the SDK's batch processor does with a full queue, the oldest span makes room; unlike it,
    no warning is made for each one (the log record alone cost the builder more than the span, on
    every span of an outage); each drop is counted."""
    from otel_straggler.instrumentation import batching

    warnings = []
    monkeypatch.setattr(batching._logger, "warning", lambda *args, **kwargs: warnings.append(args))
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "100")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "50")
    handle = configure(job_id="collector-down", rank=0, endpoint=unreachable_endpoint, protocol="grpc",
                       device_timing="off")
    train(steps=200)
    handle.flush(timeout_s=0.5)  # builds every span; the export behind it cannot finish
    status = handle.status()
    assert status["lost"]["exporter_queue_full"] > 0
    assert warnings == []
    assert handle._pipeline.batch_processor.queue_length() <= 100  # bounded
    shut_down(handle)


def test_flushes_during_an_outage_keep_their_timeout_and_start_one_thread(configure, unreachable_endpoint):
    import threading

    def flushers() -> set:  # an earlier test's flush may still be retrying: only new ones count
        return {thread for thread in threading.enumerate() if thread.name == "otel-straggler-flush"}

    before = flushers()
    handle = configure(job_id="collector-down", rank=0, endpoint=unreachable_endpoint, protocol="grpc",
                       device_timing="off")
    train(20)
    for _ in range(10):  # the SDK's flush retries the export for seconds: each call gives up at its timeout
        started = time.monotonic()
        assert handle.flush(timeout_s=0.05) is False
        assert time.monotonic() - started < 0.5
    assert len(flushers() - before) <= 1
    shut_down(handle)
