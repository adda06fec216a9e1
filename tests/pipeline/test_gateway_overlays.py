"""The overlays, merged on gateway.yaml and run for real: detector auth, and the compose stack's."""

from __future__ import annotations

import shutil
import uuid

import pytest

from otel_straggler.testing import services
from .otlp_sink import make_self_signed_certificate
from .telemetry import Rank, send_rank_steps, send_verdict_event

pytestmark = pytest.mark.services

DEADLINE_S = 45
AUTH_CONFIGS = [services.CONFIG_DIR / "gateway.yaml", services.CONFIG_DIR / "gateway-detector-auth.yaml"]


@pytest.fixture
def certificate(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed (scripts/services.sh build installs it)")
    return make_self_signed_certificate(tmp_path / "tls", name="detector")


def _auth_env(shard, token: str, ca_file) -> dict:
    return {"DETECTOR_ENDPOINTS": f"[{shard.endpoint}]", "DETECTOR_BEARER_TOKEN": token,
            "DETECTOR_CA_FILE": str(ca_file), "DETECTOR_TLS_SERVER_NAME": "detector"}


def test_right_token_over_tls_is_accepted(certificate, start_collector, otlp_sink_factory):
    cert, key = certificate
    shard = otlp_sink_factory(token="s3cret", tls=(cert, key))
    gateway = start_collector(AUTH_CONFIGS, name="gateway-auth", env=_auth_env(shard, "s3cret", cert))
    sent = send_rank_steps(gateway.grpc_endpoint, Rank(f"auth-{uuid.uuid4().hex[:8]}", 0, 1, "c0"), range(1))
    try:
        services.wait_until(lambda: len(shard.spans()) >= sent, DEADLINE_S, what="spans at the TLS shard")
    except TimeoutError:
        pytest.fail(f"no spans arrived\n{gateway.log_tail()}")
    assert shard.refused == 0
    assert set(shard.authorization_headers) == {"Bearer s3cret"}


def test_wrong_token_is_refused(certificate, start_collector, otlp_sink_factory):
    cert, key = certificate
    shard = otlp_sink_factory(token="s3cret", tls=(cert, key))
    gateway = start_collector(AUTH_CONFIGS, name="gateway-auth", env=_auth_env(shard, "wrong", cert))
    send_rank_steps(gateway.grpc_endpoint, Rank(f"auth-{uuid.uuid4().hex[:8]}", 0, 1, "c0"), range(1))
    services.wait_until(lambda: shard.refused > 0, DEADLINE_S, what="a refused export")
    assert shard.spans() == []
    services.wait_until(lambda: "Unauthenticated" in gateway.log_text(), DEADLINE_S,
                        what="the refusal in the collector's log")


def test_compose_overlay_logs_events_and_keeps_every_step(pipeline, start_collector, otlp_sink_factory):
    """compose-gateway.yaml as docker-compose.yml runs it, with the Jaeger of the shared test stack."""
    shard = otlp_sink_factory()
    gateway = start_collector([services.CONFIG_DIR / "gateway.yaml", services.CONFIG_DIR / "compose-gateway.yaml"],
                              name="gateway-compose", env={
                                  "DETECTOR_ENDPOINTS": f"[{shard.endpoint}]",
                                  "JAEGER_OTLP_ENDPOINT": pipeline.jaeger_otlp_grpc})
    job_id = f"compose-{uuid.uuid4().hex[:8]}"
    service = f"training-{job_id}"
    steps = range(10)
    send_rank_steps(gateway.grpc_endpoint, Rank(job_id, 0, 1, "c0", service_name=service), steps)
    send_verdict_event(gateway.grpc_endpoint, job_id, rank=0)

    # No JAEGER_SAMPLING_PERCENTAGE given: the overlay's default keeps every step.
    services.wait_until(lambda: len(services.jaeger_traces(pipeline.jaeger_query_url, service)) == len(steps),
                        DEADLINE_S, what="every step in Jaeger")
    services.wait_until(lambda: job_id in gateway.log_text(), DEADLINE_S, what="the verdict event in the collector log")
    assert not gateway.events_path.exists(), "the compose overlay writes no events file"
