"""Heartbeats (CONTRACT §2b), the restart count (§1) and where ranks run, as every decoder reads
them: the C scanner's path, the Python protobuf decoder and OTLP/JSON (replay) give the same."""
from __future__ import annotations

import pytest

from otel_straggler import contract
from otel_straggler.detector.decode import ProtobufDecoder, decode_json_request
from otel_straggler.detector.observation import GpuSample, Heartbeat, Placement

from otel_straggler.testing.otlp_spans import heartbeat_span, otlp_json, readable_span, request_bytes, stage_spans

T = 1_700_000_000_000_000_000
DECODERS = {
    "fast": lambda spans: ProtobufDecoder().decode(request_bytes(spans)),
    "python": lambda spans: ProtobufDecoder().decode_in_python(request_bytes(spans)),
    "json": lambda spans: decode_json_request(otlp_json(spans)),
}


@pytest.fixture(params=sorted(DECODERS))
def decode(request):
    return DECODERS[request.param]


def test_heartbeats_are_decoded_with_their_open_stages(decode):
    spans = [heartbeat_span(1, T, (("forward-compute", T - 5), ("all-grads-sync", T - 2)), restart=2, local_rank=1)]
    batch = decode(spans + stage_spans(2, 3))
    assert batch.heartbeats == [Heartbeat("job-1", 0, "tp0", 1, 2, 7, T, ("forward-compute", "all-grads-sync"),
                                          (T - 5, T - 2))]
    assert (len(batch.observations), batch.ignored, batch.malformed) == (3, 0, 0)
    assert Placement("job-1", 0, 2, 1, "node-0", 1, "tp0") in batch.placements


GPU = {contract.GPU_INDEX: 3, contract.GPU_UUID: "GPU-5c1e", contract.GPU_SM_CLOCK_MHZ: 1410,
       contract.GPU_SM_CLOCK_MAX_MHZ: 1980, contract.GPU_CLOCK_EVENT_REASONS: 0x40, contract.GPU_TEMPERATURE_C: 89,
       contract.GPU_POWER_W: 402.5, contract.GPU_UTILIZATION: 0.97, contract.GPU_ECC_UNCORRECTED: 2,
       contract.GPU_PCIE_REPLAY: 17}


def test_a_heartbeats_gpu_health_is_decoded_field_for_field(decode):
    batch = decode([heartbeat_span(1, T, (("forward-compute", T - 5),), attributes=GPU)])
    assert [beat.gpu for beat in batch.heartbeats] == [GpuSample(3, "GPU-5c1e", 1410, 1980, 0x40, 89, 402.5, 0.97, 2, 17)]
    assert batch.gpu_fields_invalid == 0
    without = decode([heartbeat_span(1, T, (("forward-compute", T - 5),))])
    assert without.heartbeats[0].gpu is None  # NVML not there: no sample, no error


@pytest.mark.parametrize("field, bad", [
    (contract.GPU_SM_CLOCK_MHZ, -1), (contract.GPU_SM_CLOCK_MHZ, "1410"), (contract.GPU_UTILIZATION, 97.0),
    (contract.GPU_POWER_W, float("nan")), (contract.GPU_UUID, 7), (contract.GPU_CLOCK_EVENT_REASONS, True),
])
def test_a_bad_gpu_field_is_left_out_and_counted_and_the_heartbeat_kept(decode, field, bad):
    batch = decode([heartbeat_span(1, T, (("forward-compute", T - 5),), attributes={**GPU, field: bad})])
    assert len(batch.heartbeats) == 1 and batch.malformed == 0
    gpu = batch.heartbeats[0].gpu
    assert gpu is not None and gpu.sm_clock_max_mhz == 1980
    assert batch.gpu_fields_invalid == 1
    assert getattr(gpu, GpuSample._fields[[*GPU].index(field)]) is None


def test_heartbeats_with_no_stage_open_and_before_the_first_step(decode):
    batch = decode([heartbeat_span(0, T, (), step=None)])
    assert batch.heartbeats == [Heartbeat("job-1", 0, "tp0", 0, 0, None, T, (), ())]


@pytest.mark.parametrize("attributes", [
    {contract.HEARTBEAT_OPEN_STAGES: ("forward-compute",), contract.HEARTBEAT_OPEN_SINCE: ()},
    {contract.HEARTBEAT_OPEN_STAGES: "forward-compute", contract.HEARTBEAT_OPEN_SINCE: (1,)},
    {contract.HEARTBEAT_OPEN_STAGES: (1,), contract.HEARTBEAT_OPEN_SINCE: (1,)},
    {contract.HEARTBEAT_OPEN_STAGES: ("",), contract.HEARTBEAT_OPEN_SINCE: (1,)},
])
def test_a_heartbeat_with_bad_open_stages_is_rejected_with_its_kind(decode, attributes):
    batch = decode([heartbeat_span(0, T, attributes=attributes)] + stage_spans(1, 2))
    assert batch.heartbeats == [] and len(batch.observations) == 2
    assert dict(batch.rejections) == {"bad_heartbeat": 1}


def test_the_restart_count_is_part_of_every_observation(decode):
    spans = stage_spans(0, 2)
    with_count = [readable_span(o, spans[0].resource.merge(
        __import__("opentelemetry.sdk.resources", fromlist=["Resource"]).Resource({contract.RESTART_COUNT: 3})))
        for o in ProtobufDecoder().decode_in_python(request_bytes(spans)).observations]
    assert [o.restart for o in decode(with_count).observations] == [3, 3]
    assert [o.restart for o in decode(spans).observations] == [0, 0]  # absent: 0


def test_a_bad_restart_count_is_rejected(decode):
    from opentelemetry.sdk.resources import Resource
    spans = stage_spans(0, 2)
    bad = [readable_span(o, spans[0].resource.merge(Resource({contract.RESTART_COUNT: "one"})))
           for o in ProtobufDecoder().decode_in_python(request_bytes(spans)).observations]
    batch = decode(bad)
    assert batch.observations == [] and dict(batch.rejections) == {"bad_restart_count": 2}


def test_placements_come_from_the_resource_once_per_request(decode):
    batch = decode(stage_spans(9, 4))
    assert batch.placements == [Placement("job-1", 0, 0, 9, "node-1", None, "tp0")]


@pytest.mark.parametrize("world_size, read", [(4, 4), (0, None), ("4", None), (True, None)])
def test_a_placement_carries_the_world_size_its_resource_reports(decode, world_size, read):
    from opentelemetry.sdk.resources import Resource
    spans = stage_spans(1, 2)
    sized = [readable_span(o, spans[0].resource.merge(Resource({contract.WORLD_SIZE: world_size})))
             for o in ProtobufDecoder().decode_in_python(request_bytes(spans)).observations]
    batch = decode(sized)
    assert batch.placements == [Placement("job-1", 0, 0, 1, "node-0", None, "tp0", read)]
    assert len(batch.observations) == 2 and batch.malformed == 0  # a bad one is unknown, not a rejection


def test_on_kubernetes_a_placement_names_the_node_as_host_and_carries_pod_and_namespace(decode):
    """CONTRACT v1.2 §5: host.name is the pod's name there; the node is the one to cordon."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    spans = stage_spans(1, 2)
    k8s = Resource({contract.K8S_NODE_NAME: "gpu-node-17", contract.K8S_POD_NAME: "train-worker-1",
                    contract.K8S_NAMESPACE_NAME: "ml"})
    placed = [readable_span(o, spans[0].resource.merge(k8s))
              for o in ProtobufDecoder().decode_in_python(request_bytes(spans)).observations]
    beat = heartbeat_span(2, T, ())  # a heartbeat places its rank too
    placed.append(ReadableSpan(name=beat.name, context=beat.context, resource=beat.resource.merge(k8s),
                               attributes=beat.attributes, start_time=T, end_time=T,
                               instrumentation_scope=beat.instrumentation_scope))
    batch = decode(placed)
    where = {(p.rank, p.host, p.pod, p.namespace, p.k8s_node_name) for p in batch.placements}
    assert where == {(1, "gpu-node-17", "train-worker-1", "ml", "gpu-node-17"),
                     (2, "gpu-node-17", "train-worker-1", "ml", "gpu-node-17")}
    # an empty node name is no node: host.name stays the host
    blank = [readable_span(o, spans[0].resource.merge(Resource({contract.K8S_NODE_NAME: ""})))
             for o in ProtobufDecoder().decode_in_python(request_bytes(spans)).observations]
    assert [(p.host, p.pod, p.k8s_node_name) for p in decode(blank).placements] == [("node-0", None, None)]

