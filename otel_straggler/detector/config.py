"""Every detector setting in one table: default, bounds, env var and flag.

Flags win over `OTEL_STRAGGLER_*` env vars, which win over defaults. Each value is validated
when loaded, and a bad one fails with one line that names the flag (or env var) and the bound.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from otel_straggler import settings as _settings
from otel_straggler.settings import ConfigError, Setting, parse_bool as _bool

__all__ = ["ConfigError", "DetectorConfig", "SETTINGS", "add_arguments", "load"]


SETTINGS: tuple[Setting, ...] = (
    # engine: detection rules (docs/detection.md)
    Setting("window_steps", int, 10, "steps per window: window w holds steps [w*W, (w+1)*W)", 1, 100_000),
    Setting("rel_threshold", float, 0.05, "slow means slowdown > 1 + this", 0.001, 10.0),
    Setting("min_gap_ms", float, 5.0, "slow also needs rank median - reference > this many ms", 0.0, 3_600_000.0),
    Setting(
        "false_alarm_rate", float, 0.05,
        "slow also needs a deviation beyond the cohort's own noise: z x its robust spread, z the normal quantile 1 - "
        "this / (comparisons in the window)",
        1e-9, 0.5,
    ),
    Setting("persist_windows", int, 3, "consecutive slow windows before a straggler alert", 1, 1000),
    Setting(
        "intermittent_threshold", float, 0.25,
        "a slow step (intermittent stragglers) is over the median of its step's ranks by more than this, and by "
        "min_gap_ms",
        0.01, 100.0,
    ),
    Setting(
        "job_slowdown_threshold", float, 0.15,
        "`job_slowdown` when a cohort's step time (time per token where tokens are reported) is over its own baseline "
        "by more than this for persist_windows windows",
        0.01, 10.0,
    ),
    Setting(
        "job_slowdown_min_s", float, 30.0,
        "`job_slowdown` also needs those windows' steps to have taken at least this many seconds: with fast steps, "
        "a few windows are seconds long, within a busy host's swings",
        0.0, 86_400.0,
    ),
    Setting("warmup_windows", int, 2, "each rank's first windows are not judged", 0, 1000),
    Setting(
        "work_tolerance", float, 0.1,
        "ranks are comparable when tokens per step differ by at most this fraction",
        0.0, 10.0,
    ),
    Setting(
        "min_cohort_size", int, 3,
        "a rank needs at least this many comparable ranks, itself included",
        2, 1_000_000,
    ),
    Setting("reference_quantile", float, 0.5, "quantile of the peers' window medians used as the reference", 0.0, 1.0),
    Setting(
        "window_grace_s", float, 30.0,
        "a window closes this long after its last span even if the cohort has not moved on",
        0.1, 86_400.0,
    ),
    Setting("silent_windows", int, 3, "a rank missing from this many consecutive closed windows is `silent`", 1, 1000),
    Setting(
        "window_close_lag", int, 16,
        "a window also closes once more than half of its cohort's ranks have reported a window this many later, "
        "however recently the ranks it waits for delivered",
        1, 1000,
    ),
    Setting(
        "max_export_lag_s", float, 15.0,
        "longest a window waits for a rank that has not reached past it; less once the rank's own delivery gap is "
        "known (twice it, plus 1 s)",
        0.1, 3600.0,
    ),
    Setting(
        "hang_timeout_s", float, 120.0,
        "`hang` when no interval of a job ended for this long while its heartbeats show ranks alive; longer than the "
        "longest pause every rank takes together (a checkpoint save)",
        1.0, 86_400.0,
    ),
    Setting(
        "dedup_horizon", int, 512,
        "recent sequence numbers remembered per rank for de-duplication (8 bytes each; rounded up to a power of two)",
        16, 1 << 20,
    ),
    Setting(
        "max_jobs", int, 64,
        "bound on jobs tracked at once: a new job takes the place of one never judged, else of one idle for "
        "--idle-evict-s, else it is shed (counted)",
        1, 100_000,
    ),
    Setting(
        "idle_evict_s", float, 600.0,
        "a job or cohort judged before gives its place to a new one only once it sent nothing for this long",
        1.0, 86_400.0 * 30,
    ),
    Setting("max_cohorts", int, 4096, "bound on cohorts tracked at once: taken as --max-jobs are", 1, 1_000_000),
    Setting("max_ranks", int, 65_536, "bound on ranks tracked per cohort", 1, 10_000_000),
    Setting(
        "max_tracked_ranks", int, 262_144,
        "bound on ranks whose placement and latest heartbeat are kept, over all jobs (about 300 bytes each)",
        1, 100_000_000,
    ),
    Setting(
        "max_gpu_ranks", int, 32_768,
        "bound on ranks whose latest GPU health samples are kept for verdicts' gpu evidence (about 3 KB each); the "
        "least recently heard from is forgotten first",
        1, 10_000_000,
    ),
    Setting("max_stages", int, 256, "bound on distinct stage names per cohort", 1, 100_000),
    Setting(
        "max_open_windows", int, 32,
        "bound on windows open at once per cohort (they wait for the ranks' export bursts)",
        1, 1000,
    ),
    Setting(
        "report_below_floor", _bool, False,
        "also emit `uncertain`/`below_absolute_floor` verdicts (a rank over the relative threshold but under "
        "--min-gap-ms for persist_windows windows); off, they are only counted in status.json",
    ),
    Setting(
        "max_window_rows_per_rank", int, 65_536,
        "spans a window holds per reporting rank of its cohort (32 bytes each); one that reaches it closes early and "
        "is judged (a step that does not advance, such as a long evaluation)",
        256, 1 << 24,
    ),
    # service: intake
    Setting("listen_address", str, "127.0.0.1", "address the OTLP receivers bind"),
    Setting("grpc_port", int, 4317, "OTLP/gRPC port (0 picks a free one)", 0, 65535),
    Setting("http_port", int, 4318, "OTLP/HTTP port (0 picks a free one)", 0, 65535),
    Setting(
        "max_request_bytes", int, 16 * 1024 * 1024,
        "largest OTLP request accepted (after decompression)",
        1024, 1 << 31,
    ),
    Setting(
        "max_pending_requests", int, 256,
        "requests queued for the engine before intake answers 'retry later'",
        1, 1_000_000,
    ),
    Setting(
        "max_pending_spans", int, 1_000_000,
        "spans queued for the engine before intake answers 'retry later'",
        1, 100_000_000,
    ),
    Setting(
        "receiver_threads", int, 4,
        "threads that decompress, decode and queue OTLP requests (connections and calls wait on one event loop, not on"
        " these)",
        1, 256,
    ),
    Setting(
        "max_http_connections", int, 256,
        "OTLP/HTTP connections at once; one more takes the place of the one that waited longest for its next request, "
        "or gets 503 when all are busy",
        1, 100_000,
    ),
    Setting(
        "max_grpc_calls", int, 256,
        "OTLP/gRPC calls at once; one more takes the place of the one that waited longest for its message, or gets "
        "RESOURCE_EXHAUSTED when all are busy",
        1, 100_000,
    ),
    Setting("auth_token_file", str, "", "file holding the bearer token clients must send (empty: no auth)"),
    Setting("auth_token", str, "", "bearer token clients must send (prefer --auth-token-file)"),
    Setting("tls_cert_file", str, "", "PEM certificate; with --tls-key-file serves TLS on both ports"),
    Setting("tls_key_file", str, "", "PEM private key for --tls-cert-file"),
    # service: outputs
    Setting("evidence_dir", str, "straggler-evidence", "folder for verdicts.jsonl and status.json"),
    Setting("flush_interval_s", float, 1.0, "evidence is flushed at least this often", 0.05, 60.0),
    Setting(
        "max_evidence_bytes", int, 1 << 30,
        "verdicts.jsonl stops growing at this size; later verdicts are counted, not written",
        1024, 1 << 40,
    ),
    Setting(
        "console_verdicts", _bool, True,
        "print one line per alert, recovery, hang, job slowdown and silent rank on the console (stderr)",
    ),
    Setting(
        "console_status_interval_s", float, 60.0,
        "print a one-line status (jobs, ranks, spans/s, late, rejected) this often (0: never)",
        0.0, 86_400.0,
    ),
    Setting(
        "record_windows", _bool, True,
        "write each judged window's per-rank stage medians to windows.jsonl in the evidence directory (the report's "
        "heat map and timelines)",
    ),
    Setting(
        "max_window_record_bytes", int, 256 * 1024 * 1024,
        "windows.jsonl stops growing at this size; later windows are counted, not written",
        1024, 1 << 40,
    ),
    Setting("prometheus_port", int, -1, "also serve metrics for scraping on this port (-1: off)", -1, 65535),
    Setting("export_metrics", _bool, True, "export verdict metrics and events over OTLP (OTEL_EXPORTER_OTLP_*)"),
    Setting("metric_export_interval_s", float, 5.0, "OTLP metric export period", 0.1, 3600.0),
    Setting(
        "prompt_export_spacing_s", float, 1.0,
        "metrics are also exported right after a verdict that starts or ends an alert, at most this often (0: only the"
        " periodic export)",
        0.0, 3600.0,
    ),
    Setting(
        "max_metric_series", int, 50_000,
        "bound on series per per-rank metric (slowdown, alert, verdicts); more go to the overflow series",
        100, 10_000_000,
    ),
)

_BY_NAME = {setting.name: setting for setting in SETTINGS}


@dataclass(frozen=True)
class DetectorConfig:
    window_steps: int = 10
    rel_threshold: float = 0.05
    min_gap_ms: float = 5.0
    false_alarm_rate: float = 0.05
    persist_windows: int = 3
    intermittent_threshold: float = 0.25
    job_slowdown_threshold: float = 0.15
    job_slowdown_min_s: float = 30.0
    warmup_windows: int = 2
    work_tolerance: float = 0.1
    min_cohort_size: int = 3
    reference_quantile: float = 0.5
    window_grace_s: float = 30.0
    silent_windows: int = 3
    window_close_lag: int = 16
    max_export_lag_s: float = 15.0
    hang_timeout_s: float = 120.0
    dedup_horizon: int = 512
    max_jobs: int = 64
    idle_evict_s: float = 600.0
    max_cohorts: int = 4096
    max_ranks: int = 65_536
    max_tracked_ranks: int = 262_144
    max_gpu_ranks: int = 32_768
    max_stages: int = 256
    max_open_windows: int = 32
    report_below_floor: bool = False
    max_window_rows_per_rank: int = 65_536
    listen_address: str = "127.0.0.1"
    grpc_port: int = 4317
    http_port: int = 4318
    max_request_bytes: int = 16 * 1024 * 1024
    max_pending_requests: int = 256
    max_pending_spans: int = 1_000_000
    receiver_threads: int = 4
    max_http_connections: int = 256
    max_grpc_calls: int = 256
    auth_token_file: str = ""
    auth_token: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    evidence_dir: str = "straggler-evidence"
    flush_interval_s: float = 1.0
    max_evidence_bytes: int = 1 << 30
    console_verdicts: bool = True
    console_status_interval_s: float = 60.0
    record_windows: bool = True
    max_window_record_bytes: int = 256 * 1024 * 1024
    prometheus_port: int = -1
    export_metrics: bool = True
    metric_export_interval_s: float = 5.0
    prompt_export_spacing_s: float = 1.0
    max_metric_series: int = 50_000

    def __post_init__(self) -> None:
        for field in fields(self):
            setting = _BY_NAME[field.name]
            setting.check(getattr(self, field.name), setting.flag)
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("--tls-cert-file and --tls-key-file must be given together")

    def replace(self, **changes: Any) -> "DetectorConfig":
        values = {field.name: getattr(self, field.name) for field in fields(self)}
        values.update(changes)
        return DetectorConfig(**values)


def add_arguments(parser: argparse.ArgumentParser, names: Optional[set[str]] = None) -> None:
    """One flag per setting (all of them, or only `names`)."""
    _settings.add_arguments(parser, (s for s in SETTINGS if names is None or s.name in names))


def load(args: Optional[argparse.Namespace] = None, environ: Optional[Mapping[str, str]] = None) -> DetectorConfig:
    """Builds the config from flags, then env, then defaults; raises ConfigError with one line."""
    explicit = vars(args) if args is not None else None
    return DetectorConfig(**_settings.resolve(SETTINGS, explicit, os.environ if environ is None else environ))
