"""Stands in for the trainer in launcher tests: prints rank 0's progress lines, and can fail or hang."""
import argparse
import os
import time

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--step-seconds", type=float, default=0.05)
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--fail-at", type=int, default=0)
parser.add_argument("--exit-code", type=int, default=3)
parser.add_argument("--hang-at", type=int, default=-1)
args = parser.parse_args()
rank = int(os.environ["RANK"])
for step in range(args.steps):
    if step == args.hang_at:
        time.sleep(3600)
    if rank == args.fail_rank and step == args.fail_at:
        print("simulated failure", flush=True)
        raise SystemExit(args.exit_code)
    time.sleep(args.step_seconds)
    if rank == 0:
        print(f"step {step + 1}/{args.steps} loss {1.0 / (step + 1):.4f}", flush=True)
