"""The checks that need a real GPU, in one short command (well under 5 minutes on one GPU):

    python benchmarks/gpu_check.py [--pairs 6] [--steps 60]

1. hot path with real CUDA events: ns per interval (start+stop, one event recorded at each end)
   against a plain OTel SDK span, in the same run;
2. device durations are right: a matmul of known size timed in isolation (CUDA events around
   it, then a synchronize, outside the library) against the `training.stage.device_duration_ms`
   our spans carry for the same matmul;
3. no device syncs added: synchronizing CUDA calls counted with torch's sync debug mode plus a
   spy on torch.cuda.synchronize, over the same loop with the library off and on (must be equal);
4. overhead on a single-GPU training loop: ON/OFF pairs in alternating order, the per-pair
   estimate 100 x (mean ON / mean OFF - 1) of step time, and its 95% bootstrap CI.
Prints a table and writes gpu_check.json into $OUT (or the working directory).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_straggler as ots
from otel_straggler import contract
from otel_straggler.instrumentation import hot_path as hot_path_choice
from otel_straggler.processors.cuda_event_span_processor import CudaEventSpanProcessor
from otel_straggler.processors.device_events import TorchCudaEvents

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paired_protocol import ON, Protocol, summarize  # noqa: E402


def configure_in_memory():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    processor = CudaEventSpanProcessor(SimpleSpanProcessor(exporter), TorchCudaEvents(), readout_timeout_s=30.0)
    provider.add_span_processor(processor)
    handle = ots.configure(job_id="gpu-check", rank=0, world_size=1, tracer_provider=provider,
                           device_processor=processor, export_metrics=False, build_interval_ms=20)
    return handle, exporter


def hot_path(intervals: int) -> dict:
    handle, _ = configure_in_memory()
    try:
        ots.step(0)  # makes the event pool on the current device
        stage = ots.stage
        for _ in range(1000):
            with stage("forward-compute"):
                pass
        handle.flush(30)
        start = time.perf_counter_ns()
        for i in range(intervals):
            if i % 2000 == 0:
                ots.step(i // 2000 + 1)  # keep the pool from running dry: events come back per step
            with stage("forward-compute"):
                pass
        cuda_ns = (time.perf_counter_ns() - start) / intervals
        status = handle.status()
    finally:
        handle.shutdown(30)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    tracer = provider.get_tracer("reference")
    start = time.perf_counter_ns()
    for _ in range(intervals):
        tracer.start_span("forward-compute").end()
    sdk_ns = (time.perf_counter_ns() - start) / intervals
    return {"cuda_events_ns": cuda_ns, "sdk_span_ns": sdk_ns, "ratio": sdk_ns / cuda_ns,
            "pool_exhausted": status["lost"]["pool_exhausted"]}


def device_duration_accuracy(size: int, repeats: int) -> dict:
    a = torch.randn(size, size, device="cuda")
    b = torch.randn(size, size, device="cuda")
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    isolated = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
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
    return {"matmul": f"{size}x{size} fp32", "isolated_ms": reference, "span_ms": measured,
            "error_pct": 100 * (measured / reference - 1), "spans_with_device_time": len(ours),
            "tflops": flops / (reference / 1e3) / 1e12}


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


def make_training(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[layer for _ in range(8) for layer in (torch.nn.Linear(4096, 4096), torch.nn.GELU())]).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    inputs = torch.randn(2048, 4096, device="cuda")

    def train_step(n: int) -> None:
        ots.step(n, tokens=inputs.shape[0])
        with ots.stage("forward-compute"):
            loss = model(inputs).pow(2).mean()
        with ots.stage("backward-compute"):
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        with ots.stage("optimizer"):
            optimizer.step()

    return train_step


def count_syncs(steps: int) -> dict:
    results = {}
    for arm in ("off", "on"):
        handle = configure_in_memory()[0] if arm == "on" else None
        train_step = make_training()
        train_step(0)
        torch.cuda.synchronize()
        with SyncCounter() as counter:
            for n in range(1, steps + 1):
                train_step(n)
        torch.cuda.synchronize()
        if handle is not None:
            handle.shutdown(30)
        results[arm] = counter.count
    return results


def timed_arm(on: bool, steps: int, warmup: int) -> float:
    """Mean step time (s) of one arm: warm-up steps discarded, one sync per measured block."""
    handle = configure_in_memory()[0] if on else None
    try:
        train_step = make_training()
        for n in range(warmup):
            train_step(n)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for n in range(warmup, warmup + steps):
            train_step(n)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps
    finally:
        if handle is not None:
            handle.shutdown(30)


def paired_overhead(protocol: Protocol) -> dict:
    """The same paired design and estimator as benchmarks/overhead.py, on one GPU."""
    arm_means = [timed_arm(arm == ON, protocol.steps_per_arm, warmup)
                 for arm, warmup in zip(protocol.schedule(), protocol.warmups())]
    return {"protocol": protocol.describe(), **summarize(protocol, arm_means)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--intervals", type=int, default=50_000)
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--warmup-extra", type=int, default=10,
                        help="each pair's warm-up adds a seeded uniform draw of 0..this many steps (paired_protocol.py)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; nothing to check", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0)
    started = time.time()
    report = {"gpu": gpu, "torch": torch.__version__, "hot_path_implementation": hot_path_choice.IMPLEMENTATION}
    report["hot_path"] = hot_path(args.intervals)
    report["device_duration"] = device_duration_accuracy(4096, 20)
    report["syncs"] = count_syncs(20)
    report["overhead"] = paired_overhead(Protocol(pairs=args.pairs, warmup_steps=args.warmup,
                                                         warmup_extra_steps=args.warmup_extra, steps_per_arm=args.steps))
    report["wall_s"] = time.time() - started

    hot, accuracy, syncs, overhead = report["hot_path"], report["device_duration"], report["syncs"], report["overhead"]
    print(f"GPU check on {gpu} (torch {torch.__version__}, hot path in {hot_path_choice.IMPLEMENTATION}),"
          f" {report['wall_s']:.0f} s")
    print(f"{'check':44} {'result':>40}")
    print(f"{'hot path, real CUDA events (ns/interval)':44} {hot['cuda_events_ns']:40.0f}")
    print(f"{'plain OTel SDK span (ns), same run':44} {hot['sdk_span_ns']:40.0f}")
    print(f"{'SDK span / ours':44} {hot['ratio']:40.1f}")
    print(f"{'matmul ' + accuracy['matmul'] + ' isolated (ms)':44} {accuracy['isolated_ms']:40.3f}")
    print(f"{'same matmul, span device_duration_ms':44} {accuracy['span_ms']:40.3f}")
    print(f"{'device duration error (%)':44} {accuracy['error_pct']:40.2f}")
    print(f"{'synchronizing calls, library off / on':44} {str(syncs['off']) + ' / ' + str(syncs['on']):>40}")
    print(f"{'overhead ON vs OFF, mean of pairs (%)':44} {overhead['mean_pct']:40.3f}")
    ci = overhead["ci95_pct"]
    print(f"{'overhead 95% bootstrap CI (%)':44} {f'[{ci[0]:.3f}, {ci[1]:.3f}]':>40}")
    print(f"{'verdict':44} {overhead['verdict']:>40}")
    print(f"protocol: {overhead['protocol']}")
    out_dir = os.environ.get("OUT") or "."
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as out:
        json.dump(report, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
