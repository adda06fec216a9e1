"""GPU health (CONTRACT §2c): the rank's GPU found through CUDA_VISIBLE_DEVICES and LOCAL_RANK,
read through NVML (a fake here) on the builder thread at each heartbeat, its fields on the
`train.heartbeat` span; what NVML does not support left out and counted; a lost GPU stops the
sampler while training goes on; the hw.* metrics only when turned on."""
from __future__ import annotations

import logging

import pytest

import otel_straggler
from otel_straggler import contract
from otel_straggler.instrumentation import gpu_health
from otel_straggler.instrumentation.fake_nvml import (NVML_ERROR_LIBRARY_NOT_FOUND, NVML_ERROR_NO_PERMISSION,
                                                      NVML_ERROR_UNKNOWN, FakeMigDevice, FakeNvml, NVMLError,
                                                      NVMLError_NotSupported)
from otel_straggler.settings import ConfigError

INTERVAL_MS = 100.0
JOB = "job-gpu-health"


def uuid_of(index: int) -> str:
    return f"GPU-{index:08x}-1111-2222-3333-444455556666"


def started(nvml: FakeNvml) -> FakeNvml:
    nvml.nvmlInit()
    return nvml


# -- which GPU is the rank's ---------------------------------------------------------------------

@pytest.mark.parametrize("visible, cuda_index, nvml_index", [
    (None, 3, 3),  # unset: every GPU, in NVML's order
    ("5,2", 1, 2),
    (" 6 , 4", 1, 4),
    (uuid_of(6), 0, 6),
    (f"{uuid_of(1)},{uuid_of(7)}", 1, 7),
    ("GPU-00000004", 0, 4),  # a prefix, as CUDA accepts
    ("3,GPU-00000005-11", 1, 5),
])
def test_the_rank_s_cuda_device_maps_through_cuda_visible_devices(visible, cuda_index, nvml_index):
    nvml = started(FakeNvml())
    assert gpu_health.nvml_handle(nvml, cuda_index, visible) is nvml.gpus[nvml_index]


@pytest.mark.parametrize("visible, cuda_index, reason", [
    ("1,2", 2, "device_not_visible"),
    ("1,-1,3", 1, "device_not_visible"),  # CUDA stops at an entry naming no device
    ("", 0, "device_not_visible"),
    ("GPU-0000000", 0, "uuid_ambiguous"),
    ("GPU-deadbeef", 0, "uuid_not_found"),
    ("MIG-GPU-00000001-1111-2222-3333-444455556666/1/0", 0, "mig_device_not_found"),
])
def test_a_cuda_device_without_an_nvml_gpu_says_why(visible, cuda_index, reason):
    with pytest.raises(gpu_health.Unresolved, match=f"^{reason}$"):
        gpu_health.nvml_handle(started(FakeNvml()), cuda_index, visible)


def test_a_mig_device_reads_its_parent_gpu():
    nvml = started(FakeNvml())
    parent = nvml.gpus[2]
    parent.mig_devices["MIG-aaaa-bbbb"] = FakeMigDevice("MIG-aaaa-bbbb", parent)
    assert gpu_health.nvml_handle(nvml, 0, "MIG-aaaa-bbbb") is parent


def test_the_cuda_device_comes_from_the_events_then_configure_then_local_rank():
    assert gpu_health.cuda_device_of_rank(1, 2, 3) == (1, "cuda_events")
    assert gpu_health.cuda_device_of_rank(None, 2, 3) == (2, "current_device")
    assert gpu_health.cuda_device_of_rank(None, None, 3) == (3, "local_rank")
    assert gpu_health.cuda_device_of_rank(None, None, None) == (0, "default")


def test_no_cuda_device_is_read_where_torch_is_not_imported_or_cuda_not_initialised(monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "torch", None)
    assert gpu_health.current_cuda_device() is None
    calls = []
    cuda = types.SimpleNamespace(is_initialized=lambda: False, current_device=lambda: calls.append(1) or 5)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert gpu_health.current_cuda_device() is None and calls == []
    cuda.is_initialized = lambda: True
    assert gpu_health.current_cuda_device() == 5


# -- samples on heartbeats -------------------------------------------------------------------

def configure_fake(in_memory, **kwargs):
    kwargs.setdefault("heartbeat_interval_ms", INTERVAL_MS)
    handle = in_memory.configure(job_id=JOB, gpu_health="fake", device_timing="off", **kwargs)
    return handle, handle._pipeline.gpu_health.nvml


def gpu_attributes(span) -> dict:
    return {key: value for key, value in span.attributes.items() if key.startswith("training.gpu.")}


def test_every_gpu_field_rides_on_the_heartbeat(in_memory, wait_until):
    handle, nvml = configure_fake(in_memory, local_rank=1, environ={"CUDA_VISIBLE_DEVICES": "4,6,7"})
    gpu = nvml.gpus[6]
    gpu.sm_clock_mhz, gpu.sm_clock_max_mhz, gpu.clock_event_reasons = 1410, 1980, 0x4 | 0x20
    gpu.temperature_c, gpu.power_mw, gpu.utilization_percent = 83, 612_500, 88
    gpu.ecc_uncorrected, gpu.pcie_replay = 2, 17
    otel_straggler.step(0)
    assert wait_until(lambda: in_memory.heartbeats(), timeout_s=5.0)
    attributes = gpu_attributes(in_memory.heartbeats()[0])
    assert attributes == {
        contract.GPU_INDEX: 6, contract.GPU_UUID: uuid_of(6), contract.GPU_SM_CLOCK_MHZ: 1410,
        contract.GPU_SM_CLOCK_MAX_MHZ: 1980, contract.GPU_CLOCK_EVENT_REASONS: 0x24, contract.GPU_TEMPERATURE_C: 83,
        contract.GPU_POWER_W: 612.5, contract.GPU_UTILIZATION: 0.88, contract.GPU_ECC_UNCORRECTED: 2,
        contract.GPU_PCIE_REPLAY: 17}
    assert set(attributes) == set(contract.GPU_ATTRIBUTES)
    for key, value in attributes.items():  # the contract's types: ints as int, power and utilization as double
        assert type(value) is (float if key in (contract.GPU_POWER_W, contract.GPU_UTILIZATION)
                               else str if key == contract.GPU_UUID else int), key
    # the latest sample each time: a clock that drops shows on the next heartbeat
    gpu.sm_clock_mhz = 705
    in_memory.exporter.clear()
    assert wait_until(lambda: in_memory.heartbeats(), timeout_s=5.0)
    assert gpu_attributes(in_memory.heartbeats()[-1])[contract.GPU_SM_CLOCK_MHZ] == 705
    status = handle.status()["gpu_health"]
    assert status["state"] == "on" and status["samples"] >= 2 and status["errors"] == {}
    assert (status["index"], status["uuid"], status["device_from"]) == (6, uuid_of(6), "local_rank")
    # read once: the index, UUID and maximum clock; per sample: the rest
    assert nvml.calls["nvmlInit"] == nvml.calls["nvmlDeviceGetMaxClockInfo"] == nvml.calls["nvmlDeviceGetIndex"] == 1
    assert nvml.calls["nvmlDeviceGetClockInfo"] == status["samples"]


def test_nothing_is_sampled_on_the_training_thread(in_memory, wait_until):
    import threading

    handle, nvml = configure_fake(in_memory)
    threads = set()
    reading = nvml.nvmlDeviceGetClockInfo
    nvml.nvmlDeviceGetClockInfo = lambda *args: threads.add(threading.current_thread().name) or reading(*args)
    otel_straggler.step(0)
    with otel_straggler.stage("forward-compute"):
        pass
    assert wait_until(lambda: len(in_memory.heartbeats()) >= 2, timeout_s=5.0)
    assert threads == {"otel-straggler-span-builder"}
    assert "nvmlInit" in nvml.calls and gpu_attributes(in_memory.stage_spans()[0]) == {}


def test_an_older_binding_reads_the_reasons_by_their_throttle_name(in_memory, wait_until):
    nvml = FakeNvml(event_reasons_api=False)
    nvml.gpus[0].clock_event_reasons = 0x40
    sampler = gpu_health.GpuHealth("on", lambda: (0, "default"), {}, nvml=nvml)
    assert sampler.sample()[contract.GPU_CLOCK_EVENT_REASONS] == 0x40
    assert nvml.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 1


def test_fields_nvml_does_not_support_are_left_out_and_counted_once(in_memory, wait_until):
    handle, nvml = configure_fake(in_memory)
    nvml.fail("ecc", NVMLError_NotSupported())
    nvml.fail("max_clock", NVMLError_NotSupported())
    otel_straggler.step(0)
    assert wait_until(lambda: len(in_memory.heartbeats()) >= 3, timeout_s=5.0)
    for span in in_memory.heartbeats():
        attributes = gpu_attributes(span)
        assert contract.GPU_ECC_UNCORRECTED not in attributes and contract.GPU_SM_CLOCK_MAX_MHZ not in attributes
        assert attributes[contract.GPU_SM_CLOCK_MHZ] == 1980 and contract.GPU_PCIE_REPLAY in attributes
    status = handle.status()["gpu_health"]
    assert status["errors"] == {"not_supported": 2} and status["state"] == "on"
    assert sorted(status["not_supported"]) == sorted([contract.GPU_ECC_UNCORRECTED, contract.GPU_SM_CLOCK_MAX_MHZ])
    assert nvml.calls["nvmlDeviceGetTotalEccErrors"] == 1  # not asked again


def test_other_nvml_errors_are_counted_by_kind_and_the_rest_still_read():
    nvml = FakeNvml()
    sampler = gpu_health.GpuHealth("on", lambda: (0, "default"), {}, nvml=nvml)
    nvml.fail("power", NVMLError(NVML_ERROR_NO_PERMISSION))
    nvml.fail("pcie_replay", NVMLError(NVML_ERROR_UNKNOWN))
    nvml.fail("temperature", RuntimeError("a binding bug"))
    for _ in range(2):
        attributes = sampler.sample()
    assert contract.GPU_POWER_W not in attributes and contract.GPU_SM_CLOCK_MHZ in attributes
    assert sampler.status()["errors"] == {"no_permission": 2, "unknown": 2, "internal_error": 2}
    nvml.fail("power", None)
    assert sampler.sample()[contract.GPU_POWER_W] == 350.0  # asked again: it was no "not supported"


def test_a_lost_gpu_stops_the_sampler_for_good_and_training_goes_on(in_memory, wait_until, caplog):
    handle, nvml = configure_fake(in_memory)
    otel_straggler.step(0)
    assert wait_until(lambda: in_memory.heartbeats(), timeout_s=5.0)
    with caplog.at_level(logging.WARNING, logger="otel_straggler"):
        nvml.lose_gpu()
        assert wait_until(lambda: handle.status()["gpu_health"]["state"] == "stopped", timeout_s=5.0)
        in_memory.exporter.clear()
        otel_straggler.step(1)
        with otel_straggler.stage("forward-compute"):
            pass
        assert wait_until(lambda: len(in_memory.heartbeats()) >= 3, timeout_s=5.0)
    assert all(gpu_attributes(span) == {} for span in in_memory.heartbeats())  # nothing stale
    assert [span.name for span in in_memory.stage_spans()] == ["forward-compute"]
    status = handle.status()["gpu_health"]
    assert (status["reason"], status["errors"]["gpu_lost"]) == ("gpu_lost", 1)  # not asked again
    assert len([record for record in caplog.records if "stopped for good" in record.getMessage()]) == 1
    assert nvml.initialized is False  # let go of


def test_samples_that_read_nothing_stop_the_sampler_after_a_few(caplog):
    nvml = FakeNvml()
    sampler = gpu_health.GpuHealth("auto", lambda: (0, "default"), {}, nvml=nvml)
    assert sampler.sample()
    for name in ("clock", "clock_event_reasons", "temperature", "power", "utilization", "ecc", "pcie_replay"):
        nvml.fail(name, NVMLError(NVML_ERROR_UNKNOWN))
    with caplog.at_level(logging.WARNING, logger="otel_straggler"):
        for _ in range(gpu_health.MAX_FAILED_SAMPLES + 2):
            assert sampler.sample() == {}
    assert (sampler.state, sampler.reason) == ("stopped", "failing")
    assert sampler.status()["errors"] == {"unknown": 7 * gpu_health.MAX_FAILED_SAMPLES}
    assert len(caplog.records) == 1


def test_in_auto_mode_no_nvml_is_silent_and_off(in_memory, wait_until, monkeypatch, caplog):
    broken = FakeNvml()
    broken.fail_init = NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)  # libnvidia-ml.so not found: a host without the driver
    monkeypatch.setattr(gpu_health, "load_nvml", lambda: broken)
    with caplog.at_level(logging.WARNING, logger="otel_straggler"):
        handle = in_memory.configure(job_id=JOB, heartbeat_interval_ms=INTERVAL_MS, device_timing="off")
        otel_straggler.step(0)
        assert wait_until(lambda: len(in_memory.heartbeats()) >= 2, timeout_s=5.0)
    assert all(gpu_attributes(span) == {} for span in in_memory.heartbeats())
    status = handle.status()["gpu_health"]
    assert (status["state"], status["reason"]) == ("off", "nvml_init_failed:library_not_found")
    assert broken.calls["nvmlInit"] == 1  # tried once
    assert [record for record in caplog.records if "GPU" in record.getMessage()] == []


def test_on_mode_says_once_why_it_cannot(in_memory, wait_until, monkeypatch, caplog):
    def not_installed():
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(gpu_health, "load_nvml", not_installed)
    with caplog.at_level(logging.WARNING, logger="otel_straggler"):
        handle = in_memory.configure(job_id=JOB, heartbeat_interval_ms=INTERVAL_MS, gpu_health="on",
                                     device_timing="off")
        otel_straggler.step(0)
        assert wait_until(lambda: len(in_memory.heartbeats()) >= 3, timeout_s=5.0)
    warnings = [record.getMessage() for record in caplog.records if "GPU_HEALTH" in record.getMessage()]
    assert len(warnings) == 1 and "nvidia-ml-py" in warnings[0] and "\n" not in warnings[0]
    assert handle.status()["gpu_health"]["reason"] == "nvml_not_installed"


def test_off_never_loads_nvml(in_memory, wait_until, monkeypatch):
    monkeypatch.setattr(gpu_health, "load_nvml", lambda: pytest.fail("NVML loaded"))
    handle = in_memory.configure(job_id=JOB, heartbeat_interval_ms=INTERVAL_MS, gpu_health="off",
                                 device_timing="off")
    otel_straggler.step(0)
    assert wait_until(lambda: len(in_memory.heartbeats()) >= 2, timeout_s=5.0)
    assert handle.status()["gpu_health"] == {"state": "off", "reason": "setting_off", "samples": 0, "errors": {}}


@pytest.mark.parametrize("variable, value, complaint", [
    ("OTEL_STRAGGLER_GPU_HEALTH", "yes", "must be one of auto, on, fake, off, got 'yes'"),
    ("OTEL_STRAGGLER_GPU_METRICS", "sometimes", "expected bool, got 'sometimes'"),
])
def test_a_bad_gpu_setting_fails_configure_with_one_line(configure, monkeypatch, variable, value, complaint):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as raised:
        configure(job_id=JOB, device_timing="off")
    assert str(raised.value) == f"{variable}: {complaint}"
    assert otel_straggler.current() is None


# -- the hw.* metrics ------------------------------------------------------------------------

HW_METRICS = ("hw.gpu.utilization", "hw.gpu.memory.usage", "hw.power", "hw.temperature")


@pytest.mark.parametrize("gpu_metrics", [True, False])
def test_hardware_metrics_only_when_turned_on(configure, grpc_receiver, wait_until, gpu_metrics):
    handle = configure(job_id=JOB, rank=0, endpoint=grpc_receiver.endpoint, protocol="grpc", device_timing="off",
                       gpu_health="fake", gpu_metrics=gpu_metrics, heartbeat_interval_ms=INTERVAL_MS)
    nvml = handle._pipeline.gpu_health.nvml
    nvml.gpus[0].name = "NVIDIA H100 80GB HBM3"
    nvml.fail("ecc", NVMLError_NotSupported())
    otel_straggler.step(0)
    assert wait_until(lambda: handle.status()["gpu_health"]["samples"] >= 2, timeout_s=5.0)
    handle.shutdown(timeout_s=5.0)  # the metrics' last collection
    points = grpc_receiver.metric_points()
    assert points["straggler.instrumentation.gpu_health.errors"] == [({"kind": "not_supported"}, 1)]
    if not gpu_metrics:
        assert not set(HW_METRICS) & set(points)
        assert "nvmlDeviceGetMemoryInfo" not in nvml.calls  # read only for the metric
        return
    device = {"hw.type": "gpu", "hw.id": uuid_of(0), "hw.name": "NVIDIA H100 80GB HBM3"}
    assert points["hw.gpu.utilization"] == [({**device, "hw.gpu.task": "general"}, 0.97)]
    assert points["hw.gpu.memory.usage"] == [(device, 40 << 30)]
    assert points["hw.power"] == [(device, 350.0)]
    assert points["hw.temperature"] == [(device, 45)]


def test_the_demos_slowed_rank_reads_throttled_on_heartbeats_from_its_first_slowed_step(in_memory, wait_until):
    """gpu_health=fake on the rank the demo's trainer slows (its --simulate-gpu): the trainer's
    straggler throttles the fake NVML the heartbeats read, which then read its GPU at its thermal
    limit from the slowed step on, and as made before it."""
    from otel_straggler.demo.straggler import Straggler, simulated_gpu

    handle, nvml = configure_fake(in_memory, rank=0)
    assert simulated_gpu(handle) is nvml
    straggler = Straggler("forward-compute", from_step=5, slowdown=0.01, gpu=simulated_gpu(handle))
    otel_straggler.step(4)
    straggler.begin_step(4)
    assert wait_until(lambda: in_memory.heartbeats(), timeout_s=5.0)
    before = gpu_attributes(in_memory.heartbeats()[-1])
    assert (before[contract.GPU_SM_CLOCK_MHZ], before[contract.GPU_CLOCK_EVENT_REASONS]) == (1980, 0)
    otel_straggler.step(5)
    straggler.begin_step(5)
    in_memory.exporter.clear()
    assert wait_until(lambda: in_memory.heartbeats(), timeout_s=5.0)
    after = gpu_attributes(in_memory.heartbeats()[-1])
    assert (after[contract.GPU_SM_CLOCK_MHZ], after[contract.GPU_CLOCK_EVENT_REASONS],
            after[contract.GPU_TEMPERATURE_C]) == (1410, 0x40, 89)


def test_an_unslowed_ranks_simulated_gpu_stays_as_made(in_memory, wait_until):
    from types import SimpleNamespace

    from otel_straggler.demo.straggler import Straggler

    handle, nvml = configure_fake(in_memory, rank=1)
    flags = SimpleNamespace(slow_rank=0, slow_stage="forward-compute", from_step=5, slowdown=0.01, block_s=0.0)
    straggler = Straggler.from_args(flags, rank=1, telemetry=handle)
    otel_straggler.step(9)
    straggler.begin_step(9)
    assert wait_until(lambda: in_memory.heartbeats(), timeout_s=5.0)
    assert gpu_attributes(in_memory.heartbeats()[-1])[contract.GPU_SM_CLOCK_MHZ] == 1980
