import io

from otel_straggler.demo.live_view import LiveView, progress_bar, verdict_line, window_table

from demo_synthetic_evidence import verdict

STAGES = ["forward-compute", "all-grads-sync"]
MEDIANS = {0: {"forward-compute": 30.0, "all-grads-sync": 29.0}, 2: {"forward-compute": 39.04, "all-grads-sync": 20.0}}


def test_progress_bar():
    assert progress_bar(0, 70, width=10) == "[..........]"
    assert progress_bar(35, 70, width=10) == "[#####.....]"
    assert progress_bar(99, 70, width=10) == "[##########]"


def test_verdict_lines():
    assert verdict_line(verdict(2, 4)) == "ALERT: straggler rank 2 in forward-compute at window 4 (1.30x its peers, +9.0 ms)"
    intermittent = verdict(2, 7, reason="intermittent", slowdown=1.5, gap_ms=15.1,
                           slow_steps={"slow": 11, "steps": 60, "share": 0.1833, "peer_share": 0.0})
    assert verdict_line(intermittent) == ("ALERT: straggler rank 2 in forward-compute at window 7 (slow in 11 of 60 "
                                          "steps, its peers in 0.0%; those steps 1.50x, +15.1 ms)")
    assert verdict_line(verdict(2, 6, kind="recovered")) == "RECOVERED: rank 2 in forward-compute at window 6"
    assert verdict_line(verdict(1, 6, kind="silent", stage="*")) == "SILENT: rank 1 stopped reporting at window 6"
    assert verdict_line(verdict(1, 6, kind="uncertain")) is None
    hang = verdict(1, 2, kind="hang", reason="never_entered_collective", stalled_s=31.2, host="node-0",
                   reference_ranks=[0, 2, 3], reference_ms=30_400.0)
    assert verdict_line(hang) == ("HANG: no interval ended for 31 s: rank 1 on node-0 never left forward-compute "
                                  "(never_entered_collective); ranks 0, 2, 3 wait in the collective (30.4 s)")
    lost = dict(hang, reason="rank_lost")
    assert verdict_line(lost).startswith("HANG: no interval ended for 31 s: rank 1 on node-0 is gone (no heartbeats")
    assert verdict_line(verdict(1, 2, kind="recovered", reason="progress_resumed")) == \
        "RESUMED: rank 1 is making progress again"
    slower = verdict(None, 14, kind="job_slowdown", stage="all-grads-sync", reason="slower_than_baseline",
                     slowdown=1.36, rank_ms=378.0, reference_ms=278.0)
    assert verdict_line(slower) == ("JOB SLOWDOWN: every rank alike, 1.36x its own baseline (378 vs 278 ms), "
                                    "most in all-grads-sync, at window 14")
    assert verdict_line(dict(slower, stage="*")).endswith("(378 vs 278 ms), at window 14")
    assert verdict_line(verdict(None, 20, kind="recovered", stage="*", reason="back_to_baseline")) == \
        "RECOVERED: the job is back to its own baseline at window 20"


def test_a_stall_shows_as_it_grows():
    stream = io.StringIO()
    view = LiveView(stream, 70, 10, "header", interactive=False)
    view.on_progress(40, 1.0)
    for seconds in (3.0, 5.5, 7.0, 10.2):
        view.on_stall(seconds)
    view.on_stall(None)
    lines = [line for line in stream.getvalue().splitlines() if line.startswith("stalled")]
    assert lines == ["stalled: no step finished for 6 s (after step 40)",
                     "stalled: no step finished for 10 s (after step 40)"]


def test_window_table_marks_flagged_cells_without_color():
    lines = window_table(4, 10, MEDIANS, STAGES, {(2, "forward-compute")}, color=False)
    assert lines[0] == "window 4 (steps 40-49), median ms per stage"
    assert lines[1].split() == ["rank", "forward-compute", "all-grads-sync"]
    assert lines[2].split() == ["0", "30.0", "29.0"]
    assert lines[3].split() == ["2", "39.0!", "20.0"]


def test_window_table_colors_flagged_cells_and_whole_step_ranks():
    lines = window_table(4, 10, MEDIANS, STAGES, {(2, "*")}, color=True)
    assert "\x1b[31m" in lines[3] and "\x1b[31m" not in lines[2]


def test_plain_output_prints_each_event_once():
    out = io.StringIO()
    view = LiveView(out, total_steps=20, window_steps=10, header="demo: 4 ranks", interactive=False)
    for step in range(1, 21):
        view.on_progress(step, 1.0)
    view.on_window(0, MEDIANS)
    view.on_verdict(verdict(2, 4))
    view.on_verdict(verdict(0, 4, kind="uncertain"))
    view.refresh()
    view.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "demo: 4 ranks"
    assert [line.split()[2] for line in lines if line.startswith("[")] == ["10/20", "20/20"]
    assert sum(line.startswith("ALERT") for line in lines) == 1
    assert sum(line.startswith("window 0") for line in lines) == 1
    assert "\x1b" not in out.getvalue()


def test_terminal_output_redraws_the_block_in_place():
    out = io.StringIO()
    view = LiveView(out, total_steps=20, window_steps=10, header="demo", interactive=True)
    view.on_progress(5, 2.0)
    view.refresh()
    view.on_window(0, MEDIANS)
    view.on_verdict(verdict(2, 0, stage="forward-compute"))
    view.refresh()
    text = out.getvalue()
    assert text.count("\x1b[1F\x1b[J") == 1  # the first block (one progress line) was erased once
    last_block = text.rsplit("\x1b[J", 1)[1]
    assert "step 5/20" in last_block and "alerts:" in last_block and "\x1b[31m" in last_block


def test_whole_step_alert_marks_the_rank_once():
    lines = window_table(4, 10, MEDIANS, STAGES, {(2, "*")}, color=False)
    assert lines[3].split()[0] == "2!"
    assert verdict_line(verdict(2, 6, kind="recovered", stage="*")) == (
        "RECOVERED: rank 2 in the whole-step compute (*) at window 6")


def test_columns_line_up_with_the_header():
    lines = window_table(4, 10, MEDIANS, STAGES, {(2, "forward-compute")}, color=False)
    assert len({len(line) for line in lines[1:]}) == 1
    header_end = lines[1].index("forward-compute") + len("forward-compute")
    assert lines[3][header_end - 4:header_end] == "39.0"


HOT = {"sm_clock_mhz": 1410, "peer_sm_clock_mhz": 1980, "clock_event_reasons": ["hw_thermal"], "temperature_c": 89,
       "power_w": 300.0, "ecc_uncorrected_delta": 0, "pcie_replay_delta": 0, "uuid": "GPU-hot"}


def test_an_alert_is_followed_by_its_gpu_evidence_and_what_to_look_at_first():
    out = io.StringIO()
    view = LiveView(out, total_steps=20, window_steps=10, header="demo", interactive=False)
    view.on_verdict(verdict(2, 4, host="node017", local_rank=2, attribution="gpu_stream_stall", gpu=HOT))
    view.on_verdict(verdict(2, 6, kind="recovered", reason="within_tolerance", host="node017", gpu=HOT))
    lines = out.getvalue().splitlines()
    assert lines[2] == ("  GPU: SM clock 1410 MHz vs 1980 at its peers; hw_thermal throttling; 89 °C; 300 W; next: "
                        "GPU GPU-hot on node017 runs at reduced clocks: check cooling: fans, inlet temperature, "
                        "airflow; `nvidia-smi -q -d PERFORMANCE,CLOCK,TEMPERATURE,POWER`, then `dcgmi diag -r 3` on "
                        "that GPU.")
    assert lines[3].startswith("RECOVERED") and len(lines) == 4  # a recovery gets no advice


def test_several_slow_ranks_of_one_host_are_said_once_as_the_node():
    out = io.StringIO()
    view = LiveView(out, total_steps=20, window_steps=10, header="demo", interactive=False,
                    host_ranks={"node017": 4, "node018": 4})
    view.on_verdict(verdict(0, 4, host="node018"))
    view.on_verdict(verdict(4, 4, host="node017"))
    assert "NODE:" not in out.getvalue()  # one of four: that rank's matter
    view.on_verdict(verdict(5, 4, host="node017"))
    view.on_verdict(verdict(6, 4, host="node017"))
    node_lines = [line for line in out.getvalue().splitlines() if line.startswith("NODE:")]
    assert node_lines == [
        "NODE: node017: 2 of 4 ranks slow (4, 5): suspect the node, not a GPU: cordon or drain node017 so the "
        "restart lands elsewhere (`kubectl cordon node017`, or `scontrol update nodename=node017 state=drain "
        "reason=straggler`), then look at what its GPUs share: chassis power and cooling, its NICs, CPU contention."]
