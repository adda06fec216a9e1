"""Wire contract v1.1: every attribute, metric and verdict name shared by the rank side,
the detector and the backends. Outside dashboards and alert rules depend on these strings:
add names, never rename them."""
from typing import Any

# §1 resource attributes
SERVICE_NAME = "service.name"
JOB_ID = "training.job.id"
RANK = "training.rank"
WORLD_SIZE = "training.world_size"
LOCAL_RANK = "training.local_rank"
HOST_NAME = "host.name"
COHORT = "training.cohort"
TOPOLOGY_EPOCH = "training.topology.epoch"
RESTART_COUNT = "training.restart.count"  # v1.1: a new value is a new incarnation
# v1.2 (§5), OTel semantic conventions: on Kubernetes the node (a verdict's `host`: the node to
# cordon, not the pod's host.name), the pod and its namespace
K8S_NODE_NAME = "k8s.node.name"
K8S_POD_NAME = "k8s.pod.name"
K8S_NAMESPACE_NAME = "k8s.namespace.name"
PARALLEL_DIMS = ("tp", "pp", "cp", "ep", "dp", "vpp")


def parallel_rank_key(dim: str) -> str:
    return f"training.parallel.{dim}.rank"


def parallel_size_key(dim: str) -> str:
    return f"training.parallel.{dim}.size"


# §2 stage spans
STEP_SPAN_NAME = "train.step"
STAGE = "training.stage"
STAGE_GROUP = "training.stage.group"
STEP = "training.step"
SEQ = "training.seq"
TIMING = "training.stage.timing"
DEVICE_DURATION_MS = "training.stage.device_duration_ms"
TIMING_REASON = "training.stage.timing_reason"
COLLECTIVE = "training.stage.collective"
WORKLOAD_TOKENS = "training.workload.tokens"
WORKLOAD_SAMPLES = "training.workload.samples"

# §2b heartbeats (v1.1)
HEARTBEAT_SPAN_NAME = "train.heartbeat"
HEARTBEAT_OPEN_STAGES = "training.heartbeat.open_stages"
HEARTBEAT_OPEN_SINCE = "training.heartbeat.open_since_unix_nano"

# §2c GPU health on heartbeats (v1.1): the latest sample of the rank's own GPU, where NVML reads it
GPU_INDEX = "training.gpu.index"  # int, NVML index
GPU_UUID = "training.gpu.uuid"  # string
GPU_SM_CLOCK_MHZ = "training.gpu.sm_clock_mhz"  # int
GPU_SM_CLOCK_MAX_MHZ = "training.gpu.sm_clock_max_mhz"  # int
GPU_CLOCK_EVENT_REASONS = "training.gpu.clock_event_reasons"  # int bitmask, CLOCK_EVENT_REASONS below
GPU_TEMPERATURE_C = "training.gpu.temperature_c"  # int
GPU_POWER_W = "training.gpu.power_w"  # double
GPU_UTILIZATION = "training.gpu.utilization"  # double 0..1
GPU_ECC_UNCORRECTED = "training.gpu.ecc_uncorrected"  # int, volatile, since the driver loaded
GPU_PCIE_REPLAY = "training.gpu.pcie_replay"  # int
GPU_ATTRIBUTES = (GPU_INDEX, GPU_UUID, GPU_SM_CLOCK_MHZ, GPU_SM_CLOCK_MAX_MHZ, GPU_CLOCK_EVENT_REASONS,
                  GPU_TEMPERATURE_C, GPU_POWER_W, GPU_UTILIZATION, GPU_ECC_UNCORRECTED, GPU_PCIE_REPLAY)
# NVML's clock event (throttle) reason bits and their names, lowest bit first
CLOCK_EVENT_REASONS = (
    (0x1, "gpu_idle"), (0x2, "clocks_setting"), (0x4, "sw_power_cap"), (0x8, "hw_slowdown"),
    (0x10, "sync_boost"), (0x20, "sw_thermal"), (0x40, "hw_thermal"), (0x80, "hw_power_brake"),
    (0x100, "display_clocks"),
)


def clock_event_reason_names(mask: int) -> tuple[str, ...]:
    """The names of the bits set in an NVML clock event reasons mask; unknown bits as hex."""
    names = [name for bit, name in CLOCK_EVENT_REASONS if mask & bit]
    unknown = mask & ~sum(bit for bit, _ in CLOCK_EVENT_REASONS)
    if unknown:
        names.append(hex(unknown))
    return tuple(names)


TIMING_DEVICE = "device"  # also a verdict's `timing` when its numbers are device durations
TIMING_HOST = "host"  # a verdict's `timing` when its numbers are host durations (never a span's)
TIMING_HOST_ONLY = "host_only"
TIMING_DEVICE_UNAVAILABLE = "device_unavailable"

STAGE_GROUPS = ("forward", "backward", "optimizer", "communication", "data", "eval", "setup", "other")

# §3a verdicts
VERDICT_STRAGGLER = "straggler"
VERDICT_RECOVERED = "recovered"
VERDICT_UNCERTAIN = "uncertain"
VERDICT_SILENT = "silent"
VERDICT_HANG = "hang"  # v1.1
VERDICT_JOB_SLOWDOWN = "job_slowdown"  # v1.1
HANG_NEVER_ENTERED_COLLECTIVE = "never_entered_collective"
HANG_RANK_LOST = "rank_lost"
HANG_ALL_RANKS_WAITING = "all_ranks_waiting"
HANG_PROGRESS_RESUMED = "progress_resumed"
HANG_ALL_RANKS_STALLED = "all_ranks_stalled"
# `recovered`: an alert of a cohort whose ranks stopped reporting here (the job ended, or the
# gateway moved the cohort to another detector shard)
REASON_COHORT_DEPARTED = "cohort_departed"
# the other reasons of straggler, recovered, uncertain, silent and job_slowdown verdicts
REASON_SLOW_VS_PEERS = "slow_vs_peers"
REASON_INTERMITTENT = "intermittent"  # slow in a sizeable share of its steps (detector/intermittent.py)
REASON_LAST_TO_ARRIVE = "last_to_arrive"  # at a collective: the rank its peers wait for
REASON_WITHIN_TOLERANCE = "within_tolerance"
REASON_RESTARTED = "restarted"  # an alert ended by a new incarnation of its cohort (training.restart.count)
REASON_BELOW_ABSOLUTE_FLOOR = "below_absolute_floor"
REASON_COHORT_BELOW_MIN_SIZE = "cohort_below_min_size"
REASON_WORKLOAD_INCOMPARABLE = "workload_incomparable"
REASON_RECOVERY_EVIDENCE_INSUFFICIENT = "recovery_evidence_insufficient"
REASON_WAITING_ON_PEER = "waiting_on_peer"
REASON_NO_REPORT = "no_report"
REASON_SLOWER_THAN_BASELINE = "slower_than_baseline"
REASON_BACK_TO_BASELINE = "back_to_baseline"
WHOLE_STEP_STAGE = "*"

VERDICT_FIELDS = (
    "time_unix_nano", "job_id", "cohort", "stage", "rank", "window", "verdict", "reason",
    "slowdown", "gap_ms", "rank_ms", "reference_ms", "reference_ranks", "timing",
    "attribution", "workload_comparable",
    "host", "local_rank", "gpu", "stalled_s",  # v1.1
    "slow_steps",  # v1.2: an intermittent straggler's slow steps (docs/detection.md)
    "also_slow",  # v1.2: the rank's other slow stages that the verdict's stage explains
    "pod", "namespace",  # v1.2: k8s.pod.name, k8s.namespace.name of the rank, where it sent them
)

ATTRIBUTION_GPU = "gpu_stream_stall"
ATTRIBUTION_HOST = "host_only_stall"
ATTRIBUTION_WAITING = "waiting_on_peer"
ATTRIBUTION_UNKNOWN = "attribution_unknown"

# Every value a verdict's enumerated fields take, with when: docs/contract-values.md is generated
# from these (python -m otel_straggler.contract_doc), and a test checks that the detector
# emits no other. A new value is an addition to the contract.
VERDICTS = {
    VERDICT_STRAGGLER: "an alert starts: the rank is slower than its peers",
    VERDICT_RECOVERED: "an alert (straggler, hang or job_slowdown) ends",
    VERDICT_UNCERTAIN: "the detector cannot judge the rank and stage, or the rank waits on a peer; noted once",
    VERDICT_SILENT: "the rank stopped reporting while its peers go on",
    VERDICT_HANG: "the job stopped making progress while its ranks are alive (v1.1)",
    VERDICT_JOB_SLOWDOWN: "the whole job is slower than its own baseline, no rank to blame (v1.1)",
}
# reason: (the verdicts that carry it, when)
REASONS = {
    REASON_SLOW_VS_PEERS: ((VERDICT_STRAGGLER,),
                           "slower than its peers' reference beyond the thresholds and the stage's noise for "
                           "persist_windows windows"),
    REASON_INTERMITTENT: ((VERDICT_STRAGGLER,),
                          "slow in a share of its steps well beyond its peers' while its median does not move"),
    REASON_LAST_TO_ARRIVE: ((VERDICT_STRAGGLER,),
                            "at a collective, consistently the rank its peers wait for"),
    REASON_WITHIN_TOLERANCE: ((VERDICT_RECOVERED,),
                              "back within the relative threshold (or, intermittent, no longer slow in a share of "
                              "its steps)"),
    REASON_RESTARTED: ((VERDICT_RECOVERED,),
                       "the alert's cohort was replaced by a new incarnation (training.restart.count)"),
    REASON_COHORT_DEPARTED: ((VERDICT_RECOVERED,),
                             "the cohort's ranks stopped reporting to this detector (the job ended, or it moved "
                             "to another shard)"),
    REASON_BELOW_ABSOLUTE_FLOOR: ((VERDICT_UNCERTAIN,),
                                  "over the relative threshold but under the absolute floor for persist_windows "
                                  "windows"),
    REASON_COHORT_BELOW_MIN_SIZE: ((VERDICT_UNCERTAIN,),
                                   "the stage has fewer ranks than min_cohort_size"),
    REASON_WORKLOAD_INCOMPARABLE: ((VERDICT_UNCERTAIN,),
                                   "too few peers with a comparable workload (tokens per step)"),
    REASON_RECOVERY_EVIDENCE_INSUFFICIENT: ((VERDICT_UNCERTAIN,),
                                            "an active alert met a window in which the rank cannot be compared"),
    REASON_WAITING_ON_PEER: ((VERDICT_UNCERTAIN,),
                             "the rank's wait at a collective is long for persist_windows windows"),
    REASON_NO_REPORT: ((VERDICT_SILENT,),
                       "no rows for silent_windows windows while its peers' intervals end later than any export "
                       "delay"),
    HANG_NEVER_ENTERED_COLLECTIVE: ((VERDICT_HANG,),
                                    "the rank is in another stage while most ranks wait inside a collective"),
    HANG_RANK_LOST: ((VERDICT_HANG,), "the rank's heartbeats stopped too: the process is gone or frozen"),
    HANG_ALL_RANKS_WAITING: ((VERDICT_HANG,), "every rank waits inside the same collective; rank null"),
    HANG_ALL_RANKS_STALLED: ((VERDICT_HANG,),
                             "no progress, most live ranks outside a collective and no rank lost; rank null, "
                             "`stage` the most common open stage"),
    HANG_PROGRESS_RESUMED: ((VERDICT_RECOVERED,), "intervals complete again after a hang"),
    REASON_SLOWER_THAN_BASELINE: ((VERDICT_JOB_SLOWDOWN,),
                                  "the job's pace is over job_slowdown_threshold above its baseline for "
                                  "persist_windows windows whose steps took job_slowdown_min_s or more"),
    REASON_BACK_TO_BASELINE: ((VERDICT_RECOVERED,), "the job's pace is back near its baseline"),
}
TIMINGS = {
    TIMING_HOST: "the numbers are host durations",
    TIMING_DEVICE: "the numbers are device (CUDA event) durations",
}
ATTRIBUTIONS = {
    ATTRIBUTION_GPU: "the device duration is the slow one",
    ATTRIBUTION_HOST: "the host duration is slow while the device durations are comparable and not slow",
    ATTRIBUTION_WAITING: "the rank waits at a collective for a peer (waiting_on_peer; all_ranks_waiting)",
    ATTRIBUTION_UNKNOWN: "anything else: no comparable device duration, or a verdict whose rule does not compare "
                         "host and device (intermittent, last_to_arrive, silent, hang, job_slowdown, recovered by "
                         "restart or departure)",
}
# field: its values and when (each value's entry: its when; for reason, REASONS' (verdicts, when))
VERDICT_FIELD_VALUES: dict[str, dict[str, Any]] = {"verdict": VERDICTS, "reason": REASONS, "timing": TIMINGS,
                                                    "attribution": ATTRIBUTIONS}

# §3b metrics
METRIC_RANK_SLOWDOWN = "straggler.rank.slowdown"
METRIC_ALERT_ACTIVE = "straggler.alert.active"
METRIC_VERDICTS = "straggler.verdicts"
METRIC_DETECTOR_SPANS = "straggler.detector.spans"
METRIC_JOB_HANG = "straggler.job.hang"  # v1.1
METRIC_JOB_SLOWDOWN = "straggler.job.slowdown"  # v1.1
# added: 1 while a straggler alert is active, with what the evidence says in words (attributes
# `suspect`, `gpu`, `next_step`) for alert annotations; gone when the alert ends
METRIC_ALERT_EVIDENCE = "straggler.alert.evidence"

# §3c events
VERDICT_EVENT_NAME = "straggler.verdict"
