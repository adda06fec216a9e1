"""The one paragraph a run ends with: what was flagged, how fast, and what else was flagged.

Pure functions over verdict records (CONTRACT §3a, as dicts) and the run record.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

from otel_straggler import contract
from otel_straggler.report.evidence_files import RunRecord

Verdict = dict[str, Any]
MAX_NAMED_ALERTS = 6


@dataclass(frozen=True)
class Detection:
    """The first alert for the injected rank in the injected stage or the whole step."""

    verdict: Verdict
    windows_after_injection: int  # windows from the one the injection began in, both counted
    seconds_after_injection: Optional[float]  # None when the injection's start time is unknown


def straggler_alerts(verdicts: Iterable[Verdict]) -> list[Verdict]:
    """Alert onsets in the order they were made; those of one window by rank, each rank's leading
    stage first (the one whose `also_slow` explains others) and the whole step last."""
    alerts = [verdict for verdict in verdicts if verdict.get("verdict") == contract.VERDICT_STRAGGLER]
    return sorted(alerts, key=lambda verdict: (verdict["window"], verdict.get("time_unix_nano") or 0,
                                               verdict["rank"], _stage_order(verdict)))


def _stage_order(verdict: Verdict) -> int:
    if verdict.get("also_slow"):
        return 0
    return 2 if verdict["stage"] == contract.WHOLE_STEP_STAGE else 1


def leading_alerts(verdicts: Iterable[Verdict]) -> list[Verdict]:
    """The alerts worth naming: one whose stage another alert of the same rank and window lists in
    `also_slow` is told as part of that one ("also slow: ...")."""
    alerts = straggler_alerts(verdicts)
    explained = {_where(alert, stage) for alert in alerts for stage in alert.get("also_slow") or ()}
    return [alert for alert in alerts if alert.get("also_slow") or _where(alert, alert["stage"]) not in explained]


def _where(alert: Verdict, stage: str) -> tuple:
    return alert.get("job_id"), alert.get("cohort"), alert["rank"], alert["window"], stage


def also_slow(alert: Verdict) -> list[str]:
    """The stages the alert's stage explains, the whole step last."""
    stages = [stage for stage in alert.get("also_slow") or () if isinstance(stage, str)]
    return sorted(stages, key=lambda stage: stage == contract.WHOLE_STEP_STAGE)


def find_detection(run: RunRecord, verdicts: Iterable[Verdict]) -> Optional[Detection]:
    if run.injection is None:
        return None
    wanted_stages = (run.injection.stage, contract.WHOLE_STEP_STAGE)
    for alert in straggler_alerts(verdicts):
        if alert["rank"] == run.injection.rank and alert["stage"] in wanted_stages:
            injection_window = run.injection.from_step // run.window_steps
            started = run.injection_started_unix_nano()
            made = alert.get("time_unix_nano")
            seconds = (made - started) / 1e9 if started is not None and isinstance(made, int) else None
            return Detection(alert, alert["window"] - injection_window + 1, seconds)
    return None


def other_alerts(run: Optional[RunRecord], verdicts: Iterable[Verdict]) -> list[Verdict]:
    """Leading alerts on any rank but the injected one (all of them when nothing was injected)."""
    injected_rank = run.injection.rank if run is not None and run.injection is not None else None
    return [alert for alert in leading_alerts(verdicts) if alert["rank"] != injected_rank]


def describe_alert(alert: Verdict) -> str:
    """'rank 2 in forward-compute at window 4 (1.31x its peers, +9.4 ms)'; for an intermittent
    straggler '(slow in 11 of 60 steps, its peers in 0.0%; those steps 1.50x, +15.1 ms)'; either
    followed by '; also slow: all-grads-sync, the whole step (*)' when its stage explains others."""
    numbers = []
    slow_steps = alert.get("slow_steps")
    if isinstance(alert.get("slowdown"), (int, float)):
        numbers.append(f"{alert['slowdown']:.2f}x" + ("" if slow_steps else " its peers"))
    if isinstance(alert.get("gap_ms"), (int, float)):
        numbers.append(f"{alert['gap_ms']:+.1f} ms")
    detail = f" ({', '.join(numbers)})" if numbers else ""
    if isinstance(slow_steps, dict) and slow_steps.get("steps"):
        peers = slow_steps.get("peer_share")
        detail = (f" (slow in {slow_steps['slow']} of {slow_steps['steps']} steps"
                  + (f", its peers in {peers:.1%}" if isinstance(peers, (int, float)) else "")
                  + (f"; those steps {', '.join(numbers)})" if numbers else ")"))
    explained = also_slow(alert)
    if explained:
        also = "also slow: " + ", ".join(
            "the whole step (*)" if stage == contract.WHOLE_STEP_STAGE else stage for stage in explained)
        detail = f"{detail[:-1]}; {also})" if detail else f" ({also})"
    return f"rank {alert['rank']} in {stage_phrase(alert['stage'])} at window {alert['window']}{detail}"


def _join(phrases: list[str]) -> str:
    return phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]


def _alert_list(alerts: list[Verdict]) -> str:
    """The alerts described, the first MAX_NAMED_ALERTS of them: a large job's would fill a page."""
    named = [describe_alert(alert) for alert in alerts[:MAX_NAMED_ALERTS]]
    if len(alerts) > MAX_NAMED_ALERTS:
        named.append(f"{len(alerts) - MAX_NAMED_ALERTS} more")
    return _join(named)


def hang_verdicts(verdicts: Iterable[Verdict]) -> list[Verdict]:
    return sorted((verdict for verdict in verdicts if verdict.get("verdict") == contract.VERDICT_HANG),
                  key=lambda verdict: verdict.get("time_unix_nano") or 0)


def describe_hang_culprit(verdict: Verdict) -> str:
    """'rank 2 (never_entered_collective, in forward-compute)' or 'the job (all_ranks_waiting, ...)'."""
    who = "no single rank" if verdict.get("rank") is None else f"rank {verdict['rank']}"
    where = f" on {verdict['host']}" if verdict.get("host") else ""
    return f"{who}{where} ({verdict['reason']}, in {stage_phrase(verdict['stage'])})"


def _summarize_hang(run: RunRecord, verdicts: list[Verdict]) -> list[str]:
    injection = run.injection
    assert injection is not None  # called for a run that injected a hang only
    hangs = hang_verdicts(verdicts)
    culprit = next((verdict for verdict in hangs if verdict.get("rank") == injection.rank), None)
    blocked = f"rank {injection.rank} blocked in {injection.stage} at step {injection.from_step}"
    if culprit is None:
        sentences = [f"The hang ({blocked}) was not named."]
    else:
        started, made = run.injection_started_unix_nano(), culprit.get("time_unix_nano")
        after = (f" {(made - started) / 1e9:.1f} s after it blocked" if started is not None and isinstance(made, int)
                 else "")
        timeout = f" (hang timeout {run.hang_timeout_s:g} s)" if run.hang_timeout_s is not None else ""
        sentences = [f"Named the hang's culprit: {describe_hang_culprit(culprit)},{after}{timeout}; {blocked}."]
    others = [verdict for verdict in hangs if verdict is not culprit]
    if others:
        sentences.append(f"Also said of the hang: {_join([describe_hang_culprit(verdict) for verdict in others])}.")
    return sentences


def summarize(run: Optional[RunRecord], verdicts: list[Verdict]) -> str:
    """The closing paragraph. Without a run record (a detector's evidence alone) it lists the alerts."""
    sentences = []
    others = other_alerts(run, verdicts)
    if run is not None and run.injection is not None and run.injection.hang:
        sentences += _summarize_hang(run, verdicts)
        if others:
            sentences.append(f"Straggler alerts: {_alert_list(others)}.")
    elif run is not None and run.injection is not None:
        injection = run.injection
        injected = (f"injected slowdown (+{injection.slowdown:.0%} in {injection.stage} on rank {injection.rank} "
                    f"from step {injection.from_step})")
        detection = find_detection(run, verdicts)
        if detection is None:
            sentences.append(f"The {injected} was not flagged within {len(run.step_end_unix_nano)} steps.")
        else:
            after = f"{detection.windows_after_injection} window{'s' if detection.windows_after_injection != 1 else ''}"
            if detection.seconds_after_injection is not None:
                after += f" and {detection.seconds_after_injection:.1f} s"
            sentences.append(f"Flagged {describe_alert(detection.verdict)}, {after} after the {injected} began.")
        # the detected stage again (the steady rule taking over from the intermittent one's alert,
        # or an alert after a recovery) is the same finding, not another stage flagged
        same_rank_elsewhere = [
            alert for alert in leading_alerts(verdicts)
            if alert["rank"] == injection.rank and (detection is None or alert["stage"] != detection.verdict["stage"])
        ]
        if same_rank_elsewhere:
            also = "also " if detection is not None else ""
            stages = [stage_phrase(stage) for stage in _stages_whole_step_last(same_rank_elsewhere)]
            sentences.append(f"Rank {injection.rank} was {also}flagged in {_join(stages)}.")
        sentences.append("No other rank was flagged." if not others else
                         f"Other ranks flagged: {_alert_list(others)}.")
    elif run is not None:
        windows = -(-len(run.step_end_unix_nano) // run.window_steps)
        sentences.append(
            f"No rank was flagged over {len(run.step_end_unix_nano)} healthy steps ({windows} windows)." if not others
            else f"Flagged with no slowdown injected: {_alert_list(others)}.")
    else:
        sentences.append("No straggler alert in this evidence." if not others
                         else f"Straggler alerts: {_alert_list(others)}.")
    if run is not None and len(run.losses) >= 2:
        sentences.append(f"Training loss went from {run.losses[0]:.2f} to {run.losses[-1]:.2f}.")
    return " ".join(sentences)


def _stages_whole_step_last(alerts: list[Verdict]) -> list[str]:
    return sorted({alert["stage"] for alert in alerts}, key=lambda stage: (stage == contract.WHOLE_STEP_STAGE, stage))


def stage_phrase(stage: str) -> str:
    return "the whole-step compute (*)" if stage == contract.WHOLE_STEP_STAGE else stage
