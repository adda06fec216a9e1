"""Generate the Grafana dashboards for otel-straggler.

The dashboards are data built here and written as JSON to dashboards/, which Grafana loads through
provisioning/dashboards/. Edit this file, not the JSON: tests/pipeline checks that the committed
JSON equals what this script writes, and runs every panel's query against a real Prometheus.

    python collector-config/grafana/generate_dashboards.py          # rewrite dashboards/*.json
    python collector-config/grafana/generate_dashboards.py --check  # exit 1 if they are stale

Metric and label names are those of the collector's prometheus exporter (docs/pipeline.md).
Standard library only, so it runs anywhere Python does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DASHBOARD_DIR = Path(__file__).resolve().parent / "dashboards"

# Data source uids fixed by provisioning/datasources/datasources.yml.
PROMETHEUS = {"type": "prometheus", "uid": "prometheus"}

# Every query is filtered by the dashboard's variables; tests expand them with expand_variables().
JOB = 'training_job_id=~"$job_id"'
JOB_COHORT = JOB + ', training_cohort=~"$cohort"'

# Where a rank runs: its node and its slot there (training.local_rank, i.e. which GPU), as the
# detector labels its per-rank series (CONTRACT v1.1 §3b). Legends write it "rank 3 on node-0/3".
RANK_ON_HOST = "rank {{training_rank}} on {{host_name}}/{{training_local_rank}}"

# Slowdown colours: within the detector's default 5% tolerance, beyond it, far beyond it.
SLOWDOWN_THRESHOLDS = [
    {"color": "green", "value": None},
    {"color": "yellow", "value": 1.05},
    {"color": "red", "value": 1.2},
]

# The whole job against its own baseline (straggler_job_slowdown): the detector's default
# --job-slowdown-threshold 0.15, as the TrainingJobSlowdown alert in rules.yml; change them together.
JOB_SLOWDOWN_THRESHOLDS = [
    {"color": "green", "value": None},
    {"color": "red", "value": 1.15},
]

# A verdict names job, rank and stage, but not the step: it closes a window of steps. The link
# opens Jaeger's search for that rank's spans of the job in the panel's time range; each hit is the
# trace of one step with every rank side by side. Jaeger's search takes microseconds. The job is the
# dashboard's (one at a time), not a series label: panels that sum or group series by rank keep the
# rank label but not the job's. The rank is a label of the clicked series, or in a table whose labels
# became columns (labelsToFields, which takes them off the value), that row's `rank` column.
def jaeger_search_link(rank: str) -> dict:
    return {
        "title": f"Jaeger: traces of rank {rank}",
        "targetBlank": True,
        "url": (
            "${jaeger_url}/search?service=${training_service}"
            '&tags=%7B%22training.job.id%22%3A%22${job_id:percentencode}%22'
            f'%2C%22training.rank%22%3A%22{rank}%22%7D'
            "&start=${__from}000&end=${__to}000&limit=20"
        ),
    }


JAEGER_SEARCH_LINK = jaeger_search_link("${__field.labels.training_rank}")
JAEGER_SEARCH_LINK_TABLE = jaeger_search_link("${__data.fields.rank}")


def prom_target(expr: str, legend: str = "", ref: str = "A", instant: bool = False, table: bool = False) -> dict:
    """table: Prometheus's table format (one column per label, the value in `Value #<ref>`), for
    tables that merge several queries on their labels."""
    target = {
        "datasource": PROMETHEUS,
        "expr": expr,
        "legendFormat": legend,
        "refId": ref,
        "instant": instant,
        "range": not instant,
    }
    if table:
        target["format"] = "table"
    return target


class Layout:
    """Places panels left to right on Grafana's 24-column grid, wrapping to a new row."""

    def __init__(self) -> None:
        self.x = 0
        self.y = 0
        self.row_height = 0
        self.next_id = 1

    def place(self, panel: dict, width: int, height: int) -> dict:
        if self.x + width > 24:
            self.x, self.y, self.row_height = 0, self.y + self.row_height, 0
        panel["id"] = self.next_id
        panel["gridPos"] = {"x": self.x, "y": self.y, "w": width, "h": height}
        self.next_id += 1
        self.x += width
        self.row_height = max(self.row_height, height)
        return panel


def panel(kind: str, title: str, description: str, targets: list[dict], **extra) -> dict:
    body = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": PROMETHEUS,
        "targets": targets,
    }
    body.update(extra)
    return body


def field_config(unit: str = "none", thresholds: list[dict] | None = None, links: list[dict] | None = None,
                 custom: dict | None = None, color_mode: str = "thresholds", no_value: str | None = None) -> dict:
    """no_value: what an empty panel means, shown instead of "No data", for a panel that lists an
    incident and is rightly empty while the job is healthy (the healthy end-to-end run accepts
    emptiness only from such panels; the smoke test seeds an incident for every panel)."""
    defaults = {
        "unit": unit,
        "color": {"mode": color_mode},
        "thresholds": {"mode": "absolute", "steps": thresholds or [{"color": "green", "value": None}]},
        "links": links or [],
        "custom": custom or {},
    }
    if no_value is not None:
        defaults["noValue"] = no_value
    return {"defaults": defaults, "overrides": []}


def variables() -> list[dict]:
    def query_variable(name: str, label: str, query: str, multi: bool) -> dict:
        return {
            "type": "query",
            "name": name,
            "label": label,
            "datasource": PROMETHEUS,
            "query": {"query": query, "refId": f"{name}-values"},
            "definition": query,
            "refresh": 2,
            "includeAll": multi,
            "multi": multi,
            "allValue": ".*" if multi else None,
            "sort": 1,
            "current": {},
            "options": [],
        }

    def constant(name: str, label: str, value: str, description: str) -> dict:
        return {
            "type": "textbox",
            "name": name,
            "label": label,
            "description": description,
            "query": value,
            "current": {"text": value, "value": value},
            "options": [{"selected": True, "text": value, "value": value}],
            "hide": 0,
        }

    return [
        # a job that hangs before its first window (often: in its first collective) has a hang
        # series but no slowdown yet, and must be selectable too
        query_variable("job_id", "Job",
                       'label_values({__name__=~"straggler_rank_slowdown|straggler_job_hang"}, training_job_id)', False),
        query_variable("cohort", "Cohort", 'label_values(straggler_rank_slowdown{training_job_id=~"$job_id"}, training_cohort)', True),
        constant("jaeger_url", "Jaeger UI", "http://localhost:16686",
                 "Where the browser reaches Jaeger's UI; used by the trace links."),
        constant("training_service", "Training service", "training",
                 "service.name of the training ranks (OTEL_SERVICE_NAME), used by the trace links."),
    ]


def job_overview() -> dict:
    layout = Layout()
    hang_labels = "training_job_id, training_rank, host_name, training_local_rank, training_stage, reason"
    # A host's ranks of the job, each counted once over its stages and shards, as the
    # TrainingNodeDegraded alert counts them (rules.yml); series without host_name form no host.
    host_ranks = ('max by (training_job_id, host_name, training_rank) '
                  f'(straggler_alert_active{{{JOB}, host_name!=""}})')
    alerted_per_host = f"count by (training_job_id, host_name) ({host_ranks} == 1)"
    ranks_per_host = f"count by (training_job_id, host_name) ({host_ranks})"
    evidence_labels = ("training_job_id, training_cohort, training_stage, training_rank, host_name, "
                       "training_local_rank, suspect, gpu, next_step")
    panels = [
        layout.place(panel(
            "stat", "Active hangs",
            "Culprits of a current hang (straggler_job_hang == 1): no rank completed an interval for the "
            "detector's hang timeout while heartbeats show ranks alive. A hang with no culprit "
            "(all_ranks_waiting) counts once.",
            [prom_target(f"count(max by ({hang_labels}) (straggler_job_hang{{{JOB}}}) == 1) or vector(0)",
                         "active hangs", instant=True)],
            fieldConfig=field_config(thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 1}]),
            options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                     "colorMode": "background", "graphMode": "none", "textMode": "value"},
        ), 4, 5),
        layout.place(panel(
            "table", "Hangs by culprit",
            "One row per culprit of a current hang: its rank, host and local rank (GPU slot), the stage it "
            "is stuck in, and why: never_entered_collective (outside a collective while the others wait "
            "in one), rank_lost (its heartbeats stopped too), all_ranks_waiting (every rank waits in the "
            "same collective; rank -1, no host). Empty while the job makes progress. The link opens the "
            "culprit's step traces in Jaeger.",
            [prom_target(f"max by ({hang_labels}) (straggler_job_hang{{{JOB}}}) == 1", instant=True)],
            fieldConfig=field_config(links=[JAEGER_SEARCH_LINK_TABLE], no_value="No hang"),
            transformations=[
                {"id": "labelsToFields", "options": {"mode": "columns"}},
                {"id": "organize", "options": {
                    "excludeByName": {"Time": True, "Value": True},
                    "indexByName": {"training_job_id": 0, "training_rank": 1, "host_name": 2,
                                    "training_local_rank": 3, "training_stage": 4, "reason": 5},
                    "renameByName": {"training_job_id": "job", "training_rank": "rank", "host_name": "host",
                                     "training_local_rank": "local rank", "training_stage": "stage"}}},
            ],
            options={"showHeader": True},
        ), 20, 5),
        layout.place(panel(
            "stat", "Active straggler alerts",
            "Ranks the detector currently holds a straggler alert for (straggler_alert_active == 1).",
            [prom_target(f"sum(straggler_alert_active{{{JOB_COHORT}}})", "active alerts", instant=True)],
            fieldConfig=field_config(thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 1}]),
            options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                     "colorMode": "background", "graphMode": "none", "textMode": "value"},
        ), 4, 6),
        layout.place(panel(
            "table", "Active alerts",
            "One row per rank and stage under an active straggler alert, with the rank's host and local "
            "rank (GPU slot) and its latest slowdown. The link opens that rank's step traces in Jaeger.",
            [prom_target(
                f"straggler_rank_slowdown{{{JOB_COHORT}}} and on (training_job_id, training_cohort, training_stage, training_rank, "
                f"host_name, training_local_rank) "
                f"(straggler_alert_active{{{JOB_COHORT}}} == 1)", instant=True)],
            fieldConfig=field_config(unit="none", thresholds=SLOWDOWN_THRESHOLDS, links=[JAEGER_SEARCH_LINK_TABLE]),
            transformations=[
                {"id": "labelsToFields", "options": {"mode": "columns"}},
                {"id": "organize", "options": {
                    "excludeByName": {"Time": True, "__name__": True, "job": True, "instance": True,
                                      "otel_scope_name": True, "otel_scope_version": True},
                    "indexByName": {"training_job_id": 0, "training_cohort": 1, "training_rank": 2, "host_name": 3,
                                    "training_local_rank": 4, "training_stage": 5, "Value": 6},
                    "renameByName": {"Value": "slowdown", "training_rank": "rank", "training_stage": "stage",
                                     "training_cohort": "cohort", "training_job_id": "job", "host_name": "host",
                                     "training_local_rank": "local rank"}}},
            ],
            options={"showHeader": True},
        ), 20, 6),
        layout.place(panel(
            "table", "Alerted ranks by host",
            "Hosts with a rank under a straggler alert: how many of the job's ranks on that host are "
            "alerted (any stage) and their share. Half or more, and at least 2, is the "
            "TrainingNodeDegraded alert: suspect the node (power, cooling, NIC, CPU, a noisy neighbour), "
            "not one GPU.",
            [prom_target(alerted_per_host, ref="A", instant=True, table=True),
             prom_target(f"{ranks_per_host} and on (training_job_id, host_name) {alerted_per_host}",
                         ref="B", instant=True, table=True),
             prom_target(f"{alerted_per_host} / on (training_job_id, host_name) {ranks_per_host}",
                         ref="C", instant=True, table=True)],
            fieldConfig={**field_config(no_value="No alerted rank"), "overrides": [{
                "matcher": {"id": "byName", "options": "share"},
                "properties": [{"id": "unit", "value": "percentunit"},
                               {"id": "thresholds", "value": {"mode": "absolute", "steps": [
                                   {"color": "green", "value": None}, {"color": "red", "value": 0.5}]}},
                               {"id": "custom.cellOptions", "value": {"type": "color-text"}}]}]},
            transformations=[
                {"id": "merge", "options": {}},
                {"id": "organize", "options": {
                    "excludeByName": {"Time": True},
                    "indexByName": {"training_job_id": 0, "host_name": 1, "Value #A": 2, "Value #B": 3, "Value #C": 4},
                    "renameByName": {"training_job_id": "job", "host_name": "host", "Value #A": "alerted ranks",
                                     "Value #B": "ranks", "Value #C": "share"}}},
            ],
            options={"showHeader": True, "sortBy": [{"displayName": "share", "desc": True}]},
        ), 9, 7),
        layout.place(panel(
            "table", "Straggler evidence",
            "What the detector holds against each alerted rank (straggler_alert_evidence): its suspect "
            "(gpu_throttled, gpu_errors, input_pipeline, host, gpu, peer_wait, unknown), the GPU evidence "
            "in words, and what to look at first, as the TrainingStragglerDetected alert's next_step says. "
            "Empty while no rank is alerted, and with a detector that does not export it. The link opens "
            "the rank's step traces in Jaeger.",
            [prom_target(f"max by ({evidence_labels}) (straggler_alert_evidence{{{JOB_COHORT}}})", instant=True)],
            fieldConfig=field_config(links=[JAEGER_SEARCH_LINK_TABLE], no_value="No evidence"),
            transformations=[
                {"id": "labelsToFields", "options": {"mode": "columns"}},
                {"id": "organize", "options": {
                    "excludeByName": {"Time": True, "Value": True, "training_job_id": True,
                                      "training_cohort": True},
                    "indexByName": {"training_rank": 0, "host_name": 1, "training_local_rank": 2,
                                    "training_stage": 3, "suspect": 4, "gpu": 5, "next_step": 6},
                    "renameByName": {"training_rank": "rank", "host_name": "host",
                                     "training_local_rank": "local rank", "training_stage": "stage",
                                     "gpu": "GPU", "next_step": "next step"}}},
            ],
            options={"showHeader": True, "cellHeight": "sm"},
        ), 15, 7),
        layout.place(panel(
            "timeseries", "Job slowdown vs its baseline",
            "Each cohort's latest window step time (or time per token) over the cohort's own baseline "
            "(straggler_job_slowdown; 1.00 = as usual, 1.36 = 36% slower), from its first baseline on. "
            "The dashed line is the detector's default job slowdown threshold (1.15); above it with no "
            "straggler to blame, the detector issues a job_slowdown verdict naming the stage that grew most.",
            [prom_target(f"max by (training_job_id, training_cohort) (straggler_job_slowdown{{{JOB_COHORT}}})",
                         "{{training_job_id}} {{training_cohort}}")],
            fieldConfig=field_config(
                unit="none", thresholds=JOB_SLOWDOWN_THRESHOLDS, color_mode="palette-classic",
                custom={"thresholdsStyle": {"mode": "dashed"}, "lineWidth": 1, "showPoints": "auto"},
                no_value="No baseline yet"),
            options={"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"]},
                     "tooltip": {"mode": "multi", "sort": "desc"}},
        ), 24, 8),
        layout.place(panel(
            "table", "Slowdown per rank × stage",
            "Latest window slowdown of each rank against its comparable peers (1.00 = as fast as the "
            "reference, 1.10 = 10% slower), rows by rank (\"3 on node-0/3\": rank on host/local rank), "
            "columns by stage. Yellow from 5%, red from 20%.",
            # the matrix takes one row field: the rank and where it runs, joined into one label
            [prom_target(
                'label_join(label_join('
                f"max by (training_rank, host_name, training_local_rank, training_stage) (straggler_rank_slowdown{{{JOB_COHORT}}}), "
                '"slot", "/", "host_name", "training_local_rank"), "rank", " on ", "training_rank", "slot")',
                instant=True)],
            # no Jaeger link here: the matrix's cells are not series, so they carry no rank label
            # (the panels beside it link each rank)
            fieldConfig=field_config(
                unit="none", thresholds=SLOWDOWN_THRESHOLDS,
                custom={"cellOptions": {"type": "color-background"}, "align": "center"}),
            transformations=[
                {"id": "labelsToFields", "options": {"mode": "columns"}},
                {"id": "groupingToMatrix", "options": {
                    "rowField": "rank", "columnField": "training_stage", "valueField": "Value"}},
            ],
            options={"showHeader": True},
        ), 12, 10),
        layout.place(panel(
            "timeseries", "Slowdown over time",
            "Each rank's window slowdown per stage; the dashed line is the detector's default 5% threshold.",
            [prom_target(f"straggler_rank_slowdown{{{JOB_COHORT}}}", RANK_ON_HOST + " {{training_stage}}")],
            fieldConfig=field_config(
                unit="none", thresholds=SLOWDOWN_THRESHOLDS, links=[JAEGER_SEARCH_LINK], color_mode="palette-classic",
                custom={"thresholdsStyle": {"mode": "dashed"}, "lineWidth": 1, "showPoints": "auto"}),
            options={"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"]},
                     "tooltip": {"mode": "multi", "sort": "desc"}},
        ), 12, 10),
        layout.place(panel(
            "state-timeline", "Verdict timeline: alert state per rank",
            "When each rank and stage was under a straggler alert (red) or not (green).",
            [prom_target(f"max by (training_rank, host_name, training_local_rank, training_stage) "
                         f"(straggler_alert_active{{{JOB_COHORT}}})", RANK_ON_HOST + " {{training_stage}}")],
            fieldConfig=field_config(
                thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 1}],
                links=[JAEGER_SEARCH_LINK],
                custom={"fillOpacity": 80, "lineWidth": 0}),
            options={"showValue": "never", "mergeValues": True, "rowHeight": 0.8,
                     "legend": {"showLegend": False}},
        ), 12, 10),
        layout.place(panel(
            "timeseries", "Verdicts",
            "Verdicts per evaluation interval by rank, verdict and reason (straggler_verdicts_total), "
            "hangs included (rank -1: a hang with no culprit); uncertain verdicts are left out here.",
            [prom_target(
                "sum by (training_rank, host_name, training_local_rank, verdict, reason) "
                f'(increase(straggler_verdicts_total{{{JOB}, verdict!="uncertain"}}[$__rate_interval]))',
                RANK_ON_HOST + " {{verdict}} ({{reason}})")],
            fieldConfig=field_config(
                unit="short", links=[JAEGER_SEARCH_LINK], color_mode="palette-classic",
                custom={"drawStyle": "bars", "fillOpacity": 60, "stacking": {"mode": "normal", "group": "A"}}),
            options={"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        ), 12, 10),
        layout.place(panel(
            "timeseries", "Detector intake by outcome",
            "Spans reaching the detector per second: accepted, duplicate, late, malformed, dropped. "
            "Malformed or dropped spans are evidence the detector never saw.",
            [prom_target("sum by (outcome) (rate(straggler_detector_spans_total[$__rate_interval]))", "{{outcome}}")],
            fieldConfig=field_config(unit="reqps", color_mode="palette-classic", custom={"fillOpacity": 10}),
            options={"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        ), 6, 8),
        layout.place(panel(
            "timeseries", "Detector ingest lag and windows",
            "p95 age of a span batch when the engine ingests it (left), and windows judged per second (right). "
            "A growing lag means the detector falls behind the ranks.",
            [prom_target("histogram_quantile(0.95, sum by (le) (rate(straggler_detector_ingest_lag_seconds_bucket[$__rate_interval])))",
                         "ingest lag p95", "A"),
             prom_target("sum(rate(straggler_detector_windows_closed_total[$__rate_interval]))", "windows closed/s", "B")],
            fieldConfig={**field_config(unit="s", color_mode="palette-classic"), "overrides": [{
                "matcher": {"id": "byName", "options": "windows closed/s"},
                "properties": [{"id": "unit", "value": "short"}, {"id": "custom.axisPlacement", "value": "right"}]}]},
            options={"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        ), 6, 8),
        layout.place(panel(
            "timeseries", "Collector: spans in and out",
            "The gateway collector's own counters: spans accepted from the ranks, and spans sent and "
            "failed per exporter (load_balancing/detector = detector shards, otlp_grpc/jaeger = Jaeger, sampled).",
            [prom_target("sum(rate(otelcol_receiver_accepted_spans[$__rate_interval]))", "received", "A"),
             prom_target("sum by (exporter) (rate(otelcol_exporter_sent_spans[$__rate_interval]))", "sent {{exporter}}", "B")],
            fieldConfig=field_config(unit="reqps", color_mode="palette-classic"),
            options={"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        ), 6, 8),
        layout.place(panel(
            "stat", "Scrape targets up",
            "Prometheus reaching the collector's metric endpoints (1 = up).",
            [prom_target("up", "{{job}} {{instance}}", instant=True)],
            fieldConfig=field_config(thresholds=[{"color": "red", "value": None}, {"color": "green", "value": 1}]),
            options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                     "colorMode": "background", "graphMode": "none", "textMode": "value_and_name"},
        ), 6, 8),
    ]
    return {
        "uid": "otel-straggler-job",
        "title": "otel-straggler: job overview",
        "description": "Straggler verdicts of one training job and the health of the detector pipeline.",
        "tags": ["otel-straggler", "training"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "schemaVersion": 39,
        "version": 1,
        "templating": {"list": variables()},
        "annotations": {"list": []},
        "links": [{"title": "Jaeger", "type": "link", "url": "${jaeger_url}", "targetBlank": True}],
        "panels": panels,
    }


DASHBOARDS = {"job-overview.json": job_overview}


def render(build) -> str:
    return json.dumps(build(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def expand_variables(expr: str, job_id: str = ".+", cohort: str = ".*", rate_interval: str = "1m") -> str:
    """A panel query as Grafana would send it, with the dashboard variables filled in."""
    return (expr.replace("$job_id", job_id).replace("$cohort", cohort)
            .replace("$__rate_interval", rate_interval))


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL with variables) for every query of every generated dashboard."""
    return [(p["title"], t["expr"]) for build in DASHBOARDS.values() for p in build()["panels"] for t in p["targets"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing; exit 1 when stale")
    parser.add_argument("--out", type=Path, default=DASHBOARD_DIR, help="directory for the JSON files")
    args = parser.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        path = args.out / name
        text = render(build)
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path))
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    if stale:
        print("stale, run collector-config/grafana/generate_dashboards.py: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
