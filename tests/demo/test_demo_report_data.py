from pathlib import Path

import pytest

from otel_straggler.report import report_data
from otel_straggler.report.evidence_files import Evidence, WindowMedian

from demo_synthetic_evidence import run_record, verdict, window_medians


def evidence(verdicts, windows=(), run=None):
    return Evidence(directory=Path("."), verdicts=list(verdicts), windows=list(windows), run=run, status=None)


def test_stage_grids_are_rank_by_window_in_first_seen_stage_order():
    grids = report_data.stage_grids(window_medians(windows=3))
    assert [grid.stage for grid in grids] == ["forward-compute", "backward-compute", "all-grads-sync"]
    forward = grids[0]
    assert forward.ranks == [0, 1, 2, 3] and forward.windows == [0, 1, 2]
    assert forward.median_ms[2] == [30.4, 30.4, 39.4]
    assert grids[2].collective and not forward.collective


def test_missing_cells_are_none():
    medians = [median for median in window_medians(windows=2) if not (median.rank == 1 and median.window == 1)]
    assert report_data.stage_grids(medians)[0].median_ms[1] == [30.2, None]


def test_largest_job_keeps_one_cohort():
    other = WindowMedian("job-2", "default", 0, "forward-compute", 0, 1.0, 10, False)
    assert report_data.largest_job(window_medians(windows=2) + [other]) == window_medians(windows=2)


def test_threshold_is_the_stricter_rule():
    assert report_data.threshold(100.0, 0.05, 5.0) == pytest.approx(105.0)
    assert report_data.threshold(20.0, 0.05, 5.0) == pytest.approx(25.0)


def test_timeline_from_windows_compares_the_rank_with_its_peers():
    run = run_record()
    timeline = report_data.timeline(evidence([verdict(2, 4), verdict(2, 5, stage="*")], window_medians(), run), 0.05, 5.0)
    assert (timeline.rank, timeline.stage, timeline.source) == (2, "forward-compute", "windows")
    assert timeline.rank_ms[1] == pytest.approx(30.4) and timeline.rank_ms[3] == pytest.approx(39.4)
    assert timeline.reference_ms[3] == pytest.approx(30.2)  # median of ranks 0, 1, 3
    assert (timeline.peer_low_ms[3], timeline.peer_high_ms[3]) == (pytest.approx(30.0), pytest.approx(30.6))
    assert timeline.threshold_ms[3] == pytest.approx(35.2)
    assert timeline.alert_windows == [4, 5] and timeline.injection_window == 2


def test_whole_step_alert_without_a_run_follows_the_slowest_stage():
    timeline = report_data.timeline(evidence([verdict(2, 4, stage="*")], window_medians()), 0.05, 5.0)
    assert timeline.stage == "forward-compute"


def test_timeline_from_verdicts_alone_uses_their_medians():
    verdicts = [verdict(2, 3, kind="uncertain", rank_ms=33.0, reference_ms=30.0), verdict(2, 4),
                verdict(1, 4, kind="uncertain")]
    timeline = report_data.timeline(evidence(verdicts), 0.05, 5.0)
    assert timeline.source == "verdicts" and timeline.windows == [3, 4]
    assert timeline.rank_ms == [33.0, 39.0] and timeline.threshold_ms == [pytest.approx(35.0)] * 2
    assert timeline.alert_windows == [4]


def test_no_alert_and_no_injection_means_no_timeline():
    assert report_data.timeline(evidence([verdict(1, 4, kind="uncertain")], window_medians()), 0.05, 5.0) is None


def test_notable_verdicts_skip_uncertain_and_sort_by_window():
    verdicts = [verdict(2, 6, kind="recovered"), verdict(1, 2, kind="uncertain"), verdict(2, 4), verdict(3, 5, kind="silent")]
    assert [(v["window"], v["verdict"]) for v in report_data.notable_verdicts(verdicts)] == [
        (4, "straggler"), (5, "silent"), (6, "recovered")]
    assert report_data.verdict_counts(verdicts) == {"recovered": 1, "uncertain": 1, "straggler": 1, "silent": 1}
