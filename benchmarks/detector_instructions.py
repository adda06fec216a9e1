"""Instructions per span from serialized OTLP requests to verdicts, counted by valgrind's cachegrind,
in the layouts of detector_throughput.py, against the protobuf parse-only pass of the same payloads.
A shared VM moves CPU seconds by a third within minutes and instruction counts by well under 1%, so
this decides changes of a few percent that the timed benchmark cannot.

    python benchmarks/detector_instructions.py [--ranks 1024] [--steps 60] [--small-cohorts 8]

Each arm runs in a child under `valgrind --tool=cachegrind --cache-sim=no`, once making its pass over
the payloads once and once making it twice; the difference is one warm pass (what the timed
benchmark's later rounds measure) without the interpreter's start, the imports and the loading of
the payloads, which the parent builds once. Needs valgrind (Debian: `apt-get install valgrind`);
about 3 minutes at the defaults, two children at a time.
"""
from __future__ import annotations

import argparse
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from detector_throughput import end_to_end, parse_only, workload

ARMS = {"parse only (FromString)": parse_only, "decode -> engine -> verdicts": end_to_end}
_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")


def child(arm: str, payloads: str, passes: int) -> None:
    with open(payloads, "rb") as source:
        rounds, _ = pickle.load(source)
    for _ in range(passes):
        ARMS[arm](rounds)


def instructions(arm: str, payloads: Path, passes: int) -> int:
    """Instructions of a child that loads `payloads` and makes `passes` passes of `arm` over them."""
    argv = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
            sys.executable, __file__, "--child", arm, str(payloads), str(passes)]
    env = dict(os.environ, PYTHONHASHSEED="0")  # set and dict orders, hence counts, alike run to run
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    found = _REFS.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{arm} x{passes}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--steps-per-request", type=int, default=5)
    parser.add_argument("--small-cohorts", type=int, default=8, help="ranks per cohort of the second layout")
    parser.add_argument("--child", nargs=3, metavar=("ARM", "PAYLOADS", "PASSES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return 0
    if shutil.which("valgrind") is None:
        print("detector_instructions: valgrind not found (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    layouts = {f"1 cohort of {args.ranks:,}": args.ranks,
               f"{-(-args.ranks // args.small_cohorts)} cohorts of {args.small_cohorts}": args.small_cohorts}
    print(f"{args.ranks:,} ranks x 10 stages x {args.steps} steps; instructions of one warm pass "
          "(cachegrind: a child making two passes minus one making one)")
    print(f"{'layout':<22}{'arm':<32}{'instructions/span':>19}{'vs parse only':>15}")
    with tempfile.TemporaryDirectory(prefix="detector-instructions-") as folder:
        for layout, cohort_size in layouts.items():
            rounds, spans = workload(args.ranks, args.steps, args.steps_per_request, cohort_size)
            payloads = Path(folder) / f"{cohort_size}.pickle"
            with open(payloads, "wb") as sink:
                pickle.dump((rounds, spans), sink)
            del rounds
            runs = [(arm, passes) for arm in ARMS for passes in (1, 2)]
            with ThreadPoolExecutor(max_workers=2) as pool:  # counts do not depend on what runs beside
                counted = dict(zip(runs, pool.map(lambda run: instructions(run[0], payloads, run[1]), runs)))
            per_span = {arm: (counted[(arm, 2)] - counted[(arm, 1)]) / spans for arm in ARMS}
            reference = per_span["parse only (FromString)"]
            for arm, count in per_span.items():
                print(f"{layout:<22}{arm:<32}{count:>19,.0f}{reference / count:>14.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
