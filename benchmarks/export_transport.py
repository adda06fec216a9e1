"""CPU a rank spends per OTLP span export, by transport, for the same encoded request.

    python benchmarks/export_transport.py [--spans 40] [--requests 200] [--paced 20] [--json out.json]

One request of --spans spans (what a rank of the overhead benchmark's 4-rank job exports every
500 ms), encoded once by the rank's SpanEncoder, is sent to a live detector in another process by:
  gRPC                 the channel's Export taking bytes, as the rank's gRPC exporter sends
  HTTP, requests       a requests Session (http_transport.SessionTransport: what the rank's
                       HTTP exporter uses behind a proxy, and the SDK's exporter always)
  HTTP, kept-alive     the rank's KeptAliveHTTPTransport (one connection, its own HTTP/1.1 framing)
Figures are CPU of the whole process per request (the sender and any threads the transport
runs), from the process clock: back to back (--requests in a row), and paced as a rank sends, one
request every 500 ms (--paced of them), where a transport's idle threads and cold caches count.
The reference, measured in the same run: a process that only sleeps 500 ms, paced the same way
(what waking up costs on this machine). Each arm runs in a fresh process (no other transport's
threads in it), in an order that alternates round by round.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from detector_process import DetectorProcess
from measured_on import describe, measured_on

PACE_S = 0.5  # OTEL_BSP_SCHEDULE_DELAY of the demo's ranks and the overhead benchmark
ROUNDS = 3
REFERENCE = "reference: sleep only"
ARMS = ("gRPC", "HTTP, requests", "HTTP, kept-alive", REFERENCE)


def encoded_request(spans: int) -> bytes:
    """A request of `spans` stage spans the detector accepts whole (an empty answer, as a rank gets)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    from otel_straggler import contract
    from otel_straggler.instrumentation.span_encoding import SpanEncoder

    tracer = TracerProvider(resource=Resource.create({"service.name": "training", contract.JOB_ID: "transport",
                                                      contract.RANK: 0})).get_tracer("otel_straggler")
    made = []
    for index in range(spans):
        span = tracer.start_span("forward-compute", attributes={contract.STAGE: "forward-compute", contract.STEP: index,
                                                                contract.SEQ: index})
        span.end()
        made.append(span)
    return SpanEncoder().encode(made)


def sender(arm: str, endpoints: dict[str, str]):
    """send(body) -> bool of one arm."""
    if arm == REFERENCE:
        return lambda body: True
    if arm == "gRPC":
        import grpc
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        export = grpc.insecure_channel(endpoints["grpc"]).unary_unary(
            "/opentelemetry.proto.collector.trace.v1.TraceService/Export", request_serializer=None,
            response_deserializer=ExportTraceServiceResponse.FromString)
        return lambda body: export(body, timeout=10) is not None
    from otel_straggler.instrumentation.http_transport import KeptAliveHTTPTransport, SessionTransport

    url = f"http://{endpoints['http']}/v1/traces"
    transport = SessionTransport() if arm == "HTTP, requests" else KeptAliveHTTPTransport()
    headers = {"Content-Type": "application/x-protobuf"}
    return lambda body: transport.request("POST", url, headers=headers, timeout=10.0, data=body).status_code == 200


def cpu_per_request_us(send, body: bytes, count: int, pace_s: float) -> float:
    for _ in range(5):  # connections made, caches warm
        if not send(body):
            raise RuntimeError("an export failed")
    before = time.process_time_ns()
    for _ in range(count):
        if not send(body):
            raise RuntimeError("an export failed")
        if pace_s:
            time.sleep(pace_s)
    return (time.process_time_ns() - before) / count / 1e3


def one_arm(arm: str, endpoints: dict[str, str], spans: int, requests: int, paced: int) -> dict:
    body = encoded_request(spans)
    send = sender(arm, endpoints)
    return {"bytes": len(body),
            "back_to_back": None if arm == REFERENCE else cpu_per_request_us(send, body, requests, 0.0),
            "paced": cpu_per_request_us(send, body, paced, PACE_S)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=40)
    parser.add_argument("--requests", type=int, default=200, help="back-to-back requests per arm and round")
    parser.add_argument("--paced", type=int, default=20, help="paced requests per arm and round, 500 ms apart")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one arm, in a child
    parser.add_argument("--endpoints", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.arm:
        print(json.dumps(one_arm(args.arm, json.loads(args.endpoints), args.spans, args.requests, args.paced)))
        return 0
    results: dict[str, dict[str, list[float]]] = {arm: {"back_to_back": [], "paced": []} for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="export-transport-") as scratch:
        detector = DetectorProcess(scratch)
        endpoints = json.dumps({"grpc": detector.endpoint, "http": detector.http_endpoint})
        try:
            for round_number in range(ROUNDS):
                for arm in (ARMS if round_number % 2 == 0 else tuple(reversed(ARMS))):
                    child = subprocess.run([sys.executable, __file__, "--arm", arm, "--endpoints", endpoints,
                                            "--spans", str(args.spans), "--requests", str(args.requests),
                                            "--paced", str(args.paced)], check=True, capture_output=True, text=True)
                    measured = json.loads(child.stdout.strip().splitlines()[-1])
                    body_bytes = measured["bytes"]
                    for key in ("back_to_back", "paced"):
                        if measured[key] is not None:
                            results[arm][key].append(measured[key])
        finally:
            detector.stop()
    print(f"\nCPU per OTLP span export of {args.spans} spans ({body_bytes:,} bytes) to a live detector, whole process;"
          f" {ROUNDS} rounds, median (min-max); {describe(measured_on())}")
    print(f"\n{'transport':24} {'back to back µs':>22} {'paced every 500 ms µs':>26}")
    for arm, figures in results.items():
        cells = []
        for key in ("back_to_back", "paced"):
            values = figures[key]
            cells.append(f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})" if values else "-")
        print(f"{arm:24} {cells[0]:>22} {cells[1]:>26}")
    if args.json:
        args.json.write_text(json.dumps({"spans": args.spans, "bytes": body_bytes, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
