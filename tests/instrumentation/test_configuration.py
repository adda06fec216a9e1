"""Configuration from env vars: a bad value fails configure() with one line naming the
variable; under `opentelemetry-instrument` the env alone turns the instrumentation on, and a
bad value there says so once while training goes on."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import otel_straggler
from otel_straggler.settings import ConfigError


@pytest.mark.parametrize("variable, value, complaint", [
    ("OTEL_STRAGGLER_QUEUE_SIZE", "lots", "expected int"),
    ("OTEL_STRAGGLER_QUEUE_SIZE", "8", ">= 16"),
    ("OTEL_STRAGGLER_EVENT_POOL_SIZE", "1", ">= 2"),
    ("OTEL_STRAGGLER_READOUT_TIMEOUT_MS", "nan", "finite"),
    ("OTEL_STRAGGLER_DEVICE_TIMING", "gpu", "must be one of auto, cuda, fake, off"),
    ("OTEL_STRAGGLER_EXPORT_METRICS", "sometimes", "expected bool"),
    ("OTEL_STRAGGLER_READOUT_TIMEOUT_MS", "0.5", ">= 1"),
    ("OTEL_STRAGGLER_HEARTBEAT_INTERVAL_MS", "50", "must be >= 100 or 0 (off), got 50"),
    ("OTEL_STRAGGLER_HEARTBEAT_INTERVAL_MS", "-1", "must be >= 100 or 0 (off)"),
    ("OTEL_STRAGGLER_HEARTBEAT_INTERVAL_MS", "4000000", "must be <= 3.6e+06 or 0 (off)"),
    ("OTEL_STRAGGLER_HEARTBEAT_INTERVAL_MS", "often", "expected float"),
    ("OTEL_STRAGGLER_RESTART_COUNT", "first", "expected int"),
    ("OTEL_SDK_DISABLED", "perhaps", "expected true or false"),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon", "must be one of grpc, http/protobuf"),
    ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon", "must be one of grpc, http/protobuf"),
    ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "carrier-pigeon", "must be one of grpc, http/protobuf"),
    # read by the SDK's exporters themselves, which would raise a traceback or go on without them
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "abc", "expected a number of seconds"),
    ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "-1", "expected a number of seconds"),
    ("OTEL_EXPORTER_OTLP_COMPRESSION", "zstdx", "expected gzip (protocol grpc)"),
    ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "/nonexistent/ca.pem", "cannot read"),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "", "expected a number of seconds"),  # set to nothing: the SDK fails too
    ("OTEL_EXPORTER_OTLP_COMPRESSION", " ", "expected gzip (protocol grpc)"),
    # the rank's metrics exporter is made later, on the builder thread: checked at configure() all the same
    ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "abc", "expected a number of seconds"),
])
def test_a_bad_env_var_fails_configure_with_one_line_naming_it(configure, monkeypatch, variable, value, complaint):
    monkeypatch.setenv("OTEL_STRAGGLER_DEVICE_TIMING", "off")  # no torch import to wait for
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as raised:
        configure(job_id="bad-config")
    message = str(raised.value)
    assert message.startswith(f"{variable}: ") and complaint in message
    assert "\n" not in message
    assert otel_straggler.current() is None


def test_a_good_configure_works_after_a_bad_one(configure, monkeypatch, in_memory):
    monkeypatch.setenv("OTEL_STRAGGLER_QUEUE_SIZE", "0")
    with pytest.raises(ConfigError):
        configure()
    monkeypatch.setenv("OTEL_STRAGGLER_QUEUE_SIZE", "32")
    assert in_memory.configure().recorder.capacity == 32


TRAIN_SCRIPT = textwrap.dedent("""
    import json
    import otel_straggler
    handle = otel_straggler.current()
    for number in range(3):
        otel_straggler.step(number)
        with otel_straggler.stage("forward-compute"):
            pass
    report = {"configured": handle is not None and handle.enabled, "trained": True}
    if report["configured"]:
        report["job_id"] = handle.resource_attributes.get("training.job.id")
        handle.shutdown(timeout_s=5.0)
        report["exported"] = handle.status()["exported"]
    print(json.dumps(report))
""")


def run_under_opentelemetry_instrument(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    bin_dir = str(Path(sys.executable).parent)
    environ = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
               "OTEL_STRAGGLER_DEVICE_TIMING": "off", **env}
    return subprocess.run(["opentelemetry-instrument", "python", str(script)], env=environ, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.child_processes
def test_opentelemetry_instrument_turns_it_on_from_env_alone(tmp_path, grpc_receiver):
    finished = run_under_opentelemetry_instrument(
        tmp_path, OTEL_STRAGGLER_ENABLED="true", OTEL_STRAGGLER_JOB_ID="auto-job",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://{grpc_receiver.endpoint}", OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_STRAGGLER_EXPORT_METRICS="false")
    assert finished.returncode == 0, finished.stderr
    report = json.loads(finished.stdout.strip().splitlines()[-1])
    assert report == {"configured": True, "trained": True, "job_id": "auto-job", "exported": 6}
    assert {item.resource["training.job.id"] for item in grpc_receiver.spans()} == {"auto-job"}


@pytest.mark.child_processes
def test_without_enabling_it_stays_off(tmp_path):
    finished = run_under_opentelemetry_instrument(tmp_path)
    assert finished.returncode == 0, finished.stderr
    assert json.loads(finished.stdout.strip().splitlines()[-1]) == {"configured": False, "trained": True}


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.child_processes
@pytest.mark.parametrize("bad", [
    {"OTEL_STRAGGLER_QUEUE_SIZE": "lots"}, {"OTEL_STRAGGLER_ENABLED": "yes please"},
    pytest.param({"OTEL_STRAGGLER_DEVICE_TIMING": "cuda"}, id="cuda-without-a-gpu",
                 marks=pytest.mark.skipif(cuda_available(), reason="a GPU is here: cuda is a setting it can meet")),
])
def test_a_bad_value_under_opentelemetry_instrument_says_so_once_and_training_goes_on(tmp_path, bad):
    finished = run_under_opentelemetry_instrument(tmp_path, **{"OTEL_STRAGGLER_ENABLED": "true", **bad})
    assert finished.returncode == 0, finished.stderr
    assert json.loads(finished.stdout.strip().splitlines()[-1]) == {"configured": False, "trained": True}
    complaints = [line for line in finished.stderr.splitlines() if "otel-straggler" in line]
    (variable,) = bad
    assert len(complaints) == 1 and variable in complaints[0], finished.stderr


@pytest.mark.child_processes
def test_status_has_every_section_from_the_start(unreachable_endpoint):
    """A script reads status()["automatic"] or ["timer_misuse"] without having used automatic
    timing or Megatron's timers: a fresh process has every section, with zeros."""
    code = textwrap.dedent(f"""
        import json, otel_straggler
        handle = otel_straggler.configure(job_id="sections", rank=0, endpoint="{unreachable_endpoint}")
        status = handle.status()
        print(json.dumps({{name: status[name] for name in ("ddp", "timer_misuse", "automatic")}}))
        handle.shutdown(timeout_s=0.5)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OTEL_SDK_DISABLED": "false"})
    assert done.returncode == 0, done.stderr
    sections = json.loads(done.stdout.strip().splitlines()[-1])
    assert sections["ddp"] == {"hook_errors": 0, "models": 0}
    assert sections["timer_misuse"] == {}
    assert sections["automatic"]["instrumented"] is False and sections["automatic"]["errors"] == 0
