"""Fixtures for tests that run the real collector, Jaeger and Prometheus.

- `pipeline_binaries`: the built programs; skips (with the reason) when they are not built.
- `pipeline`: a running stack's StackEndpoints. With OTEL_STRAGGLER_SERVICES_ENV naming an env
  file (written by `scripts/services.sh start`), the tests use that stack; otherwise one stack is
  started once per test run on free ports and stopped at its end.
- `start_collector`: starts extra collectors with any of our configs; all stopped after the test.
- `otlp_sink_factory`: fake detector shards (OTLP/gRPC receivers that record what they get).

The long end-to-end runs (marked `slow`) go after the other tests of this folder: once the
detector of one test leaves the shared gateway's shard port, the gateway's gRPC channel to that
port retries its connection with a backoff that grows to minutes, and a later quick test that
listens there must not wait out minutes of unrelated runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from otel_straggler.testing import services


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    positions = [i for i, item in enumerate(items) if here in Path(str(item.fspath)).resolve().parents]
    mine = [items[i] for i in positions]
    ordered = ([item for item in mine if item.get_closest_marker("slow") is None]
               + [item for item in mine if item.get_closest_marker("slow") is not None])
    for position, item in zip(positions, ordered):
        items[position] = item


@pytest.fixture(scope="session")
def pipeline_binaries() -> services.Binaries:
    found = services.binaries()
    missing = found.missing()
    if missing:
        message = "pipeline programs not built, run `scripts/services.sh build`: missing " + ", ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(message)  # CI builds them first: missing there is a failure, never a skip
        pytest.skip(message)
    return found


@pytest.fixture(scope="session")
def pipeline(pipeline_binaries, tmp_path_factory):
    env_file = os.environ.get("OTEL_STRAGGLER_SERVICES_ENV")
    if env_file:
        endpoints = services.StackEndpoints.from_env(services.read_env_file(Path(env_file)))
        if services.http_get(endpoints.collector_health_url)[0] != 200:
            pytest.fail(f"the stack in {env_file} is not running (scripts/services.sh start)")
        yield endpoints
        return
    stack = services.Stack(tmp_path_factory.mktemp("stack"))
    stack.start()
    try:
        yield stack.endpoints
    finally:
        stack.stop()


@pytest.fixture
def start_collector(pipeline_binaries, tmp_path):
    started: list[services.Collector] = []

    def start(configs, env=None, name="collector") -> services.Collector:
        collector = services.Collector(configs, tmp_path / name, env, name=name)
        started.append(collector)
        collector.start()
        return collector

    yield start
    for collector in reversed(started):
        collector.stop()


@pytest.fixture
def otlp_sink_factory():
    from .otlp_sink import OtlpSink

    sinks = []

    def make(**kwargs) -> OtlpSink:
        sink = OtlpSink(**kwargs).start()
        sinks.append(sink)
        return sink

    yield make
    for sink in sinks:
        sink.stop()
