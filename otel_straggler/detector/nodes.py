"""Ranks of one host rolled up: several slow ranks of one node are said once, and when they are
enough of its ranks, the node is the suspect, not a GPU (what to do: next_step.node_next_step).

A node is `degraded` when at least MIN_SLOW_RANKS of its ranks and at least NODE_SHARE of them are
slow: one slow GPU of eight is that GPU's matter; four of eight, or a two-GPU host with both slow,
point at what they share (power, cooling, NICs, CPU). The Prometheus rule TrainingNodeDegraded
applies the same two numbers to straggler_alert_active.
"""
from __future__ import annotations

from typing import Callable, Iterable, NamedTuple, Optional, TypeVar

from otel_straggler.detector.next_step import node_next_step

MIN_SLOW_RANKS = 2
NODE_SHARE = 0.5


JobId = TypeVar("JobId", str, Optional[str])  # the engine's jobs always have one; a report's lines may not


class NodeRollup(NamedTuple):
    job_id: Optional[str]
    host: str
    slow_ranks: tuple[int, ...]
    ranks: Optional[int]  # the host's ranks of the job; None: not known

    @property
    def degraded(self) -> bool:
        slow, ranks = len(self.slow_ranks), self.ranks or 0  # 0: not known
        return slow >= MIN_SLOW_RANKS and bool(ranks) and slow >= NODE_SHARE * ranks

    def line(self) -> str:
        """'node017: 8 of 8 ranks slow (0-7): suspect the node, not a GPU: cordon or drain ...'"""
        of = f" of {self.ranks}" if self.ranks else ""
        slow = len(self.slow_ranks)
        listed = ", ".join(map(str, self.slow_ranks[:16])) + (", ..." if slow > 16 else "")
        text = f"{self.host}: {slow}{of} rank{'' if slow == 1 and not of else 's'} slow ({listed})"
        return f"{text}: {node_next_step(self.host)}" if self.degraded else text

    def to_dict(self) -> dict:
        return {"job_id": self.job_id, "host": self.host, "slow_ranks": list(self.slow_ranks),
                "ranks": self.ranks, "degraded": self.degraded}


def roll_up(slow: Iterable[tuple[JobId, Optional[str], int]],
            ranks_on: Callable[[JobId, str], Optional[int]]) -> list[NodeRollup]:
    """`slow`: (job, host, rank) of slow ranks (a rank may repeat; no host: left out; no job, as
    an evidence line may have: a job of its own); `ranks_on(job, host)`: how many ranks the host
    runs for the job. Most slow ranks first."""
    by_host: dict[tuple[JobId, str], set[int]] = {}
    for job_id, host, rank in slow:
        if host:
            by_host.setdefault((job_id, host), set()).add(rank)
    nodes = []
    for (job_id, host), ranks in by_host.items():
        known = ranks_on(job_id, host)
        nodes.append(NodeRollup(job_id, host, tuple(sorted(ranks)),
                                None if known is None else max(known, len(ranks))))
    return sorted(nodes, key=lambda node: (-len(node.slow_ranks), node.job_id or "", node.host))
