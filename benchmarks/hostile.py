"""The detector in a hostile world, on loopback: legitimate exports keep being served while hostile
clients attack each receiver, and the engine keeps its verdicts right under skewed clocks, id floods,
an outage's backlog and its own restart.

    python benchmarks/hostile.py [--seconds 8] [--cases all]

Intake. A `DetectorService` at its defaults (ports on loopback) gets legitimate OTLP exports all the
time, a small batch of stage spans every 20 ms, alternately over gRPC and HTTP (each on a kept-alive
connection, as SDK exporters send), timed from send to answer. First `baseline` (no attack), then
each attack for `--seconds` with the same legitimate load:
  grpc-slow-streams  40 gRPC calls at once that open their stream and never send the message (more
                     than max_grpc_calls / 8 would be needed on one connection: HTTP/2's 16 streams)
  http-slowloris     260 connections sending their request head a byte every 5 s, reopened when closed
  gzip-members       two clients posting 4 MiB bodies of empty gzip members, back to back
  bad-framing        a client sending ambiguous HTTP framing (two Content-Lengths, Content-Length with
                     chunked, `+N`, a header line without a colon, a garbage request line) in a loop
Per phase: legitimate requests, the share served (200), their p50 and p99 latency, and the hostile
requests made with what they got; for gzip-members the detector's CPU per hostile request (this
process's CPU time over the phase, less the baseline's rate, over the hostile requests).

Engine (the same code, no sockets, the detector's clock scripted): a hang with rank clocks a day fast
or 300 s slow (seconds from the block to the hang verdict, against honest clocks); 20,000 new job ids
sent among a live job's spans (the window its slow rank is named in, against no flood); an outage's
backlog (`silent` verdicts of live ranks); a restart on the same evidence directory (onsets repeated,
alerts left without `recovered`, whether status.json's counters continue).
"""
from __future__ import annotations

import argparse
import gzip
import http.client
import json
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult

from otel_straggler import contract
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.engine import Engine
from otel_straggler.detector.observation import Observation
from otel_straggler.detector.service import DetectorService
from otel_straggler.testing.otlp_spans import per_step_requests, request_bytes, stage_spans
from otel_straggler.testing.scripted_job import CONFIG as HANG_CONFIG, SECOND, ScriptedJob, hangs, stuck_rank_one
from otel_straggler.testing.synthetic import TRAINING_STAGES, SyntheticJob

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
LEGIT_EVERY_S = 0.02


# ---------------------------------------------------------------- intake

class LegitimateLoad:
    """Exports every LEGIT_EVERY_S, alternately over gRPC and HTTP; latencies of the current phase."""

    def __init__(self, service: DetectorService) -> None:
        grpc_port, self._http_port = service.bound_ports
        self._grpc = OTLPSpanExporter(endpoint=f"127.0.0.1:{grpc_port}", insecure=True, timeout=10)
        self._http = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.samples: list[tuple[bool, float]] = []
        self._seq = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def take(self) -> list[tuple[bool, float]]:
        with self._lock:
            samples, self.samples = self.samples, []
        return samples

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)
        self._grpc.shutdown()

    def _run(self) -> None:
        over_grpc = True
        while not self._stop.wait(LEGIT_EVERY_S):
            spans = stage_spans(rank=0, count=4, job_id="legit", first_seq=self._seq)
            self._seq += 4
            started = time.perf_counter()
            ok = self._grpc.export(spans) is SpanExportResult.SUCCESS if over_grpc else self._post(spans)
            with self._lock:
                self.samples.append((ok, time.perf_counter() - started))
            over_grpc = not over_grpc

    def _post(self, spans) -> bool:
        body = request_bytes(spans)
        for _ in range(2):  # a kept-alive connection the server closed is reopened, as exporters do
            try:
                if self._http is None:
                    self._http = http.client.HTTPConnection("127.0.0.1", self._http_port, timeout=10)
                self._http.request("POST", "/v1/traces", body=body, headers={"Content-Type": "application/x-protobuf"})
                response = self._http.getresponse()
                response.read()
                return response.status == 200
            except (OSError, http.client.HTTPException):
                self._http.close()
                self._http = None
        return False


class Attack:
    """Hostile clients on threads until stop(); `outcomes` counts what they got."""

    def __init__(self, service: DetectorService) -> None:
        self.grpc_port, self.http_port = service.bound_ports
        self.stopping = threading.Event()
        self.outcomes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def count(self, outcome: str) -> None:
        with self._lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def spawn(self, target, count: int = 1) -> None:
        for _ in range(count):
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self.stopping.set()
        for thread in self._threads:
            thread.join(20)


def grpc_slow_streams(attack: Attack) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{attack.grpc_port}")
    call = channel.stream_unary(EXPORT_METHOD, request_serializer=None, response_deserializer=None)

    def never():
        attack.stopping.wait(60)
        time.sleep(2)  # until the channel closes: cancelled, not a call without a message
        return
        yield

    def stream() -> None:
        while not attack.stopping.is_set():
            try:
                call(never(), timeout=60)
                outcome = "answered"
            except grpc.RpcError as error:
                outcome = error.code().name
            if not attack.stopping.is_set():  # what the detector did, not the probe ending its calls
                attack.count(outcome)
    attack.spawn(stream, 40)
    attack.stopping.wait()
    channel.close()


def _closed(connection: socket.socket) -> bool:
    try:
        return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False


def http_slowloris(attack: Attack) -> None:
    def connection() -> None:
        while not attack.stopping.is_set():
            try:
                with socket.create_connection(("127.0.0.1", attack.http_port), timeout=30) as slow:
                    attack.count("opened")
                    head = b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 10_000
                    for byte in head:
                        slow.sendall(bytes([byte]))
                        if attack.stopping.wait(5.0):
                            return
                        if _closed(slow):
                            raise ConnectionResetError
            except OSError:
                attack.count("closed by the server")
    attack.spawn(connection, 260)


def gzip_members(attack: Attack) -> None:
    member = gzip.compress(b"")
    body = member * (4 * 1024 * 1024 // len(member))

    def client() -> None:
        while not attack.stopping.is_set():
            try:
                connection = http.client.HTTPConnection("127.0.0.1", attack.http_port, timeout=30)
                connection.request("POST", "/v1/traces", body=body, headers={
                    "Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"})
                attack.count(str(connection.getresponse().status))
                connection.close()
            except (OSError, http.client.HTTPException):
                attack.count("error")
    attack.spawn(client, 2)


BAD_FRAMING = [
    b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Length: +3\r\n\r\nabc",
    b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Length: 1_2\r\n\r\nabc",
    b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nno colon\r\nContent-Length: 3\r\n\r\nabc",
    b"HELLO THERE\r\n\r\n",
    b"HEAD /v1/traces HTTP/1.1\r\nHost: x\r\n\r\n",
]


def bad_framing(attack: Attack) -> None:
    def client() -> None:
        index = 0
        while not attack.stopping.is_set():
            try:
                with socket.create_connection(("127.0.0.1", attack.http_port), timeout=5) as connection:
                    connection.sendall(BAD_FRAMING[index % len(BAD_FRAMING)])
                    answer = connection.recv(64)
                    attack.count(answer[:12].decode("latin-1").strip() or "no answer")
            except OSError:
                attack.count("error")
            index += 1
            time.sleep(0.005)
    attack.spawn(client)


ATTACKS = {"grpc-slow-streams": grpc_slow_streams, "http-slowloris": http_slowloris,
           "gzip-members": gzip_members, "bad-framing": bad_framing}


def intake_rows(seconds: float) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as evidence:
        service = DetectorService(DetectorConfig(grpc_port=0, http_port=0, evidence_dir=evidence, export_metrics=False,
                                                 console_verdicts=False))
        service.start()
        load = LegitimateLoad(service)
        load.start()
        try:
            time.sleep(1.0)
            load.take()
            cpu_started, wall_started = time.process_time(), time.monotonic()
            time.sleep(seconds)
            baseline_cpu_rate = (time.process_time() - cpu_started) / (time.monotonic() - wall_started)
            rows.append(_row("baseline", load.take(), {}, None))
            for name, start in ATTACKS.items():
                attack = Attack(service)
                cpu_started, wall_started = time.process_time(), time.monotonic()
                threading.Thread(target=start, args=(attack,), daemon=True).start()
                time.sleep(seconds)
                samples = load.take()
                cpu = time.process_time() - cpu_started - baseline_cpu_rate * (time.monotonic() - wall_started)
                attack.stop()
                hostile = sum(attack.outcomes.values())
                rows.append(_row(name, samples, attack.outcomes,
                                 cpu / hostile if name == "gzip-members" and hostile else None))
                time.sleep(1.0)  # what the attack left closes
                load.take()
        finally:
            load.stop()
            service.stop(timeout_s=10)
    return rows


def _row(phase: str, samples, outcomes: dict, cpu_per_hostile) -> dict:
    latencies = sorted(seconds for _, seconds in samples)
    served = sum(ok for ok, _ in samples)
    return {"phase": phase, "legit": len(samples), "served": served / len(samples) if samples else 0.0,
            "p50_ms": 1000 * statistics.median(latencies) if latencies else None,
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else None,
            "hostile": outcomes, "cpu_per_hostile_s": cpu_per_hostile}


# ---------------------------------------------------------------- engine

def feed(engine: Engine, observations: list, chunk: int) -> list:
    """Ingests `chunk` observations at a time, the clock a step (0.1 s) on after each, then drains."""
    verdicts, now = [], 1_700_000_000_000_000_000
    for start in range(0, len(observations), chunk):
        engine.ingest_many(observations[start:start + chunk])
        now += 100_000_000
        verdicts += engine.advance(now)
    return verdicts + engine.drain(now + 100_000_000)


def observation(job_id: str) -> Observation:
    """One valid stage span of a job id of its own."""
    return Observation(job_id, 0, "c", 0, "s", 0, 0, 10.0, None, False, None, None, 1_700_000_000_000_000_000)


def hang_delays() -> dict[str, float]:
    """Seconds from the block to the hang verdict (hang_timeout_s 60), per clock setting."""
    delays = {}
    for name, offsets in (("honest clocks", {}), ("rank 0 a day fast", {0: 86_400 * SECOND}),
                          ("every clock 300 s slow", {rank: -300 * SECOND for rank in range(4)})):
        job = ScriptedJob(Engine(HANG_CONFIG))
        job.clock_offset = offsets
        job.run(30)
        blocked = job.now
        found = hangs(job.run(120, progress=False, open_stages=stuck_rank_one(blocked)))
        delays[name] = (found[0].time_unix_nano - blocked) / 1e9 if found else None
    return delays


def id_flood(ids: int = 20_000) -> dict:
    """The window the live job's slow rank is named in, with and without `ids` new job ids among its spans."""
    observations = SyntheticJob(ranks=8, seed=5, job_id="live").slow(3, 1.3, from_step=60).observations(200)
    chunk = 8 * len(TRAINING_STAGES)
    per_chunk = ids // (len(observations) // chunk)
    def first_alert(stream, size) -> tuple:
        engine = Engine(DetectorConfig())
        onsets = [v.window for v in feed(engine, stream, size) if v.job_id == "live" and v.rank == 3
                  and v.verdict == contract.VERDICT_STRAGGLER]
        return (onsets[0] if onsets else None), engine.stats()
    quiet, _ = first_alert(observations, chunk)
    flooded, sent = [], 0
    for start in range(0, len(observations), chunk):
        flooded += [observation(job_id=f"flood-{sent + index}") for index in range(per_chunk)]
        sent += per_chunk
        flooded += observations[start:start + chunk]
    loud, stats = first_alert(flooded, chunk + per_chunk)
    return {"ids": sent, "window without": quiet, "window with": loud, "evictions_jobs": stats["evictions_jobs"],
            "jobs_shed": stats["jobs_shed"]}


def outage_backlog() -> int:
    """`silent` verdicts of live ranks when a peer's backlog arrives after the others dropped theirs."""
    observations = SyntheticJob(ranks=4, seed=11).observations(300)
    backlog = [o for o in observations if o.rank == 2 and 100 <= o.step < 180]
    current = [o for o in observations if o.step >= 180]
    peers_first = [o for o in current if o.rank != 2 and o.step < 200]
    arrivals = []
    for burst in range(8):
        arrivals += peers_first[burst::8] + backlog[burst * len(backlog) // 8:(burst + 1) * len(backlog) // 8]
    arrivals += [o for o in current if o not in peers_first]
    verdicts = feed(Engine(DetectorConfig()), arrivals, 4 * len(TRAINING_STAGES))
    return sum(v.verdict == contract.VERDICT_SILENT for v in verdicts)


def restart() -> dict:
    """Two detector processes (services) on one evidence directory, a rank slow across the restart."""
    job = SyntheticJob(ranks=8, seed=3).slow(3, 1.3, from_step=10, to_step=64)
    with tempfile.TemporaryDirectory() as evidence:
        config = DetectorConfig(grpc_port=0, http_port=0, evidence_dir=evidence, export_metrics=False,
                                console_verdicts=False, flush_interval_s=0.05, window_grace_s=3600.0, window_steps=5)
        for first_step in (0, 40):
            service = DetectorService(config)
            service.start()
            exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{service.bound_ports[0]}", insecure=True, timeout=10)
            for spans in per_step_requests(job.observations(40, first_step=first_step,
                                                            seq_start=first_step * len(TRAINING_STAGES))):
                exporter.export(spans)
            exporter.shutdown()
            service.stop(timeout_s=10)
        records = [json.loads(line) for line in Path(evidence, "verdicts.jsonl").read_text().splitlines()]
        status = json.loads(Path(evidence, "status.json").read_text())
    onsets, open_alerts = {}, set()
    for record in records:
        key = (record["rank"], record["stage"])
        if record["verdict"] == contract.VERDICT_STRAGGLER:
            onsets[key] = onsets.get(key, 0) + 1
            open_alerts.add(key)
        elif record["verdict"] == contract.VERDICT_RECOVERED:
            open_alerts.discard(key)
    return {"repeated onsets": sum(count - 1 for count in onsets.values()), "left open": len(open_alerts),
            "spans accepted (both)": status["spans"]["accepted"], "processes": status["history"]["processes"]}


# ---------------------------------------------------------------- table

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="each attack phase")
    parser.add_argument("--cases", default="all", help="intake, engine or all")
    args = parser.parse_args()
    if args.cases in ("all", "intake"):
        print(f"legitimate exports every {LEGIT_EVERY_S * 1000:.0f} ms (gRPC and HTTP by turns), {args.seconds:g} s a phase,"
              f" {os.cpu_count()} CPUs")
        print(f"{'phase':<19} {'legit':>6} {'served':>7} {'p50 ms':>7} {'p99 ms':>7}  hostile requests and what they got")
        for row in intake_rows(args.seconds):
            hostile = ", ".join(f"{k} {v}" for k, v in sorted(row["hostile"].items(), key=lambda kv: -kv[1]))
            cpu = f"; {row['cpu_per_hostile_s'] * 1000:.1f} ms CPU each" if row["cpu_per_hostile_s"] is not None else ""
            print(f"{row['phase']:<19} {row['legit']:>6} {row['served'] * 100:>6.1f}% {row['p50_ms']:>7.1f} "
                  f"{row['p99_ms']:>7.1f}  {hostile or '-'}{cpu}")
    if args.cases in ("all", "engine"):
        print()
        for name, delay in hang_delays().items():
            print(f"hang, {name:<24} named {delay:.1f} s after the block (hang_timeout_s 60)" if delay is not None
                  else f"hang, {name:<24} not named")
        flood = id_flood()
        print(f"{flood['ids']} new job ids among a live job's spans: its slow rank named at window "
              f"{flood['window with']} (without them: {flood['window without']}); evictions {flood['evictions_jobs']},"
              f" shed {flood['jobs_shed']}")
        print(f"outage backlog: {outage_backlog()} `silent` verdicts of live ranks")
        result = restart()
        print(f"restart on the same evidence: {result['repeated onsets']} onsets repeated, {result['left open']} alerts"
              f" left open, status.json counts {result['spans accepted (both)']} spans over {result['processes']}"
              f" processes")


if __name__ == "__main__":
    main()
