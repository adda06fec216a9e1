"""What a verdict's evidence points at, and what to look at first: a `suspect` (one word, a metric
attribute) and a sentence for the person on call. Text only: the detector never acts on the cluster.

The order of the questions is the order in which the evidence is conclusive: errors a GPU logs
(ECC, PCIe replays) are a fault whatever else is seen; a slow data-loading stage is the input
pipeline whatever the GPU does; a throttled GPU (a slowing clock event reason, or an SM clock well
under its peers') explains a slow GPU; then the timing's attribution says device, host or peer.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from otel_straggler import contract
from otel_straggler.detector.gpu_evidence import throttling
from otel_straggler.instrumentation.stage_names import classify

SUSPECTS = ("gpu_errors", "input_pipeline", "gpu_throttled", "gpu", "host", "peer_wait", "unknown")
CLOCK_SHORTFALL = 0.9  # an SM clock under this share of its peers' counts as throttled


def suspect(record: Mapping[str, Any]) -> str:
    gpu = record.get('gpu') or {}
    if gpu.get("ecc_uncorrected_delta") or gpu.get("pcie_replay_delta"):
        return "gpu_errors"
    stage = record.get('stage')
    if isinstance(stage, str) and stage != contract.WHOLE_STEP_STAGE and classify(stage).group == "data":
        return "input_pipeline"
    clock, peer = gpu.get("sm_clock_mhz"), gpu.get("peer_sm_clock_mhz")
    if throttling(gpu) or (clock is not None and peer and clock < CLOCK_SHORTFALL * peer):
        return "gpu_throttled"
    return {contract.ATTRIBUTION_GPU: "gpu", contract.ATTRIBUTION_HOST: "host",
            contract.ATTRIBUTION_WAITING: "peer_wait"}.get(record.get('attribution') or "", "unknown")


def _gpu_name(record: Mapping[str, Any]) -> str:
    gpu = record.get('gpu') or {}
    name = f"GPU {gpu['uuid']}" if gpu.get("uuid") else \
        f"GPU {record.get('local_rank')}" if record.get('local_rank') is not None else "its GPU"
    return name + (f" on {record.get('host')}" if record.get('host') else "")


def _host(record: Mapping[str, Any]) -> str:
    return record.get('host') or "its host"


def next_step(record: Mapping[str, Any]) -> str:
    """What to look at first for a per-rank straggler (or its suspect's reading for other verdicts)."""
    if record.get('verdict') == contract.VERDICT_HANG:
        return hang_next_step(record.get('reason'), record.get('rank'), record.get('host'), record.get('local_rank'))
    kind = suspect(record)
    gpu_name = _gpu_name(record)
    if kind == "gpu_errors":
        return (f"{gpu_name} is logging errors (uncorrected ECC or PCIe replays): drain that GPU so the restart "
                f"runs without it, then `nvidia-smi -q -d ECC,PAGE_RETIREMENT`, dmesg for XID errors and "
                f"`dcgmi diag -r 3` on it.")
    if kind == "input_pipeline":
        return (f"The rank's data loading ({record.get('stage')}) is slow, not its GPU: look at the storage or input "
                f"pipeline it reads from (file system or object store latency, DataLoader workers, CPU on "
                f"{_host(record)}).")
    if kind == "gpu_throttled":
        reasons = throttling(record.get('gpu'))
        cause = ("power: power caps, the PSU, a power brake" if reasons and all("power" in r for r in reasons)
                 else "cooling: fans, inlet temperature, airflow" if reasons and all("thermal" in r for r in reasons)
                 else "cooling and power")
        return (f"{gpu_name} runs at reduced clocks: check {cause}; "
                "`nvidia-smi -q -d PERFORMANCE,CLOCK,TEMPERATURE,POWER`, then `dcgmi diag -r 3` on that GPU.")
    if kind == "gpu":
        return (f"The rank's GPU work is slower with no throttling in its samples: look for another process on "
                f"{gpu_name} (`nvidia-smi`), compare its clocks (`nvidia-smi -q -d PERFORMANCE,CLOCK`), then "
                f"`dcgmi diag -r 3`.")
    if kind == "host":
        return (f"The rank's host-side work is slow while its GPU is not: look for CPU contention on "
                f"{_host(record)} (other processes, CPU frequency, data loader workers); `py-spy dump --pid` "
                f"of the rank shows where its Python spends the time.")
    if kind == "peer_wait":
        return (f"The rank waits longer in collectives: look at the network of {_host(record)} (NIC and link "
                f"errors, NCCL_DEBUG=INFO) and at the ranks it waits for.")
    return (f"Check, in this order: {gpu_name} (`nvidia-smi -q -d PERFORMANCE,CLOCK`, `dcgmi diag -r 3`), "
            f"CPU load on {_host(record)}, then the rank's input pipeline.")


def hang_next_step(reason: Optional[str], rank: Optional[int], host: Optional[str], local_rank: Optional[int]) -> str:
    where = f" on {host}" if host else ""
    worker = f"the worker with LOCAL_RANK={local_rank}" if local_rank is not None else f"rank {rank}'s worker"
    if reason == contract.HANG_NEVER_ENTERED_COLLECTIVE:
        return (f"`py-spy dump --pid <pid>` of {worker}{where} shows where it is stuck outside the collective "
                f"(data loader, I/O, a lock, a CUDA call); the NCCL flight recorder dump "
                f"(TORCH_NCCL_TRACE_BUFFER_SIZE) of the waiting ranks shows the collective they wait in.")
    if reason == contract.HANG_RANK_LOST:
        return (f"Check whether {worker}{where} still exists or is stopped (`ps`), dmesg for an OOM kill or GPU "
                f"XID errors, and the NCCL flight recorder dumps of its peers.")
    if reason == contract.HANG_ALL_RANKS_WAITING:
        return ("Every rank waits in the same collective: the network between the nodes (NIC and link errors, "
                "NCCL_DEBUG=INFO), the NCCL flight recorder dumps, and a rank outside the detector's view.")
    return f"`py-spy dump --pid <pid>` of {worker}{where}, and the NCCL flight recorder dumps of the job."


def node_next_step(host: str) -> str:
    return (f"suspect the node, not a GPU: cordon or drain {host} so the restart lands elsewhere "
            f"(`kubectl cordon {host}`, or `scontrol update nodename={host} state=drain reason=straggler`), "
            f"then look at what its GPUs share: chassis power and cooling, its NICs, CPU contention.")
