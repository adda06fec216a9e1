"""Training overhead of the instrumentation: ON against OFF, in paired runs, on two workloads.

    python benchmarks/overhead.py [--quick] [--workload NAME] [--json overhead.json] [--nice N]
        [--protocol http/protobuf | --protocol grpc]

Arms (benchmarks/demo_training.py runs them; same code, same seeds, only the switch differs):
  OFF  the library is not configured: ots.step()/ots.stage() are no-ops
  ON   the full path: stages, fake device events, span building, batching, OTLP export to a
       live detector (DetectorService on 127.0.0.1, started here, in this process), over
       OTLP/HTTP by default, the export the docs recommend for ranks (--protocol grpc: gRPC)
Workloads:
  loop-50ms    one process, torch.set_num_threads(1), the demo's MLP sized to about 50 ms a
               step, four stages per step (no all-reduce)
  ddp-4-ranks  the demo's job: 4 gloo ranks as 4 processes (on however many cores there are),
               five stages per step including the gradient all-reduce. A rank's step time is
               its own host time per step; the arm's figure is the mean over the 4 ranks
               (rank-mean, the primary figure); the slowest rank's mean is reported too.
The protocol (paired_protocol.py) is fixed below, before any run, and printed with the result;
the pairs of a workload all run in the same processes, one after another. Also measured in
the same run, to explain the figure: CPU time of the background threads per step (ON minus
OFF, and the library's own threads by name), the detector's CPU per step, garbage collections
per step, the training thread's own CPU and its waiting (wall time minus CPU: for the GIL or a
core) per step, ON minus OFF, and the hot path per step (intervals per step x ns per interval, from
benchmarks/hot_path.py in the single-process run), and the training thread's page faults and
context switches (voluntary: it blocked; involuntary: it was preempted) per step.
The machine is shared: the load average is printed with the result, and --nice can put the
benchmark ahead of other processes. Both arms' processes keep the memory they free mapped
(benchmarks/allocators.py; --allocator glibc-default leaves glibc's own heuristics).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from allocators import ALLOCATORS, allocator_environment
from paired_protocol import OFF, ON, TARGET_CI_HIGH_PCT, TARGET_POINT_PCT, Protocol, summarize

from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.service import DetectorService

HARNESS = Path(__file__).resolve().parent / "demo_training.py"
# The library's own threads on a rank: its builder and device-timing threads, and the SDK
# BatchSpanProcessor's worker that encodes and exports.
LIBRARY_THREAD_PREFIXES = ("otel-straggler-", "OtelBatchSpanRecordProcessor")


@dataclass(frozen=True)
class Workload:
    name: str
    world_size: int
    hidden: int
    batch_size: int
    stages_per_step: int
    protocol: Protocol
    quick: Protocol


# Sized from the spread of per-pair estimates on the 2-core VM (2026-11-29), not from any
# estimate of the effect: step times wander by a few % over seconds, so the loop's per-pair
# estimates spread by 4.7% (sd, 200 pairs of this design), and 450 pairs make its 95% interval
# about +-0.43%. The 4-rank job's 256 pairs are sized from the spread its 12 pairs showed in the
# run of 2026-11-30 04:10 (sd 3.67%, freed memory kept mapped; 6-8% before), for an interval of
# about +-0.45%. Shorter arms and more pairs resolve more per minute than long arms.
# Warm-up: at least one build interval (1 s), then up to one more at random (see paired_protocol).
WORKLOADS = (
    Workload("loop-50ms", world_size=1, hidden=1024, batch_size=256, stages_per_step=4,
             protocol=Protocol(pairs=450, warmup_steps=25, warmup_extra_steps=23, steps_per_arm=30),
             quick=Protocol(pairs=2, warmup_steps=2, warmup_extra_steps=2, steps_per_arm=8)),
    Workload("ddp-4-ranks", world_size=4, hidden=1024, batch_size=128, stages_per_step=5,
             protocol=Protocol(pairs=256, warmup_steps=12, warmup_extra_steps=11, steps_per_arm=40),
             quick=Protocol(pairs=2, warmup_steps=2, warmup_extra_steps=2, steps_per_arm=6)),
)
HOT_PATH_INTERVALS = {False: 20_000, True: 2_000}  # by --quick
# The launcher gives up on the ranks after this many seconds a pair (a pair takes about 10 s on
# the 2-core VM): a guard against a hung rank, never a limit on a long protocol.
RANK_TIMEOUT_S_PER_PAIR = 60.0
OTLP_PROTOCOLS = ("grpc", "http/protobuf")  # in the order of the detector's bound ports


def run_workload(workload: Workload, protocol: Protocol, endpoint: str, otlp_protocol: str, out_dir: Path,
                 hot_path_intervals: int, allocator: str) -> list[dict]:
    command = [sys.executable, str(HARNESS), "--schedule", ",".join(protocol.schedule()), "--protocol", otlp_protocol,
               "--warmup", ",".join(map(str, protocol.warmups())), "--steps", str(protocol.steps_per_arm),
               "--world-size", str(workload.world_size), "--hidden", str(workload.hidden),
               "--batch-size", str(workload.batch_size), "--endpoint", endpoint,
               "--job-prefix", f"overhead-{workload.name}", "--out", str(out_dir),
               "--timeout-s", str(max(900.0, RANK_TIMEOUT_S_PER_PAIR * protocol.pairs))]
    if hot_path_intervals:
        command += ["--hot-path-intervals", str(hot_path_intervals)]
    subprocess.run(command, check=True, env=allocator_environment(allocator, os.environ))
    return [json.loads((out_dir / f"rank-{rank}.json").read_text()) for rank in range(workload.world_size)]


def background_cpu_ns(arm: dict) -> int:
    """Every thread but the training thread's steps: background threads, threads that ended
    meanwhile, and the final flush (which the training thread runs)."""
    return arm["process_cpu_ns"] - arm["training_thread_cpu_ns"]


def library_threads_cpu_ns(arm: dict) -> int:
    return sum(cpu for name, cpu in arm["thread_cpu_ns"].items() if name.startswith(LIBRARY_THREAD_PREFIXES))


def analyze(workload: Workload, protocol: Protocol, ranks: list[dict], detector_cpu_ns: int, hot_path: dict) -> dict:
    schedule = protocol.schedule()
    arms_by_rank = [rank["arms"] for rank in ranks]
    rank_means = [[statistics.mean(arms[index]["step_s"]) for arms in arms_by_rank] for index in range(len(schedule))]
    arm_means = [statistics.mean(means) for means in rank_means]
    arm_medians = [statistics.mean(statistics.median(arms[index]["step_s"]) for arms in arms_by_rank)
                   for index in range(len(schedule))]
    step_s = {arm: statistics.mean(mean for mean, name in zip(arm_means, schedule) if name == arm) for arm in (OFF, ON)}

    def per_step(arm_name: str, measure) -> float:
        """Mean over the arms of that name and over ranks of a figure per measured step."""
        return statistics.mean(measure(arms[index]) / protocol.steps_per_arm
                               for index, name in enumerate(schedule) if name == arm_name for arms in arms_by_rank)

    def per_step_ms(arm_name: str, measure) -> float:
        """per_step() of a CPU figure in ns, in ms."""
        return per_step(arm_name, measure) / 1e6

    background = {arm: per_step_ms(arm, background_cpu_ns) for arm in (OFF, ON)}
    library_threads = per_step_ms(ON, library_threads_cpu_ns)
    training_thread = {arm: per_step_ms(arm, lambda record: record["training_thread_cpu_ns"]) for arm in (OFF, ON)}
    # wall time the training thread spent not running: waiting for the GIL or for a core
    training_waits = {arm: per_step_ms(arm, lambda record: sum(record["step_s"]) * 1e9 - record["training_thread_cpu_ns"])
                      for arm in (OFF, ON)}
    page_faults = {arm: per_step(arm, lambda record: record["training_thread_page_faults"]) for arm in (OFF, ON)}
    switches = {arm: {kind: per_step(arm, lambda record, kind=kind: record["training_thread_context_switches"][kind])
                      for kind in ("voluntary", "involuntary")}
                for arm in (OFF, ON)}
    gc_per_1000_steps = {arm: [1000 * per_step(arm, lambda record, generation=generation:
                                               record["gc_collections"][generation]) for generation in range(3)]
                         for arm in (OFF, ON)}
    on_steps = sum(warmup + protocol.steps_per_arm for warmup, name in zip(protocol.warmups(), schedule) if name == ON)
    intervals_per_step = workload.stages_per_step + 1  # the step() mark counted as one more interval
    hot_path_ms = intervals_per_step * hot_path["ns_per_interval"] / 1e6
    # ON and OFF of a pair run the same steps (a pair's warm-up is the same for both arms)
    identical = all((arms[first]["losses"], arms[first]["state_sha256"]) == (arms[first + 1]["losses"],
                                                                             arms[first + 1]["state_sha256"])
                    for arms in arms_by_rank for first in range(0, len(schedule), 2))
    lost = [sum(arm["status"]["lost"].values()) for arms in arms_by_rank for arm in arms if arm["status"]]
    return {
        "workload": {"world_size": workload.world_size, "hidden": workload.hidden, "batch_size": workload.batch_size,
                     "stages_per_step": workload.stages_per_step},
        "protocol": protocol.as_dict(), "schedule": schedule, "arm_mean_step_s": arm_means,
        "rank_mean_step_s": rank_means,
        "overhead_rank_mean": summarize(protocol, arm_means),
        "overhead_slowest_rank": summarize(protocol, [max(means) for means in rank_means]),
        # secondary, robust to the odd step stalled by another process: medians instead of means
        "overhead_medians": summarize(protocol, arm_medians),
        "step_ms": {arm: seconds * 1e3 for arm, seconds in step_s.items()},
        "background_cpu_ms_per_step": background,
        "extra_background_cpu_ms_per_step": background[ON] - background[OFF],
        "library_threads_cpu_ms_per_step": library_threads,
        "training_thread_cpu_ms_per_step": training_thread,
        "training_thread_waiting_ms_per_step": training_waits,
        "gc_collections_per_1000_steps": gc_per_1000_steps,
        "training_thread_page_faults_per_step": page_faults,
        "training_thread_context_switches_per_step": switches,
        # the detector runs in this process, which otherwise only waits
        "detector_cpu_ms_per_step": detector_cpu_ns / on_steps / 1e6,
        "hot_path": {**hot_path, "intervals_per_step": intervals_per_step, "ms_per_step": hot_path_ms,
                     "pct_of_step": 100 * hot_path_ms / (step_s[OFF] * 1e3)},
        "losses_and_state_identical_across_arms": identical,
        "spans_lost": sum(lost),
    }


def print_report(report: dict) -> None:
    machine = report["machine"]
    print(f"\notel-straggler training overhead, ON vs OFF — {report['date']}, {machine['cores']} cores"
          f" ({machine['processor']}), python {machine['python']}, torch {machine['torch']},"
          f" load average {machine['load_before'][0]:.1f} before / {machine['load_after'][0]:.1f} after,"
          f" niceness {report['niceness']}, hot path in {machine.get('hot_path', 'python')},"
          f" allocator {report['allocator']}, export OTLP {report.get('otlp_protocol', 'grpc')}")
    print(f"target: mean < {TARGET_POINT_PCT}% and 95% CI upper bound < {TARGET_CI_HIGH_PCT}%")
    if report["quick"]:
        print("--quick: a smoke run of the machinery; its figures are not a result")
    for name, result in report["workloads"].items():
        print(f"\n{name}: {Protocol(**result['protocol']).describe()}")
    print(f"\n{'workload':34} {'OFF ms/step':>11} {'ON ms/step':>11} {'overhead %':>11} {'95% CI %':>18} {'target':>11}")
    for name, result in report["workloads"].items():
        ranks = result["workload"]["world_size"] > 1
        figures = [("rank-mean" if ranks else "mean", result["overhead_rank_mean"])]
        if ranks:
            figures.append(("slowest rank", result["overhead_slowest_rank"]))
        figures.append(("medians, secondary", result["overhead_medians"]))
        for label, summary in figures:
            low, high = summary["ci95_pct"]
            title = f"{name} ({label})"
            print(f"{title:34} {result['step_ms'][OFF]:11.2f} {result['step_ms'][ON]:11.2f} {summary['mean_pct']:+11.3f}"
                  f" {f'[{low:+.3f}, {high:+.3f}]':>18} {summary['verdict']:>11}")
    print(f"\n{'where the time goes, per step':28} {'hot path':>14} {'library thr.':>13} {'bg CPU ON-OFF':>14}"
          f" {'detector CPU':>13} {'train thr. CPU ON-OFF':>22} {'train thr. waiting ON-OFF':>26}")
    for name, result in report["workloads"].items():
        hot, step_ms = result["hot_path"], result["step_ms"][OFF]
        main = result["training_thread_cpu_ms_per_step"]
        waiting = result["training_thread_waiting_ms_per_step"]
        cells = [hot["ms_per_step"], result["library_threads_cpu_ms_per_step"],
                 result["extra_background_cpu_ms_per_step"], result["detector_cpu_ms_per_step"]]
        print(f"{name + ' (ms, % of step)':28}" + "".join(
            f" {f'{value:.3f} ({100 * value / step_ms:.2f}%)':>{width}}" for value, width in zip(cells, (14, 13, 14, 13)))
            + f" {f'{main[ON] - main[OFF]:+.3f}':>22} {f'{waiting[ON] - waiting[OFF]:+.3f}':>26}")
    print("\nsecondary, not the verdict (paired_protocol.py): the geometric mean of the pair ratios, and the"
          " primary's upward bias from noise alone (half the variance of the log pair ratios)")
    for name, result in report["workloads"].items():
        secondary = result["overhead_rank_mean"]["secondary"]
        low, high = secondary["geometric_ci95_pct"]
        print(f"  {name}: geometric mean {secondary['geometric_mean_pct']:+.3f}% [{low:+.3f}, {high:+.3f}];"
              f" noise bias of the mean of ratios about {secondary['noise_bias_pct']:+.3f} points")
    print("\nper-pair estimates (%):")
    for name, result in report["workloads"].items():
        print(f"  {name}: " + " ".join(f"{value:+.2f}" for value in result["overhead_rank_mean"]["per_pair_pct"]))
    for name, result in report["workloads"].items():
        print(f"{name}: losses and final state bit-identical, ON and OFF, in every pair: "
              f"{'yes' if result['losses_and_state_identical_across_arms'] else 'NO'}; spans lost: {result['spans_lost']};"
              f" hot path {result['hot_path']['ns_per_interval']:.0f} ns/interval x {result['hot_path']['intervals_per_step']};"
              f" GC collections per 1000 steps by generation OFF {_rounded(result['gc_collections_per_1000_steps'][OFF])}"
              f" ON {_rounded(result['gc_collections_per_1000_steps'][ON])};"
              f" training thread's page faults per step OFF {result['training_thread_page_faults_per_step'][OFF]:.1f}"
              f" ON {result['training_thread_page_faults_per_step'][ON]:.1f}; its context switches per step"
              + ";".join(f" {arm.upper()} {switches['voluntary']:.2f} voluntary, {switches['involuntary']:.2f} involuntary"
                         for arm, switches in result["training_thread_context_switches_per_step"].items()))


def _rounded(values: list[float]) -> list[float]:
    return [round(value, 1) for value in values]


def detector_idle_cpu_per_s(seconds: float = 3.0) -> float:
    """CPU ns per second this process spends with the detector running and no spans coming in
    (its timers: windows closed by the clock, evidence flushed)."""
    before = time.process_time_ns()
    time.sleep(seconds)
    return (time.process_time_ns() - before) / seconds


def machine() -> dict:
    import torch

    from otel_straggler.instrumentation import hot_path  # the ranks run in this installation too

    return {"cores": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__, "load_before": os.getloadavg(),
            "hot_path": hot_path.IMPLEMENTATION}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 short pairs per workload")
    parser.add_argument("--workload", choices=[workload.name for workload in WORKLOADS], action="append",
                        help="run only this workload (may be given more than once); default: all")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--allocator", choices=tuple(ALLOCATORS), default="kept-memory",
                        help="the ranks' malloc settings, both arms alike: kept-memory (default) keeps freed memory"
                             " mapped; glibc-default leaves glibc's heuristics, which fault a varying share of every"
                             " step's tensors in again")
    parser.add_argument("--nice", type=int, default=0,
                        help="run the detector and the workloads (both arms alike) at this niceness; negative puts"
                             " them ahead of other processes on a shared machine (needs root)")
    parser.add_argument("--protocol", choices=OTLP_PROTOCOLS, default="http/protobuf",
                        help="the ON arm's OTLP export: http/protobuf (default; recommended for ranks) or grpc")
    args = parser.parse_args(argv)
    if args.nice:
        os.nice(args.nice)  # inherited by the workload processes
    report = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "machine": machine(),
              "quick": args.quick, "niceness": os.getpriority(os.PRIO_PROCESS, 0), "allocator": args.allocator,
              "allocator_environment": ALLOCATORS[args.allocator], "otlp_protocol": args.protocol,
              "workloads": {}}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="overhead-") as scratch:
        detector = DetectorService(DetectorConfig(grpc_port=0, http_port=0, evidence_dir=os.path.join(scratch, "evidence"),
                                                  export_metrics=False))
        detector.start()
        endpoint = f"127.0.0.1:{detector.bound_ports[OTLP_PROTOCOLS.index(args.protocol)]}"
        hot_path = None
        try:
            idle_cpu_per_s = detector_idle_cpu_per_s()
            report["detector_idle_cpu_ms_per_s"] = idle_cpu_per_s / 1e6
            for workload in (w for w in WORKLOADS if not args.workload or w.name in args.workload):
                protocol = workload.quick if args.quick else workload.protocol
                print(f"{workload.name}: {protocol.describe()}", flush=True)
                cpu_before, wall_before = time.process_time_ns(), time.monotonic()
                ranks = run_workload(workload, protocol, endpoint, args.protocol, Path(scratch) / workload.name,
                                     HOT_PATH_INTERVALS[args.quick] if hot_path is None else 0, args.allocator)
                # what the detector spent on the ranks' spans: its CPU beyond its idle rate
                detector_cpu_ns = (time.process_time_ns() - cpu_before) - idle_cpu_per_s * (time.monotonic() - wall_before)
                hot_path = hot_path or ranks[0]["hot_path"]
                report["workloads"][workload.name] = analyze(workload, protocol, ranks, detector_cpu_ns, hot_path)
            report["detector"] = {key: detector.status().get(key) for key in ("spans", "errors")}
        finally:
            detector.stop()
    report["machine"]["load_after"] = os.getloadavg()
    report["wall_s"] = time.monotonic() - started
    print_report(report)
    print(f"\nwall time {report['wall_s']:.0f} s; detector intake: {report['detector']['spans']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
