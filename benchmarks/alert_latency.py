"""How long a page takes: from a slow rank's evidence to TrainingStragglerDetected firing in
Prometheus, and from a hang to TrainingJobHung, through the real pipeline, each part its own process.

    python benchmarks/alert_latency.py [--quick] [--configs baseline,shipped]

    ranks (light Python processes, the project's instrumentation, OTLP/gRPC)
      -> gateway collector (collector-config/gateway.yaml)
      -> `otel-straggler detect` (its evidence dir: verdicts.jsonl)
      -> its metrics over OTLP back to the gateway -> the gateway's prometheus exporter
      -> Prometheus (collector-config/prometheus/prometheus.yml and rules.yml, own target files)

Ranks. 4 straggler jobs and 4 hang jobs at once, each 4 rank processes that time `forward-compute` and `backward-compute` (10 ms
sleeps) and then wait for each other at a barrier inside `all-reduce` (a collective stage), as
DDP's ranks do; 5-step windows (--window-steps 5) of about 25 ms steps. Straggler jobs slow one
(rank, stage) at a time by +15 ms until its alert fires, then let it recover and move on to the
next pair, so every alert is a series of its own (no alert has to resolve in Prometheus first).
Hang jobs block one (rank, stage) at a time until TrainingJobHung fires (the other ranks wait in
the all-reduce: `never_entered_collective`), then let it go; --hang-timeout-s 10. The rank side
exports as the demo does: spans every 0.5 s (OTEL_BSP_SCHEDULE_DELAY), built every 0.25 s,
heartbeats every second.

Per alert, on the one clock of this machine:
  (a) evidence -> verdict: a straggler's verdict time (`time_unix_nano` in verdicts.jsonl, the
      detector's clock when it judged) less the end of the last span of the window that made it
      (the verdict's `window` w holds steps [5w, 5w+5): the latest end over the ranks of step
      5w+4, whose all-reduce is each rank's last span of the window, taken on the ranks). A hang's:
      the verdict time less the moment the hang was due, the end of the job's last interval
      before it stalled plus --hang-timeout-s (the rule cannot speak earlier).
  (b) verdict -> series: to the scrape timestamp of the first sample of the verdict's series at 1
      (straggler_alert_active, straggler_job_hang) in Prometheus (raw samples, read afterwards).
  (c) series -> firing: to the alert's activeAt (/api/v1/alerts, polled every 0.15 s; both rules
      have no `for:`, so activeAt is the evaluation that fired it).
and the whole chains verdict -> firing (b + c) and evidence -> firing (a + b + c).

Configurations, each a fresh stack, run one after the other in the same run:
  baseline  as shipped before the latency work: metrics exported every 5 s only, scrape and
            evaluation every 5 s
  shipped   the configs of this checkout: the detector exports at once when an alert starts or
            ends (at most once a second more), prometheus.yml as committed
`--export-interval-s`, `--scrape-s`, `--eval-s` and `--no-prompt-export` make a config of one's own.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import re
import statistics
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from otel_straggler.testing import services

STAGES = ("forward-compute", "backward-compute")
COLLECTIVE = "all-reduce"
WORLD = 4
WINDOW_STEPS = 5
STAGE_S = 0.010
EXTRA_S = 0.015  # the slow rank's added time in its slow stage
HANG_TIMEOUT_S = 10.0
POLL_S = 0.15
STRAGGLER_ALERT = "TrainingStragglerDetected"
HANG_ALERT = "TrainingJobHung"
FIRE_TIMEOUT_S = 30.0  # the slowest chain here is under 20 s; a verdict with no page is counted, not awaited
WARM_TIMEOUT_S = 90.0  # spawn, imports and the first windows of 4 ranks on a loaded 2-core machine
PHASE_JITTER_S = 5.0  # a random pause before each pair, so alerts do not keep one phase to the scrape clock


@dataclass(frozen=True)
class Setup:
    name: str
    export_interval_s: float  # --metric-export-interval-s; None: the detector's default
    prompt_export: bool
    scrape_s: Optional[float]  # None: prometheus.yml as committed
    eval_s: Optional[float]

    def describe(self) -> str:
        export = f"export every {self.export_interval_s:g} s" if self.export_interval_s else "export at the default period"
        export += " + at once on an alert change" if self.prompt_export else ", periodic only"
        scrape = f"scrape {self.scrape_s:g} s" if self.scrape_s else "scrape as prometheus.yml"
        evaluation = f"eval {self.eval_s:g} s" if self.eval_s else "eval as prometheus.yml"
        return f"{self.name}: {export}; {scrape}; {evaluation}"


BASELINE = Setup("baseline", 5.0, False, 5.0, 5.0)
SHIPPED = Setup("shipped", None, True, None, None)


# ---------------------------------------------------------------- ranks

def rank_main(job_id: str, rank: int, env: dict, control, barrier, steps_done, stop, log_path: str) -> None:
    """One rank: its own process (multiprocessing spawn). control[2*rank] is the stage index to slow
    (-1 none), control[2*rank+1] the stage index to block in while it stays set (-1 none)."""
    os.environ.update(env)
    import otel_straggler as ots

    ots.configure(job_id=job_id, rank=rank, world_size=WORLD, local_rank=rank)
    with open(log_path, "w", buffering=1) as log:  # per step: "step end_of_last_stage_before_the_barrier_ns end_ns"
        step = 0
        while not stop.is_set():
            ots.step(step)
            for index, name in enumerate(STAGES):
                with ots.stage(name):
                    time.sleep(STAGE_S + (EXTRA_S if control[2 * rank] == index else 0.0))
                    while control[2 * rank + 1] == index and not stop.is_set():
                        time.sleep(0.02)
            before_barrier_ns = time.time_ns()
            with ots.stage(COLLECTIVE):
                try:
                    barrier.wait(timeout=600)
                except threading.BrokenBarrierError:
                    break
            log.write(f"{step} {before_barrier_ns} {time.time_ns()}\n")
            steps_done[rank] = step
            step += 1
    ots.current().shutdown(2.0) if ots.current() else None


class Job:
    def __init__(self, context, workdir: Path, job_id: str, endpoint: str, kind: str) -> None:
        self.job_id, self.kind = job_id, kind
        self.control = context.Array("i", [-1] * (2 * WORLD), lock=False)
        self.steps_done = context.Array("q", [-1] * WORLD, lock=False)
        self.stop = context.Event()
        self.barrier = context.Barrier(WORLD)
        self.log_paths = [workdir / f"{job_id}-rank{rank}.steps" for rank in range(WORLD)]
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{endpoint}", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_SERVICE_NAME": "training", "OTEL_BSP_SCHEDULE_DELAY": "500",
            "OTEL_STRAGGLER_BUILD_INTERVAL_MS": "250", "OTEL_STRAGGLER_HEARTBEAT_INTERVAL_MS": "1000",
            "OTEL_STRAGGLER_EXPORT_METRICS": "false", "OTEL_STRAGGLER_DEVICE_TIMING": "off",
        }
        self.processes = [context.Process(target=rank_main, daemon=True, name=f"{job_id}-rank{rank}", args=(
            job_id, rank, env, self.control, self.barrier, self.steps_done, self.stop, str(self.log_paths[rank])))
            for rank in range(WORLD)]

    def start(self) -> None:
        for process in self.processes:
            process.start()

    def step(self) -> int:
        return min(self.steps_done[:])

    def wait_for_step(self, step: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.step() < step:
            if time.monotonic() > deadline or any(not p.is_alive() for p in self.processes):
                return False
            time.sleep(0.05)
        return True

    def finish(self) -> None:
        self.stop.set()
        for rank in range(WORLD):
            self.control[2 * rank + 1] = -1
        self.barrier.abort()
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)

    def step_times(self) -> dict[int, list[tuple[int, int]]]:
        """rank -> [(before the barrier ns, step end ns)] indexed by step."""
        times = {}
        for rank, path in enumerate(self.log_paths):
            rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
            times[rank] = {int(step): (int(before), int(end)) for step, before, end in rows}
        return times


# ---------------------------------------------------------------- watching

def labels_key(labels: dict, kind: str) -> tuple:
    rank = int(labels.get("training_rank", "-1"))
    return (kind, labels.get("training_job_id"), rank, labels.get("training_stage"))


class Watcher:
    """Tails verdicts.jsonl and polls Prometheus: first sightings, on this machine's clock."""

    def __init__(self, evidence_dir: Path, prometheus_url: str) -> None:
        self.verdicts_path = evidence_dir / "verdicts.jsonl"
        self.url = prometheus_url
        self.verdicts: list[dict] = []
        self.firing: dict[tuple, dict[float, float]] = {}  # key -> {activeAt: first poll seeing it firing}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._offset = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._read_verdicts()
            self._poll()
            self._stop.wait(POLL_S)

    def _read_verdicts(self) -> None:
        try:
            with open(self.verdicts_path, "rb") as file:
                file.seek(self._offset)
                data = file.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self._offset += end
        new = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        with self.lock:
            self.verdicts.extend(new)

    def _poll(self) -> None:
        status, body = services.http_get(f"{self.url}/api/v1/alerts", timeout=5)
        if status != 200:
            return
        now = time.time()
        for alert in json.loads(body)["data"]["alerts"]:
            name = alert["labels"].get("alertname")
            if alert["state"] != "firing" or name not in (STRAGGLER_ALERT, HANG_ALERT):
                continue
            key = labels_key(alert["labels"], "straggler" if name == STRAGGLER_ALERT else "hang")
            with self.lock:
                self.firing.setdefault(key, {}).setdefault(parse_rfc3339(alert["activeAt"]), now)

    def verdicts_of(self, job_id: str, kind: str, rank: Optional[int] = None) -> list[dict]:
        with self.lock:
            return [v for v in self.verdicts if v["job_id"] == job_id and v["verdict"] == kind
                    and (rank is None or v["rank"] == rank)]

    def fired(self, key: tuple, after_s: float) -> Optional[float]:
        """activeAt of the series' first firing at or after `after_s` (unix s), None if none yet."""
        with self.lock:
            return min((at for at in self.firing.get(key, {}) if at >= after_s), default=None)

    def first_sample_at_one(self, key: tuple, after_s: float) -> Optional[float]:
        """Scrape timestamp of the first raw sample == 1 of the series at or after `after_s`."""
        kind, job_id, rank, stage = key
        metric = "straggler_alert_active" if kind == "straggler" else "straggler_job_hang"
        selector = f'{metric}{{training_job_id="{job_id}",training_rank="{rank}",training_stage="{stage}"}}[15m]'
        status, body = services.http_get(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': selector})}",
                                         timeout=10)
        if status != 200:
            return None
        stamps = [float(t) for row in json.loads(body)["data"]["result"] for t, value in row["values"]
                  if float(value) == 1 and float(t) >= after_s - 0.001]
        return min(stamps, default=None)


def parse_rfc3339(text: str) -> float:
    """Prometheus's activeAt (nanosecond digits, Z or an offset) as unix seconds."""
    found = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$", text)
    from datetime import datetime, timezone
    base = datetime.strptime(found.group(1), "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
    fraction = float("0" + found.group(2)) if found.group(2) else 0.0
    zone = found.group(3)
    offset = 0 if zone == "Z" else (int(zone[1:3]) * 3600 + int(zone[4:6]) * 60) * (1 if zone[0] == "+" else -1)
    return base + fraction - offset


# ---------------------------------------------------------------- drivers

@dataclass
class Alert:
    kind: str
    key: tuple
    verdict: dict
    evidence_ns: Optional[int] = None  # span end (straggler) or hang due time (hang), unix ns
    series_s: Optional[float] = None
    fired_s: Optional[float] = None  # activeAt


def warm(job: Job, notes: list) -> bool:
    """The job past its detector warmup; a job that never gets there is noted, not awaited."""
    if job.wait_for_step(4 * WINDOW_STEPS, WARM_TIMEOUT_S):
        return True
    notes.append(f"{job.job_id}: not at step {4 * WINDOW_STEPS} within {WARM_TIMEOUT_S:.0f} s (at step {job.step()})")
    return False


def drive_stragglers(job: Job, watcher: Watcher, alerts: list, notes: list, pairs: list, budget_s: float) -> None:
    if not warm(job, notes):
        return
    # the budget counts from the warm job, so a slow start (8 processes importing on 2 cores) costs
    # no pair; the first pair always runs
    deadline = time.monotonic() + budget_s
    alerted: set = set()
    jitter = random.Random(job.job_id)
    for index, (rank, stage_index) in enumerate(pairs):
        time.sleep(jitter.uniform(0, PHASE_JITTER_S))
        if index and time.monotonic() > deadline:
            notes.append(f"{job.job_id}: budget spent after {index} of {len(pairs)} pairs")
            return
        known = {id(v) for v in watcher.verdicts_of(job.job_id, "straggler", rank)}
        job.control[2 * rank] = stage_index
        onset_deadline = time.monotonic() + FIRE_TIMEOUT_S
        onsets: dict[tuple, dict] = {}
        while time.monotonic() < onset_deadline:
            # one alert per series: a pair's first verdict (intermittent, say) opens it, a later
            # one of the same stage (slow_vs_peers) only restates it; another stage ("*") is its own
            # (a series alerted in an earlier pair, the whole step's, is left out: its alert may not
            # have resolved in Prometheus in between)
            for verdict in watcher.verdicts_of(job.job_id, "straggler", rank):
                key = ("straggler", job.job_id, rank, verdict["stage"])
                if id(verdict) not in known and key not in alerted:
                    onsets.setdefault(key, verdict)
            if onsets and all(watcher.fired(key, v["time_unix_nano"] / 1e9) for key, v in onsets.items()):
                break
            time.sleep(0.1)
        if not onsets:
            notes.append(f"{job.job_id}: rank {rank} {STAGES[stage_index]} slow, no straggler verdict within "
                         f"{FIRE_TIMEOUT_S:.0f} s")
        for key, verdict in onsets.items():
            alerts.append(Alert("straggler", key, verdict))
        alerted.update(onsets)
        job.control[2 * rank] = -1
        # recovered, and a window of normal steps, before the next pair
        recover_deadline = time.monotonic() + 30
        done = {id(v) for v in watcher.verdicts_of(job.job_id, "recovered", rank)}
        while time.monotonic() < recover_deadline and not [
                v for v in watcher.verdicts_of(job.job_id, "recovered", rank) if id(v) not in done]:
            time.sleep(0.1)
        job.wait_for_step(job.step() + 2 * WINDOW_STEPS, 20)


def drive_hangs(job: Job, watcher: Watcher, alerts: list, notes: list, pairs: list, budget_s: float) -> None:
    if not warm(job, notes):
        return
    deadline = time.monotonic() + budget_s
    jitter = random.Random(job.job_id)
    for index, (rank, stage_index) in enumerate(pairs):
        time.sleep(jitter.uniform(0, PHASE_JITTER_S))
        if index and time.monotonic() + HANG_TIMEOUT_S + 10 > deadline:
            notes.append(f"{job.job_id}: budget spent after {index} of {len(pairs)} pairs")
            return
        known = {id(v) for v in watcher.verdicts_of(job.job_id, "hang")}
        job.control[2 * rank + 1] = stage_index
        hang_deadline = time.monotonic() + HANG_TIMEOUT_S + 5 + FIRE_TIMEOUT_S
        found = []
        while time.monotonic() < hang_deadline and not found:
            # a job-level `all_ranks_waiting` verdict (rank null) is held back by the rule while a
            # culprit of the job is named: not a page, so not awaited
            found = [v for v in watcher.verdicts_of(job.job_id, "hang") if id(v) not in known and v["rank"] is not None]
            time.sleep(0.1)
        keys = [("hang", job.job_id, -1 if v["rank"] is None else v["rank"], v["stage"]) for v in found]
        while keys and time.monotonic() < hang_deadline and not all(
                watcher.fired(k, v["time_unix_nano"] / 1e9) for k, v in zip(keys, found)):
            time.sleep(0.1)
        stalled_at = job.step()
        if not found:
            notes.append(f"{job.job_id}: rank {rank} blocked in {STAGES[stage_index]} at step {stalled_at + 1}, no "
                         f"hang verdict naming a rank within {HANG_TIMEOUT_S + 5 + FIRE_TIMEOUT_S:.0f} s")
        for verdict, key in zip(found, keys):
            alerts.append(Alert("hang", key, dict(verdict, blocked_step=stalled_at + 1, blocked_rank=rank)))
        job.control[2 * rank + 1] = -1
        job.wait_for_step(stalled_at + 3 * WINDOW_STEPS, 30)


def evidence_times(alerts: list, jobs: dict) -> None:
    times = {job_id: job.step_times() for job_id, job in jobs.items()}
    for alert in alerts:
        steps = times[alert.key[1]]
        if alert.kind == "straggler":
            last_step = (alert.verdict["window"] + 1) * WINDOW_STEPS - 1
            ends = [per_rank[last_step][1] for per_rank in steps.values() if last_step in per_rank]
            alert.evidence_ns = max(ends) if len(ends) == WORLD else None
        else:
            # the stalled step: every rank but the blocked one reached its all-reduce; the job's last
            # interval to end is the latest stage end before a barrier at that step
            step, blocked = alert.verdict["blocked_step"], alert.verdict["blocked_rank"]
            ends = [per_rank[step][0] for rank, per_rank in steps.items() if rank != blocked and step in per_rank]
            if ends:
                alert.evidence_ns = max(ends) + int(HANG_TIMEOUT_S * 1e9)


# ---------------------------------------------------------------- one configuration

def prometheus_with(setup: Setup, workdir: Path) -> services.Prometheus:
    prometheus = services.Prometheus(workdir)
    config = prometheus.config_dir / "prometheus.yml"
    text = config.read_text()
    if setup.scrape_s:
        text = re.sub(r"(?m)^(\s*scrape_interval:) \S+", rf"\1 {setup.scrape_s:g}s", text, count=1)
    if setup.eval_s:
        text = re.sub(r"(?m)^(\s*evaluation_interval:) \S+", rf"\1 {setup.eval_s:g}s", text, count=1)
    config.write_text(text)
    return prometheus


class DetectorProcess(services.Detector):
    """`otel-straggler detect`, or the same with the extra exports on alert changes turned off."""

    def __init__(self, *args, prompt_export: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompt_export = prompt_export

    def argv(self) -> list[str]:
        argv = super().argv()
        return argv if self.prompt_export else argv + ["--prompt-export-spacing-s=0"]


def run_setup(setup: Setup, workdir: Path, straggler_jobs: int, hang_jobs: int, pairs_per_job: int,
              budget_s: float, notes: list) -> list[Alert]:
    """The alerts of one configuration's jobs; `notes` gets a line for each pair that gave no alert."""
    workdir.mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("spawn")
    detector_grpc, detector_http = services.free_port(), services.free_port()
    gateway = services.Collector([services.CONFIG_DIR / "gateway.yaml"], workdir, {
        "DETECTOR_ENDPOINTS": f"[{services.LOOPBACK}:{detector_grpc}]", "JAEGER_SAMPLING_PERCENTAGE": "0"},
        name="gateway")
    prometheus = prometheus_with(setup, workdir)
    prometheus.set_targets([gateway.metrics_address], [gateway.telemetry_address])
    args = [f"--window-steps={WINDOW_STEPS}", f"--hang-timeout-s={HANG_TIMEOUT_S:g}", "--console-status-interval-s=0"]
    if setup.export_interval_s:
        args.append(f"--metric-export-interval-s={setup.export_interval_s:g}")
    detector = DetectorProcess(workdir, detector_grpc, detector_http, otlp_endpoint=gateway.grpc_endpoint,
                               args=tuple(args), prompt_export=setup.prompt_export)
    jobs: dict[str, Job] = {}
    alerts: list[Alert] = []
    started = []
    try:
        for process in (prometheus, gateway, detector):
            process.start()
            started.append(process)
        watcher = Watcher(detector.evidence_dir, prometheus.url)
        watcher.start()
        tag = os.urandom(3).hex()
        combos = [(rank, stage) for stage in range(len(STAGES)) for rank in range(WORLD)]
        drivers = []
        for index in range(straggler_jobs + hang_jobs):
            kind = "straggler" if index < straggler_jobs else "hang"
            job = Job(context, workdir, f"{setup.name}-{kind}{index}-{tag}", gateway.grpc_endpoint, kind)
            jobs[job.job_id] = job
            job.start()
            rotated = combos[index % len(combos):] + combos[:index % len(combos)]
            target = drive_stragglers if kind == "straggler" else drive_hangs
            drivers.append(threading.Thread(target=target, daemon=True, args=(
                job, watcher, alerts, notes, rotated[:pairs_per_job], budget_s)))
        for driver in drivers:
            driver.start()
        for driver in drivers:
            driver.join(WARM_TIMEOUT_S + budget_s + HANG_TIMEOUT_S + FIRE_TIMEOUT_S + 60)
        time.sleep(1.0)
        watcher.stop()
        for job in jobs.values():
            job.finish()
        evidence_times(alerts, jobs)
        for alert in alerts:
            verdict_s = alert.verdict["time_unix_nano"] / 1e9
            alert.series_s = watcher.first_sample_at_one(alert.key, verdict_s)
            alert.fired_s = watcher.fired(alert.key, verdict_s)
    finally:
        for job in jobs.values():
            job.finish()
        for process in reversed(started):
            process.stop()
    return alerts


# ---------------------------------------------------------------- table

def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def hops(alert: Alert) -> dict[str, Optional[float]]:
    verdict_s = alert.verdict["time_unix_nano"] / 1e9
    evidence_s = alert.evidence_ns / 1e9 if alert.evidence_ns else None
    fired_s = alert.fired_s
    row = {"a": verdict_s - evidence_s if evidence_s is not None else None,
           "b": alert.series_s - verdict_s if alert.series_s is not None else None,
           "c": fired_s - alert.series_s if fired_s is not None and alert.series_s is not None else None,
           "verdict->firing": fired_s - verdict_s if fired_s is not None else None,
           "evidence->firing": fired_s - evidence_s if fired_s is not None and evidence_s is not None else None}
    return row


HOP_NAMES = ("a", "b", "c", "verdict->firing", "evidence->firing")
HOP_TITLES = {"a": "(a) evidence->verdict", "b": "(b) verdict->series", "c": "(c) series->firing",
              "verdict->firing": "verdict->firing", "evidence->firing": "evidence->firing"}


def summarize(alerts: list[Alert], notes: list[str]) -> dict:
    """kind -> {"n", "missed", hop -> (p50, p99, max, n, min), "notes": the pairs that gave no alert}."""
    summary = {}
    for kind in ("straggler", "hang"):
        rows = [hops(alert) for alert in alerts if alert.kind == kind]
        entry: dict = {"n": len(rows), "missed": sum(1 for row in rows if row["verdict->firing"] is None),
                       "notes": [note for note in notes if f"-{kind}" in note.split(":")[0]]}
        for name in HOP_NAMES:
            values = [row[name] for row in rows if row[name] is not None]
            entry[name] = (statistics.median(values), percentile(values, 0.99), max(values), len(values),
                           min(values)) if values else None
        summary[kind] = entry
    return summary


def print_table(results: dict[str, dict], setups: dict[str, Setup]) -> None:
    for name, setup in setups.items():
        print(setup.describe())
    print()
    header = f"{'config':<9} {'alert':<9} {'N':>3} {'hop':<22} {'p50 s':>7} {'p99 s':>7} {'max s':>7}"
    print(header)
    print("-" * len(header))
    for name, summary in results.items():
        for kind, entry in summary.items():
            for hop in HOP_NAMES:
                figures = entry[hop]
                n = entry["n"]
                if figures is None:
                    print(f"{name:<9} {kind:<9} {n:>3} {HOP_TITLES[hop]:<22} {'-':>7} {'-':>7} {'-':>7}")
                    continue
                p50, p99, top, count, _ = figures
                p99_text = f"{p99:7.2f}" if count >= 20 else f"{'(max)':>7}"
                print(f"{name:<9} {kind:<9} {count:>3} {HOP_TITLES[hop]:<22} {p50:7.2f} {p99_text} {top:7.2f}")
            if entry["missed"]:
                print(f"{name:<9} {kind:<9}     {entry['missed']} verdict(s) whose alert did not fire within {FIRE_TIMEOUT_S:.0f} s")
            for note in entry.get("notes", ()):
                print(f"{name:<9} {kind:<9}     {note}")
    print("\np99 is printed only from 20 alerts up; below that read the max.")


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the shipped config only, a few alerts (about a minute)")
    parser.add_argument("--configs", default="baseline,shipped", help="comma-separated: baseline, shipped, custom")
    parser.add_argument("--straggler-jobs", type=int, default=4)
    parser.add_argument("--hang-jobs", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=8, help="(rank, stage) pairs each job goes through (at most 8)")
    parser.add_argument("--budget-s", type=float, default=120.0,
                        help="time each job may take for its pairs, from its warmup (its first pair always runs)")
    parser.add_argument("--export-interval-s", type=float, help="custom: --metric-export-interval-s")
    parser.add_argument("--no-prompt-export", action="store_true", help="custom: no export on alert changes")
    parser.add_argument("--scrape-s", type=float, help="custom: scrape_interval")
    parser.add_argument("--eval-s", type=float, help="custom: evaluation_interval")
    parser.add_argument("--workdir", type=Path, help="keep logs and evidence here (default: a scratch folder)")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)
    missing = services.binaries().missing()
    if missing:
        raise SystemExit("missing programs, run scripts/services.sh build: " + ", ".join(missing))
    custom = Setup("custom", args.export_interval_s, not args.no_prompt_export, args.scrape_s, args.eval_s)
    available = {"baseline": BASELINE, "shipped": SHIPPED, "custom": custom}
    names = ["shipped"] if args.quick else [name.strip() for name in args.configs.split(",") if name.strip()]
    setups = {name: available[name] for name in names}
    if args.quick:
        args.straggler_jobs, args.hang_jobs, args.pairs, args.budget_s = 1, 1, 2, 40.0
    results, details = {}, {}
    with tempfile.TemporaryDirectory(prefix="alert-latency-") as scratch:
        root = args.workdir or Path(scratch)
        for name, setup in setups.items():
            notes: list[str] = []
            alerts = run_setup(setup, root / name, args.straggler_jobs, args.hang_jobs, min(8, args.pairs),
                               args.budget_s, notes)
            results[name] = summarize(alerts, notes)
            details[name] = [{"kind": a.kind, "job": a.key[1], "rank": a.key[2], "stage": a.key[3],
                              "reason": a.verdict["reason"], "window": a.verdict["window"], **hops(a)} for a in alerts]
    print_table(results, setups)
    if args.json:
        args.json.write_text(json.dumps({"summary": results, "alerts": details}, indent=1))
    return results


if __name__ == "__main__":
    main()
