from otel_straggler.report.evidence_files import Injection
from otel_straggler.report.summary import find_detection, other_alerts, summarize

from demo_synthetic_evidence import run_record, verdict


def test_detection_counts_windows_and_seconds_from_the_injection():
    run = run_record()  # injected at step 20 (window 2); step 19 ended at 4.0 s
    made = run.started_unix_nano + int(10.5e9)
    detection = find_detection(run, [verdict(2, 4, made_unix_nano=made)])
    assert detection is not None
    assert detection.windows_after_injection == 3
    assert abs(detection.seconds_after_injection - 6.5) < 1e-6


def test_whole_step_alert_counts_as_detection_but_other_stages_do_not():
    run = run_record()
    assert find_detection(run, [verdict(2, 4, stage="*")]).verdict["stage"] == "*"
    assert find_detection(run, [verdict(2, 4, stage="backward-compute")]) is None
    assert find_detection(run, [verdict(1, 4)]) is None
    assert find_detection(run, [verdict(2, 4, kind="uncertain")]) is None


def test_earliest_window_wins():
    run = run_record()
    detection = find_detection(run, [verdict(2, 6, stage="*"), verdict(2, 4)])
    assert detection.verdict["window"] == 4


def test_summary_names_rank_stage_latency_and_no_other_rank():
    run = run_record()
    text = summarize(run, [verdict(2, 4, made_unix_nano=run.started_unix_nano + int(10.5e9)),
                           verdict(2, 5, stage="*"), verdict(0, 3, kind="uncertain")])
    assert "rank 2 in forward-compute at window 4" in text
    assert "3 windows and 6.5 s after" in text
    assert "1.30x its peers" in text and "+9.0 ms" in text
    assert "also flagged in the whole-step compute (*)" in text
    assert "No other rank was flagged." in text
    assert "2.30 to 1.10" in text


def test_the_detected_stage_flagged_again_by_another_rule_is_not_another_flag():
    """The intermittent rule's onset first, then the steady rule's on the same stage (it takes the
    alert over): one finding, not 'also flagged in forward-compute'."""
    run = run_record()
    text = summarize(run, [verdict(2, 4, reason="intermittent", slow_steps={"slow": 21, "steps": 60}),
                           verdict(2, 5)])
    assert "rank 2 in forward-compute at window 4 (slow in 21 of 60 steps" in text
    assert "also flagged" not in text and "No other rank was flagged." in text


def test_summary_reports_other_ranks_and_a_miss():
    run = run_record()
    text = summarize(run, [verdict(1, 5, stage="backward-compute")])
    assert "was not flagged within 70 steps" in text
    assert "Other ranks flagged: rank 1 in backward-compute at window 5" in text
    assert [alert["rank"] for alert in other_alerts(run, [verdict(1, 5), verdict(2, 4)])] == [1]


def test_healthy_summary():
    run = run_record(injection=None)
    assert "No rank was flagged over 70 healthy steps (7 windows)." in summarize(run, [verdict(0, 3, kind="uncertain")])
    assert "Flagged with no slowdown injected: rank 3" in summarize(run, [verdict(3, 4)])


def test_summary_without_a_run_record_lists_alerts():
    assert summarize(None, []) == "No straggler alert in this evidence."
    assert "rank 5 in forward-compute at window 9" in summarize(None, [verdict(5, 9)])


def test_unknown_injection_time_still_gives_windows():
    run = run_record(injection=Injection(2, "forward-compute", 20, 0.3), steps_done=10)
    detection = find_detection(run, [verdict(2, 4)])
    assert detection.windows_after_injection == 3 and detection.seconds_after_injection is None


def hang(rank, reason="never_entered_collective", stage="forward-compute", made_unix_nano=0, host="node-0"):
    return verdict(rank, 2, kind="hang", stage=stage, made_unix_nano=made_unix_nano, reason=reason, slowdown=None,
                   gap_ms=None, stalled_s=31.0, host=host, local_rank=rank)


def test_hang_summary_names_the_culprit_and_how_long_it_took():
    run = run_record(injection=Injection(2, "forward-compute", 20, 0.3, hang=True))
    run.hang_timeout_s = 30.0
    text = summarize(run, [hang(2, made_unix_nano=run.started_unix_nano + int(35e9))])  # blocked at 4.0 s
    assert text.startswith("Named the hang's culprit: rank 2 on node-0 (never_entered_collective, in forward-compute), "
                           "31.0 s after it blocked (hang timeout 30 s)")
    assert "Also said" not in text


def test_hang_summary_says_a_miss_and_what_else_was_said():
    run = run_record(injection=Injection(2, "forward-compute", 20, 0.3, hang=True))
    text = summarize(run, [hang(None, reason="all_ranks_waiting", stage="all-grads-sync", host=None)])
    assert "The hang (rank 2 blocked in forward-compute at step 20) was not named." in text
    assert "Also said of the hang: no single rank (all_ranks_waiting, in all-grads-sync)" in text
