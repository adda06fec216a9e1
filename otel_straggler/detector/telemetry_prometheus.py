"""A Prometheus scrape endpoint (`--prometheus-port`) for the detector's metrics.

The text exposition format is small enough to write here, which saves the service a dependency on
prometheus_client. Names follow the collector's prometheus exporter (UnderscoreEscapingWithSuffixes)
so the alert rules in collector-config/prometheus work against either: dots become underscores,
monotonic sums get `_total`, seconds get `_seconds`, attribute keys become labels the same way.
Metrics are collected from the SDK on each scrape (InMemoryMetricReader, cumulative).
"""
from __future__ import annotations

import math
import re
import ssl
import threading
from typing import Callable, Optional

from opentelemetry.sdk.metrics.export import (
    Gauge, Histogram, HistogramDataPoint, InMemoryMetricReader, MetricsData, NumberDataPoint, Sum,
)

from otel_straggler.detector.http_server import BoundedHTTPServer, BoundedRequestHandler
from otel_straggler.detector.receiver import bearer_matches

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_INVALID_NAME_CHARS = re.compile(r"[^a-zA-Z0-9_]")
_UNIT_SUFFIXES = {"s": "seconds", "ms": "milliseconds", "By": "bytes"}


def _name(text: str) -> str:
    name = _INVALID_NAME_CHARS.sub("_", text)
    return "_" + name if name[:1].isdigit() else name


def _number(value: float) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        return repr(value)
    return str(value)


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(attributes, extra: Optional[tuple[str, str]] = None) -> str:
    pairs = [(_name(key), value) for key, value in (attributes or {}).items()]
    if extra:
        pairs.append(extra)
    if not pairs:
        return ""
    escaped = (f'{key}="{_escape(value)}"' for key, value in pairs)
    return "{" + ",".join(escaped) + "}"


def exposition_text(data: Optional[MetricsData]) -> str:
    """MetricsData -> Prometheus text format 0.0.4."""
    lines: list[str] = []
    for resource_metrics in (data.resource_metrics if data else ()):
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                name = _name(metric.name)
                suffix = _UNIT_SUFFIXES.get(metric.unit or "")
                if suffix and not name.endswith("_" + suffix):
                    name += "_" + suffix
                points = metric.data.data_points
                if isinstance(metric.data, Sum) and metric.data.is_monotonic:
                    kind, name = "counter", name + "_total"
                elif isinstance(metric.data, (Sum, Gauge)):
                    kind = "gauge"
                elif isinstance(metric.data, Histogram):
                    kind = "histogram"
                else:
                    continue  # exponential histograms are not used by the detector
                if metric.description:
                    lines.append(f"# HELP {name} {metric.description.replace(chr(10), ' ')}")
                lines.append(f"# TYPE {name} {kind}")
                for point in points:  # a sum's and a gauge's are NumberDataPoints, a histogram's HistogramDataPoints
                    if isinstance(point, NumberDataPoint):
                        lines.append(f"{name}{_labels(point.attributes)} {_number(point.value)}")
                        continue
                    if not isinstance(point, HistogramDataPoint):
                        continue
                    cumulative = 0
                    for bound, count in zip(list(point.explicit_bounds) + [math.inf], point.bucket_counts, strict=True):
                        cumulative += count
                        labels = _labels(point.attributes, ("le", _number(float(bound))))
                        lines.append(f"{name}_bucket{labels} {cumulative}")
                    lines.append(f"{name}_sum{_labels(point.attributes)} {_number(point.sum)}")
                    lines.append(f"{name}_count{_labels(point.attributes)} {point.count}")
    return "\n".join(lines) + "\n"


MAX_SCRAPE_CONNECTIONS = 16  # scrapers served at once; a Prometheus server or two needs one each


class PrometheusEndpoint:
    """Serves GET /metrics on its own port from an InMemoryMetricReader, bounded as the OTLP/HTTP
    receiver is (http_server); `on_event` gets what was refused or cut."""

    def __init__(self, reader: InMemoryMetricReader, address: str, port: int,
                 on_event: Callable[[str], None] = lambda event: None,
                 ssl_context: Optional[ssl.SSLContext] = None, token: Optional[str] = None) -> None:
        """With `ssl_context` it serves HTTPS; with `token` a scrape must send it as a bearer token
        (the OTLP ports' own settings: a detector that guards them does not leave this one open)."""
        self._reader = reader
        endpoint = self
        expected = None if token is None else f"Bearer {token}".encode()

        class Handler(BoundedRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if expected is not None and not bearer_matches(expected, self.headers.get("Authorization")):
                    on_event("unauthenticated")
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", "Bearer")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404)
                    return
                body = exposition_text(endpoint._reader.get_metrics_data()).encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = BoundedHTTPServer((address, port), Handler, MAX_SCRAPE_CONNECTIONS, on_event, ssl_context)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="straggler-prometheus", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
