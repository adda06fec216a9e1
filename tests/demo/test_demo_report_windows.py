"""The report of a detector's evidence directory (no demo.json), with the windows.jsonl the detector
writes: heat map, a timeline per alerted stage with its onset, the job, uncertain verdicts counted,
and the headline led by each alert's leading stage."""
from __future__ import annotations

from pathlib import Path

import pytest

from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.evidence import EvidenceFiles, verdict_line
from otel_straggler.detector.observation import Observation
from otel_straggler.detector.window_record import WindowRecord, detector_engine
from otel_straggler.report import evidence_files, figures, html_report, report_data
from otel_straggler.report.summary import leading_alerts, summarize

from demo_synthetic_evidence import verdict

JOB = "job-7"
STAGES = (("batch-generator", 20.0, False), ("forward-compute", 30.0, False), ("all-grads-sync", 10.0, True))
SLOW_RANK, SLOW_FROM_STEP, STEPS, WINDOW_STEPS = 2, 30, 90, 10


def observations() -> list[Observation]:
    """Four ranks; from step 30 rank 2 takes 50% longer in batch-generator, and the others wait for
    it in all-grads-sync, which every rank leaves at the same time. A little deterministic jitter,
    as real ranks have."""
    spans = []
    for step in range(STEPS):
        step_start_ms = step * 200.0
        compute_ms = {}
        for rank in range(4):
            durations = []
            for index, (stage, base_ms, collective) in enumerate(STAGES[:2]):
                host_ms = base_ms * (1.0 + 0.01 * ((rank * 7 + step * 3 + index) % 5))
                if step >= SLOW_FROM_STEP and rank == SLOW_RANK and stage == "batch-generator":
                    host_ms *= 1.5
                durations.append((stage, host_ms))
            compute_ms[rank] = durations
        sync_end_ms = step_start_ms + max(sum(ms for _, ms in durations) for durations in compute_ms.values()) + 10.0
        for rank, durations in compute_ms.items():
            end_ms = step_start_ms
            for index, (stage, host_ms) in enumerate(durations):
                end_ms += host_ms
                spans.append(_span(rank, stage, step, index, host_ms, False, end_ms))
            spans.append(_span(rank, "all-grads-sync", step, 2, sync_end_ms - end_ms, True, sync_end_ms))
    return spans


def _span(rank: int, stage: str, step: int, index: int, host_ms: float, collective: bool, end_ms: float) -> Observation:
    return Observation(JOB, 0, "default", rank, stage, step, step * 3 + index, host_ms, None, collective, None, None,
                       1_700_000_000_000_000_000 + int(end_ms * 1e6))


@pytest.fixture(scope="module")
def detector_evidence(tmp_path_factory) -> Path:
    """What a detector leaves: verdicts.jsonl and windows.jsonl, written by its own writers."""
    directory = tmp_path_factory.mktemp("evidence")
    config = DetectorConfig(window_steps=WINDOW_STEPS, evidence_dir=str(directory))
    record = WindowRecord.from_config(config)
    engine = detector_engine(config, record)
    engine.ingest_many(observations())
    verdicts = engine.drain(1_800_000_000_000_000_000)
    assert record.stop(timeout_s=10)
    files = EvidenceFiles(str(directory), 1 << 20)
    files.append(verdict_line(made) for made in verdicts)
    files.close()
    return directory


def test_the_detector_windows_give_a_heat_map_with_the_whole_step_first(detector_evidence):
    evidence = evidence_files.load(detector_evidence)
    grids = report_data.stage_grids(report_data.largest_job(evidence.windows))
    assert [grid.stage for grid in grids] == ["*", "batch-generator", "forward-compute", "all-grads-sync"]
    batch = grids[1]
    assert batch.ranks == [0, 1, 2, 3] and batch.windows == list(range(STEPS // WINDOW_STEPS))
    assert batch.median_ms[SLOW_RANK][5] > 1.4 * batch.median_ms[0][5]
    assert report_data.job_ids(evidence) == [JOB]


def test_each_alerted_stage_gets_a_timeline_with_its_onset(detector_evidence):
    evidence = evidence_files.load(detector_evidence)
    alerts = [alert for alert in evidence.verdicts if alert["verdict"] == "straggler"]
    assert {alert["rank"] for alert in alerts} == {SLOW_RANK}
    timelines = report_data.timelines(evidence, 0.05, 5.0, persist_windows=3)
    stages = [timeline.stage for timeline in timelines]
    assert "batch-generator" in stages and set(stages) == {alert["stage"] for alert in alerts}
    batch = timelines[stages.index("batch-generator")]
    assert batch.source == "windows" and batch.windows == list(range(STEPS // WINDOW_STEPS))
    (alert,) = [alert for alert in alerts if alert["stage"] == "batch-generator"]
    assert batch.alert_windows == [alert["window"]]
    assert batch.onset_windows == [alert["window"] - 2] == [SLOW_FROM_STEP // WINDOW_STEPS]
    assert batch.rank_ms[5] > batch.threshold_ms[5]


def test_the_report_of_a_detector_directory_is_complete(detector_evidence, tmp_path):
    built = html_report.build(detector_evidence, tmp_path)
    html = built.html_path.read_text()
    assert [path.name for path in built.picture_paths] == [html_report.HEATMAP_FILE, html_report.TIMELINE_FILE,
                                                           html_report.VERDICTS_PICTURE_FILE]
    assert "no heat map" not in html
    assert f"Job <code>{JOB}</code>" in html and "4 ranks" in html
    assert "Straggler alerts: rank 2 in batch-generator" in built.summary


def also_slow_verdicts() -> list[dict]:
    """One window's alerts of rank 1 as the detector makes them when one stage explains the others,
    in the order it writes them (the whole step first), and an uncertain verdict or two."""
    return [
        verdict(1, 9, stage="*", rank_ms=130.0),
        verdict(1, 9, stage="ddp-grads-ready", rank_ms=20.0),
        verdict(1, 9, stage="batch-generator", also_slow=["*", "ddp-grads-ready"]),
        verdict(3, 9, stage="forward-compute"),
        verdict(0, 4, kind="uncertain", stage="all-grads-sync", reason="waiting_on_peer"),
        verdict(2, 5, kind="uncertain", stage="all-grads-sync", reason="waiting_on_peer"),
        verdict(2, 6, kind="uncertain", stage="*", reason="below_absolute_floor"),
    ]


def test_the_headline_leads_with_the_stage_that_explains_the_others():
    text = summarize(None, also_slow_verdicts())
    assert text == ("Straggler alerts: rank 1 in batch-generator at window 9 (1.30x its peers, +9.0 ms; also slow: "
                    "ddp-grads-ready, the whole step (*)) and rank 3 in forward-compute at window 9 "
                    "(1.30x its peers, +9.0 ms).")
    assert [(alert["rank"], alert["stage"]) for alert in leading_alerts(also_slow_verdicts())] == [
        (1, "batch-generator"), (3, "forward-compute")]


def test_many_alerts_are_named_up_to_a_bound():
    text = summarize(None, [verdict(rank, 4) for rank in range(10)])
    assert "rank 5 in forward-compute" in text and "rank 6 " not in text and "and 4 more." in text


def test_verdicts_of_one_window_share_one_label_leading_stage_first():
    labels = figures.alert_labels(also_slow_verdicts())
    assert labels == {(9, 1): "batch-generator\nalso: ddp-grads-ready, *", (9, 3): "forward-compute"}


def test_uncertain_verdicts_are_counted_by_reason_and_stage():
    assert report_data.uncertain_counts(also_slow_verdicts()) == [
        ("waiting_on_peer", "all-grads-sync", 2), ("below_absolute_floor", "*", 1)]


def test_the_alert_table_lists_the_leading_stage_first_and_the_whole_step_last():
    order = [(v["rank"], v["stage"]) for v in report_data.notable_verdicts(also_slow_verdicts())]
    assert order == [(1, "batch-generator"), (1, "ddp-grads-ready"), (1, "*"), (3, "forward-compute")]


def test_timelines_follow_the_leading_stage_first_and_mark_the_alert_on_explained_ones():
    from demo_synthetic_evidence import window_medians

    verdicts = [verdict(2, 4, stage="*"), verdict(2, 4, stage="backward-compute", also_slow=["forward-compute", "*"]),
                verdict(2, 4)]
    evidence = evidence_files.Evidence(directory=Path("."), verdicts=verdicts, windows=window_medians(),
                                       run=None, status=None)
    timelines = report_data.timelines(evidence, 0.05, 5.0, persist_windows=3)
    # windows.jsonl of the demo of before has no `*`: the whole step falls back to a stage shown already
    assert [timeline.stage for timeline in timelines] == ["backward-compute", "forward-compute"]
    assert timelines[0].also_slow == ("forward-compute", "*") and timelines[1].alert_windows == [4]
    assert timelines[1].onset_windows == [2]


def test_a_device_time_alert_is_drawn_in_device_time():
    from otel_straggler.report.evidence_files import WindowMedian

    windows = [WindowMedian(JOB, "default", rank, "forward-compute", window, 40.0, 10, False,
                            30.0 + (5.0 if rank == 1 and window >= 2 else 0.0))
               for window in range(4) for rank in range(3)]
    alert = verdict(1, 3, timing="device", job_id=JOB)
    evidence = evidence_files.Evidence(directory=Path("."), verdicts=[alert], windows=windows, run=None, status=None)
    (timeline,) = report_data.timelines(evidence, 0.05, 1.0, persist_windows=2)
    assert timeline.timing == "device" and timeline.rank_ms == [30.0, 30.0, 35.0, 35.0]
    assert timeline.onset_windows == [2]
