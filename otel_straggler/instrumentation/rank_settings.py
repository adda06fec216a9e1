"""Rank-side settings: every `OTEL_STRAGGLER_*` knob of the instrumentation, its default and
bounds. Standard OTel variables (OTEL_SERVICE_NAME, OTEL_EXPORTER_OTLP_*, OTEL_BSP_*,
OTEL_RESOURCE_ATTRIBUTES, OTEL_SDK_DISABLED) are read by the SDK itself and by `exporting.py`."""
from __future__ import annotations

from otel_straggler.settings import Setting, parse_bool

DEVICE_TIMING_MODES = ("auto", "cuda", "fake", "off")
GPU_HEALTH_MODES = ("auto", "on", "fake", "off")

SETTINGS: tuple[Setting, ...] = (
    Setting("enabled", parse_bool, False, "turn the instrumentation on under opentelemetry-instrument"),
    Setting("job_id", str, "", "training.job.id (default: TORCHELASTIC_RUN_ID, then SLURM_JOB_ID, then "
                               "MASTER_ADDR:MASTER_PORT; none: configure() warns)"),
    Setting("cohort", str, "", "training.cohort (default: from Megatron parallel state, else left out)"),
    Setting("topology_epoch", int, 0, "training.topology.epoch; bump when the job re-shards", 0, 1 << 62),
    Setting("restart_count", int, 0, "training.restart.count (default: TORCHELASTIC_RESTART_COUNT, else 0)",
            0, 1 << 62),
    Setting("device_timing", str, "auto", "CUDA-event timing: auto (when a GPU is visible), cuda (configure() "
                                          "fails without one), fake, off",
            choices=DEVICE_TIMING_MODES),
    Setting("event_pool_size", int, 4096, "CUDA events allocated once; 2 per interval in flight", 2, 1 << 20),
    Setting("readout_timeout_ms", float, 10_000.0, "a device duration not readable after this is "
                                                   "device_unavailable",
            1.0, 3_600_000.0),
    Setting("queue_size", int, 65_536, "completed intervals waiting for the span builder; beyond it they are "
                                       "dropped and counted",
            16, 1 << 24),
    Setting("build_interval_ms", float, 1000.0, "how often the background thread turns intervals into spans "
                                                "(less often: fewer wake-ups, less CPU)",
            1.0, 60_000.0),
    Setting("heartbeat_interval_ms", float, 5000.0, "how often the background thread sends a train.heartbeat "
                                                    "span (open stages, step), also while training is blocked",
            100.0, 3_600_000.0, off=0.0),
    Setting("no_stage_warning_s", float, 60.0, "log one warning when the rank has timed no stage this long "
                                               "after configure() (the training loop calls no stage(), say)",
            0.1, 86_400.0, off=0.0),
    Setting("max_pending_spans", int, 16_384, "spans held while their CUDA events complete", 16, 1 << 22),
    Setting("export_metrics", parse_bool, True, "export the rank's own straggler.instrumentation.* metrics"),
    Setting("gpu_health", str, "auto", "training.gpu.* on heartbeats, read through NVML: auto (where NVML loads and "
                                       "the rank's GPU is found, else silently off), on (the same, with one warning "
                                       "when it cannot), fake (tests), off (NVML never loaded)",
            choices=GPU_HEALTH_MODES),
    Setting("gpu_metrics", parse_bool, False, "also export the GPU health samples as the OTel hardware metrics "
                                              "hw.gpu.utilization, hw.gpu.memory.usage, hw.power, hw.temperature "
                                              "(needs export_metrics)"),
)

DEFAULTS = {setting.name: setting.default for setting in SETTINGS}
