"""The demo's and report's flags fail in one line with exit code 2, before anything starts."""
import socket

import pytest

from otel_straggler import cli
from otel_straggler.demo import demo_command


def one_line_error(capsys, argv):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.parametrize("flags, expected", [
    (["--ranks", "100000"], "this machine can run at most"),
    (["--ranks", "2"], "at least 3 ranks"),
    (["--slow-rank", "4"], "--slow-rank 4: must be a rank of the job, 0 to 3"),
    (["--slowdown", "0"], "--slowdown 0: must be above 0"),
    (["--from-step", "120"], "--from-step 120: must be a step of the run, 0 to 119"),
    (["--steps", "30"], "needs at least 5 windows"),
    (["--grpc-port", "70000"], "--grpc-port 70000: must be 0 to 65535"),
    (["--hang", "--healthy"], "--hang and --healthy: pick one"),
    (["--hang", "--hang-timeout-s", "0"], "--hang-timeout-s 0: must be 1 to 3600"),
])
def test_bad_demo_flags(capsys, tmp_path, flags, expected):
    line = one_line_error(capsys, ["demo", "--out", str(tmp_path / "out"), *flags])
    assert line.startswith("otel-straggler demo: ") and expected in line
    assert not (tmp_path / "out").exists()


def test_port_in_use(capsys, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_line_error(capsys, ["demo", "--out", str(tmp_path / "out"), "--grpc-port", str(port)])
    assert f"--grpc-port {port}: cannot listen on it" in line and "pick another port" in line
    assert not (tmp_path / "out").exists()


def test_torch_missing(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(demo_command, "torch_installed", lambda: False)
    line = one_line_error(capsys, ["demo", "--out", str(tmp_path / "out")])
    assert "pip install torch" in line


def test_out_folder_must_be_new(capsys, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    assert "exists and is not an empty folder" in one_line_error(capsys, ["demo", "--out", str(tmp_path)])
    assert "exists and is not an empty folder" in one_line_error(capsys, ["demo", "--out", str(tmp_path / "keep.txt")])


def test_report_of_a_folder_without_evidence(capsys, tmp_path):
    line = one_line_error(capsys, ["report", str(tmp_path)])
    assert line.startswith("otel-straggler report: ") and "holds no verdicts.jsonl" in line


def test_machine_rank_limit_counts_cores(monkeypatch):
    monkeypatch.setattr(demo_command, "_usable_cores", lambda: 2)
    monkeypatch.setattr(demo_command, "_available_memory_bytes", lambda: None)
    assert demo_command.machine_rank_limit() == 8
    monkeypatch.setattr(demo_command, "_available_memory_bytes", lambda: 3 * demo_command.RANK_MEMORY_BYTES)
    assert demo_command.machine_rank_limit() == 3


def test_runs_without_out_go_to_the_cache_not_the_working_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OTEL_STRAGGLER_CACHE", str(tmp_path / "cache"))
    runs_dir = demo_command.demo_runs_dir(demo_command.os.environ)
    assert runs_dir == tmp_path / "cache" / "demo-runs"
    first = demo_command._fresh_out_dir(None, runs_dir)
    second = demo_command._fresh_out_dir(None, runs_dir)
    assert first.parent == runs_dir and second.parent == runs_dir and first != second
    assert first.is_absolute() and list(tmp_path.iterdir()) == [tmp_path / "cache"]


def test_the_default_folder_keeps_the_newest_runs_and_nothing_else_is_touched(tmp_path):
    runs_dir = tmp_path / "demo-runs"
    old_runs = [f"20260101-1200{second:02d}" for second in range(12)] + ["20260101-120011-1"]
    for name in old_runs + ["mine"]:
        (runs_dir / name).mkdir(parents=True)
    (runs_dir / "20260101-000000.txt").write_text("not a run")
    new_run = demo_command._fresh_out_dir(None, runs_dir)
    kept = sorted(path.name for path in runs_dir.iterdir() if demo_command.RUN_NAME.fullmatch(path.name))
    assert len(kept) == demo_command.DEMO_RUNS_KEPT and new_run.name in kept
    assert old_runs[-(demo_command.DEMO_RUNS_KEPT - 1):] == [name for name in kept if name != new_run.name]
    assert (runs_dir / "mine").is_dir() and (runs_dir / "20260101-000000.txt").is_file()
