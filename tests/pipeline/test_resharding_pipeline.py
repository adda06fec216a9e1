"""Detector shards added and removed behind the real gateway while a job runs: 2 -> 3 -> 2 shards.

The gateway's load_balancing exporter finds the shards with its `dns` resolver. The name resolves
through a hosts file that this test owns: the collector runs in its own mount namespace (`unshare`)
with that file bound over /etc/hosts, each shard listens on the same port at its own loopback
address (127.0.0.11, .12, .13; Linux routes all of 127/8 to lo), and rewriting the file in place
adds or removes a shard as a DNS change would on Kubernetes. The ring then moves cohorts: the
shard that lost one ends its alerts (`recovered`/`cohort_departed`), the one that gained it judges
it after its warmup (docs/detection.md, "A job that ends, a cohort that moves to another shard").

The job: 12 cohorts of 4 ranks, one rank slow from the start, heartbeats every second. The slow
rank's cohort is one the ring puts on the third shard, so it moves on both changes (A -> C -> A).
Measured and printed (docs/kubernetes.md quotes them): false verdicts, the windows and seconds
between the losing shard's last judgement of the slow rank and the gaining shard's re-flag, spans
lost between the sender and the shards.
"""
from __future__ import annotations

import bisect
import json
import random
import shlex
import socket
import struct
import subprocess
import time
import uuid
import zlib
from pathlib import Path

import pytest
import yaml
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags

from otel_straggler import contract
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.evidence import WINDOWS_FILE
from otel_straggler.detector.service import DetectorService

from otel_straggler.testing import services
from .telemetry import STAGES, Rank, step_trace_id

pytestmark = pytest.mark.services

SHARD_HOSTNAME = "detectors.test"
SHARD_ADDRESSES = {"A": "127.0.0.11", "B": "127.0.0.12", "C": "127.0.0.13"}
COHORTS = 12
RANKS_PER_COHORT = 4
SLOW_FACTOR = 1.4  # the slow rank's compute stages take 40% longer
STAGE_MS = {"forward-compute": 20.0, "backward-compute": 40.0, "grads-all-reduce": 10.0}
STEP_PERIOD_S = 0.2
WINDOW_STEPS = 5  # one window a second
HEARTBEAT_PERIOD_S = 1.0
WARMUP_WINDOWS = 2  # the detector's defaults, named for the bound on windows without a verdict
PERSIST_WINDOWS = 3
HANG_TIMEOUT_S = 10.0
MOVE_DEADLINE_S = 25.0  # the resolver's interval + Go's hosts-file cache (5 s) + the gaining shard's warmup
SETTLE_S = 4.0  # after each move has been judged: long enough for a false `silent` (3 windows) to show
SCOPE = InstrumentationScope("otel_straggler")

# The load_balancing exporter's ring (consistent_hashing.go, v0.161): 200 points per endpoint at
# crc32(endpoint + little-endian point index) mod 131071, a key goes to the first point at or after
# crc32(key) mod 131071. The test uses it only to pick a slow cohort that moves on both changes;
# the placement it predicts is checked against where the spans arrived.
RING_POSITIONS = 131071
RING_POINTS = 200
RING_PROBES = 10


def ring(endpoints: list[str]) -> list[tuple[int, str]]:
    candidates = sorted((crc % RING_POSITIONS, crc, endpoint) for endpoint in endpoints for crc in
                        (zlib.crc32(endpoint.encode() + struct.pack("<I", i)) for i in range(RING_POINTS)))
    used, items = set(), []
    for position, _, endpoint in candidates:
        probed = 0
        while position in used and probed < RING_PROBES:
            position, probed = (position + 1) % RING_POSITIONS, probed + 1
        if probed < RING_PROBES:
            used.add(position)
            items.append((position, endpoint))
    return sorted(items)


def shard_for(items: list[tuple[int, str]], job_id: str, cohort: str) -> str:
    key = f"training.job.id={job_id}|training.cohort={cohort}|"
    index = bisect.bisect_left([position for position, _ in items], zlib.crc32(key.encode()) % RING_POSITIONS)
    return items[index % len(items)][1]


def placement(job_id: str, cohorts: list[str], names: list[str], port: int) -> dict[str, str]:
    """cohort -> shard name, as the gateway places them while `names` are resolved."""
    endpoints = {f"{SHARD_ADDRESSES[name]}:{port}": name for name in names}
    items = ring(list(endpoints))
    return {cohort: endpoints[shard_for(items, job_id, cohort)] for cohort in cohorts}


def port_free_on_every_address() -> int:
    """A port that every shard address can bind (the DNS resolver gives one port for all)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((SHARD_ADDRESSES["A"], 0))
            port = probe.getsockname()[1]
        try:
            for address in SHARD_ADDRESSES.values():
                with socket.socket() as other:
                    other.bind((address, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every shard address")


def write_hosts(path: Path, names: list[str]) -> None:
    """Rewrites the file IN PLACE: the collector sees it through a bind mount of this inode, which a
    rename would replace."""
    text = "127.0.0.1 localhost\n" + "".join(f"{SHARD_ADDRESSES[name]} {SHARD_HOSTNAME}\n" for name in names)
    with open(path, "r+" if path.exists() else "w") as hosts:
        hosts.seek(0)
        hosts.truncate()
        hosts.write(text)


class NamespacedCollector(services.Collector):
    """The collector in a mount namespace of its own where /etc/hosts is the test's file."""

    def __init__(self, configs: list[Path], workdir: Path, hosts: Path) -> None:
        super().__init__(configs, workdir, name="gateway")
        self.hosts = hosts

    def argv(self) -> list[str]:
        collector = " ".join(shlex.quote(arg) for arg in super().argv())
        return ["unshare", "--mount", "sh", "-c",
                f"mount --bind {shlex.quote(str(self.hosts))} /etc/hosts && exec {collector}"]


def require_mount_namespaces() -> None:
    try:
        probe = subprocess.run(["unshare", "--mount", "sh", "-c", "mount --bind /etc/hosts /etc/hosts"],
                               capture_output=True, text=True, timeout=30)
        reason = (probe.stderr.strip() or f"exit status {probe.returncode}") if probe.returncode else ""
    except OSError as error:  # no unshare (util-linux) on the machine
        reason = str(error)
    if reason:  # CI runs as root: a missing permission is a failure there, never a skip
        pytest.fail("this test runs the gateway in its own mount namespace (unshare --mount, then a bind mount "
                    f"over /etc/hosts), which failed here: {reason}")


def gateway_config(tmp_path: Path, port: int) -> Path:
    """collector-config/gateway.yaml with the `dns` resolver, as on Kubernetes with a headless Service."""
    config = yaml.safe_load((services.CONFIG_DIR / "gateway.yaml").read_text())
    config["exporters"]["load_balancing/detector"]["resolver"] = {
        "dns": {"hostname": SHARD_HOSTNAME, "port": str(port), "interval": "1s", "timeout": "1s"}}
    path = tmp_path / "gateway-dns.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def span(rank: Rank, name: str, start: int, end: int, attributes: dict, span_id: int, step: int) -> ReadableSpan:
    context = SpanContext(step_trace_id(rank.job_id, step), span_id, is_remote=False,
                          trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return ReadableSpan(name=name, context=context, resource=rank.resource(), attributes=attributes,
                        start_time=start, end_time=end, instrumentation_scope=SCOPE)


class Job:
    """Sends, on each tick(), one training step of every rank, and each rank's heartbeat once a second."""

    def __init__(self, endpoint: str, job_id: str, slow_rank: int) -> None:
        self.exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=10)
        self.ranks = [Rank(job_id, cohort * RANKS_PER_COHORT + i, COHORTS * RANKS_PER_COHORT, f"tp{cohort}")
                      for cohort in range(COHORTS) for i in range(RANKS_PER_COHORT)]
        self.slow_rank = slow_rank
        self.random = random.Random(0)
        self.steps = 0
        self.sent = 0
        self.span_ids = 0
        self.next_heartbeat = time.monotonic()

    def tick(self) -> None:
        if time.monotonic() >= self.next_heartbeat:
            self._heartbeat()
            self.next_heartbeat += HEARTBEAT_PERIOD_S
        self._step()

    def _export(self, spans: list[ReadableSpan]) -> None:
        assert self.exporter.export(spans) is SpanExportResult.SUCCESS
        self.sent += len(spans)

    def _next_id(self) -> int:
        self.span_ids += 1
        return self.span_ids

    def _step(self) -> None:
        step, now, spans = self.steps, time.time_ns(), []
        for rank in self.ranks:
            t = now + int(self.random.uniform(0, 2e6))
            for index, (name, group, collective) in enumerate(STAGES):
                factor = SLOW_FACTOR if rank.rank == self.slow_rank and not collective else 1.0
                end = t + int(STAGE_MS[name] * factor * self.random.uniform(0.98, 1.02) * 1e6)
                spans.append(span(rank, name, t, end, {
                    contract.STAGE: name, contract.STAGE_GROUP: group, contract.STEP: step,
                    contract.SEQ: step * len(STAGES) + index, contract.TIMING: contract.TIMING_HOST_ONLY,
                    contract.COLLECTIVE: collective}, self._next_id(), step))
                t = end
        self._export(spans)
        self.steps += 1

    def _heartbeat(self) -> None:
        now = time.time_ns()
        self._export([span(rank, contract.HEARTBEAT_SPAN_NAME, now, now, {
            contract.STEP: self.steps, contract.SEQ: 0, contract.HEARTBEAT_OPEN_STAGES: (STAGES[0][0],),
            contract.HEARTBEAT_OPEN_SINCE: (now,)}, self._next_id(), self.steps) for rank in self.ranks])


def windows_judged(evidence_dir: Path, rank: int) -> list[int]:
    path = evidence_dir / WINDOWS_FILE
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted({record["window"] for record in records if record.get("rank") == rank})


def delivered(shard: DetectorService) -> int:
    """Spans the shard took in: stage spans (`accepted`) and heartbeats, counted apart."""
    spans = shard.status()["spans"]
    return spans["accepted"] + spans["heartbeats"]


def cohorts_judged(evidence_dir: Path) -> list[str]:
    path = evidence_dir / WINDOWS_FILE
    lines = path.read_text().splitlines() if path.exists() else []
    return sorted({json.loads(line)["cohort"] for line in lines if line.strip()})


def test_shards_added_and_removed_mid_job_move_cohorts_without_false_verdicts(pipeline_binaries, tmp_path):
    require_mount_namespaces()
    job_id = f"reshard-{uuid.uuid4().hex[:8]}"
    cohorts = [f"tp{c}" for c in range(COHORTS)]
    # a port on which the ring puts the slow rank's cohort and at least one other on the third shard
    for _ in range(100):
        port = port_free_on_every_address()
        two, three = placement(job_id, cohorts, ["A", "B"], port), placement(job_id, cohorts, ["A", "B", "C"], port)
        moving = [cohort for cohort in cohorts if three[cohort] == "C"]
        if len(moving) >= 2 and two[moving[0]] == "A" and set(two.values()) == {"A", "B"}:
            break
    else:
        raise RuntimeError("no port found on which the ring moves two cohorts")
    slow_cohort = moving[0]
    slow_rank = cohorts.index(slow_cohort) * RANKS_PER_COHORT + 1

    events: list[tuple[float, str, object]] = []  # (monotonic s, shard, verdict)
    shards: dict[str, DetectorService] = {}
    hosts = tmp_path / "hosts"
    write_hosts(hosts, ["A", "B"])
    gateway = None
    job = None
    try:
        for name, address in SHARD_ADDRESSES.items():
            service = DetectorService(DetectorConfig(
                listen_address=address, grpc_port=port, http_port=0, evidence_dir=str(tmp_path / name),
                export_metrics=False, console_verdicts=False, window_steps=WINDOW_STEPS, min_cohort_size=3,
                warmup_windows=WARMUP_WINDOWS, persist_windows=PERSIST_WINDOWS,
                hang_timeout_s=HANG_TIMEOUT_S, max_export_lag_s=1.0))
            service.add_verdict_listener(lambda verdict, name=name: events.append((time.monotonic(), name, verdict)))
            service.start()
            shards[name] = service
        gateway = NamespacedCollector([gateway_config(tmp_path, port)], tmp_path / "gateway", hosts)
        gateway.start()
        job = Job(gateway.grpc_endpoint, job_id, slow_rank)
        started = time.monotonic()
        third = []  # (monotonic s, spans the third shard took in so far), at each step

        def run_until(condition, timeout: float, what: str) -> None:
            """Sends steps (and heartbeats) at the job's pace until condition() holds."""
            deadline = time.monotonic() + timeout
            while True:
                tick = time.monotonic()
                job.tick()
                third.append((tick, delivered(shards["C"])))
                if condition():
                    return
                if tick >= deadline:
                    said_so_far = [(round(t - started, 1), n, v.verdict, v.reason, v.rank) for t, n, v in events]
                    raise AssertionError(f"{what}: not within {timeout:.0f}s; verdicts so far: {said_so_far}\n"
                                         f"{gateway.log_tail(20)}")
                time.sleep(max(0.0, tick + STEP_PERIOD_S - time.monotonic()))

        def said(shard: str, verdict: str, after: float) -> list:
            return [(t, v) for t, n, v in events if n == shard and v.verdict == verdict and t >= after
                    and v.rank == slow_rank]

        run_until(lambda: said("A", contract.VERDICT_STRAGGLER, started), 30, "the slow rank flagged on A")
        moves = []
        for names, losing, gaining in ((["A", "B", "C"], "A", "C"), (["A", "B"], "C", "A")):
            changed = time.monotonic()
            write_hosts(hosts, names)
            run_until(lambda: said(gaining, contract.VERDICT_STRAGGLER, changed)
                      and said(losing, contract.VERDICT_RECOVERED, changed), MOVE_DEADLINE_S,
                      f"the slow rank's cohort moved from {losing} to {gaining}")
            settle = time.monotonic() + SETTLE_S
            run_until(lambda: time.monotonic() >= settle, SETTLE_S + 5, "settling")
            moves.append((changed, losing, gaining))
        alerts = {name: {(state.cohort, state.rank) for state in shard.rank_state() if state.alert_active}
                  for name, shard in shards.items()}
        job.exporter.shutdown()
        wall_s = time.monotonic() - started
        try:  # what is still in the gateway's batch or queues arrives within seconds
            services.wait_until(lambda: sum(delivered(s) for s in shards.values()) >= job.sent, 15, interval=0.5)
        except TimeoutError:
            pass  # counted as lost below
        accepted = {name: delivered(s) for name, s in shards.items()}
        telemetry = gateway.telemetry()
    finally:
        if job is not None:
            job.exporter.shutdown()
        if gateway is not None:
            gateway.stop()
        for service in shards.values():
            service.stop(timeout_s=10.0)

    cohorts_held = {name: cohorts_judged(tmp_path / name) for name in shards}
    predicted = {name: sorted(cohort for cohort in cohorts if name in (two[cohort], three[cohort]))
                 for name in shards}

    def exporter_spans(metric: str) -> float:
        return sum(value for series, value in telemetry.items()
                   if series.startswith(metric + "{") and 'exporter="load_balancing/detector"' in series)

    refused = sum(value for series, value in telemetry.items() if series.startswith("otelcol_receiver_refused_spans"))
    failed = exporter_spans("otelcol_exporter_send_failed_spans")
    lost = job.sent - sum(accepted.values())

    expected = {(contract.VERDICT_STRAGGLER, contract.REASON_SLOW_VS_PEERS),
                (contract.VERDICT_RECOVERED, contract.REASON_COHORT_DEPARTED)}
    false_verdicts = [(round(t - started, 1), name, v.verdict, v.reason, v.cohort, v.rank) for t, name, v in events
                      if v.rank != slow_rank or (v.verdict, v.reason) not in expected]

    # when the ring switched: the third shard's first spans, then its last ones
    gained_at = next(t for t, count in third if count)
    lost_at = next(t for t, count in third if count == third[-1][1])
    rows = []
    for (changed, losing, gaining), switched in zip(moves, (gained_at, lost_at)):
        flagged = min(said(gaining, contract.VERDICT_STRAGGLER, changed), key=lambda said: said[0])
        departed = min(said(losing, contract.VERDICT_RECOVERED, changed), key=lambda said: said[0])
        last_judged = max(w for w in windows_judged(tmp_path / losing, slow_rank) if w < flagged[1].window)
        gained = windows_judged(tmp_path / gaining, slow_rank)
        first_gained = flagged[1].window  # the first of the unbroken run of windows the gaining shard judged
        while first_gained - 1 in gained:
            first_gained -= 1
        rows.append({"move": f"{losing}->{gaining}", "hosts file to ring switch s": round(switched - changed, 1),
                     "last window judged by the loser": last_judged, "first window judged by the gainer": first_gained,
                     "re-flag window": flagged[1].window,
                     "windows without a verdict": flagged[1].window - last_judged - 1,
                     "ring switch to departure s": round(departed[0] - switched, 1),
                     "ring switch to re-flag s": round(flagged[0] - switched, 1)})
    print(f"\nresharding 2->3->2 shards, {COHORTS} cohorts x {RANKS_PER_COHORT} ranks, slow rank {slow_rank} "
          f"({slow_cohort}), windows of {WINDOW_STEPS} steps = {WINDOW_STEPS * STEP_PERIOD_S:.1f}s, "
          f"job ran {wall_s:.1f}s")
    print(f"cohorts moved by each change: {len(moving)} of {COHORTS} ({', '.join(moving)}); "
          f"cohorts judged by each shard: {cohorts_held}")
    for row in rows:
        print("  " + ", ".join(f"{key}: {value}" for key, value in row.items()))
    print(f"false verdicts: {len(false_verdicts)} {false_verdicts}")
    print(f"spans sent {job.sent}, accepted by the shards {accepted} = {sum(accepted.values())}, lost {lost}; "
          f"gateway: refused {refused:.0f}, send_failed {failed:.0f}, "
          f"sent {exporter_spans('otelcol_exporter_sent_spans'):.0f}")

    # the ring as predicted: each shard judged exactly the cohorts the two rings gave it
    assert cohorts_held == predicted, (cohorts_held, predicted)
    assert not false_verdicts
    assert alerts == {"A": {(slow_cohort, slow_rank)}, "B": set(), "C": set()}, alerts  # one shard holds the alert
    assert lost == 0 and refused == 0 and failed == 0
    # the gaining shard flags after its warmup (an alert carried over would not be flagged again at all)
    assert all(row["re-flag window"] - row["first window judged by the gainer"] >= WARMUP_WINDOWS for row in rows), rows
    # the gaining shard's warmup and persistence, plus the window the move cut in two
    assert all(row["windows without a verdict"] <= WARMUP_WINDOWS + PERSIST_WINDOWS + 1 for row in rows), rows
