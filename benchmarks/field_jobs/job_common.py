"""What the field jobs beside this file share besides their slowdowns (slowdowns.py): the command
line every job takes, one-write output lines, and the regression data of the MLP jobs."""
from __future__ import annotations

import argparse
import sys

import torch
from torch.utils.data import Dataset

SLOW_KINDS = ("none", "forward", "backward", "data")


def job_arguments(description: str) -> argparse.ArgumentParser:
    """The options every field job takes; a job adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=130, help="optimizer steps")
    parser.add_argument("--slow", choices=SLOW_KINDS, default="none")
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--from-step", type=int, default=60)
    parser.add_argument("--extra-ms", type=float, default=30.0, help="forward/backward work, in CPU ms")
    parser.add_argument("--data-delay-ms", type=float, default=30.0)
    return parser


def say(line: str) -> None:
    """One line in one write: torchrun gives every rank the same stdout, and print() writes the
    line and its newline apart, so two ranks' lines could run together."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Samples(Dataset):
    """`count` random (features, target) pairs, the same for a seed."""

    def __init__(self, count: int, features: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(count, features, generator=generator)
        self.y = torch.randn(count, 1, generator=generator)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]
