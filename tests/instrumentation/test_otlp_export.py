"""Real OTLP export (gRPC and HTTP) to an in-test receiver: every CONTRACT §1 resource
attribute and every §2 span field as it arrives on the wire, the trace id two ranks share,
and the rank's own straggler.instrumentation.* metrics."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import otel_straggler
from otel_straggler import contract
from otel_straggler.instrumentation.span_builder import trace_id_for_step

JOB = "job-otlp"
STEPS = 3
# (stage, group, collective, device ms with the fake backend's 1 ms per recorded event), in the
# order the stages complete within a step
COMPLETION_ORDER = [
    ("forward-compute", "forward", False, 1.0),
    ("backward-compute", "backward", False, 1.0),
    ("forward-backward", "other", False, 5.0),  # its two events enclose the children's four
    ("all-grads-sync", "communication", True, 1.0),
    ("optimizer", "optimizer", False, 1.0),
]
PARALLEL = {"tp": (1, 2), "pp": (0, 2), "cp": (0, 1), "ep": (0, 1), "dp": (1, 2)}


def train(steps: int = STEPS) -> None:
    for number in range(steps):
        otel_straggler.step(number, tokens=1000 + number, samples=8)
        with otel_straggler.stage("forward-backward"):
            with otel_straggler.stage("forward-compute"):
                pass
            with otel_straggler.stage("backward-compute"):
                pass
        with otel_straggler.stage("all-grads-sync"):
            pass
        with otel_straggler.stage("optimizer"):
            pass


def trace_id_bytes(step: int, job: str = JOB) -> bytes:
    return trace_id_for_step(job, step).to_bytes(16, "big")


@pytest.fixture(params=["megatron", "resource_attributes"])
def parallel_layout(request, monkeypatch, megatron_state) -> None:
    """The parallel layout, known either from Megatron's parallel state or given as resource attributes."""
    given = ["training.topology.epoch=2"]
    if request.param == "megatron":
        megatron_state(**PARALLEL, vpp=None)
    else:
        given += [f"{key}={value}" for dim, (rank, size) in PARALLEL.items()
                  for key, value in ((contract.parallel_rank_key(dim), rank), (contract.parallel_size_key(dim), size))]
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", ",".join(given))
    monkeypatch.setenv("OTEL_SERVICE_NAME", "trainer")


def test_every_contract_field_arrives(otlp_receiver, parallel_layout, configure):
    started_ns = time.time_ns()
    handle = configure(job_id=JOB, rank=3, world_size=4, local_rank=1, endpoint=otlp_receiver.endpoint,
                       protocol=otlp_receiver.protocol, device_timing="fake")
    train()
    handle.shutdown(timeout_s=5.0)  # ends the last step's span and exports everything
    finished_ns = time.time_ns()
    received = otlp_receiver.spans()
    assert len(received) == STEPS * (len(COMPLETION_ORDER) + 1)
    assert handle.status()["exported"] == len(received)

    expected_resource = {
        contract.SERVICE_NAME: "trainer", contract.JOB_ID: JOB, contract.RANK: 3, contract.WORLD_SIZE: 4,
        contract.LOCAL_RANK: 1, contract.HOST_NAME: socket.gethostname(), contract.COHORT: "tp1.pp0.cp0.ep0",
        contract.TOPOLOGY_EPOCH: 2, contract.RESTART_COUNT: 0,  # not under torchrun: 0
        **{key: value for dim, (rank, size) in PARALLEL.items()
           for key, value in ((contract.parallel_rank_key(dim), rank), (contract.parallel_size_key(dim), size))},
    }
    for item in received:
        shown = {key: item.resource.get(key) for key in expected_resource}
        assert shown == expected_resource
        assert all(type(shown[key]) is type(value) for key, value in expected_resource.items())  # 3, not "3"
        assert not any(key.startswith("training.parallel.vpp") for key in item.resource)

    steps = {item.attributes[contract.STEP]: item for item in received if item.span.name == contract.STEP_SPAN_NAME}
    assert sorted(steps) == list(range(STEPS))
    for number, item in steps.items():
        assert item.span.trace_id == trace_id_bytes(number)
        assert item.span.parent_span_id == b""  # each rank's step is the root of its part of the trace
        assert item.attributes[contract.WORKLOAD_TOKENS] == 1000 + number
        assert item.attributes[contract.WORKLOAD_SAMPLES] == 8

    stages = {(item.attributes[contract.STEP], item.span.name): item for item in received
              if item.span.name != contract.STEP_SPAN_NAME}
    assert len(stages) == STEPS * len(COMPLETION_ORDER)
    completion_order = []
    for number in range(STEPS):
        step_span = steps[number].span
        for name, group, collective, device_ms in COMPLETION_ORDER:
            item = stages[number, name]
            span, attributes = item.span, item.attributes
            completion_order.append(attributes[contract.SEQ])
            assert attributes[contract.STAGE] == name
            assert attributes[contract.STAGE_GROUP] == group
            assert attributes[contract.COLLECTIVE] is collective
            assert attributes[contract.STEP] == number
            assert attributes[contract.WORKLOAD_TOKENS] == 1000 + number and attributes[contract.WORKLOAD_SAMPLES] == 8
            assert attributes[contract.TIMING] == contract.TIMING_DEVICE
            assert attributes[contract.DEVICE_DURATION_MS] == device_ms
            assert contract.TIMING_REASON not in attributes
            assert span.trace_id == trace_id_bytes(number)
            assert started_ns <= span.start_time_unix_nano <= span.end_time_unix_nano <= finished_ns
            assert step_span.start_time_unix_nano <= span.start_time_unix_nano
            parent = stages[number, "forward-backward"].span if name.endswith("-compute") else step_span
            assert span.parent_span_id == parent.span_id, name
            assert parent.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano \
                <= parent.end_time_unix_nano
    assert completion_order == list(range(len(completion_order)))  # unique, in completion order
    assert len({item.span.span_id for item in received}) == len(received)


def test_the_ranks_own_counters_arrive_as_metrics(otlp_receiver, configure):
    handle = configure(job_id=JOB, rank=0, endpoint=otlp_receiver.endpoint, protocol=otlp_receiver.protocol,
                       device_timing="fake")
    train()
    handle.shutdown(timeout_s=5.0)  # the metric reader's last collection goes out at shutdown
    status = handle.status()
    points = otlp_receiver.metric_points()

    lost = {attributes["reason"]: value for attributes, value in points["straggler.instrumentation.lost"]}
    assert lost == {reason: 0 for reason in status["lost"]}
    spans = {attributes["outcome"]: value for attributes, value in points["straggler.instrumentation.spans"]}
    assert spans == {"intervals": STEPS * len(COMPLETION_ORDER), "spans_built": STEPS * len(COMPLETION_ORDER),
                     "heartbeats": 0, "exported": status["exported"]}  # heartbeats off: the fixture's default


RANK_SCRIPT = textwrap.dedent("""
    import sys
    import otel_straggler
    handle = otel_straggler.configure(endpoint=sys.argv[1], protocol="grpc", device_timing="off", export_metrics=False)
    for number in range(int(sys.argv[2])):
        otel_straggler.step(number)
        with otel_straggler.stage("forward-compute"):
            pass
    handle.shutdown(timeout_s=5.0)
    sys.exit(0 if handle.status()["exported"] == 2 * int(sys.argv[2]) else 1)
""")


def test_two_ranks_put_a_step_in_one_trace(grpc_receiver, configure, monkeypatch):
    torchrun = {"TORCHELASTIC_RUN_ID": JOB, "WORLD_SIZE": "2"}
    other_rank = subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, grpc_receiver.endpoint, str(STEPS)],
                                  env={**os.environ, **torchrun, "RANK": "1", "LOCAL_RANK": "1"})
    for name, value in {**torchrun, "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    handle = configure(endpoint=grpc_receiver.endpoint, protocol="grpc", device_timing="off", export_metrics=False)
    for number in range(STEPS):
        otel_straggler.step(number)
        with otel_straggler.stage("forward-compute"):
            pass
    handle.shutdown(timeout_s=5.0)
    assert other_rank.wait(timeout=30) == 0

    received = grpc_receiver.spans()  # both ranks shut down: everything was exported
    by_rank_and_step = {(item.resource[contract.RANK], item.attributes[contract.STEP], item.span.name): item.span
                        for item in received}
    assert len(by_rank_and_step) == 4 * STEPS
    for number in range(STEPS):
        rank0, rank1 = (by_rank_and_step[rank, number, contract.STEP_SPAN_NAME] for rank in (0, 1))
        assert rank0.trace_id == rank1.trace_id == trace_id_bytes(number)
        assert rank0.span_id != rank1.span_id
        for rank, step_span in ((0, rank0), (1, rank1)):
            assert by_rank_and_step[rank, number, "forward-compute"].parent_span_id == step_span.span_id
    assert {item.resource[contract.JOB_ID] for item in received} == {JOB}
    assert {item.resource[contract.WORLD_SIZE] for item in received} == {2}


def test_grpc_sends_the_encoded_request_as_it_is_also_after_a_reconnect(grpc_receiver):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExportResult

    from otel_straggler.instrumentation.exporting import span_exporter

    exporter = span_exporter(grpc_receiver.endpoint, "grpc")
    tracer = TracerProvider().get_tracer("test")

    def export(name: str) -> None:
        span = tracer.start_span(name)
        span.end()
        assert exporter.export([exporter.prewrite(span)]) == SpanExportResult.SUCCESS

    try:
        export("first")
        exporter._connect()  # as after UNAVAILABLE: a fresh channel
        export("after-reconnect")
    finally:
        exporter.shutdown()
    assert [received.span.name for received in grpc_receiver.spans()] == ["first", "after-reconnect"]


EXIT_WITHOUT_SHUTDOWN = """
import sys
import otel_straggler
handle = otel_straggler.configure(job_id="exit", rank=0, world_size=1, endpoint=sys.argv[1], protocol="grpc",
                                  device_timing="fake", build_interval_ms=60_000.0)
for number in range(50):
    otel_straggler.step(number)
    for name in ("forward-compute", "backward-compute", "optimizer"):
        with otel_straggler.stage(name):
            pass
    if number == 0 and sys.argv[2] == "built-before":
        handle.flush(5.0)  # the span pipeline is made at the first build: here, after the first step
print(handle.status()["pending_build"])
# no shutdown(): the process exits with every record still queued, and configure()'s exit handler
# builds and exports them
"""


@pytest.mark.child_processes
@pytest.mark.parametrize("pipeline", ["built-before", "made-at-exit"])
def test_a_rank_that_exits_without_shutdown_exports_everything(grpc_receiver, tmp_path, pipeline):
    script = tmp_path / "rank.py"
    script.write_text(EXIT_WITHOUT_SHUTDOWN)
    result = subprocess.run([sys.executable, str(script), grpc_receiver.endpoint, pipeline], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    # nothing built before the exit but the first step's stages where the pipeline was made early
    assert int(result.stdout.split()[-1]) == 50 * 4 - (4 if pipeline == "built-before" else 0)
    names = [received.span.name for received in grpc_receiver.spans()]
    assert len(names) == 50 * 3 + 50, (len(names), result.stderr[-2000:])  # the stages and 50 step spans


def one_stage_received(handle, receiver, wait_until):
    """One step of one stage, flushed: what the receiver got of it (the open step's span is not
    built yet)."""
    otel_straggler.step(0)
    with otel_straggler.stage("forward-compute"):
        pass
    assert handle.flush(timeout_s=5.0)
    assert wait_until(lambda: [item.span.name for item in receiver.spans()] == ["forward-compute"])
    return receiver.spans()[0]


def test_the_exported_resource_has_the_detected_attributes_and_the_identity(configure, grpc_receiver, monkeypatch,
                                                                            wait_until):
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging,training.rank=9")
    handle = configure(job_id="resource", rank=3, endpoint=grpc_receiver.endpoint, protocol="grpc",
                       device_timing="off", export_metrics=False)
    resource = one_stage_received(handle, grpc_receiver, wait_until).resource
    assert resource["deployment.environment"] == "staging"  # from the env, through the detectors
    assert resource["telemetry.sdk.name"] == "opentelemetry"  # the SDK's own part
    assert resource["training.rank"] == 3 and resource["training.job.id"] == "resource"  # explicit wins
    assert resource["service.name"]


def test_rank_metrics_that_fail_to_start_leave_the_spans_going(configure, grpc_receiver, monkeypatch, wait_until):
    from otel_straggler.instrumentation import rank_pipeline

    def failing(*args, **kwargs):
        raise RuntimeError("no metrics exporter here")

    monkeypatch.setattr(rank_pipeline, "start_rank_metrics", failing)
    handle = configure(job_id="no-metrics", rank=0, endpoint=grpc_receiver.endpoint, protocol="grpc",
                       device_timing="off", export_metrics=True)
    one_stage_received(handle, grpc_receiver, wait_until)
    status = handle.status()
    assert status["metrics_errors"] == 1 and status["lost"]["internal_error"] == 0
