import signal
import time
from pathlib import Path

import pytest

from otel_straggler.demo.launcher import LaunchPlan, RankFailure, RankGroup, describe_exit, parse_progress

HERE = Path(__file__).parent


def test_parse_progress():
    assert parse_progress("step 12/70 loss 1.2345\n") == (12, 1.2345)
    assert parse_progress("step 3/9 loss ?") == (3, None)
    assert parse_progress("Warning: something") is None


def test_describe_exit():
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"


def run_group(tmp_path, *trainer_args, stall_timeout_s=10.0, deadline_s=30.0):
    progress = []
    plan = LaunchPlan(ranks=3, trainer_args=tuple(trainer_args), env={"PYTHONPATH": str(HERE)},
                      log_dir=tmp_path / "ranks", stall_timeout_s=stall_timeout_s, trainer_module="fake_rank")
    group = RankGroup(plan, lambda steps, loss: progress.append((steps, loss)))
    group.start()
    started = time.monotonic()
    try:
        while not group.poll():
            assert time.monotonic() - started < deadline_s, "the launcher did not end the run in time"
            time.sleep(0.05)
    finally:
        group.stop()
    return progress, group


def test_all_ranks_finish_and_progress_arrives(tmp_path):
    progress, group = run_group(tmp_path, "--steps", "4")
    assert [steps for steps, _ in progress] == [1, 2, 3, 4]
    assert progress[-1][1] == pytest.approx(0.25)
    assert "step 4/4" in group.log_path(0).read_text()


def test_a_failing_rank_ends_the_run_with_its_name_and_log(tmp_path):
    started = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_group(tmp_path, "--steps", "100", "--fail-rank", "1", "--fail-at", "3")
    message = str(failure.value)
    assert message.startswith("rank 1 exited with code 3")
    assert "simulated failure" in message and "rank-1.log" in message
    assert time.monotonic() - started < 20


def test_a_stalled_job_is_stopped(tmp_path):
    with pytest.raises(RankFailure, match="no progress for 1 s after step 2"):
        run_group(tmp_path, "--steps", "100", "--hang-at", "2", stall_timeout_s=1.0)
