"""A detector restarted on the same evidence directory carries on where its predecessor stopped: an
alert it left open is neither raised again nor orphaned (it ends with `recovered`), and status.json's
counters continue (inherited_alerts.py, evidence.carried_counters)."""
from __future__ import annotations

import json
from pathlib import Path

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult

from otel_straggler import contract
from otel_straggler.detector import inherited_alerts, service as service_module
from otel_straggler.detector.inherited_alerts import AlertKey, read_open_alerts

from otel_straggler.testing.otlp_spans import per_step_requests, running_service, service_config, verdict_records
from otel_straggler.testing.synthetic import TRAINING_STAGES, SyntheticJob

RANKS = 8
STEPS = 40  # per process


def job() -> SyntheticJob:
    # rank 3 is 30% slower in steps 10-64: raised by the first process (steps 0-39), still slow past
    # the second one's warmup, over three windows (the whole step's recovery) before its end
    return SyntheticJob(ranks=RANKS, seed=3).slow(3, 1.3, from_step=10, to_step=64)


def send(service, first_step: int) -> None:
    observations = job().observations(STEPS, first_step=first_step, seq_start=first_step * len(TRAINING_STAGES))
    exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{service.bound_ports[0]}", insecure=True, timeout=10)
    for spans in per_step_requests(observations):
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    exporter.shutdown()


def two_processes(tmp_path) -> tuple[list[dict], list[dict], dict]:
    """(verdicts of the first process, of the second, the last status.json)."""
    config = service_config(tmp_path)
    verdicts_path = Path(config.evidence_dir) / "verdicts.jsonl"
    with running_service(config) as first:
        send(first, 0)
    before = verdict_records(verdicts_path)
    with running_service(config) as second:
        send(second, STEPS)
    after = verdict_records(verdicts_path)[len(before):]
    return before, after, json.loads((Path(config.evidence_dir) / "status.json").read_text())


def onsets(records: list[dict]) -> list[tuple]:
    return [(r["rank"], r["stage"]) for r in records if r["verdict"] == contract.VERDICT_STRAGGLER]


def test_an_alert_left_open_is_taken_over_not_raised_again_and_ends_with_recovered(tmp_path):
    before, after, status = two_processes(tmp_path)
    raised = onsets(before)
    assert raised and {rank for rank, _ in raised} == {3}
    assert onsets(after) == []
    ended = {(r["rank"], r["stage"]) for r in after if r["verdict"] == contract.VERDICT_RECOVERED}
    assert set(raised) <= ended  # every onset of the first process is closed by the second
    assert status["engine"]["alerts_taken_over"] == len(set(raised)) and status["engine"]["alerts_pending_takeover"] == 0


def test_without_taking_over_the_restart_raises_the_alert_again(tmp_path, monkeypatch):
    # control: the same two processes, the second reading no open alerts
    monkeypatch.setattr(service_module, "read_open_alerts", lambda path: ({}, 0))
    before, after, _ = two_processes(tmp_path)
    assert onsets(before) and onsets(after)


def test_status_counters_continue_across_the_restart(tmp_path):
    before, after, status = two_processes(tmp_path)
    assert status["spans"]["accepted"] == 2 * STEPS * RANKS * len(TRAINING_STAGES)
    assert sum(status["verdicts"].values()) == len(before) + len(after)
    assert status["history"]["processes"] == 2
    assert status["history"]["counting_since_unix_nano"] < status["started_unix_nano"]


def test_open_alerts_are_read_from_whole_lines_and_bounded(tmp_path, monkeypatch):
    path = tmp_path / "verdicts.jsonl"

    def line(verdict: str, rank, stage: str = "*", reason: str = "slow_vs_peers") -> str:
        return json.dumps({"job_id": "j", "cohort": "c", "rank": rank, "stage": stage, "verdict": verdict,
                           "reason": reason}) + "\n"

    path.write_text(line("straggler", 1) + line("recovered", 1) + line("straggler", 2, "fwd", "intermittent")
                    + "not json\n" + line("hang", None) + line("straggler", 4) + line("straggler", 5))
    monkeypatch.setattr(inherited_alerts, "MAX_OPEN", 2)
    alerts, unreadable = read_open_alerts(str(path))
    assert alerts == {AlertKey("j", "c", 4, "*"): "slow_vs_peers", AlertKey("j", "c", 5, "*"): "slow_vs_peers"}
    assert unreadable == 1
    assert read_open_alerts(str(tmp_path / "none.jsonl")) == ({}, 0)
