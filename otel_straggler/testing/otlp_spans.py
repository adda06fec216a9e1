"""Stage spans as the rank side sends them, built from Observations, for the service's tests: as the
OTel SDK's ReadableSpans (for the SDK's own OTLP exporters), as serialized OTLP requests, and as the
JSON lines the collector's file exporter writes (hex ids, int64 as strings)."""
from __future__ import annotations

import base64
import contextlib
import hashlib
import itertools
import json
from typing import Any, Iterable, Iterator, Optional

from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags

from otel_straggler import contract
from otel_straggler.detector.config import DetectorConfig
from otel_straggler.detector.observation import Observation

SCOPE = InstrumentationScope("otel_straggler.instrumentation", "0.1.0")
_span_ids = itertools.count(1)


def rank_resource(job_id: str, rank: int, cohort: Optional[str] = None, epoch: Optional[int] = None) -> Resource:
    attributes: dict[str, Any] = {contract.SERVICE_NAME: "training", contract.JOB_ID: job_id, contract.RANK: rank,
                                  contract.HOST_NAME: f"node-{rank // 8}"}
    if cohort is not None:
        attributes[contract.COHORT] = cohort
    if epoch is not None:
        attributes[contract.TOPOLOGY_EPOCH] = epoch
    return Resource(attributes)


def stage_attributes(observation: Observation) -> dict:
    attributes = {
        contract.STAGE: observation.stage, contract.STEP: observation.step, contract.SEQ: observation.seq,
        contract.TIMING: contract.TIMING_DEVICE if observation.device_ms is not None else contract.TIMING_HOST_ONLY,
        contract.COLLECTIVE: observation.collective,
    }
    if observation.device_ms is not None:
        attributes[contract.DEVICE_DURATION_MS] = observation.device_ms
    if observation.tokens is not None:
        attributes[contract.WORKLOAD_TOKENS] = observation.tokens
    if observation.samples is not None:
        attributes[contract.WORKLOAD_SAMPLES] = observation.samples
    return attributes


def readable_span(observation: Observation, resource: Resource, name: Optional[str] = None,
                  attributes: Optional[dict] = None) -> ReadableSpan:
    # one trace per (job, step), as the rank side derives it
    trace_id = int.from_bytes(hashlib.sha256(f"{observation.job_id}/{observation.step}".encode()).digest()[:16], "big")
    context = SpanContext(trace_id, next(_span_ids), is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return ReadableSpan(
        name=name or observation.stage, context=context, resource=resource,
        attributes=stage_attributes(observation) if attributes is None else attributes,
        start_time=observation.end_unix_nano - int(observation.host_ms * 1e6), end_time=observation.end_unix_nano,
        instrumentation_scope=SCOPE,
    )


def export_batches(observations: Iterable[Observation]) -> list[list[ReadableSpan]]:
    """Consecutive observations of one rank become one export batch, as one rank's SDK sends them."""
    batches = []
    for (job_id, epoch, cohort, rank), group in itertools.groupby(
            observations, key=lambda o: (o.job_id, o.epoch, o.cohort, o.rank)):
        resource = rank_resource(job_id, rank, cohort, epoch)
        batches.append([readable_span(observation, resource) for observation in group])
    return batches


def stage_spans(rank: int = 0, count: int = 4, job_id: str = "job-1", first_seq: int = 0,
                end_unix_nano: int = 1_700_000_000_000_000_000) -> list[ReadableSpan]:
    """`count` consecutive stage spans of one rank, 10 ms each, one step per span."""
    resource = rank_resource(job_id, rank, "tp0")
    return [readable_span(Observation(job_id, 0, "tp0", rank, "forward-compute", first_seq + index, first_seq + index,
                                      10.0, 9.5, False, 2048, 4, end_unix_nano + index * 20_000_000), resource)
            for index in range(count)]


def slow_rank_observations(ranks: int = 8, steps: int = 40, slow_rank: int = 3,
                           job_id: str = "job-1") -> list[Observation]:
    """A data-parallel job in which `slow_rank` is 30% slower from step 10 on: with window_steps=5 it
    becomes a straggler after warmup and persistence."""
    from .synthetic import SyntheticJob

    return SyntheticJob(ranks=ranks, job_id=job_id).slow(slow_rank, 1.3, from_step=10).observations(steps)


def eventful_observations(ranks: int = 8) -> list[Observation]:
    """Every kind of verdict with window_steps=5: rank 3 is 30% slower in steps 10-34 (straggler,
    then recovered; its small stages are below the floor: uncertain) and rank 5 stops reporting
    after step 44 (silent)."""
    from .synthetic import SyntheticJob

    observations = SyntheticJob(ranks=ranks).slow(3, 1.3, from_step=10, to_step=34).observations(70)
    return [o for o in observations if not (o.rank == 5 and o.step >= 45)]


def per_step_requests(observations: list[Observation]) -> list[list[ReadableSpan]]:
    """Every rank's spans of one step in one export, as a collector in front of the detector batches."""
    return [sum(group, []) for _, group in itertools.groupby(
        export_batches(observations), key=lambda spans: (spans[0].attributes or {})[contract.STEP])]


def request_bytes(spans: list[ReadableSpan]) -> bytes:
    return encode_spans(spans).SerializeToString()


def otlp_json(spans: list[ReadableSpan]) -> dict:
    """OTLP/JSON as the spec and the collector write it: ids as hex, int64 as strings."""
    request = json_format.MessageToDict(encode_spans(spans))
    for resource_spans in request.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
    return request


def json_line(spans: list[ReadableSpan]) -> str:
    return json.dumps(otlp_json(spans), separators=(",", ":")) + "\n"


def service_config(tmp_path, **changes) -> DetectorConfig:
    """Free ports, no OTLP export, quick flushes; windows close by the cohort moving on, never by
    wall-clock grace, so live runs give the same verdicts as replay."""
    values: dict[str, Any] = dict(grpc_port=0, http_port=0, evidence_dir=str(tmp_path / "evidence"),
                                  export_metrics=False, flush_interval_s=0.05, window_grace_s=3600.0, window_steps=5)
    values.update(changes)
    return DetectorConfig(**values)


@contextlib.contextmanager
def running_service(config: DetectorConfig, engine=None) -> Iterator:
    from otel_straggler.detector.service import DetectorService

    service = DetectorService(config, engine=engine)
    service.start()
    try:
        yield service
    finally:
        service.stop(timeout_s=10.0)


def verdict_records(path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def without_time(records: Iterable[dict]) -> list[tuple]:
    """Verdicts comparable across live and replay: everything but when they were made."""
    return sorted(tuple((key, json.dumps(value)) for key, value in record.items() if key != "time_unix_nano")
                  for record in records)


def heartbeat_span(rank: int, time_unix_nano: int, open_stages=(("forward-compute", 1),), step: Optional[int] = 7,
                   job_id: str = "job-1", restart: Optional[int] = None, local_rank: Optional[int] = None,
                   attributes: Optional[dict] = None) -> ReadableSpan:
    """A `train.heartbeat` span (CONTRACT §2b) as the rank side sends it: start = end = the sample."""
    resource = rank_resource(job_id, rank, "tp0")
    extra = {}
    if restart is not None:
        extra[contract.RESTART_COUNT] = restart
    if local_rank is not None:
        extra[contract.LOCAL_RANK] = local_rank
    resource = resource.merge(Resource(extra))
    if attributes is None:
        attributes = {contract.SEQ: 3, contract.HEARTBEAT_OPEN_STAGES: tuple(name for name, _ in open_stages),
                      contract.HEARTBEAT_OPEN_SINCE: tuple(since for _, since in open_stages)}
        if step is not None:
            attributes[contract.STEP] = step
    context = SpanContext(1, next(_span_ids), is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return ReadableSpan(name=contract.HEARTBEAT_SPAN_NAME, context=context, resource=resource, attributes=attributes,
                        start_time=time_unix_nano, end_time=time_unix_nano, instrumentation_scope=SCOPE)
