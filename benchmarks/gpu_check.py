"""The checks that need a real GPU, in one short command (about 3 minutes on one GPU):

    python benchmarks/gpu_check.py [--pairs 20] [--steps 60] [--checks equivalence,syncs]

1. hot path with real CUDA events: ns per interval (start+stop, one event recorded at each end)
   by benchmarks/hot_path.py's method, against host-only timing and a plain OTel SDK span, in
   the same run; what one record costs (`torch.cuda.Event.record()`, the current-stream lookup
   it makes in Python, and `torch.Event.record()`, which the backend uses where torch has it);
   and that the backend's events land on the current stream (a side stream, not the default);
2. device durations are right: a matmul of known size timed in isolation (CUDA events around
   it, then a synchronize, outside the library) against the `training.stage.device_duration_ms`
   our spans carry for the same matmul;
3. no device syncs added: synchronizing CUDA calls counted with torch's sync debug mode plus a
   spy on torch.cuda.synchronize, over the same loop with the library off and on (must be equal);
   and training is unchanged: the loop's losses and final state bit-identical OFF and ON;
4. overhead on a single-GPU training loop: ON/OFF pairs in alternating order, the per-pair
   estimate 100 x (mean ON / mean OFF - 1) of step time, and its 95% bootstrap CI. ON is the
   full path: stages with real CUDA events, span building, batching and OTLP/gRPC export to a
   live detector (`otel-straggler detect`, started here as its own process, as in a real job).
   Two loops: a GPU-bound one (`overhead`, about 30 ms steps on an H200) and a launch-bound one
   (`overhead_small`, 96 small layers: the host's kernel launches are the bottleneck, the worst case).
5. GPU health through the real NVML (`gpu_health`): the rank-side sampler on CUDA device 0
   returns every training.gpu.* field of CONTRACT §2c or names those NVML does not support here,
   the SM clock is within (0, max], and what one sample costs. Needs nvidia-ml-py, not torch: where
   torch or CUDA is missing the other checks are skipped with a line saying so and this one runs.
Each check runs on its own: one that breaks is reported as failed and the others still run; the
exit code is 1 when a check broke or answered no (events off the current stream, added syncs,
training changed). Prints a table and writes gpu_check.json into $OUT (or the working directory).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_straggler as ots
from otel_straggler import contract
from otel_straggler.instrumentation import hot_path as hot_path_choice
from otel_straggler.processors.cuda_event_span_processor import CudaEventSpanProcessor
from otel_straggler.processors.device_events import TorchCudaEvents

import hot_path as hot_path_bench
from detector_process import DetectorProcess
from paired_protocol import ON, Protocol, summarize

try:  # the CUDA checks need torch; the GPU health check does not
    import torch
    from demo_training import state_sha256
except ImportError as missing:
    torch = None
    TORCH_MISSING = str(missing)


def configure_in_memory():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    processor = CudaEventSpanProcessor(SimpleSpanProcessor(exporter), TorchCudaEvents(), readout_timeout_s=30.0)
    provider.add_span_processor(processor)
    handle = ots.configure(job_id="gpu-check", rank=0, world_size=1, tracer_provider=provider,
                           device_processor=processor, export_metrics=False, build_interval_ms=20)
    return handle, exporter


def hot_path_cost(intervals: int, rounds: int = 3) -> dict:
    """The training thread's cost of one `with stage():` with real CUDA events, by
    benchmarks/hot_path.py's method (builder held back while timed, drained between chunks of
    1,000 intervals), against host-only timing and a plain SDK span, rounds interleaved; medians."""
    statuses: list[dict] = []
    arms = {"cuda_events_ns": hot_path_bench.instrumented_arm(hot_path_bench.stage_loop, device=True,
                                                              events_factory=TorchCudaEvents, statuses=statuses),
            "host_only_ns": hot_path_bench.instrumented_arm(hot_path_bench.stage_loop, device=False),
            "sdk_span_ns": hot_path_bench.sdk_span_arm}
    results = {name: [] for name in arms}
    background = []
    for _ in range(rounds):
        for name, arm in arms.items():
            ns, background_ns = arm(intervals, 1000)
            results[name].append(ns)
            if name == "cuda_events_ns":
                background.append(background_ns)
    report = {name: statistics.median(values) for name, values in results.items()}
    report["background_ns_per_span"] = statistics.median(background)
    report["ratio"] = report["sdk_span_ns"] / report["cuda_events_ns"]
    report["event_api"] = TorchCudaEvents().event_api
    # the figure is of CUDA-event timing only if the intervals were device-timed, none lost
    report["lost"] = {reason: sum(status["lost"][reason] for status in statuses) for reason in statuses[0]["lost"]}
    report["device_timed"] = sum(status["device_timed"] for status in statuses)
    report["passed"] = report["device_timed"] > 0 and not any(report["lost"].values())
    return report


def record_cost(calls: int) -> dict:
    """What one record costs: `torch.cuda.Event.record()` looks the current stream up in Python
    (a `Stream` object made by torch.cuda.current_stream()) and then records; `torch.Event.record()`
    does both in C. The backend uses the latter where torch has it (processors/device_events.py)."""
    cuda_events = [torch.cuda.Event(enable_timing=True) for _ in range(1000)]
    generic_events = [torch.Event("cuda", enable_timing=True) for _ in range(1000)] if hasattr(torch, "Event") else []
    stream = torch.cuda.current_stream()

    def per_call_ns(call, events) -> float:
        for event in events:
            call(event)
        torch.cuda.synchronize()  # outside the timed loop: nothing queued from the warm-up
        start = time.perf_counter_ns()
        for i in range(calls):
            call(events[i % 1000])
        elapsed = time.perf_counter_ns() - start
        torch.cuda.synchronize()
        return elapsed / calls

    report = {"cuda_event_record_ns": per_call_ns(lambda event: event.record(), cuda_events),
              "current_stream_ns": per_call_ns(lambda event: torch.cuda.current_stream(), cuda_events),
              "cuda_event_record_given_stream_ns": per_call_ns(lambda event: event.record(stream), cuda_events),
              "calls": calls}
    if generic_events:  # called as the backend calls it: the C method itself, no lambda frame
        report["torch_event_record_ns"] = per_call_ns(torch.Event.record, generic_events)
    return report


def records_on_current_stream() -> dict:
    """The backend's events land on the current stream, not the default one: with a side stream
    current and about a second of matmuls queued on it, its event stays pending while one recorded
    on the idle default stream completes; its elapsed time then covers the queued work."""
    backend = TorchCudaEvents()
    a = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    before, after, on_default = backend.create_event(), backend.create_event(), backend.create_event()
    with torch.cuda.stream(side):
        backend.record(before)
        for _ in range(40):
            a @ a
        backend.record(after)
    backend.record(on_default)
    on_default.synchronize()
    pending_on_side = not backend.query(after)
    torch.cuda.synchronize()
    queued_ms = backend.elapsed_ms(before, after)
    return {"event_api": backend.event_api, "side_event_pending_after_default_completed": pending_on_side,
            "side_event_covers_queued_ms": queued_ms, "passed": pending_on_side and queued_ms > 20}


def device_duration_accuracy(size: int, repeats: int) -> dict:
    a = torch.randn(size, size, device="cuda")
    b = torch.randn(size, size, device="cuda")
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    isolated = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # the device kept busy (~0.5 ms spin) while begin and the matmul are queued, so the
        # reference holds the matmul alone, not the host's launch gap after an idle device
        torch.cuda._sleep(1_000_000)
        begin.record()
        a @ b
        end.record()
        end.synchronize()
        isolated.append(begin.elapsed_time(end))
    handle, exporter = configure_in_memory()
    try:
        ots.step(0)
        for _ in range(repeats):
            with ots.stage("forward-compute"):
                a @ b
        handle.flush(60)
    finally:
        handle.shutdown(60)
    ours = [span.attributes[contract.DEVICE_DURATION_MS] for span in exporter.get_finished_spans()
            if span.name == "forward-compute" and span.attributes.get(contract.TIMING) == contract.TIMING_DEVICE]
    reference, measured = statistics.median(isolated), statistics.median(ours) if ours else float("nan")
    flops = 2 * size**3
    error_pct = 100 * (measured / reference - 1)
    return {"matmul": f"{size}x{size} fp32", "isolated_ms": reference, "span_ms": measured,
            "error_pct": error_pct, "spans_with_device_time": len(ours),
            "tflops": flops / (reference / 1e3) / 1e12,
            # every stage device-timed, and within a few percent of the isolated matmul
            "passed": len(ours) == repeats and abs(error_pct) < 3.0}


class SyncCounter:
    """Counts synchronizing CUDA calls: torch's sync debug mode warns on each one; the spy
    catches explicit torch.cuda.synchronize calls as well."""

    def __init__(self) -> None:
        self.count = 0
        self._original = torch.cuda.synchronize

    def __enter__(self):
        def spy(*args, **kwargs):
            self.count += 1
            return self._original(*args, **kwargs)

        torch.cuda.synchronize = spy
        torch.cuda.set_sync_debug_mode("warn")
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc_info) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._catcher.__exit__(*exc_info)
        torch.cuda.synchronize = self._original
        self.count += sum("synchroniz" in str(warning.message) for warning in self._caught)


# The loops the overhead is measured on: (layers, width, batch). "large" keeps the GPU busy (the
# host runs ahead and its share is hidden); "small" is many small layers, launch-bound, the host
# the bottleneck (hundreds of kernel launches a step), so every microsecond the hot path adds on
# the training thread shows: the worst case for a GPU job.
LOOPS = {"large": (8, 4096, 2048), "small": (96, 512, 64)}


def make_training(seed: int = 0, loop: str = "large"):
    torch.manual_seed(seed)
    layers, width, batch = LOOPS[loop]
    # made on the GPU: a CPU init of these 134M parameters would take longer than the arm
    model = torch.nn.Sequential(*[layer for _ in range(layers)
                                  for layer in (torch.nn.Linear(width, width, device="cuda"), torch.nn.GELU())])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    inputs = torch.randn(batch, width, device="cuda")

    def train_step(n: int) -> torch.Tensor:
        ots.step(n, tokens=inputs.shape[0])
        with ots.stage("forward-compute"):
            loss = model(inputs).pow(2).mean()
        with ots.stage("backward-compute"):
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        with ots.stage("optimizer"):
            optimizer.step()
        return loss.detach()  # still on the device: reading it here would sync

    train_step.state = lambda: state_sha256(model, optimizer)
    return train_step


def training_equivalence(steps: int) -> dict:
    """ON changes nothing about training on a GPU either: the same seeded loop run OFF, OFF
    again and ON (real CUDA events), and its loss sequence and final state (sha256 of every
    tensor) compared bit for bit. The second OFF run says whether this GPU and library are
    deterministic for the loop at all; if they are not, the ON comparison is inconclusive."""
    runs = {}
    for arm in ("off", "off-again", "on"):
        handle = configure_in_memory()[0] if arm == "on" else None
        try:
            train_step = make_training()
            losses = torch.stack([train_step(n) for n in range(steps)]).cpu()
            runs[arm] = (losses, train_step.state())
        finally:
            if handle is not None:
                handle.shutdown(30)

    def identical(a: str, b: str) -> bool:
        return bool(torch.equal(runs[a][0], runs[b][0])) and runs[a][1] == runs[b][1]

    deterministic, same = identical("off", "off-again"), identical("off", "on")
    return {"steps": steps, "off_runs_identical": deterministic, "on_identical_to_off": same,
            "passed": same if deterministic else None, "final_loss": float(runs["off"][0][-1])}


def count_syncs(steps: int) -> dict:
    results = {}
    for arm in ("off", "on"):
        handle = configure_in_memory()[0] if arm == "on" else None
        try:
            train_step = make_training()
            train_step(0)
            torch.cuda.synchronize()
            with SyncCounter() as counter:
                for n in range(1, steps + 1):
                    train_step(n)
            torch.cuda.synchronize()
        finally:  # a handle left installed would instrument every later arm
            if handle is not None:
                handle.shutdown(30)
        results[arm] = counter.count
    results["passed"] = results["off"] == results["on"]
    return results


# the rank's settings in a real job, as the demo sets its ranks up (and benchmarks/overhead.py)
RANK_ENVIRONMENT = {"OTEL_BSP_SCHEDULE_DELAY": "500", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}


def timed_arm(endpoint: str | None, index: int, steps: int, warmup: int, loop: str) -> tuple[float, dict]:
    """Mean step time (s) of one arm (ON when an endpoint is given): warm-up steps discarded,
    one sync per measured block; and the ON arm's lost spans by reason."""
    handle = None
    if endpoint is not None:
        handle = ots.configure(job_id=f"gpu-check-arm{index}", rank=0, world_size=1, endpoint=f"http://{endpoint}",
                               protocol="grpc", device_timing="cuda", export_metrics=False)
    try:
        train_step = make_training(loop=loop)
        for n in range(warmup):
            train_step(n)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for n in range(warmup, warmup + steps):
            train_step(n)
        torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) / steps
        lost = {}
        if handle is not None:
            handle.flush(60)
            lost = {reason: count for reason, count in handle.status()["lost"].items() if count}
        return elapsed, lost
    finally:
        if handle is not None:
            handle.shutdown(30)


def paired_overhead(protocol: Protocol, loop: str = "large") -> dict:
    """The same paired design and estimator as benchmarks/overhead.py, on one GPU."""
    os.environ.update(RANK_ENVIRONMENT)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as evidence_dir:
        detector = DetectorProcess(evidence_dir)
        try:
            arm_means, lost = [], {}
            for index, (arm, warmup) in enumerate(zip(protocol.schedule(), protocol.warmups())):
                mean, arm_lost = timed_arm(detector.endpoint if arm == ON else None, index,
                                           protocol.steps_per_arm, warmup, loop)
                arm_means.append(mean)
                for reason, count in arm_lost.items():
                    lost[reason] = lost.get(reason, 0) + count
            time.sleep(2.5)  # status.json is refreshed once a second
            intake = detector.spans()
        finally:
            detector.stop()
    return {"loop": loop, "protocol": protocol.describe(), "step_ms_off": 1e3 * statistics.mean(
                mean for arm, mean in zip(protocol.schedule(), arm_means) if arm != ON),
            "step_ms_on": 1e3 * statistics.mean(mean for arm, mean in zip(protocol.schedule(), arm_means) if arm == ON),
            "spans_lost": lost, "detector_spans": intake, **summarize(protocol, arm_means)}


def gpu_health_check(samples: int) -> dict:
    """The sampler the rank runs, on the real NVML: every §2c field or the reason it is missing,
    the SM clock within (0, max], and one sample's cost (the median of `samples`)."""
    from otel_straggler.instrumentation import gpu_health

    try:
        gpu_health.load_nvml()
    except ImportError as missing:
        return {"skipped": f"nvidia-ml-py is not installed ({missing}); pip install otel-straggler[gpu]"}
    sampler = gpu_health.GpuHealth("on", lambda: (0, "gpu_check"), os.environ, memory=True)
    try:
        attributes = sampler.sample()
        if sampler.state != gpu_health.ON:
            return {"passed": False, "state": sampler.state, "reason": sampler.reason, "errors": sampler.errors}
        costs_ns = []
        for _ in range(samples):
            started = time.perf_counter_ns()
            attributes = sampler.sample()
            costs_ns.append(time.perf_counter_ns() - started)
        clock, maximum = attributes.get(contract.GPU_SM_CLOCK_MHZ), attributes.get(contract.GPU_SM_CLOCK_MAX_MHZ)
        missing = [name for name in contract.GPU_ATTRIBUTES if name not in attributes]
        clock_in_range = None if clock is None or maximum is None else 0 < clock <= maximum
        return {"attributes": attributes, "not_supported": sampler.not_supported, "errors": sampler.errors,
                "unexplained_missing": [name for name in missing if name not in sampler.not_supported],
                "clock_in_range": clock_in_range, "sample_us": statistics.median(costs_ns) / 1e3,
                "memory_used_bytes": sampler.latest.get(gpu_health.MEMORY_USED), "name": sampler.name,
                "passed": clock_in_range is not False and all(name in sampler.not_supported for name in missing)}
    finally:
        sampler.close()


def run_check(report: dict, name: str, check, *args) -> None:
    """One check on its own: a failure is reported with its traceback, and the others still run."""
    started = time.time()
    try:
        report[name] = check(*args)
    except Exception as error:  # noqa: BLE001 - a failed check is a result to print, not a reason to stop
        traceback.print_exc()
        report[name] = {"error": f"{type(error).__name__}: {error}"}
    report[name]["wall_s"] = time.time() - started
    print(f"{name}: done in {report[name]['wall_s']:.0f} s{' (FAILED)' if 'error' in report[name] else ''}", flush=True)


def print_report(report: dict) -> None:
    print(f"GPU check on {report['gpu']} (torch {report['torch']}, hot path in {report['hot_path_implementation']}),"
          f" {report['wall_s']:.0f} s")
    hot, record, stream, accuracy, syncs, equivalence, overhead, overhead_small, health = (
        report.get(name, {"error": "not run"}) for name in CHECKS)
    rows = []
    if "skipped" in health:
        rows.append(("GPU health (NVML)", "skipped, see below"))
    elif "error" not in health and "attributes" not in health:
        rows.append(("GPU health (NVML): sampler off", f"{health['state']}: {health['reason']}"[:40]))
    elif "error" not in health:
        unsupported = ", ".join(name.rsplit(".", 1)[1] for name in health["not_supported"]) or "none"
        clock = health["attributes"].get(contract.GPU_SM_CLOCK_MHZ)
        rows += [("GPU health: every §2c field or not supported", "yes" if health["passed"] else "NO"),
                 ("  fields NVML does not support here", unsupported[:40]),
                 ("  SM clock / max (MHz)", f"{clock} / {health['attributes'].get(contract.GPU_SM_CLOCK_MAX_MHZ)}"),
                 ("  one sample (us, median)", f"{health['sample_us']:.1f}")]
    if "error" not in hot:
        rows += [(f"stage(), real CUDA events ({hot['event_api']}) ns", f"{hot['cuda_events_ns']:.0f}"),
                 ("stage(), host-only timing (ns)", f"{hot['host_only_ns']:.0f}"),
                 ("plain OTel SDK span (ns), same run", f"{hot['sdk_span_ns']:.0f}"),
                 ("SDK span / ours with CUDA events", f"{hot['ratio']:.1f}"),
                 ("drain between chunks, wall ns per span", f"{hot['background_ns_per_span']:.0f}"),
                 ("  intervals device-timed / lost", f"{hot['device_timed']} / {sum(hot['lost'].values())}")]
    if "error" not in record:
        rows += [("torch.cuda.Event.record() (ns/call)", f"{record['cuda_event_record_ns']:.0f}"),
                 ("  torch.cuda.current_stream() alone (ns)", f"{record['current_stream_ns']:.0f}"),
                 ("  torch.cuda.Event.record(stream) (ns)", f"{record['cuda_event_record_given_stream_ns']:.0f}"),
                 ("torch.Event.record (ns/call, as the backend calls it)",
                  f"{record.get('torch_event_record_ns', float('nan')):.0f}")]
    if "error" not in stream:
        rows += [("records on the current (side) stream", "yes" if stream["passed"] else "NO"),
                 ("  side-stream event spans queued work (ms)", f"{stream['side_event_covers_queued_ms']:.1f}")]
    if "error" not in accuracy:
        rows += [(f"matmul {accuracy['matmul']} isolated (ms)", f"{accuracy['isolated_ms']:.3f}"),
                 ("same matmul, span device_duration_ms", f"{accuracy['span_ms']:.3f}"),
                 ("device duration error (%)", f"{accuracy['error_pct']:.2f}"),
                 ("  spans device-timed / stages", f"{accuracy['spans_with_device_time']} / 20")]
    if "error" not in syncs:
        rows.append(("synchronizing calls, library off / on", f"{syncs['off']} / {syncs['on']}"))
    if "error" not in equivalence:
        verdict = ("yes" if equivalence["on_identical_to_off"] else "NO") if equivalence["off_runs_identical"] \
            else "inconclusive (OFF runs differ)"
        rows.append((f"losses and state ON = OFF, {equivalence['steps']} steps", verdict))
    for result in (overhead, overhead_small):
        if "error" in result:
            continue
        low, high = result["ci95_pct"]
        loop = result["loop"]
        rows += [(f"{loop} loop: step time OFF / ON (ms)", f"{result['step_ms_off']:.3f} / {result['step_ms_on']:.3f}"),
                 (f"{loop} loop: overhead ON vs OFF, mean (%)", f"{result['mean_pct']:.3f}"),
                 (f"{loop} loop: overhead 95% bootstrap CI (%)", f"[{low:.3f}, {high:.3f}]"),
                 (f"{loop} loop: verdict", result["verdict"]),
                 (f"{loop} loop: spans lost / accepted", f"{sum(result['spans_lost'].values())} / "
                                                        f"{result['detector_spans'].get('accepted')}")]
    rows += [(f"{name}: FAILED", report[name]["error"][:60]) for name in CHECKS if "error" in report.get(name, {})]
    print(f"{'check':46} {'result':>40}")
    for label, value in rows:
        print(f"{label:46} {value:>40}")
    for result in (overhead, overhead_small):
        if "error" not in result:
            print(f"{result['loop']} loop protocol: {result['protocol']}")
    if "skipped" in health:
        print(f"GPU health (NVML) skipped: {health['skipped']}")


CHECKS = ("hot_path", "record_cost", "current_stream", "device_duration", "syncs", "equivalence", "overhead",
          "overhead_small", "gpu_health")
NEEDS_CUDA = CHECKS[:-1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--intervals", type=int, default=20_000, help="per round of the hot-path arms (3 rounds)")
    # the overhead protocol, fixed before the first run on a GPU
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--warmup-extra", type=int, default=10,
                        help="each pair's warm-up adds a seeded uniform draw of 0..this many steps (paired_protocol.py)")
    parser.add_argument("--checks", type=lambda text: text.split(","), default=list(CHECKS),
                        help=f"comma-separated subset of: {','.join(CHECKS)} (default: all)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.checks) - set(CHECKS))
    if unknown:
        parser.error(f"--checks: unknown {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    cuda = torch is not None and torch.cuda.is_available()
    if not cuda:
        why = f"torch is not installed ({TORCH_MISSING})" if torch is None else "no CUDA device visible"
        skipped = [name for name in args.checks if name in NEEDS_CUDA]
        if skipped:
            print(f"gpu_check: {why}; skipping {', '.join(skipped)}", file=sys.stderr)
        args.checks = [name for name in args.checks if name not in NEEDS_CUDA]
        if not args.checks:
            return 2
    started = time.time()
    report = {"gpu": torch.cuda.get_device_name(0) if cuda else "no CUDA device",
              "torch": torch.__version__ if torch is not None else "not installed",
              "hot_path_implementation": hot_path_choice.IMPLEMENTATION}
    checks = {"hot_path": (hot_path_cost, args.intervals), "record_cost": (record_cost, args.intervals),
              "current_stream": (records_on_current_stream,), "device_duration": (device_duration_accuracy, 4096, 20),
              "syncs": (count_syncs, 20), "equivalence": (training_equivalence, 20),
              "overhead": (paired_overhead, Protocol(pairs=args.pairs, warmup_steps=args.warmup,
                                                     warmup_extra_steps=args.warmup_extra, steps_per_arm=args.steps)),
              # fixed before its first run: steps of a few milliseconds, so more of them per arm
              "overhead_small": (paired_overhead, Protocol(pairs=20, warmup_steps=20, warmup_extra_steps=20,
                                                           steps_per_arm=200), "small"),
              "gpu_health": (gpu_health_check, 200)}
    for name in args.checks:
        run_check(report, name, *checks[name])
    report["wall_s"] = time.time() - started
    out_dir = os.environ.get("OUT") or "."
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as out:  # first: the results outlive the printing
        json.dump(report, out, indent=2)
    print_report(report)
    # a check that broke, or one whose pass/fail answer is no (a measurement has no such answer)
    return 1 if any("error" in report[name] or report[name].get("passed") is False for name in args.checks) else 0


if __name__ == "__main__":
    sys.exit(main())
