"""Detector throughput from serialized OTLP requests to verdicts (spans per second, one core), against
the protobuf parse-only rate of the same payloads, and the detector's peak memory at 10,000 ranks.

    python benchmarks/detector_throughput.py [--ranks 1024] [--steps 60] [--steps-per-request 5]
                                             [--rounds 5] [--small-cohorts 8] [--python-only]
                                             [--memory-ranks 10000] [--memory-steps 30] [--default-malloc]
    python benchmarks/detector_throughput.py --allocator-pairs 8

Payloads are what the rank side sends: each rank's stage spans encoded by the OTel SDK's own OTLP
encoder (trace/span/parent ids, kind, status, scope, resource and every contract attribute), one
request per rank per `--steps-per-request` steps (a BatchSpanProcessor flush). Durations come from
the engine's synthetic job (otel_straggler/testing/synthetic.py) with one rank 10% slow, 10 stages.
Layouts, each with its own table: one cohort of all ranks (data parallel), and the same ranks as
cohorts of `--small-cohorts` (a TP x PP grid: many small windows, where per-window costs show),
each cohort with one rank 10% slow.

Arms, interleaved round by round because the machine is shared, timed in CPU seconds of this
(single-threaded) process, so the rate is per core:
  parse only      ExportTraceServiceRequest.FromString: the ceiling for Python (the reference)
  decode          decode.py as the detector runs it: the C scanner (_otlp_scan) when built, the
                  Python view-schema decoder where it declines; one Observation per stage span
  ... Python only the same two arms with the Python decoder alone (what runs without a C compiler;
                  with --python-only)
  end to end      decode, engine.ingest_placements and ingest_many (its C loop, _ingest, when built),
                  engine.advance after each round of every rank's request (the service advances
                  every 0.1 s), drain at the end: verdicts out
The process's allocator is set as `otel-straggler detect` sets it (detector/allocator.py) unless
--default-malloc is given; the memory child follows it. With --allocator-pairs N it compares that
setting with glibc's defaults instead: per layout, two child processes, one with each, take turns
at N end-to-end passes each (the order alternating), and the table gives the median of the
per-pair ratios, which moves far less with this machine's speed than two runs' figures would.
Memory: a fresh child process streams --memory-ranks ranks x 10 stages through decode and the engine
(one step of requests in flight at a time) and reports its peak RSS over its RSS before the run.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_straggler import contract
from otel_straggler.detector.allocator import keep_freed_memory
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.decode import ProtobufDecoder
from otel_straggler.detector.engine import Engine
from otel_straggler.testing.otlp_spans import rank_resource, readable_span
from otel_straggler.testing.synthetic import TEN_STAGES, SyntheticJob

STEP_NS = 100_000_000
TARGET = 1_000_000  # spans/s/core end to end, per layout


class RequestFactory:
    """One SDK-encoded request per rank as a template; each later request re-uses it with the step's
    values (times, step, seq, device duration) written in, which keeps the exact wire layout of the
    SDK's encoder at a small fraction of its cost."""

    def __init__(self, job: SyntheticJob, spans_per_request: int) -> None:
        self._templates: dict[int, ExportTraceServiceRequest] = {}
        self._value_slots: dict[int, list[tuple]] = {}
        first = job.observations(spans_per_request // len(job.stages))
        by_rank: dict[int, list] = defaultdict(list)
        for observation in first:
            by_rank[observation.rank].append(observation)
        for rank, observations in by_rank.items():
            resource = rank_resource(job.job_id, rank, job.cohort, job.epoch)
            request = encode_spans([readable_span(observation, resource) for observation in observations])
            spans = request.resource_spans[0].scope_spans[0].spans
            slots = []
            for span in spans:
                values = {kv.key: kv.value for kv in span.attributes}
                slots.append((span, values[contract.STEP], values[contract.SEQ], values.get(contract.DEVICE_DURATION_MS)))
            self._templates[rank] = request
            self._value_slots[rank] = slots

    def request(self, rank: int, observations: list) -> bytes:
        for (span, step, seq, device), observation in zip(self._value_slots[rank], observations, strict=True):
            span.end_time_unix_nano = observation.end_unix_nano
            span.start_time_unix_nano = observation.end_unix_nano - int(observation.host_ms * 1e6)
            step.int_value = observation.step
            seq.int_value = observation.seq
            if device is not None:
                device.double_value = observation.device_ms
        return self._templates[rank].SerializeToString()


def rounds_of_requests(job: SyntheticJob, steps: int, steps_per_request: int, factory: RequestFactory):
    """Yields, per `steps_per_request` steps, every rank's request (rank order, as they arrive)."""
    stage_count = len(job.stages)
    for first_step in range(0, steps, steps_per_request):
        observations = job.observations(steps_per_request, first_step=first_step, seq_start=first_step * stage_count)
        by_rank: dict[int, list] = defaultdict(list)
        for observation in observations:
            by_rank[observation.rank].append(observation)
        yield [factory.request(rank, by_rank[rank]) for rank in sorted(by_rank)]


def workload(ranks: int, steps: int, steps_per_request: int, cohort_size: int) -> tuple[list[list[bytes]], int]:
    """Cohorts of `cohort_size` ranks (the last one smaller when it does not divide), each with its
    first rank 10% slow; a round holds every cohort's requests, cohort after cohort."""
    jobs = [SyntheticJob(ranks=min(cohort_size, ranks - first), stages=TEN_STAGES, seed=3 + first,
                         cohort=f"cohort-{first // cohort_size}", first_rank=first).slow(first + (7 % cohort_size), 1.1)
            for first in range(0, ranks, cohort_size)]
    per_job = [rounds_of_requests(job, steps, steps_per_request, RequestFactory(job, steps_per_request * len(TEN_STAGES)))
               for job in jobs]
    rounds = [[payload for requests in job_rounds for payload in requests] for job_rounds in zip(*per_job)]
    return rounds, ranks * len(TEN_STAGES) * steps


def parse_only(rounds: list[list[bytes]]) -> int:
    parse = ExportTraceServiceRequest.FromString
    for requests in rounds:
        for payload in requests:
            parse(payload)
    return 0


def decode_only(rounds: list[list[bytes]], python_only: bool = False) -> int:
    decoder = ProtobufDecoder()
    decode = decoder.decode_in_python if python_only else decoder.decode
    for requests in rounds:
        for payload in requests:
            decode(payload)
    return 0


def ingest(engine: Engine, batch) -> None:
    """What the service's engine thread does with a decoded request (pipeline.EngineDriver)."""
    engine.ingest_placements(batch.placements)
    engine.ingest_many(batch.observations)


def end_to_end(rounds: list[list[bytes]], spans: int | None = None, python_only: bool = False) -> int:
    decoder = ProtobufDecoder()
    decode = decoder.decode_in_python if python_only else decoder.decode
    engine = Engine(DetectorConfig())
    verdicts = 0
    now = 0
    for requests in rounds:
        for payload in requests:
            ingest(engine, decode(payload))
        now += STEP_NS
        verdicts += len(engine.advance(now))
    verdicts += len(engine.drain(now + STEP_NS))
    if spans is not None:
        assert engine.stats()["accepted"] == spans, engine.stats()
    return verdicts


def throughput(args, cohort_size: int) -> float:
    """Prints one layout's table; returns its end-to-end rate over the parse-only ceiling."""
    started = time.perf_counter()
    rounds, spans = workload(args.ranks, args.steps, args.steps_per_request, cohort_size)
    payload_bytes = sum(len(payload) for requests in rounds for payload in requests)
    requests = sum(len(requests) for requests in rounds)
    layout = f"1 cohort of {args.ranks:,} ranks" if cohort_size >= args.ranks else \
        f"{-(-args.ranks // cohort_size)} cohorts of {cohort_size} ranks"
    print(f"\n{layout}: {args.ranks:,} ranks x {len(TEN_STAGES)} stages x {args.steps} steps = "
          f"{spans:,} spans in {requests:,} requests of {spans // requests} spans "
          f"({payload_bytes / spans:.0f} B/span; built in {time.perf_counter() - started:.1f} s)")
    arms = {"parse only (FromString)": parse_only, "decode": decode_only,
            "decode -> engine -> verdicts": lambda r: end_to_end(r, spans)}
    if scanner_built() and args.python_only:
        arms.update({"decode, Python only": lambda r: decode_only(r, python_only=True),
                     "Python decode -> engine -> verdicts": lambda r: end_to_end(r, spans, python_only=True)})
    cpu_seconds = {name: [] for name in arms}
    verdicts = 0
    for _ in range(args.rounds):
        for name, arm in arms.items():
            gc.collect()
            start = time.process_time()
            verdicts = arm(rounds) or verdicts
            cpu_seconds[name].append(time.process_time() - start)
    reference = cpu_seconds["parse only (FromString)"]

    def versus_parse_only(seconds: list[float]) -> float:
        """The median over rounds of the arm's rate over the parse-only rate of the same round:
        the arms of a round ran seconds apart, so this moves less with the machine than the ratio
        of the two medians does."""
        return statistics.median(parse / arm for parse, arm in zip(reference, seconds, strict=True))

    print(f"median (best) of {args.rounds} interleaved rounds, CPU time of one thread; "
          f"end to end made {verdicts} verdicts per round; 'vs parse only': per round, median of the rounds")
    print(f"{'arm':<36}{'spans/s/core':>14}{'best':>14}{'us/span':>10}{'vs parse only':>16}")
    for name, seconds in cpu_seconds.items():
        median_rate, best_rate = spans / statistics.median(seconds), spans / min(seconds)
        print(f"{name:<36}{median_rate:>14,.0f}{best_rate:>14,.0f}{1e6 / median_rate:>10.2f}"
              f"{versus_parse_only(seconds):>15.2f}x")
    end_to_end_seconds = cpu_seconds["decode -> engine -> verdicts"]
    end_to_end_rate = spans / statistics.median(end_to_end_seconds)
    print(f"target >= {TARGET:,} spans/s/core end to end: {'met' if end_to_end_rate >= TARGET else 'NOT met'} "
          f"({end_to_end_rate:,.0f}; {versus_parse_only(end_to_end_seconds):.2f}x the parse-only ceiling)")
    return versus_parse_only(end_to_end_seconds)


def allocator_child(workload_path: str, allocator: str) -> None:
    """--allocator-child: one layout's end-to-end passes over the workload pickled at
    `workload_path`, one per line read from stdin, each answered with its CPU seconds and kernel
    seconds; the allocator as main() set it (`allocator` says how, in the "ready" line). The
    workload is built in the parent: building it frees large blocks, which raises glibc's adaptive
    thresholds as a detector's own history would not."""
    with open(workload_path, "rb") as file:
        rounds, spans = pickle.load(file)
    end_to_end(rounds, spans)  # warm: imports, the scanner's string cache, the heap grown once
    print(f"ready {allocator}", flush=True)
    for _ in sys.stdin:
        gc.collect()
        kernel = resource.getrusage(resource.RUSAGE_SELF).ru_stime
        start = time.process_time()
        end_to_end(rounds, spans)
        print(time.process_time() - start, resource.getrusage(resource.RUSAGE_SELF).ru_stime - kernel, flush=True)


def _answer(child: subprocess.Popen, name: str) -> str:
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f"the allocator child '{name}' ended (exit {child.poll()})")
    return line.strip()


def allocator_pairs(args, cohort_size: int) -> None:
    """detect's allocator setting against glibc's defaults, in paired passes (see the docstring)."""
    arms = {"detect's setting (allocator.py)": [], "glibc's defaults": ["--default-malloc"]}
    children: dict[str, subprocess.Popen] = {}
    said: dict[str, str] = {}
    passes: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    try:
        with tempfile.NamedTemporaryFile(suffix=".pickle") as workload_file:
            pickle.dump(workload(args.ranks, args.steps, args.steps_per_request, cohort_size), workload_file)
            workload_file.flush()
            command = [sys.executable, os.path.abspath(__file__), "--allocator-child", workload_file.name]
            for name, flags in arms.items():
                children[name] = subprocess.Popen(command + flags, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                  text=True)
            for name, child in children.items():  # loaded: the file may go
                said[name] = _answer(child, name).removeprefix("ready ")
        for pair in range(args.allocator_pairs):
            for name in list(children)[:: 1 if pair % 2 == 0 else -1]:
                children[name].stdin.write("pass\n")
                children[name].stdin.flush()
                cpu, kernel = _answer(children[name], name).split()
                passes[name].append((float(cpu), float(kernel)))
    finally:
        for child in children.values():
            child.kill()  # idle between passes, or failed: nothing of theirs is left to wait for
            child.wait()
    spans = args.ranks * len(TEN_STAGES) * args.steps
    layout = f"1 cohort of {args.ranks:,} ranks" if cohort_size >= args.ranks else \
        f"{-(-args.ranks // cohort_size)} cohorts of {cohort_size} ranks"
    print(f"\nallocator, {layout}: {args.allocator_pairs} pairs of end-to-end passes, two processes taking turns")
    for name in arms:
        print(f"  {name}: {said[name]}")
    print(f"{'arm':<36}{'spans/s/core':>14}{'kernel s/pass':>15}")
    for name, measured in passes.items():
        print(f"{name:<36}{spans / statistics.median(cpu for cpu, _ in measured):>14,.0f}"
              f"{statistics.median(kernel for _, kernel in measured):>15.3f}")
    ratios = [default[0] / kept[0] for kept, default in zip(*passes.values(), strict=True)]
    print(f"glibc's defaults' CPU time over detect's setting's, per pair: median {statistics.median(ratios):.2f}x "
          f"(range {min(ratios):.2f}-{max(ratios):.2f})")


def scanner_built() -> bool:
    from otel_straggler.detector import decode

    return decode.scanner_built()


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def memory_child(ranks: int, steps: int) -> None:
    """Runs in a fresh process (Linux): streams one step of requests at a time, prints JSON. The
    peak-RSS mark is reset after set-up (/proc/self/clear_refs), so it covers the run alone."""
    job = SyntheticJob(ranks=ranks, stages=TEN_STAGES, seed=5).slow(7, 1.1)
    factory = RequestFactory(job, len(TEN_STAGES))
    decode = ProtobufDecoder().decode
    engine = Engine(DetectorConfig())
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the current RSS
    before_kib = _proc_status_kib("VmRSS")
    now = verdicts = in_flight = 0
    for requests in rounds_of_requests(job, steps, 1, factory):
        in_flight = max(in_flight, sum(len(payload) for payload in requests))
        for payload in requests:
            ingest(engine, decode(payload))
        del requests
        now += STEP_NS
        verdicts += len(engine.advance(now))
    verdicts += len(engine.drain(now + STEP_NS))
    stats = engine.stats()
    print(json.dumps({"before_mib": before_kib / 1024, "peak_mib": _proc_status_kib("VmHWM") / 1024,
                      "in_flight_mib": in_flight / 2**20, "verdicts": verdicts, "accepted": stats["accepted"],
                      "windows_closed": stats["windows_closed"]}))


def peak_memory(args) -> None:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-child",
                           "--memory-ranks", str(args.memory_ranks), "--memory-steps", str(args.memory_steps)]
                          + (["--default-malloc"] if args.default_malloc else []),
                          capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    print(f"\npeak memory: {args.memory_ranks:,} ranks x {len(TEN_STAGES)} stages x {args.memory_steps} steps "
          f"through decode and the engine, one request per rank per step ({result['accepted']:,} spans accepted, "
          f"{result['windows_closed']} windows judged, {result['verdicts']} verdicts)")
    print(f"{'RSS before the run (interpreter, libraries, request templates)':<68}{result['before_mib']:>9.1f} MiB")
    print(f"{'peak RSS during the run':<68}{result['peak_mib']:>9.1f} MiB")
    print(f"{'growth: engine state, decoder, requests and observations in flight':<68}"
          f"{result['peak_mib'] - result['before_mib']:>9.1f} MiB")
    print(f"{'of which one step of serialized requests':<68}{result['in_flight_mib']:>9.1f} MiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--steps-per-request", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--small-cohorts", type=int, default=8,
                        help="the second layout: the same ranks as cohorts of this many (0: one cohort only)")
    parser.add_argument("--python-only", action="store_true",
                        help="also time the Python decoder alone (what runs without a C compiler)")
    parser.add_argument("--memory-ranks", type=int, default=10_000)
    parser.add_argument("--memory-steps", type=int, default=30)
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave the C library's allocator at its defaults instead of setting it as "
                             "`otel-straggler detect` does")
    parser.add_argument("--allocator-pairs", type=int, default=0, metavar="N",
                        help="only compare `detect`'s allocator setting with glibc's defaults, N paired passes a layout")
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--allocator-child", metavar="WORKLOAD", help=argparse.SUPPRESS)
    args = parser.parse_args()
    allocator = "defaults (--default-malloc)" if args.default_malloc else keep_freed_memory()
    if args.memory_child:
        memory_child(args.memory_ranks, args.memory_steps)
        return 0
    if args.allocator_child:
        allocator_child(args.allocator_child, allocator)
        return 0
    if args.steps % args.steps_per_request:
        parser.error("--steps must be a multiple of --steps-per-request")
    print(f"detector throughput; decode: {'the C scanner (_otlp_scan), Python where it declines' if scanner_built() else 'Python only (_otlp_scan not built)'}"
          f"; allocator: {allocator}")
    for cohort_size in (args.ranks, args.small_cohorts) if args.small_cohorts else (args.ranks,):
        if args.allocator_pairs:
            allocator_pairs(args, cohort_size)
        else:
            throughput(args, cohort_size)
    if args.memory_ranks and not args.allocator_pairs:
        peak_memory(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
