"""A stand-in for the NVML binding (`pynvml`), with the functions, error classes and constants
gpu_health.py uses, and readings and failures under the test's control, so every path of the
GPU health sampler is tested on CPU, as FakeDeviceEvents does for CUDA events.

Each fake GPU has the readings a test sets (`FakeGpu`); `fail(field, error)` makes every read
of one field raise (an NVMLError of that code), `fail_init` makes nvmlInit raise, and `lose_gpu()`
makes every call on the GPUs raise GPU_IS_LOST, as a GPU fallen off the bus does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0


class NVMLError(Exception):
    """As pynvml's: the NVML return code in `value`."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's name
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_NOT_SUPPORTED)


class NVMLError_GpuIsLost(NVMLError):  # noqa: N801 - pynvml's name
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_GPU_IS_LOST)


# NVMLError under a second name: in FakeNvml's annotations its class attribute NVMLError hides the class
_NvmlError = NVMLError


# the fields a test can make fail, by the NVML function that reads them
FIELDS = ("clock", "max_clock", "clock_event_reasons", "temperature", "power", "utilization", "ecc", "pcie_replay",
          "memory", "name")


@dataclass
class FakeGpu:
    uuid: str
    name: str = "Fake GPU"
    sm_clock_mhz: int = 1980
    sm_clock_max_mhz: int = 1980
    clock_event_reasons: int = 0
    temperature_c: int = 45
    power_mw: int = 350_000
    utilization_percent: int = 97
    ecc_uncorrected: int = 0
    pcie_replay: int = 0
    memory_used_bytes: int = 40 << 30
    mig_devices: dict = field(default_factory=dict)  # MIG uuid -> FakeMigDevice


# what throttle(True) reads: a GPU at its thermal limit
THROTTLED = {"sm_clock_mhz": 1410, "clock_event_reasons": 0x40, "temperature_c": 89, "power_mw": 300_000}


@dataclass
class FakeMigDevice:
    uuid: str
    parent: FakeGpu


class _Readings:
    """What nvmlDeviceGetUtilizationRates and nvmlDeviceGetMemoryInfo return: structs with fields."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


class FakeNvml:
    """NVML over `gpus` (NVML index order). Counts the calls made, to show what is read once."""

    # pynvml's error class and constants, as attributes, the way the module has them
    NVMLError = NVMLError
    NVML_CLOCK_SM = NVML_CLOCK_SM
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = NVML_VOLATILE_ECC

    def __init__(self, gpus: Optional[list[FakeGpu]] = None, event_reasons_api: bool = True) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu(f"GPU-{index:08x}-1111-2222-3333-444455556666")
                                                   for index in range(8)]
        self.fail_init: Optional[NVMLError] = None
        self.failures: dict[str, NVMLError] = {}
        self.lost = False
        self.initialized = False
        self.calls: dict[str, int] = {}
        self._unthrottled: dict[str, dict] = {}  # uuid -> its readings before throttle(True)
        if not event_reasons_api:  # an older binding: the same bitmask under the throttle name only
            # None reads as absent to getattr(nvml, name, None), the way gpu_health probes for it
            self.nvmlDeviceGetCurrentClocksEventReasons = None  # type: ignore[method-assign,assignment]

    # -- test controls ---------------------------------------------------------------------------

    def fail(self, field_name: str, error: Optional[_NvmlError]) -> None:
        """Every read of the field raises `error` from now on (None: reads succeed again)."""
        assert field_name in FIELDS, field_name
        if error is None:
            self.failures.pop(field_name, None)
        else:
            self.failures[field_name] = error

    def lose_gpu(self) -> None:
        self.lost = True

    def throttle(self, on: bool) -> None:
        """Every GPU reads as one at its thermal limit (SM clock pulled down to THROTTLED's, hw_thermal)
        while `on`, and as it was made otherwise: the slowed rank's simulated GPU in the demo."""
        for gpu in self.gpus:
            if on and gpu.uuid not in self._unthrottled:
                self._unthrottled[gpu.uuid] = {name: getattr(gpu, name) for name in THROTTLED}
                for name, value in THROTTLED.items():
                    setattr(gpu, name, value)
            elif not on and gpu.uuid in self._unthrottled:
                for name, value in self._unthrottled.pop(gpu.uuid).items():
                    setattr(gpu, name, value)

    # -- pynvml's functions ----------------------------------------------------------------------

    def _call(self, name: str, field_name: Optional[str] = None) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if self.lost:
            raise NVMLError_GpuIsLost()
        if field_name is not None and field_name in self.failures:
            raise self.failures[field_name]

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names, here and below
        self.calls["nvmlInit"] = self.calls.get("nvmlInit", 0) + 1
        if self.fail_init is not None:
            raise self.fail_init
        self.initialized = True

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.initialized = False

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self._call("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:  # noqa: N802
        self._call("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:  # noqa: N802
        self._call("nvmlDeviceGetHandleByUUID")
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
            if uuid in gpu.mig_devices:
                return gpu.mig_devices[uuid]
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def nvmlDeviceIsMigDeviceHandle(self, handle: Any) -> int:  # noqa: N802
        self._call("nvmlDeviceIsMigDeviceHandle")
        return int(isinstance(handle, FakeMigDevice))

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: FakeMigDevice) -> FakeGpu:  # noqa: N802
        self._call("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
        return handle.parent

    def nvmlDeviceGetIndex(self, handle: FakeGpu) -> int:  # noqa: N802
        self._call("nvmlDeviceGetIndex")
        return self.gpus.index(handle)

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> str:  # noqa: N802
        self._call("nvmlDeviceGetUUID")
        return handle.uuid

    def nvmlDeviceGetName(self, handle: FakeGpu) -> bytes:  # noqa: N802
        self._call("nvmlDeviceGetName", "name")
        return handle.name.encode()  # as older bindings return it

    def nvmlDeviceGetClockInfo(self, handle: FakeGpu, clock: int) -> int:  # noqa: N802
        self._call("nvmlDeviceGetClockInfo", "clock")
        assert clock == NVML_CLOCK_SM
        return handle.sm_clock_mhz

    def nvmlDeviceGetMaxClockInfo(self, handle: FakeGpu, clock: int) -> int:  # noqa: N802
        self._call("nvmlDeviceGetMaxClockInfo", "max_clock")
        assert clock == NVML_CLOCK_SM
        return handle.sm_clock_max_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeGpu) -> int:  # noqa: N802
        self._call("nvmlDeviceGetCurrentClocksEventReasons", "clock_event_reasons")
        return handle.clock_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeGpu) -> int:  # noqa: N802
        self._call("nvmlDeviceGetCurrentClocksThrottleReasons", "clock_event_reasons")
        return handle.clock_event_reasons

    def nvmlDeviceGetTemperature(self, handle: FakeGpu, sensor: int) -> int:  # noqa: N802
        self._call("nvmlDeviceGetTemperature", "temperature")
        assert sensor == NVML_TEMPERATURE_GPU
        return handle.temperature_c

    def nvmlDeviceGetPowerUsage(self, handle: FakeGpu) -> int:  # noqa: N802
        self._call("nvmlDeviceGetPowerUsage", "power")
        return handle.power_mw

    def nvmlDeviceGetUtilizationRates(self, handle: FakeGpu) -> _Readings:  # noqa: N802
        self._call("nvmlDeviceGetUtilizationRates", "utilization")
        return _Readings(gpu=handle.utilization_percent, memory=0)

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeGpu, error_type: int, counter_type: int) -> int:  # noqa: N802
        self._call("nvmlDeviceGetTotalEccErrors", "ecc")
        assert (error_type, counter_type) == (NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)
        return handle.ecc_uncorrected

    def nvmlDeviceGetPcieReplayCounter(self, handle: FakeGpu) -> int:  # noqa: N802
        self._call("nvmlDeviceGetPcieReplayCounter", "pcie_replay")
        return handle.pcie_replay

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu) -> _Readings:  # noqa: N802
        self._call("nvmlDeviceGetMemoryInfo", "memory")
        return _Readings(used=handle.memory_used_bytes, total=80 << 30, free=(80 << 30) - handle.memory_used_bytes)
