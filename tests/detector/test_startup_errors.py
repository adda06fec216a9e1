"""What `otel-straggler detect` says when it cannot start (a listener that cannot bind, a bad OTLP
exporter env var): one line naming the flag or variable, the usual exit code, no traceback; and
gRPC requests over the size bound counted as on the HTTP side."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import grpc
import pytest

from otel_straggler.testing.otlp_spans import request_bytes, running_service, service_config, stage_spans

TRACES_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
METRICS_EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"


def detect(tmp_path, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs `otel-straggler detect` with free ports unless flags say otherwise, expecting it to fail."""
    environ = {key: value for key, value in os.environ.items()
               if not key.startswith(("OTEL_EXPORTER_OTLP", "OTEL_STRAGGLER_"))}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "otel_straggler", "detect", "--grpc-port", "0", "--http-port", "0",
         "--evidence-dir", str(tmp_path / "evidence"), *flags],
        capture_output=True, text=True, timeout=60, env=environ)


def one_line(done: subprocess.CompletedProcess) -> str:
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    return done.stderr.rstrip("\n")


@pytest.fixture
def port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


# ---------------------------------------------------------------- listeners

@pytest.mark.parametrize("flag", ["--grpc-port", "--http-port", "--prometheus-port"])
def test_a_port_in_use_names_its_flag_and_address(tmp_path, port_in_use, flag):
    done = detect(tmp_path, flag, str(port_in_use))
    assert done.returncode == 1
    expected = f"{flag}: cannot listen on 127.0.0.1:{port_in_use}: Address already in use"
    assert one_line(done) == f"otel-straggler detect: {expected}"


def test_a_second_detector_on_the_same_grpc_port_is_refused(tmp_path):
    """Not started beside the first, sharing its port and half its connections without a word."""
    with running_service(service_config(tmp_path / "first", grpc_port=0)) as first:
        port = first.bound_ports[0]
        done = detect(tmp_path / "second", "--grpc-port", str(port))
        assert done.returncode == 1
        assert one_line(done) == f"otel-straggler detect: --grpc-port: cannot listen on 127.0.0.1:{port}: Address already in use"


@pytest.mark.parametrize("address, shown", [("999.1.1.1", "999.1.1.1:0"), ("::1x", "[::1x]:0")])
def test_a_listen_address_that_does_not_resolve_is_a_bad_value(tmp_path, address, shown):
    done = detect(tmp_path, "--listen-address", address)
    assert done.returncode == 2
    assert one_line(done).startswith(f"otel-straggler detect: --listen-address: cannot listen on {shown}: ")


def test_a_listen_address_this_machine_does_not_have_names_the_flag(tmp_path):
    done = detect(tmp_path, "--listen-address", "192.0.2.1")  # TEST-NET-1, never a host's own address
    assert done.returncode == 1
    assert one_line(done).startswith("otel-straggler detect: --listen-address: cannot listen on 192.0.2.1:0: ")


def test_the_largest_max_request_bytes_still_starts(tmp_path):
    environ = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_EXPORTER_OTLP")}
    process = subprocess.Popen(
        [sys.executable, "-m", "otel_straggler", "detect", "--grpc-port", "0", "--http-port", "0",
         "--evidence-dir", str(tmp_path / "evidence"), "--max-request-bytes", str(1 << 31)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ)
    try:
        line = process.stdout.readline()
        assert "OTLP/gRPC 127.0.0.1:" in line, process.stderr.read() if process.poll() is not None else line
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0


# ---------------------------------------------------------------- OTLP exporter env vars

EXPORTING = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}


@pytest.mark.parametrize("variable, value, message", [
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "abc", "expected a number of seconds > 0, got 'abc'"),
    ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "-1", "expected a number of seconds > 0, got '-1'"),
    ("OTEL_EXPORTER_OTLP_COMPRESSION", "zstdx", "expected gzip (protocol grpc), got 'zstdx'"),
])
def test_a_bad_exporter_setting_is_one_line_and_exit_2(tmp_path, variable, value, message):
    done = detect(tmp_path, env={**EXPORTING, variable: value})
    assert done.returncode == 2
    assert one_line(done) == f"otel-straggler detect: {variable}: {message}"


def test_a_bad_compression_over_http_is_refused_too(tmp_path):
    done = detect(tmp_path, env={**EXPORTING, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                                 "OTEL_EXPORTER_OTLP_LOGS_COMPRESSION": "br"})
    assert done.returncode == 2
    assert one_line(done) == ("otel-straggler detect: OTEL_EXPORTER_OTLP_LOGS_COMPRESSION: "
                              "expected none or gzip or deflate (protocol http/protobuf), got 'br'")


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_CERTIFICATE", "OTEL_EXPORTER_OTLP_LOGS_CLIENT_KEY"])
def test_a_missing_certificate_file_is_one_line_and_exit_2(tmp_path, variable):
    missing = tmp_path / "missing.pem"
    done = detect(tmp_path, env={**EXPORTING, variable: str(missing)})
    assert done.returncode == 2
    expected = f"{variable}: cannot read {str(missing)!r}: No such file or directory"
    assert one_line(done) == f"otel-straggler detect: {expected}"


# ---------------------------------------------------------------- gRPC size bound

def raw_call(port: int, method: str, payload: bytes, **options) -> grpc.StatusCode:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            call(payload, timeout=10, **options)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def test_grpc_requests_over_the_size_bound_are_counted_as_too_large(tmp_path):
    with running_service(service_config(tmp_path, max_request_bytes=4096)) as service:
        port = service.bound_ports[0]
        spans = stage_spans(0, 1)
        while len(request_bytes(spans)) <= 4096:
            spans += stage_spans(0, 1, first_seq=len(spans))
        over = request_bytes(spans)
        assert raw_call(port, TRACES_EXPORT, over) is grpc.StatusCode.RESOURCE_EXHAUSTED
        # the bound applies after decompression, as over HTTP
        gzipped = raw_call(port, TRACES_EXPORT, over, compression=grpc.Compression.Gzip)
        assert gzipped is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert raw_call(port, METRICS_EXPORT, b"\x00" * len(over)) is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert raw_call(port, TRACES_EXPORT, request_bytes(stage_spans(1, 2))) is grpc.StatusCode.OK
        assert service.status()["requests"] == {"too_large": 3, "ok": 1}
