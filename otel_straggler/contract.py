"""Wire contract v1.1: every attribute, metric and verdict name shared by the rank side,
the detector and the backends. Outside dashboards and alert rules depend on these strings:
add names, never rename them."""

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
