"""End to end with the real programs: training ranks → collector → Jaeger and detector(s);
detector → collector → Prometheus (docs/pipeline.md, "End-to-end tests").

1. `otel-straggler demo` (4 gloo ranks, one slowed) through the gateway: every step's trace in
   Jaeger with every rank's spans and the contract attributes; `straggler_alert_active` is 1 for
   the slow rank only; every Grafana panel's query returns data.
2. Two detector shards behind `load_balancing`: each cohort on exactly one shard; the shards'
   verdicts together are a single detector's verdicts over the same spans (`otel-straggler replay`).
3. The gateway goes down mid-run and comes back: training completes, every lost span is counted by
   the ranks, and detection goes on afterwards.
4. TLS and a bearer token between gateway and detector: a wrong token is refused, the right one
   accepted.

The workload is small CPU training, 4 or 6 ranks sharing two cores with whatever else runs on
the machine. There a healthy rank's stage can run 1.5-1.9x its peers' median for several windows
in a row, and a 6 ms stage can take 16 ms while the rank's exporter thread holds the GIL (seen
right after the gateway restart). So the injected slowdown is large (+300% of forward-compute,
about 4x: +100-250 ms) and the detectors call a rank slow only beyond 2x its peers and 20 ms
(--rel-threshold 1.0 --min-gap-ms 20), and a step slow only beyond 2x its step's median
(--intermittent-threshold 1.0: at the default 25%, a healthy rank of a 3-rank cohort had 8-9 slow
backward steps of 15 against its peers' 0-1 in 2 of 5 shard runs, and was `intermittent`); the
persistence rules keep their defaults. These tests prove the plumbing; the detector's
sensitivity has its own tests and benchmarks.

Every wait has a deadline; every process is stopped when its test ends, passed or not.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Optional

import pytest

from otel_straggler.demo.straggler import slow_rank_args

from otel_straggler.testing import services
from .training import TrainingRanks, clean_environment

pytestmark = [pytest.mark.services, pytest.mark.slow]

WINDOW_STEPS = 5
SLOW_STAGE = "forward-compute"
SLOWDOWN = 3.0
DETECTOR_ARGS = (f"--window-steps={WINDOW_STEPS}", "--rel-threshold=1.0", "--min-gap-ms=20",
                 "--intermittent-threshold=1.0", "--metric-export-interval-s=1", "--flush-interval-s=0.2")
RUN_TIMEOUT_S = 240
DEADLINE_S = 60

DEMO_SERVICE = "training"  # the ranks' service.name: OTEL_SERVICE_NAME's default (CONTRACT §1)
DEMO_STAGES = {"batch-generator": ("data", False), "forward-compute": ("forward", False),
               "backward-compute": ("backward", False), "all-grads-sync": ("communication", True),
               "optimizer": ("optimizer", False)}
DEMO_SAMPLES = 256  # the trainer's batch size: training.workload.samples of every span


# ---- reading what the programs wrote ------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def verdicts_of(evidence_dir: Path, job_id: str) -> list[dict]:
    return [v for v in read_jsonl(evidence_dir / "verdicts.jsonl") if v["job_id"] == job_id]


def detector_status(detector: services.Detector) -> dict:
    path = detector.evidence_dir / "status.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def tag_map(tags: list[dict]) -> dict:
    return {tag["key"]: tag["value"] for tag in tags}


# ---- 1. demo → gateway → Jaeger + detector → Prometheus → dashboards -----------------------------

def run_demo(out_dir: Path, collector_grpc: str, log_path: Path, *flags: str) -> subprocess.Popen:
    env = clean_environment()
    env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{collector_grpc}",
                # pure data parallelism: every rank plays the same role
                "OTEL_STRAGGLER_COHORT": "tp0.pp0",
                "OTEL_METRIC_EXPORT_INTERVAL": "2000"})
    with open(log_path, "wb") as log:
        # Its own process group, which the ranks it starts join.
        return subprocess.Popen([sys.executable, "-m", "otel_straggler.cli", "demo", "--out", str(out_dir), *flags],
                                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=services._die_with_parent)


def stop_demo(process: subprocess.Popen) -> None:
    """Ctrl-C is how the demo is stopped (it then stops its ranks); whatever is left of its
    process group after that is killed."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait(5)


def alerting_ranks(prometheus_url: str, job_id: str) -> tuple[set[str], list[dict]]:
    series = services.prometheus_query(prometheus_url, f'straggler_alert_active{{training_job_id="{job_id}"}}')
    return {s["metric"]["training_rank"] for s in series if float(s["value"][1]) == 1}, series


def firing_straggler_page(prometheus_url: str, job_id: str, rank: str) -> Optional[dict]:
    """The annotations of the firing TrainingStragglerDetected of the rank, once one is firing."""
    status, body = services.http_get(f"{prometheus_url}/api/v1/alerts", timeout=5)
    if status != 200:
        return None
    for alert in json.loads(body)["data"]["alerts"]:
        labels = alert["labels"]
        if (labels.get("alertname"), labels.get("training_job_id"), labels.get("training_rank"), alert["state"]) == (
                "TrainingStragglerDetected", job_id, rank, "firing"):
            return alert["annotations"]
    return None


def step_and_stage_spans(trace: dict) -> list[dict]:
    """A Jaeger trace's spans but the heartbeats (CONTRACT §2b), whose number depends on the run's length."""
    return [span for span in trace["spans"] if span["operationName"] != "train.heartbeat"]


def check_step_trace(trace: dict, job_id: str, ranks: int) -> int:
    """One step's trace: every rank's train.step with its stage spans under it, contract
    attributes on each (the heartbeats the trace holds too are not looked at). Returns the step."""
    processes = {pid: (process["serviceName"], tag_map(process["tags"])) for pid, process in trace["processes"].items()}
    by_rank: dict[int, list[dict]] = defaultdict(list)
    for span in step_and_stage_spans(trace):
        service, resource = processes[span["processID"]]
        assert service == DEMO_SERVICE
        assert resource["training.job.id"] == job_id
        assert resource["training.world_size"] == ranks
        assert resource["training.cohort"] == "tp0.pp0"
        assert resource["training.topology.epoch"] == 0
        assert resource["training.local_rank"] == resource["training.rank"]
        assert resource["host.name"]
        by_rank[resource["training.rank"]].append(span)
    assert sorted(by_rank) == list(range(ranks)), f"ranks in trace {trace['traceID']}: {sorted(by_rank)}"

    steps = set()
    for rank, spans in by_rank.items():
        step_spans = [s for s in spans if s["operationName"] == "train.step"]
        assert len(step_spans) == 1, f"rank {rank}: {len(step_spans)} train.step spans in one trace"
        step_span = step_spans[0]
        steps.add(tag_map(step_span["tags"])["training.step"])
        stages = [s for s in spans if s is not step_span]
        assert sorted(s["operationName"] for s in stages) == sorted(DEMO_STAGES), f"rank {rank}"
        for span in stages:
            tags = tag_map(span["tags"])
            group, collective = DEMO_STAGES[span["operationName"]]
            assert tags["training.stage"] == span["operationName"]
            assert tags["training.stage.group"] == group
            assert tags["training.stage.collective"] is collective
            assert tags["training.step"] in steps
            assert isinstance(tags["training.seq"], int)
            assert tags["training.stage.timing"] == "host_only" and tags["training.stage.timing_reason"] == "no_cuda"
            assert "training.stage.device_duration_ms" not in tags
            assert tags["training.workload.samples"] == DEMO_SAMPLES
            parents = [ref["spanID"] for ref in span["references"] if ref["refType"] == "CHILD_OF"]
            assert parents == [step_span["spanID"]], f"{span['operationName']} of rank {rank} not under its train.step"
    assert len(steps) == 1, f"one step per trace, got {steps}"
    return steps.pop()


def dashboard_variables(prometheus_url: str, dashboard: dict, wanted: dict[str, str]) -> dict[str, str]:
    """Values for the dashboard's variables, chosen the way a user would in Grafana.

    Each query variable, label_values(SELECTOR, LABEL), is asked of Prometheus as Grafana asks
    (/api/v1/label/LABEL/values?match[]=SELECTOR, earlier choices filled in); `wanted` names the
    option to pick, which must be offered; a multi-value variable not in `wanted` takes "All"."""
    chosen: dict[str, str] = {}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        name = variable["name"]
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"])
        assert match, f"variable {name}: unexpected query {variable['definition']!r}"
        selector, label = match.groups()
        query = urllib.parse.urlencode({"match[]": expand(selector, chosen)})
        status, body = services.http_get(f"{prometheus_url}/api/v1/label/{label}/values?{query}", timeout=5)
        assert status == 200, f"variable {name}: {status} {body[:200]!r}"
        offered = json.loads(body)["data"]
        if name in wanted:
            assert wanted[name] in offered, f"variable {name} offers {offered}, not {wanted[name]!r}"
            chosen[name] = wanted[name]
        else:
            assert variable["includeAll"] and offered, f"variable {name}: nothing to choose from {offered}"
            chosen[name] = variable["allValue"]
    return chosen


def expand(expr: str, values: dict[str, str]) -> str:
    for name, value in sorted(values.items(), key=lambda item: -len(item[0])):
        expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
    assert "$" not in expr, f"a variable left in {expr!r}"
    return expr


@pytest.fixture
def stack(pipeline_binaries, tmp_path):
    """A stack of this test's own (Jaeger, Prometheus, gateway), not the shared `pipeline` one:
    once a detector on the shared gateway's shard port stops, the gateway's gRPC channel to that
    port backs off its reconnects (up to 2 minutes), which would hold up the next test there."""
    with services.Stack(tmp_path / "stack") as started:
        yield started.endpoints


def test_demo_through_the_gateway_to_jaeger_prometheus_and_dashboards(stack, tmp_path):
    pipeline = stack
    slow_rank, from_step, steps, ranks = 2, 10, 50, 4
    detector = services.Detector(tmp_path, pipeline.detector_grpc_port, pipeline.detector_http_port,
                                 otlp_endpoint=pipeline.collector_grpc, args=DETECTOR_ARGS)
    out_dir = tmp_path / "demo"
    started = time.monotonic()
    with detector:
        demo = run_demo(out_dir, pipeline.collector_grpc, tmp_path / "demo.log",
                        "--ranks", str(ranks), "--steps", str(steps), "--window-steps", str(WINDOW_STEPS),
                        "--slow-rank", str(slow_rank), "--stage", SLOW_STAGE, "--slowdown", str(SLOWDOWN),
                        "--from-step", str(from_step), "--simulate-gpu")
        try:
            run_file = out_dir / "evidence" / "demo.json"
            job_id = services.wait_until(lambda: run_file.exists() and json.loads(run_file.read_text())["job_id"],
                                         DEADLINE_S, what="the demo's demo.json")
            # While the job trains: the alert reaches Prometheus, for the slow rank only.
            alert_seen: Optional[float] = None
            seen: set[str] = set()
            deadline = time.monotonic() + RUN_TIMEOUT_S
            finished_at: Optional[float] = None
            while time.monotonic() < deadline:
                active, _ = alerting_ranks(pipeline.prometheus_url, job_id)
                seen |= active
                if active == {str(slow_rank)}:
                    alert_seen = alert_seen or time.time()
                if demo.poll() is not None:
                    finished_at = finished_at or time.monotonic()
                    if alert_seen or demo.returncode != 0 or time.monotonic() - finished_at > DEADLINE_S:
                        break
                time.sleep(1)
            code = demo.wait(max(1.0, deadline - time.monotonic()))
        finally:
            stop_demo(demo)
        log = (tmp_path / "demo.log").read_text(errors="replace")
        assert code == 0, log[-3000:]
        record = json.loads(run_file.read_text())
        verdicts = verdicts_of(detector.evidence_dir, job_id)
        stragglers = [v for v in verdicts if v["verdict"] == "straggler"]
        assert alert_seen is not None, (
            f"straggler_alert_active never 1 for exactly rank {slow_rank} (ranks seen alerting: {sorted(seen)}); "
            f"straggler verdicts: {stragglers}\n{log[-2000:]}")
        assert [v for v in stragglers if v["rank"] != slow_rank] == [], f"a healthy rank was flagged: {stragglers}"
        first = min((v for v in stragglers if v["stage"] == SLOW_STAGE), key=lambda v: v["window"])
        assert first["window"] >= from_step // WINDOW_STEPS
        # The slowed rank's simulated GPU read thermally throttled (the demo's --simulate-gpu): its
        # verdict carries the clocks and reasons, and the page Prometheus fires says them and what to do.
        assert (first["gpu"]["sm_clock_mhz"], first["gpu"]["peer_sm_clock_mhz"]) == (1410, 1980), first["gpu"]
        assert "hw_thermal" in first["gpu"]["clock_event_reasons"]
        def page_with_evidence() -> Optional[dict]:  # annotations are expanded again at each evaluation
            page = firing_straggler_page(pipeline.prometheus_url, job_id, str(slow_rank))
            return page if page and "SM clock" in page.get("summary", "") else None

        try:
            page = services.wait_until(page_with_evidence, DEADLINE_S, interval=1,
                                       what="TrainingStragglerDetected firing with the GPU evidence")
        except TimeoutError:
            pytest.fail(f"the page: {firing_straggler_page(pipeline.prometheus_url, job_id, str(slow_rank))}")
        assert "SM clock 1410 MHz vs 1980 at its peers; hw_thermal throttling" in page["summary"], page
        assert "runs at reduced clocks: check cooling" in page["next_step"], page
        injected_at = record["step_end_unix_nano"][from_step - 1] / 1e9
        print(f"\ndemo: {steps} steps in {time.monotonic() - started:.0f} s; rank {slow_rank} {SLOW_STAGE} "
              f"x{first['slowdown']:.2f} flagged at window {first['window']} "
              f"({first['time_unix_nano'] / 1e9 - injected_at:.1f} s after the slowdown began), "
              f"alert in Prometheus {alert_seen - injected_at:.1f} s after it")

        # Jaeger: every step is one trace holding every rank's train.step and stage spans.
        def traces():
            found = services.jaeger_traces(pipeline.jaeger_query_url, DEMO_SERVICE, {"training.job.id": job_id},
                                           limit=steps * 2)
            found = [trace for trace in found if step_and_stage_spans(trace)]  # not heartbeats before the first step
            complete = len(found) == steps and all(len(step_and_stage_spans(t)) == ranks * (1 + len(DEMO_STAGES))
                                                   for t in found)
            return found if complete else None

        try:
            found = services.wait_until(traces, DEADLINE_S, interval=1, what=f"{steps} complete step traces in Jaeger")
        except TimeoutError:
            found = services.jaeger_traces(pipeline.jaeger_query_url, DEMO_SERVICE, {"training.job.id": job_id},
                                           limit=steps * 2)
            status, services_known = services.http_get(f"{pipeline.jaeger_query_url}/api/services")
            pytest.fail(f"Jaeger holds {len(found)} traces of the job under service {DEMO_SERVICE!r}, span counts "
                        f"{sorted(Counter(len(t['spans']) for t in found).items())}; services: {services_known[:300]!r}")
        assert sorted(check_step_trace(trace, job_id, ranks) for trace in found) == list(range(steps))
        seqs = Counter((tag_map(trace["processes"][span["processID"]]["tags"])["training.rank"],
                        tag_map(span["tags"])["training.seq"])
                       for trace in found for span in step_and_stage_spans(trace) if span["operationName"] != "train.step")
        assert max(seqs.values()) == 1, "training.seq is unique per rank"

        # Prometheus: the alert as the detector holds it at the end, and every dashboard panel.
        active, series = alerting_ranks(pipeline.prometheus_url, job_id)
        assert active == {str(slow_rank)}, f"alerting at the end: {sorted(active)}"
        assert {s["metric"]["training_stage"] for s in series if s["metric"]["training_rank"] == str(slow_rank)
                and float(s["value"][1]) == 1} >= {SLOW_STAGE}
        assert {s["metric"]["training_rank"] for s in series} == {str(r) for r in range(ranks)}

        dashboard = json.loads((services.CONFIG_DIR / "grafana" / "dashboards" / "job-overview.json").read_text())
        values = dashboard_variables(pipeline.prometheus_url, dashboard, {"job_id": job_id})
        values["__rate_interval"] = "1m"  # Grafana's: at least 4 scrape intervals (5 s here)
        # A panel that says what its emptiness means (noValue: "No hang") lists incidents this healthy
        # run has none of; test_gateway_smoke seeds one and checks its queries.
        queries = [(panel["title"], expand(target["expr"], values))
                   for panel in dashboard["panels"] if "noValue" not in panel["fieldConfig"]["defaults"]
                   for target in panel.get("targets", [])]
        assert len(queries) >= 10
        empty = []
        for title, query in queries:
            try:
                services.wait_until(lambda: services.prometheus_query(pipeline.prometheus_url, query), 30,
                                    interval=1, what=title)
            except TimeoutError:
                empty.append(f"{title}: {query}")
        assert not empty, "panels without data:\n" + "\n".join(empty)


# ---- 2. two detector shards behind load_balancing = one detector over the same spans ------------

TEE_CONFIG = Path(__file__).resolve().parent / "configs" / "gateway-tee.yaml"
PROMPT_BATCHES_CONFIG = Path(__file__).resolve().parent / "configs" / "gateway-prompt-batches.yaml"
COHORTS = ("tp0.pp0", "tp1.pp0")  # a TP=2 job: even ranks hold one half of each layer, odd the other

# DELIVERY. The shards' verdicts equal one detector's over the same spans only if no span comes
# after its window was judged: such a span is counted `late` and never judged (replay, reading a
# file, has no late spans), and `accepted` then never reaches the number of spans sent. A shard
# judges a window once every rank of the cohort has moved past it, or once every rank it still
# waits for is overdue: that rank's latest new window came longer ago than twice its largest recent
# gap between new windows plus 1 s (docs/detection.md, "When a window closes").
#
# With the defaults on the way, a rank's spans travel in ticks: the instrumentation builds them
# every 1 s, the rank's batch processor sends every 0.5 s (TrainingRanks), the gateway's every 1 s.
# This job's windows (5 steps of 150-400 ms on two cores not otherwise busy) last about one gateway
# tick, so a rank's new windows reach a shard 1 or 2 ticks apart, its learned gap falls to 1 s and
# its patience to 3 s: a rank whose export once misses the gateway's tick (a moment late, as under
# load) right where its window took 2 ticks delivers its next window just as the shard stops
# waiting for it, and which comes first is down to milliseconds. Seen beside a CPU hog, 40 steps in
# 10 s: rank 4's new windows came with the gateway's batches at 1.5 and 2.5 s; the batch at 4.5 s,
# with its peers' step 15, held none of its spans; at 5.5 s the shard judged window 2 (steps 10-14)
# without them, then took that batch, with rank 4's last 2 spans of step 14, as late: `accepted`
# stopped at 598 of 600, while the shard had counted all 726 spans its 3 ranks exported and the
# gateway logged no failed export. (Those batches replayed into the engine a second apart, each
# taken in 10-60 ms after its tick, made the same 2 spans late in 19 of 40 tries.) So here the ranks
# build every 200 ms and send every 100 ms, and the gateway batches for 200 ms: a missed tick costs
# 0.2 s, not 1 s, and a rank's delivery trails its steps by well under the shard's 1 s margin.
PROMPT_RANKS = {"OTEL_STRAGGLER_BUILD_INTERVAL_MS": "200", "OTEL_BSP_SCHEDULE_DELAY": "100"}
# What a span that reached a shard is counted as (status.json `spans`): every span a rank exported
# ends in exactly one. Not `dropped`: the shard refused those (queue full) and the gateway resends them.
ARRIVED_OUTCOMES = ("accepted", "duplicate", "late", "malformed", "ignored", "heartbeats")


def duration_s(text: str) -> float:
    """A collector config duration ("10s", "200ms", "1m") in seconds."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", str(text).strip())
    assert match, f"unexpected duration {text!r}"
    return float(match.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0}[match.group(2)]


def gateway_delivery_bound_s() -> float:
    """How long after a span reached the gateway it may still reach a shard (gateway.yaml): its
    batch's timeout, then the shard's exporter tries until retry_on_failure.max_elapsed_time, each
    try bounded by its timeout. Past that the gateway has dropped it, and logged so."""
    import yaml

    config = yaml.safe_load((services.CONFIG_DIR / "gateway.yaml").read_text(encoding="utf-8"))
    otlp = config["exporters"]["load_balancing/detector"]["protocol"]["otlp"]
    return (duration_s(config["processors"]["batch"]["timeout"]) + duration_s(otlp["timeout"])
            + duration_s(otlp["retry_on_failure"]["max_elapsed_time"]))


def arrived_spans(shard: services.Detector) -> int:
    spans = detector_status(shard).get("spans", {})
    return sum(spans.get(outcome, 0) for outcome in ARRIVED_OUTCOMES)


GATEWAY_SERIES = ("otelcol_receiver_accepted_spans", "otelcol_receiver_refused_spans",
                  "otelcol_processor_memory_limiter_refused_spans", 'otelcol_exporter_sent_spans{exporter="load',
                  'otelcol_exporter_send_failed_spans{exporter="load', "otelcol_exporter_enqueue_failed_spans",
                  "otelcol_loadbalancer_backend_outcome")
GATEWAY_TROUBLE = ("exporting failed", "dropping data", "no more retries", "not retryable", "queue is full")


def delivery_report(statuses: list[dict], gateway: services.Collector, shards: list[services.Detector]) -> str:
    """Where every span is, for a failure message: lost on a rank (its counters), held or dropped
    by the gateway (its metrics and log), or at a shard, by outcome (`late`: after its window was
    judged, see DELIVERY)."""
    lost: Counter = Counter()
    for status in statuses:
        lost.update({reason: count for reason, count in status["lost"].items() if count})
    lines = [f"ranks: {sum(s['exported'] for s in statuses)} spans exported, lost {dict(lost) or 'none'}"]
    telemetry = gateway.telemetry()
    lines.append("gateway: " + (", ".join(f"{name} {value:g}" for name, value in sorted(telemetry.items())
                                          if name.startswith(GATEWAY_SERIES)) or "no telemetry"))
    trouble = [line for line in gateway.log_text().splitlines()
               if "grpc_log" not in line and any(word in line.lower() for word in GATEWAY_TROUBLE)]
    lines.append(f"gateway log: {len(trouble)} lines on failed exports" + "".join(f"\n  {line[:400]}" for line in trouble[-5:]))
    for shard in shards:
        status = detector_status(shard)
        lines.append(f"{shard.name}: spans {status.get('spans')}, requests {status.get('requests')}, "
                     f"errors {status.get('errors')}, queue {status.get('queue')}, windows closed "
                     f"{status.get('engine', {}).get('windows_closed')}")
    return "\n".join(lines)


def split_job_id(shard_ports: list[int], workdir: Path, candidates: int = 16) -> str:
    """A job id whose two cohorts the gateway's hash ring puts on different shards.

    The ring depends only on the shard endpoints, so a throwaway gateway with fake shards on the
    same ports answers for the real one: one probe span per (candidate job, cohort), and see where
    each lands. With two shards a given job splits its two cohorts half of the time."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
    from opentelemetry.proto.common.v1 import common_pb2
    from opentelemetry.proto.resource.v1 import resource_pb2
    from opentelemetry.proto.trace.v1 import trace_pb2
    import grpc

    from .otlp_sink import OtlpSink

    def attribute(key: str, value: str):
        return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(string_value=value))

    jobs = [f"e2e-shards-{uuid.uuid4().hex[:8]}" for _ in range(candidates)]
    now = time.time_ns()
    request = trace_service_pb2.ExportTraceServiceRequest(resource_spans=[
        trace_pb2.ResourceSpans(
            resource=resource_pb2.Resource(attributes=[attribute("training.job.id", job),
                                                       attribute("training.cohort", cohort)]),
            scope_spans=[trace_pb2.ScopeSpans(spans=[trace_pb2.Span(
                trace_id=os.urandom(16), span_id=os.urandom(8), name="probe",
                start_time_unix_nano=now, end_time_unix_nano=now + 1000)])])
        for job in jobs for cohort in COHORTS])
    sinks = [OtlpSink(port=port).start() for port in shard_ports]
    try:
        with services.Collector([services.CONFIG_DIR / "gateway.yaml"], workdir, name="probe-gateway", env={
                "DETECTOR_ENDPOINTS": "[" + ", ".join(f"{services.LOOPBACK}:{p}" for p in shard_ports) + "]",
                "JAEGER_SAMPLING_PERCENTAGE": "0"}) as gateway:
            with grpc.insecure_channel(gateway.grpc_endpoint) as channel:
                trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=10)
            services.wait_until(lambda: sum(len(s.spans()) for s in sinks) >= len(jobs) * len(COHORTS), DEADLINE_S,
                                what="the probe spans at the fake shards")
    finally:
        for sink in sinks:
            sink.stop()
    owner = {(resource["training.job.id"], resource["training.cohort"]): index
             for index, sink in enumerate(sinks) for resource, _ in sink.spans()}
    for job in jobs:
        if len({owner[(job, cohort)] for cohort in COHORTS}) == len(COHORTS):
            return job
    pytest.fail(f"none of {candidates} job ids splits the cohorts across the shards: {owner}")


def judged_cohort_ranks(detector_metrics_url: str) -> set[tuple[str, str]]:
    """(cohort, rank) pairs a detector has compared: the labels of its straggler_rank_slowdown."""
    status, body = services.http_get(detector_metrics_url, timeout=5)
    assert status == 200, f"{detector_metrics_url}: {status}"
    pairs = set()
    for line in body.decode().splitlines():
        if line.startswith("straggler_rank_slowdown{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            pairs.add((labels["training_cohort"], labels["training_rank"]))
    return pairs


def comparable(verdicts: list[dict]) -> Counter:
    """Verdicts as a multiset, without the time they were made."""
    return Counter(json.dumps({k: v for k, v in verdict.items() if k != "time_unix_nano"}, sort_keys=True)
                   for verdict in verdicts)


def span_counts_by_cohort(path: Path, job_id: str) -> Counter:
    """Stage and step spans per cohort in a collector file-exporter file (OTLP JSON lines); heartbeats,
    as many as the run's length makes, are left out."""
    counts: Counter = Counter()
    for line in path.read_text(encoding="utf-8").splitlines():
        for resource_spans in json.loads(line).get("resourceSpans", []):
            attributes = {a["key"]: a["value"].get("stringValue") for a in resource_spans["resource"]["attributes"]}
            if attributes.get("training.job.id") == job_id:
                counts[attributes.get("training.cohort")] += sum(
                    1 for s in resource_spans.get("scopeSpans", []) for span in s.get("spans", [])
                    if span.get("name") != "train.heartbeat")
    return counts


def test_two_shards_own_whole_cohorts_and_agree_with_one_detector(pipeline_binaries, tmp_path):
    world_size, steps, from_step = 6, 40, 10
    slow_ranks = {0: 2, 1: 5}  # one slowed rank in each cohort (cohort index: rank)
    shard_ports = [services.free_port(), services.free_port()]
    job_id = split_job_id(shard_ports, tmp_path / "probe")
    spans_path = tmp_path / "spans.jsonl"
    scrape_ports = [services.free_port(), services.free_port()]  # each shard's own /metrics
    shards = [services.Detector(tmp_path, port, services.free_port(), name=f"shard-{index}",
                                args=DETECTOR_ARGS + ("--export-metrics=false", f"--prometheus-port={scrape_port}"))
              for index, (port, scrape_port) in enumerate(zip(shard_ports, scrape_ports))]
    gateway = services.Collector(
        [services.CONFIG_DIR / "gateway.yaml", TEE_CONFIG, PROMPT_BATCHES_CONFIG], tmp_path, name="gateway", env={
            "DETECTOR_ENDPOINTS": "[" + ", ".join(f"{services.LOOPBACK}:{p}" for p in shard_ports) + "]",
            "JAEGER_SAMPLING_PERCENTAGE": "0", "OTELCOL_SPANS_PATH": str(spans_path)})

    def rank_env(rank: int) -> dict:
        return {"OTEL_STRAGGLER_COHORT": COHORTS[rank % len(COHORTS)]}

    def rank_args(rank: int) -> tuple[str, ...]:
        slowed = slow_ranks[rank % len(COHORTS)] == rank
        return slow_rank_args(rank, SLOW_STAGE, from_step, SLOWDOWN) if slowed else ()

    started = time.monotonic()
    try:
        for shard in shards:
            shard.start()
        gateway.start()
        with TrainingRanks(tmp_path / "ranks", world_size, gateway.grpc_endpoint, job_id, steps,
                           rank_env=rank_env, rank_args=rank_args, env=PROMPT_RANKS) as ranks:
            codes = ranks.wait(RUN_TIMEOUT_S)
            assert codes == [0] * world_size, f"exit codes {codes}\n{ranks.log_tails()}"
            statuses = ranks.statuses()
            assert None not in statuses, f"ranks without a final status line\n{ranks.log_tails()}"
        trained = time.monotonic() - started
        stage_spans = sum(status["spans_built"] for status in statuses)
        assert stage_spans == world_size * steps * 5
        # Each rank's status says what the gateway took (exported) and what it lost on the way.
        exported = sum(status["exported"] for status in statuses)
        assert exported == sum(s["spans_built"] + s["steps_built"] + s["heartbeats"] for s in statuses), (
            "a rank lost spans before the gateway\n" + delivery_report(statuses, gateway, shards))

        # Every span the gateway took reaches a shard, in one outcome or another, unless the gateway
        # drops it after its last retry: wait for that, not for a number of seconds.
        try:
            services.wait_until(lambda: sum(arrived_spans(shard) for shard in shards) >= exported,
                                gateway_delivery_bound_s() + 5, what=f"the {exported} exported spans at the shards")
        except TimeoutError as error:
            pytest.fail(f"{error}\n{delivery_report(statuses, gateway, shards)}")
        delivered = time.monotonic() - started - trained
        outcomes = [detector_status(shard)["spans"] for shard in shards]
        assert sum(spans["accepted"] for spans in outcomes) == stage_spans, (
            f"{stage_spans} stage spans sent; `late` ones came after their window was judged (DELIVERY)\n"
            + delivery_report(statuses, gateway, shards))
        judged = [judged_cohort_ranks(f"http://{services.LOOPBACK}:{port}/metrics") for port in scrape_ports]
    finally:
        gateway.stop()  # flushes the spans file
        for shard in shards:
            shard.stop()  # judges what is still open, writes the last evidence

    # Each cohort's spans went to exactly one shard, whole: the tee saw what the shards were sent.
    sent = span_counts_by_cohort(spans_path, job_id)
    per_cohort = (world_size // len(COHORTS)) * steps * 6  # train.step + 5 stages per rank and step
    assert sent == {cohort: per_cohort for cohort in COHORTS}, sent
    owners = {cohort: [i for i, pairs in enumerate(judged) if any(c == cohort for c, _ in pairs)] for cohort in COHORTS}
    assert sorted(len(o) for o in owners.values()) == [1, 1] and owners[COHORTS[0]] != owners[COHORTS[1]], owners
    for index, shard in enumerate(shards):
        status = detector_status(shard)
        cohort = next(c for c, o in owners.items() if o == [index])
        assert judged[index] == {(cohort, str(r)) for r in range(world_size) if COHORTS[r % 2] == cohort}
        assert status["engine"]["cohorts"] == 1 and status["engine"]["ranks"] == world_size // 2, status["engine"]
        assert status["spans"]["accepted"] == stage_spans // 2, status["spans"]
        assert status["spans"]["duplicate"] == 0 and status["spans"]["late"] == 0, status["spans"]

    # One detector over the same spans, offline: the same verdicts.
    single = tmp_path / "single-evidence"
    replay = subprocess.run(
        [sys.executable, "-m", "otel_straggler", "replay", str(spans_path), f"--evidence-dir={single}",
         *[arg for arg in DETECTOR_ARGS if not arg.startswith("--metric-export")], "--export-metrics=false"],
        env={**clean_environment(), "PYTHONPATH": str(services.REPO)}, capture_output=True, text=True, timeout=120)
    assert replay.returncode == 0, replay.stderr[-2000:]
    union = [v for shard in shards for v in verdicts_of(shard.evidence_dir, job_id)]
    alone = verdicts_of(single, job_id)
    assert comparable(union) == comparable(alone), (
        f"shards: {sorted(comparable(union))}\nsingle: {sorted(comparable(alone))}")
    flagged = {(v["cohort"], v["rank"]) for v in union if v["verdict"] == "straggler"}
    assert flagged == {(COHORTS[c], r) for c, r in slow_ranks.items()}, flagged
    for index, shard in enumerate(shards):
        assert {v["cohort"] for v in verdicts_of(shard.evidence_dir, job_id)} <= {c for c, o in owners.items() if o == [index]}
    print(f"\nshards: {world_size} ranks x {steps} steps trained in {trained:.0f} s, every span at the shards "
          f"{delivered:.1f} s later; cohort split "
          f"{ {c: f'shard-{o[0]}' for c, o in owners.items()} }; {len(union)} verdicts on the shards = "
          f"{len(alone)} from one detector replaying {sum(sent.values())} spans")


# ---- 3. the gateway restarts mid-run ------------------------------------------------------------

# The OTLP exporter of the OTel Python SDK retries UNAVAILABLE with backoff (1, 2, 4 s, ...) until
# its deadline, 10 s by default: a shorter outage loses nothing. The ranks here give up on a batch
# after 3 s (OTEL_EXPORTER_OTLP_TRACES_TIMEOUT, seconds in this SDK), so a 5 s outage loses the
# batches in flight, and the ranks, fast as they may be, are still far from the slowdown when the
# gateway is back.
OUTAGE_S = 5.0
RANK_EXPORT_TIMEOUT_S = 3


def test_gateway_restart_mid_run_loses_only_counted_spans_and_detection_resumes(pipeline_binaries, tmp_path):
    world_size, slow_rank, down_at = 4, 2, 5
    # Ranks train on while the gateway is away: up to 66 steps on the fastest 2-core machine seen.
    # The slowdown starts well after it is back, with room for a machine twice as fast, so the
    # alert it raises proves detection works after the restart.
    from_step, steps = 160, 200
    detector = services.Detector(tmp_path, services.free_port(), services.free_port(),
                                 args=DETECTOR_ARGS + ("--export-metrics=false",))
    gateway = services.Collector([services.CONFIG_DIR / "gateway.yaml"], tmp_path, name="gateway", env={
        "DETECTOR_ENDPOINTS": f"[{services.LOOPBACK}:{detector.grpc_port}]", "JAEGER_SAMPLING_PERCENTAGE": "0"})
    job_id = f"e2e-restart-{uuid.uuid4().hex[:8]}"
    try:
        detector.start()
        gateway.start()
        with TrainingRanks(tmp_path / "ranks", world_size, gateway.grpc_endpoint, job_id, steps,
                           env={"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": str(RANK_EXPORT_TIMEOUT_S)},
                           trainer_args=slow_rank_args(slow_rank, SLOW_STAGE, from_step, SLOWDOWN)) as ranks:
            ranks.wait_for_step(down_at, RUN_TIMEOUT_S)
            services.wait_until(lambda: detector_status(detector).get("spans", {}).get("accepted"), DEADLINE_S,
                                what="spans at the detector before the restart")
            gateway.stop()
            down = (time.time(), ranks.progress())
            time.sleep(OUTAGE_S)
            gateway.start()
            up = (time.time(), ranks.progress())
            windows_before = detector_status(detector)["engine"]["windows_closed"]
            assert up[1] + WINDOW_STEPS <= from_step, f"the gateway came back at step {up[1]}, too late for this test"
            codes = ranks.wait(RUN_TIMEOUT_S)
            assert codes == [0] * world_size, f"exit codes {codes}\n{ranks.log_tails()}"
            statuses = ranks.statuses()
            assert None not in statuses, f"ranks without a final status line\n{ranks.log_tails()}"
        assert up[1] > down[1], "rank 0 made no progress while the gateway was down"

        # Every span a rank made is either at the detector or counted lost by the rank.
        made = sum(s["spans_built"] + s["steps_built"] + s["heartbeats"] for s in statuses)
        exported = sum(s["exported"] for s in statuses)
        lost = Counter()
        for rank_status in statuses:
            lost.update({reason: count for reason, count in rank_status["lost"].items() if count})
        assert lost["export_failed"] > 0, f"no export failed during a {OUTAGE_S:.0f} s outage: {statuses}"
        assert made == exported + sum(lost.values()), (made, exported, lost)

        # ...and every span that left a rank reached the detector, which counts each by outcome:
        # `late` ones came after their window was judged (the backlog a rank sends after the
        # restart can trail its peers' by more than the detector waits).
        def received():
            spans = detector_status(detector).get("spans", {})
            return sum(spans.values()) >= exported and spans

        spans = services.wait_until(received, DEADLINE_S, what=f"the {exported} exported spans at the detector")
        assert sum(spans.values()) == exported and spans["duplicate"] == 0 and spans["malformed"] == 0, spans

        # Detection went on: windows closed after the restart, and the slowdown that began after
        # it raised an alert for the slow rank, and for no other.
        services.wait_until(
            lambda: [v for v in verdicts_of(detector.evidence_dir, job_id) if v["verdict"] == "straggler"],
            DEADLINE_S, what="a straggler verdict")
    finally:
        gateway.stop()
        detector.stop()  # judges the windows still open
    status = detector_status(detector)
    verdicts = [v for v in verdicts_of(detector.evidence_dir, job_id) if v["verdict"] == "straggler"]
    assert status["engine"]["windows_closed"] > windows_before
    assert {v["rank"] for v in verdicts} == {slow_rank}, verdicts
    first = min(verdicts, key=lambda v: v["window"])
    assert first["window"] * WINDOW_STEPS >= from_step and first["time_unix_nano"] / 1e9 > up[0]
    print(f"\nrestart: gateway down {OUTAGE_S:.0f} s at step {down[1]}, back at step {up[1]}; ranks lost "
          f"{dict(lost)} of {made} spans, all counted; detector: {spans}, {status['engine']['coverage_gaps']} coverage gaps, "
          f"{status['engine']['windows_closed'] - windows_before} windows closed after the restart; "
          f"rank {slow_rank} flagged at window {first['window']}")


# ---- 4. TLS and a bearer token between gateway and detector -------------------------------------

AUTH_CONFIGS = [services.CONFIG_DIR / "gateway.yaml", services.CONFIG_DIR / "gateway-detector-auth.yaml"]


def test_detector_refuses_a_wrong_bearer_token_and_accepts_the_right_one(pipeline_binaries, tmp_path):
    import shutil

    from .otlp_sink import make_self_signed_certificate
    from .telemetry import Rank, send_rank_steps

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed (scripts/services.sh build installs it)")
    cert, key = make_self_signed_certificate(tmp_path / "tls", name="detector")
    token_file = tmp_path / "detector-token"
    token_file.write_text("right-token\n", encoding="utf-8")
    detector = services.Detector(tmp_path, services.free_port(), services.free_port(), args=(
        f"--auth-token-file={token_file}", f"--tls-cert-file={cert}", f"--tls-key-file={key}",
        "--export-metrics=false", "--flush-interval-s=0.2"))
    job_id = f"e2e-auth-{uuid.uuid4().hex[:8]}"
    steps = range(3)
    stage_spans = len(steps) * 3  # telemetry.send_rank_steps: three stages per step

    def gateway(token: str) -> services.Collector:
        return services.Collector(AUTH_CONFIGS, tmp_path, name=f"gateway-{token}", env={
            "DETECTOR_ENDPOINTS": f"[{services.LOOPBACK}:{detector.grpc_port}]", "DETECTOR_BEARER_TOKEN": token,
            "DETECTOR_CA_FILE": str(cert), "DETECTOR_TLS_SERVER_NAME": "detector", "JAEGER_SAMPLING_PERCENTAGE": "0"})

    def requests() -> Counter:
        return Counter(detector_status(detector).get("requests", {}))

    with detector:
        with gateway("wrong-token") as wrong:
            for rank in range(3):
                send_rank_steps(wrong.grpc_endpoint, Rank(job_id, rank, 3, "tp0.pp0"), steps)
            services.wait_until(lambda: requests()["unauthenticated"] > 0, DEADLINE_S,
                                what="a refused request at the detector")
            services.wait_until(lambda: "Unauthenticated" in wrong.log_text(), DEADLINE_S,
                                what="the refusal in the gateway's log")
        refused = requests()
        spans = detector_status(detector).get("spans", {})
        assert sum(spans.values()) == 0, f"spans taken with a wrong token: {spans}"
        assert refused["ok"] == 0, refused

        with gateway("right-token") as right:
            for rank in range(3):
                send_rank_steps(right.grpc_endpoint, Rank(job_id, rank, 3, "tp0.pp0"), steps)
            def accepted_spans():
                spans = detector_status(detector).get("spans", {})
                return spans.get("accepted", 0) >= 3 * stage_spans and spans

            accepted = services.wait_until(accepted_spans, DEADLINE_S, what="spans accepted with the right token")
        assert accepted["accepted"] == 3 * stage_spans, accepted
        after = requests()
        assert after["ok"] > 0 and after["unauthenticated"] == refused["unauthenticated"], after
    print(f"\nauth: wrong token refused {refused['unauthenticated']} requests, nothing accepted; "
          f"right token: {after['ok']} requests, {accepted['accepted']} spans accepted")
