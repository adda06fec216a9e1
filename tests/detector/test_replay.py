"""replay.py and `otel-straggler replay`: collector file-exporter lines through the same decode and
engine as the live service, with the same verdicts."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult

from otel_straggler import contract
from otel_straggler.detector.replay import replay

from otel_straggler.testing.otlp_spans import (eventful_observations, export_batches, heartbeat_span, json_line,
                                               otlp_json, per_step_requests, running_service, service_config,
                                               slow_rank_observations, verdict_records, without_time)
from .test_receiver import post

RANKS = 8


def write_lines(path: Path, requests, extra_lines=()) -> Path:
    text = "".join(json_line(spans) for spans in requests) + "".join(extra_lines)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def test_the_same_spans_live_and_replayed_give_the_same_verdicts(tmp_path):
    requests = per_step_requests(eventful_observations(ranks=RANKS))
    # rank 5 stops 2.8 s of span time before its peers: reported silent with a shorter export lag
    live_config = service_config(tmp_path / "live", max_export_lag_s=1.0, report_below_floor=True)
    with running_service(live_config) as service:
        exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{service.bound_ports[0]}", insecure=True, timeout=10)
        for index, spans in enumerate(requests):
            if index % 2:  # every other request as OTLP/HTTP JSON, the rest as OTLP/gRPC protobuf
                body = json.dumps(otlp_json(spans)).encode()
                assert post(service.bound_ports[1], body, "application/json")[0] == 200
            else:
                assert exporter.export(spans) is SpanExportResult.SUCCESS
    live = verdict_records(Path(live_config.evidence_dir) / "verdicts.jsonl")

    files = [write_lines(tmp_path / "part-1.jsonl", requests[:20]), write_lines(tmp_path / "part-2.jsonl.gz", requests[20:])]
    replay_config = service_config(tmp_path / "replayed", max_export_lag_s=1.0, report_below_floor=True)
    summary = replay([str(path) for path in files], replay_config)
    replayed = verdict_records(Path(replay_config.evidence_dir) / "verdicts.jsonl")

    kinds = {(record["verdict"], record["rank"]) for record in live}
    assert {("straggler", 3), ("recovered", 3), ("uncertain", 3), ("silent", 5)} <= kinds
    assert without_time(live) == without_time(replayed)
    assert summary.lines == len(requests)
    assert summary.status["spans"]["accepted"] == sum(len(spans) for spans in requests)


def test_replay_skips_lines_that_are_not_trace_requests_and_counts_them(tmp_path):
    requests = per_step_requests(slow_rank_observations(ranks=RANKS))
    path = write_lines(tmp_path / "mixed.jsonl", requests, extra_lines=[
        '{"resourceMetrics": []}\n', "\n", "not json\n", "[1, 2]\n", '{"resourceSpans": 5}\n'])
    summary = replay([str(path)], service_config(tmp_path))
    assert summary.status["requests"] == {"ok": len(requests), "not_traces": 2, "malformed": 2}
    records = verdict_records(Path(service_config(tmp_path).evidence_dir) / "verdicts.jsonl")
    assert {record["rank"] for record in records if record["verdict"] == contract.VERDICT_STRAGGLER} == {3}



def test_a_replay_waits_at_the_start_for_ranks_whose_first_lines_come_later(tmp_path):
    """Each rank's SDK sends a burst of steps every few seconds, with a heartbeat stamped when the
    burst went out, after its last span. The first line's recorded times then precede its arrival,
    and the next lines' heartbeats move the clock past a live detector's 1 s wait for ranks not seen
    yet, which would close the first windows without them. Offline, where waiting costs nothing, a
    cohort's first windows wait the longest export lag instead: no span is late, and the verdicts are
    those of the same lines without heartbeats (whose clock never jumps)."""
    observations = slow_rank_observations(ranks=RANKS, steps=40)
    with_beats, without_beats = [], []
    for first_step in (0, 15, 30):
        for rank in range(RANKS):
            burst = [o for o in observations if o.rank == rank and first_step <= o.step < first_step + 15]
            (spans,) = export_batches(burst)
            sent = burst[-1].end_unix_nano + 2_000_000_000
            beat = [heartbeat_span(rank, sent, open_stages=(("forward-compute", sent - 1_000),),
                                   step=burst[-1].step + 1)]
            with_beats.append(spans + (beat if (first_step, rank) != (0, 0) else []))
            without_beats.append(spans)
    summaries, verdicts = [], []
    for name, requests in (("with", with_beats), ("without", without_beats)):
        config = service_config(tmp_path / name)
        summaries.append(replay([str(write_lines(tmp_path / f"{name}.jsonl", requests))], config))
        verdicts.append(verdict_records(Path(config.evidence_dir) / "verdicts.jsonl"))
    assert [summary.status["spans"]["late"] for summary in summaries] == [0, 0]
    assert {(v["verdict"], v["rank"]) for v in verdicts[1]} >= {("straggler", 3)}
    assert without_time(verdicts[0]) == without_time(verdicts[1])

def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "otel_straggler", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_the_replay_command_writes_evidence_and_exits_0(tmp_path):
    path = write_lines(tmp_path / "spans.jsonl.gz", per_step_requests(slow_rank_observations(ranks=RANKS)))
    evidence = tmp_path / "evidence"
    done = cli("replay", str(path), "--evidence-dir", str(evidence), "--window-steps", "5")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1 and "straggler" in done.stdout
    records = verdict_records(evidence / "verdicts.jsonl")
    assert tuple(records[0]) == contract.VERDICT_FIELDS
    assert json.loads((evidence / "status.json").read_text())["mode"] == "replay"


def test_replay_command_errors_are_one_line_with_the_right_exit_code(tmp_path):
    missing = cli("replay", str(tmp_path / "missing.jsonl"), "--evidence-dir", str(tmp_path / "e"))
    assert missing.returncode == 1 and missing.stderr.strip().count("\n") == 0 and "no such file" in missing.stderr
    bad_flag = cli("replay", str(tmp_path / "x.jsonl"), "--window-steps", "0")
    assert bad_flag.returncode == 2 and bad_flag.stderr.strip().count("\n") == 0 and "--window-steps" in bad_flag.stderr
    bad_env = cli("replay", str(tmp_path / "x.jsonl"), env={"OTEL_STRAGGLER_REL_THRESHOLD": "fast"})
    assert bad_env.returncode == 2 and "OTEL_STRAGGLER_REL_THRESHOLD" in bad_env.stderr


def test_a_recorded_hang_replays_as_it_happened(tmp_path):
    """Its clock is the latest span end, heartbeats included: the stall after the last interval
    is as long as it was live, and the culprit is named from the recorded heartbeats."""
    from otel_straggler.testing.otlp_spans import heartbeat_span

    observations = slow_rank_observations(ranks=RANKS, steps=20)  # healthy enough: no straggler yet
    requests = per_step_requests(observations)
    stopped = max(o.end_unix_nano for o in observations)
    second = 1_000_000_000
    for beat in range(1, 80, 5):  # 80 s of heartbeats after the last interval: rank 5 in its forward
        requests.append([heartbeat_span(rank, stopped + beat * second,
                                        (("forward-compute" if rank == 5 else "all-grads-sync", stopped),))
                         for rank in range(RANKS)])
    path = write_lines(tmp_path / "hang.jsonl", requests)
    config = service_config(tmp_path, hang_timeout_s=60.0)
    replay([str(path)], config)
    hangs = [v for v in verdict_records(tmp_path / "evidence" / "verdicts.jsonl") if v["verdict"] == "hang"]
    assert [(v["rank"], v["reason"], v["stage"]) for v in hangs] == [(5, "never_entered_collective", "forward-compute")]
    assert 60 <= hangs[0]["stalled_s"] < 66 and hangs[0]["host"] == "node-0"
