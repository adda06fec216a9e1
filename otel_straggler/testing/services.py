"""Run the real pipeline programs (collector, Jaeger, Prometheus) on 127.0.0.1 for tests and
benchmarks (benchmarks/alert_latency.py).

Standard library only: `scripts/services.sh start|stop` runs this file as a script, and pytest
fixtures and benchmarks import it. It needs a source checkout: the configs are read from the
repository's collector-config/. Every process gets free loopback ports, writes its log to a file, is waited
for with a deadline, and is stopped (SIGTERM, then SIGKILL) when its `with` block ends, whatever
happened inside.

    with Stack(workdir) as stack:          # Jaeger + Prometheus + gateway collector
        stack.endpoints.collector_grpc     # "127.0.0.1:PORT", for OTLP exporters
        stack.prometheus.query("up")

    with Collector([CONFIG_DIR / "agent.yaml"], workdir, env={...}) as agent: ...

Binaries are looked up where `scripts/services.sh build` puts them (see binaries()).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "collector-config"
DEFAULT_SERVICES_DIR = REPO / ".services"
LOOPBACK = "127.0.0.1"

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


class ServiceError(RuntimeError):
    """A program did not start, or did not become ready in time; the message ends with its log."""


def cache_dir() -> Path:
    return Path(os.environ.get("OTEL_STRAGGLER_CACHE") or Path.home() / ".cache" / "otel-straggler")


@dataclasses.dataclass(frozen=True)
class Binaries:
    otelcol: Path
    jaeger: Path
    prometheus: Path
    promtool: Path

    def missing(self) -> list[str]:
        return [f"{name} ({path})" for name, path in dataclasses.asdict(self).items()
                if not (Path(path).is_file() and os.access(path, os.X_OK))]


def binaries() -> Binaries:
    """Where the programs are: env overrides, else the build cache, else PATH (Prometheus)."""
    built = cache_dir() / "bin"

    def pick(env: str, default: Path) -> Path:
        return Path(os.environ.get(env) or default)

    return Binaries(
        otelcol=pick("OTELCOL_STRAGGLER_BIN", built / "otelcol-straggler"),
        jaeger=pick("JAEGER_BIN", built / "jaeger"),
        prometheus=pick("PROMETHEUS_BIN", Path(shutil.which("prometheus") or "/usr/bin/prometheus")),
        promtool=pick("PROMTOOL_BIN", Path(shutil.which("promtool") or "/usr/bin/promtool")),
    )


def _load_ports():
    """otel_straggler/demo/ports.py by path: this file runs without the package installed."""
    spec = importlib.util.spec_from_file_location("otel_straggler_ports", REPO / "otel_straggler" / "demo" / "ports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ports = _load_ports()
free_port = ports.free_port


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """(status, body); status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, b""


def wait_until(condition: Callable[[], object], timeout: float, interval: float = 0.2, what: str = "condition"):
    """Polls until condition() is truthy and returns it; raises TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not met within {timeout:.0f}s")
        time.sleep(interval)


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the test process dies, even by SIGKILL, so a
    killed test run leaves no program behind (Linux; elsewhere a no-op). The kernel ties this to
    the starting thread: start programs from the main thread, not from a short-lived worker."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def port_open(port: int, host: str = LOOPBACK) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


class ManagedProcess:
    """One program: started with a log file, ready when `is_ready()` says so, always stopped."""

    name = "process"

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"{self.name}.log"
        self.process: Optional[subprocess.Popen] = None

    # Subclasses say what to run and when it is ready.
    def argv(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return {}

    def is_ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = START_TIMEOUT_S, detach: bool = False) -> "ManagedProcess":
        env = dict(os.environ)
        env.update(self.environment())
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.argv(), env=env, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=detach,
                preexec_fn=None if detach else _die_with_parent)
        deadline = time.monotonic() + timeout
        while not self.is_ready():
            if self.process.poll() is not None:
                raise ServiceError(f"{self.name} exited with {self.process.returncode} while starting\n"
                                   f"{self.log_tail()}")
            if time.monotonic() >= deadline:
                self.stop()
                raise ServiceError(f"{self.name} not ready within {timeout:.0f}s\n{self.log_tail()}")
            time.sleep(0.2)
        return self

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout)

    def restart(self, timeout: float = START_TIMEOUT_S) -> "ManagedProcess":
        """Stops and starts again on the same ports (for restart tests)."""
        self.stop()
        return self.start(timeout)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Collector(ManagedProcess):
    """otelcol-straggler with one or more of our configs (later files overlay earlier ones).

    Every address the configs read from the environment gets a free loopback port; `env` adds
    or overrides variables (DETECTOR_ENDPOINTS, JAEGER_OTLP_ENDPOINT, OTELCOL_GATEWAY_ENDPOINT, ...).
    """

    def __init__(self, configs: list[Path], workdir: Path, env: Optional[Mapping[str, str]] = None,
                 name: str = "collector", binary: Optional[Path] = None) -> None:
        self.name = name
        super().__init__(workdir)
        self.configs = [Path(c) for c in configs]
        self.binary = Path(binary or binaries().otelcol)
        self.grpc_port, self.http_port, self.health_port = free_port(), free_port(), free_port()
        self.prometheus_port, self.telemetry_port = free_port(), free_port()
        self.events_path = self.workdir / f"{name}-events.jsonl"
        self.env = {
            "OTELCOL_OTLP_GRPC_ENDPOINT": f"{LOOPBACK}:{self.grpc_port}",
            "OTELCOL_OTLP_HTTP_ENDPOINT": f"{LOOPBACK}:{self.http_port}",
            "OTELCOL_HEALTH_ENDPOINT": f"{LOOPBACK}:{self.health_port}",
            "OTELCOL_PROMETHEUS_ENDPOINT": f"{LOOPBACK}:{self.prometheus_port}",
            "OTELCOL_TELEMETRY_HOST": LOOPBACK,
            "OTELCOL_TELEMETRY_PORT": str(self.telemetry_port),
            "OTELCOL_EVENTS_PATH": str(self.events_path),
            # Nothing listens here unless a test says otherwise: exports fail and are retried.
            "DETECTOR_ENDPOINTS": f"[{LOOPBACK}:{free_port()}]",
            "JAEGER_OTLP_ENDPOINT": f"{LOOPBACK}:{free_port()}",
            "OTELCOL_GATEWAY_ENDPOINT": f"{LOOPBACK}:{free_port()}",
        }
        self.env.update(env or {})

    def argv(self) -> list[str]:
        return [str(self.binary)] + [f"--config={c}" for c in self.configs]

    def environment(self) -> dict[str, str]:
        return self.env

    def is_ready(self) -> bool:
        return http_get(self.health_url)[0] == 200

    @property
    def grpc_endpoint(self) -> str:
        return f"{LOOPBACK}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    @property
    def health_url(self) -> str:
        return f"http://{LOOPBACK}:{self.health_port}/"

    @property
    def metrics_address(self) -> str:
        """host:port of the prometheus exporter (the detector's metrics)."""
        return f"{LOOPBACK}:{self.prometheus_port}"

    @property
    def telemetry_address(self) -> str:
        """host:port of the collector's own metrics."""
        return f"{LOOPBACK}:{self.telemetry_port}"

    def telemetry(self, prefix: str = "otelcol_") -> dict[str, float]:
        """The collector's own metrics now, `name{labels}` -> value, those whose name starts with
        `prefix` (empty when the collector does not answer). load_balancing reports what it handed
        each shard's exporter (otelcol_exporter_sent_spans / send_failed_spans of the
        load_balancing exporter, otelcol_loadbalancer_backend_outcome); the per-shard exporters'
        own queue and retry metrics are not exported, their retries and drops are in the log."""
        status, body = http_get(f"http://{self.telemetry_address}/metrics", timeout=5)
        if status != 200:
            return {}
        series = {}
        for line in body.decode(errors="replace").splitlines():
            if line.startswith(prefix) and " " in line:
                name, _, value = line.rpartition(" ")
                try:
                    series[name] = float(value)
                except ValueError:
                    pass
        return series

    def validate(self) -> subprocess.CompletedProcess:
        env = dict(os.environ)
        env.update(self.env)
        return subprocess.run([str(self.binary), "validate"] + [f"--config={c}" for c in self.configs],
                              env=env, capture_output=True, text=True, timeout=60)


class Jaeger(ManagedProcess):
    """Jaeger v2 with collector-config/jaeger/jaeger.yaml (memory storage)."""

    name = "jaeger"

    def __init__(self, workdir: Path, binary: Optional[Path] = None) -> None:
        super().__init__(workdir)
        self.binary = Path(binary or binaries().jaeger)
        self.otlp_grpc_port, self.otlp_http_port = free_port(), free_port()
        self.query_port, self.query_grpc_port, self.health_port = free_port(), free_port(), free_port()

    def argv(self) -> list[str]:
        return [str(self.binary), f"--config={CONFIG_DIR / 'jaeger' / 'jaeger.yaml'}"]

    def environment(self) -> dict[str, str]:
        return {
            "JAEGER_OTLP_GRPC_ENDPOINT": f"{LOOPBACK}:{self.otlp_grpc_port}",
            "JAEGER_OTLP_HTTP_ENDPOINT": f"{LOOPBACK}:{self.otlp_http_port}",
            "JAEGER_QUERY_HTTP_ENDPOINT": f"{LOOPBACK}:{self.query_port}",
            "JAEGER_QUERY_GRPC_ENDPOINT": f"{LOOPBACK}:{self.query_grpc_port}",
            "JAEGER_HEALTH_ENDPOINT": f"{LOOPBACK}:{self.health_port}",
            "JAEGER_MAX_TRACES": "20000",
        }

    def is_ready(self) -> bool:
        return http_get(f"{self.query_url}/api/services")[0] == 200

    @property
    def query_url(self) -> str:
        return f"http://{LOOPBACK}:{self.query_port}"

    @property
    def otlp_grpc_endpoint(self) -> str:
        return f"{LOOPBACK}:{self.otlp_grpc_port}"


class Detector(ManagedProcess):
    """`otel-straggler detect` from this checkout, exporting its metrics and events to `otlp_endpoint`.

    Ready when its OTLP/gRPC port accepts connections. `args` adds detector flags.
    """

    def __init__(self, workdir: Path, grpc_port: int, http_port: int, otlp_endpoint: Optional[str] = None,
                 args: tuple[str, ...] = (), env: Optional[Mapping[str, str]] = None, name: str = "detector",
                 python: str = sys.executable) -> None:
        self.name = name
        super().__init__(workdir)
        self.grpc_port, self.http_port = grpc_port, http_port
        self.evidence_dir = self.workdir / f"{name}-evidence"
        self.python = python
        self.args = tuple(args)
        self.env = {"OTEL_TRACES_EXPORTER": "none",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        if otlp_endpoint:
            self.env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{otlp_endpoint}",
                             "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
        self.env.update(env or {})

    def argv(self) -> list[str]:
        return [self.python, "-m", "otel_straggler", "detect", f"--listen-address={LOOPBACK}",
                f"--grpc-port={self.grpc_port}", f"--http-port={self.http_port}",
                f"--evidence-dir={self.evidence_dir}", *self.args]

    def environment(self) -> dict[str, str]:
        return self.env

    def is_ready(self) -> bool:
        return port_open(self.grpc_port)


def jaeger_traces(query_url: str, service: str, tags: Optional[Mapping[str, str]] = None,
                  limit: int = 100, lookback: str = "1h") -> list[dict]:
    """Traces from Jaeger's HTTP API (/api/traces), each {"traceID", "spans", "processes"}."""
    params = {"service": service, "limit": str(limit), "lookback": lookback}
    if tags:
        params["tags"] = json.dumps(dict(tags))
    status, body = http_get(f"{query_url}/api/traces?{urllib.parse.urlencode(params)}", timeout=5)
    if status != 200:
        return []
    return json.loads(body).get("data") or []


class Prometheus(ManagedProcess):
    """Prometheus with our prometheus.yml and rules.yml; the tests' own scrape target files.

    The config is copied into the workdir with a targets/ folder of its own, so the committed
    compose targets never apply here; set_targets() points the two scrape jobs at test ports.
    """

    name = "prometheus"

    def __init__(self, workdir: Path, binary: Optional[Path] = None) -> None:
        super().__init__(workdir)
        self.binary = Path(binary or binaries().prometheus)
        self.port = free_port()
        self.config_dir = self.workdir / "prometheus-config"
        (self.config_dir / "targets").mkdir(parents=True, exist_ok=True)
        for name in ("prometheus.yml", "rules.yml"):
            shutil.copy(CONFIG_DIR / "prometheus" / name, self.config_dir / name)
        self.set_targets([], [])

    def set_targets(self, detector_metrics: list[str], collector_telemetry: list[str]) -> None:
        """host:port lists for the two scrape jobs; Prometheus re-reads them within seconds."""
        for suffix, targets in (("detector-metrics", detector_metrics), ("collector-telemetry", collector_telemetry)):
            path = self.config_dir / "targets" / f"test-{suffix}.yml"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps([{"targets": list(targets)}]) + "\n", encoding="utf-8")
            tmp.replace(path)

    def argv(self) -> list[str]:
        return [str(self.binary),
                f"--config.file={self.config_dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.workdir / 'prometheus-data'}",
                f"--web.listen-address={LOOPBACK}:{self.port}",
                "--web.enable-lifecycle"]

    def is_ready(self) -> bool:
        return http_get(f"{self.url}/-/ready")[0] == 200

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


def prometheus_query(url: str, expr: str) -> list[dict]:
    """Instant query; the `result` list of /api/v1/query (empty on any error)."""
    status, body = http_get(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=5)
    if status != 200:
        return []
    return json.loads(body)["data"]["result"]


@dataclasses.dataclass
class StackEndpoints:
    """Where the parts of a running stack listen; written to and read from the env file."""

    collector_grpc: str            # host:port, OTLP/gRPC into the gateway
    collector_http: str            # http://host:port, OTLP/HTTP into the gateway
    collector_health_url: str
    collector_metrics: str         # host:port of the gateway's prometheus exporter
    collector_telemetry: str       # host:port of the gateway's own metrics
    detector_grpc_port: int        # the gateway routes spans here: start a detector on it
    detector_http_port: int        # reserved for the same detector's OTLP/HTTP
    events_path: str               # where the gateway writes verdict events
    jaeger_query_url: str
    jaeger_otlp_grpc: str
    prometheus_url: str

    ENV_NAMES = {
        "collector_grpc": "OTEL_STRAGGLER_TEST_COLLECTOR_GRPC",
        "collector_http": "OTEL_STRAGGLER_TEST_COLLECTOR_HTTP",
        "collector_health_url": "OTEL_STRAGGLER_TEST_COLLECTOR_HEALTH_URL",
        "collector_metrics": "OTEL_STRAGGLER_TEST_COLLECTOR_METRICS",
        "collector_telemetry": "OTEL_STRAGGLER_TEST_COLLECTOR_TELEMETRY",
        "detector_grpc_port": "OTEL_STRAGGLER_TEST_DETECTOR_GRPC_PORT",
        "detector_http_port": "OTEL_STRAGGLER_TEST_DETECTOR_HTTP_PORT",
        "events_path": "OTEL_STRAGGLER_TEST_EVENTS_PATH",
        "jaeger_query_url": "JAEGER_QUERY_URL",
        "jaeger_otlp_grpc": "JAEGER_OTLP_GRPC",
        "prometheus_url": "PROMETHEUS_URL",
    }

    def to_env(self) -> dict[str, str]:
        return {env: str(getattr(self, field)) for field, env in self.ENV_NAMES.items()}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "StackEndpoints":
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            raw = env[cls.ENV_NAMES[field.name]]
            values[field.name] = int(raw) if field.type in ("int", int) else raw
        return cls(**values)


def write_env_file(path: Path, values: Mapping[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f"{key}={value}\n" for key, value in values.items())
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def read_env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            values[key.strip()] = value.strip()
    return values


class Stack:
    """Jaeger, Prometheus and a gateway collector (gateway.yaml) wired together on loopback.

    The gateway routes spans to `endpoints.detector_grpc_port`, where nothing listens until a test
    starts a detector there; Prometheus scrapes the gateway's two metric endpoints.
    """

    def __init__(self, workdir: Path, configs: Optional[list[Path]] = None,
                 env: Optional[Mapping[str, str]] = None, detach: bool = False) -> None:
        self.workdir = Path(workdir)
        self.detach = detach
        self.detector_grpc_port, self.detector_http_port = free_port(), free_port()
        self.jaeger = Jaeger(self.workdir)
        self.prometheus = Prometheus(self.workdir)
        collector_env = {
            "DETECTOR_ENDPOINTS": f"[{LOOPBACK}:{self.detector_grpc_port}]",
            "JAEGER_OTLP_ENDPOINT": self.jaeger.otlp_grpc_endpoint,
            "JAEGER_SAMPLING_PERCENTAGE": "100",
        }
        collector_env.update(env or {})
        self.collector = Collector(configs or [CONFIG_DIR / "gateway.yaml"], self.workdir, collector_env,
                                   name="gateway")
        self.prometheus.set_targets([self.collector.metrics_address], [self.collector.telemetry_address])

    @property
    def processes(self) -> list[ManagedProcess]:
        return [self.jaeger, self.prometheus, self.collector]

    @property
    def endpoints(self) -> StackEndpoints:
        return StackEndpoints(
            collector_grpc=self.collector.grpc_endpoint,
            collector_http=self.collector.http_url,
            collector_health_url=self.collector.health_url,
            collector_metrics=self.collector.metrics_address,
            collector_telemetry=self.collector.telemetry_address,
            detector_grpc_port=self.detector_grpc_port,
            detector_http_port=self.detector_http_port,
            events_path=str(self.collector.events_path),
            jaeger_query_url=self.jaeger.query_url,
            jaeger_otlp_grpc=self.jaeger.otlp_grpc_endpoint,
            prometheus_url=self.prometheus.url,
        )

    def start(self) -> "Stack":
        try:
            for process in self.processes:
                process.start(detach=self.detach)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()

    def pids(self) -> dict[str, int]:
        return {p.name: p.process.pid for p in self.processes if p.process is not None}

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- command line, used by scripts/services.sh ----------------------------------------------

def _pid_is(pid: int, binary_name: str) -> bool:
    """True when pid is still the program we started (not a reused pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False
    return Path(cmdline.decode(errors="replace")).name == binary_name


def _stop_recorded(services_dir: Path) -> None:
    pid_file = services_dir / "pids"
    if not pid_file.exists():
        return
    recorded = [line.split() for line in pid_file.read_text().splitlines() if line.strip()]
    alive = [(int(pid), name) for name, pid, binary in recorded if _pid_is(int(pid), binary)]
    for pid, _ in alive:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for pid, name in alive:
        while _pid_exists(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _pid_exists(pid):
            os.kill(pid, signal.SIGKILL)
        print(f"stopped {name} ({pid})")
    pid_file.unlink()
    (services_dir / "env").unlink(missing_ok=True)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours has exited; it only waits to be reaped.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Start or stop the pipeline stack on 127.0.0.1.")
    parser.add_argument("command", choices=["start", "stop"])
    parser.add_argument("--dir", type=Path, default=DEFAULT_SERVICES_DIR,
                        help="where logs, data, pids and the env file go (default: .services)")
    args = parser.parse_args(argv)
    services_dir = args.dir.resolve()
    if args.command == "stop":
        _stop_recorded(services_dir)
        return 0
    _stop_recorded(services_dir)
    # A fresh stack each time: old Prometheus data would keep series of processes long gone
    # (and fire StragglerDetectorDown for them), old logs would mix runs.
    for stale in ("prometheus-data", "prometheus-config"):
        shutil.rmtree(services_dir / stale, ignore_errors=True)
    for stale in list(services_dir.glob("*.log")) + list(services_dir.glob("*-events.jsonl")):
        stale.unlink()
    missing = binaries().missing()
    if missing:
        print("missing programs, run scripts/services.sh build: " + ", ".join(missing), file=sys.stderr)
        return 1
    stack = Stack(services_dir, detach=True)
    try:
        stack.start()
    except ServiceError as error:
        print(error, file=sys.stderr)
        return 1
    finally:
        # Recorded even on failure, so `stop` finds whatever did start.
        (services_dir / "pids").write_text("".join(
            f"{p.name} {p.process.pid} {Path(p.argv()[0]).name}\n" for p in stack.processes if p.process is not None))
    write_env_file(services_dir / "env", stack.endpoints.to_env())
    print(f"started: {', '.join(f'{n} ({pid})' for n, pid in stack.pids().items())}")
    print(f"env file: {services_dir / 'env'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
