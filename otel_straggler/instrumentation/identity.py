"""Who this process is in the job: the resource attributes of CONTRACT §1.

Explicit values win; then OTEL_RESOURCE_ATTRIBUTES and OTEL_STRAGGLER_* env vars; then what
torch.distributed, torchrun/SLURM variables and Megatron's parallel state say. A value that
cannot be found is left out, never guessed. Discovery only reads state that is already there:
it never initialises a process group or imports Megatron.
"""
from __future__ import annotations

import os
import socket
import sys
from typing import Any, Mapping, Optional

from otel_straggler import contract

# Megatron parallel_state getters per dimension: (rank getter, size getter)
_MEGATRON_GETTERS = {
    "tp": ("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size"),
    "pp": ("get_pipeline_model_parallel_rank", "get_pipeline_model_parallel_world_size"),
    "cp": ("get_context_parallel_rank", "get_context_parallel_world_size"),
    "ep": ("get_expert_model_parallel_rank", "get_expert_model_parallel_world_size"),
    "dp": ("get_data_parallel_rank", "get_data_parallel_world_size"),
    "vpp": ("get_virtual_pipeline_model_parallel_rank", "get_virtual_pipeline_model_parallel_world_size"),
}
# the dimensions that decide a rank's role; data-parallel position is deliberately absent
_COHORT_DIMS = ("tp", "pp", "cp", "ep", "vpp")


def parse_resource_attributes(text: str) -> dict[str, str]:
    """OTEL_RESOURCE_ATTRIBUTES: comma-separated key=value, values percent-decoded."""
    from urllib.parse import unquote

    pairs = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            pairs[key.strip()] = unquote(value.strip())
    return pairs


def _int(value: Any) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _first_int(environ: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = _int(environ.get(name))
        if value is not None:
            return value
    return None


def _torch_distributed() -> tuple[Optional[int], Optional[int]]:
    torch = sys.modules.get("torch")
    try:
        dist = torch.distributed if torch is not None else None
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return None, None


def _megatron_parallel() -> dict[str, int]:
    found: dict[str, int] = {}
    state = sys.modules.get("megatron.core.parallel_state")
    try:
        if state is None or not state.model_parallel_is_initialized():
            return found
        for dim, (rank_getter, size_getter) in _MEGATRON_GETTERS.items():
            try:
                size = getattr(state, size_getter)()
                rank = getattr(state, rank_getter)()
            except Exception:
                continue
            if size is not None and rank is not None:
                found[contract.parallel_size_key(dim)] = int(size)
                found[contract.parallel_rank_key(dim)] = int(rank)
    except Exception:
        pass
    return found


def _parallel_from_resource_attributes(from_env: Mapping[str, str]) -> dict[str, int]:
    found: dict[str, int] = {}
    for dim in contract.PARALLEL_DIMS:
        for key in (contract.parallel_rank_key(dim), contract.parallel_size_key(dim)):
            value = _int(from_env.get(key))
            if value is not None:
                found[key] = value
    return found


def cohort_from_parallel(parallel: Mapping[str, int]) -> Optional[str]:
    """Ranks with equal non-data-parallel coordinates play the same role."""
    parts = []
    for dim in _COHORT_DIMS:
        rank = parallel.get(contract.parallel_rank_key(dim))
        if rank is not None:
            parts.append(f"{dim}{rank}")
    return ".".join(parts) if parts else None


def discover(
    explicit: Mapping[str, Any],
    environ: Optional[Mapping[str, str]] = None,
) -> dict[str, Any]:
    """The resource attributes for this process. `explicit` holds configure() arguments and
    OTEL_STRAGGLER_* values already validated (job_id, cohort, topology_epoch, restart_count, rank, ...)."""
    environ = os.environ if environ is None else environ
    from_env = parse_resource_attributes(environ.get("OTEL_RESOURCE_ATTRIBUTES", ""))
    dist_rank, dist_world = _torch_distributed()
    # Dimensions given in OTEL_RESOURCE_ATTRIBUTES override Megatron's (as ints, like the
    # contract says) and so shape the cohort too.
    parallel = {**_megatron_parallel(), **_parallel_from_resource_attributes(from_env)}

    def pick(key: str, explicit_name: str, *fallbacks: Any) -> Any:
        value = explicit.get(explicit_name)
        if value not in (None, ""):
            return value
        if key in from_env:
            return from_env[key]
        for fallback in fallbacks:
            if fallback not in (None, ""):
                return fallback
        return None

    job_id = pick(contract.JOB_ID, "job_id", _torchrun_run_id(environ), environ.get("SLURM_JOB_ID"),
                  _rendezvous_address(environ))
    attributes: dict[str, Any] = {
        contract.SERVICE_NAME: environ.get("OTEL_SERVICE_NAME") or from_env.get(contract.SERVICE_NAME) or "training",
        contract.JOB_ID: job_id,
        contract.RANK: _int(pick(contract.RANK, "rank", dist_rank, _first_int(environ, "RANK", "SLURM_PROCID"))),
        contract.WORLD_SIZE: _int(pick(contract.WORLD_SIZE, "world_size", dist_world,
                                       _first_int(environ, "WORLD_SIZE", "SLURM_NTASKS"))),
        contract.LOCAL_RANK: _int(pick(contract.LOCAL_RANK, "local_rank",
                                       _first_int(environ, "LOCAL_RANK", "SLURM_LOCALID"))),
        contract.HOST_NAME: pick(contract.HOST_NAME, "host_name", socket.gethostname()),
        contract.COHORT: pick(contract.COHORT, "cohort", cohort_from_parallel(parallel)),
        contract.TOPOLOGY_EPOCH: _int(pick(contract.TOPOLOGY_EPOCH, "topology_epoch", 0)),
        # torchrun counts the worker group's restarts; 0 when nothing says (contract §1)
        contract.RESTART_COUNT: _int(pick(contract.RESTART_COUNT, "restart_count",
                                          _first_int(environ, "TORCHELASTIC_RESTART_COUNT"), 0)),
    }
    attributes.update(parallel)
    return {key: value for key, value in attributes.items() if value is not None}


def _rendezvous_address(environ: Mapping[str, str]) -> Optional[str]:
    """torch.distributed's env:// rendezvous (torchrun's static one, SLURM scripts that set it):
    every rank of the job has the same MASTER_ADDR and MASTER_PORT, and no other job has both while
    this one runs, so the pair names the job without a collective."""
    address, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    return f"rendezvous-{address}:{port}" if address and port else None


def _torchrun_run_id(environ: Mapping[str, str]) -> Optional[str]:
    run_id = environ.get("TORCHELASTIC_RUN_ID")
    # torchrun's default run id is the literal "none": shared by every job, so not an identity
    return run_id if run_id and run_id != "none" else None
