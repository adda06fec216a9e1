"""GPU health (CONTRACT §2c): the rank's own GPU read through NVML at each heartbeat, on the span
builder's thread, never the training thread. The latest sample rides on the `train.heartbeat`
span as `training.gpu.*`, so the detector can tell a GPU that clocks down (power, thermal) from a
slow host or a slow peer.

NVML is loaded and initialised lazily, at the first sample, on that thread: configure() pays
nothing for it. The rank's GPU is resolved once, then: the CUDA device training runs on (see
`cuda_device_of_rank`) mapped through CUDA_VISIBLE_DEVICES, whose entries are NVML indices, GPU
UUIDs or their prefixes, or MIG device UUIDs (for a MIG device its parent GPU is read: clocks,
power and temperature are the whole GPU's, and NVML answers "not supported" for what it does not
report under MIG). The index, UUID and maximum SM clock are read once; each sample then makes
seven NVML calls.

Fail open: every entry point catches its errors. A field NVML does not support on this GPU is
left out of the samples and counted once as `not_supported`; other NVML errors are counted by
kind. A GPU that is lost, or MAX_FAILED_SAMPLES samples in a row in which no field could be
read, stop the sampler for good, with one warning; heartbeats go on without `training.gpu.*`.

The NVML calls go through `nvml`, an object with pynvml's function names, error class and
constants: the `pynvml` module itself (package nvidia-ml-py, `pip install otel-straggler[gpu]`),
or fake_nvml.FakeNvml in tests.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Any, Callable, Mapping, Optional

from otel_straggler import contract

MAX_FAILED_SAMPLES = 3  # samples in a row that read nothing: NVML has stopped answering for this GPU
MEMORY_USED = "memory_used_bytes"  # read only for the hw.gpu.memory.usage metric; not on heartbeats
_ON_HEARTBEATS = frozenset(contract.GPU_ATTRIBUTES)
_log = logging.getLogger("otel_straggler")

# NVML's return codes (nvml.h, the same in every driver) -> the kind an error is counted as; looked
# up with whatever an error carries as `value`
_ERROR_KINDS: dict[object, str] = {
    1: "uninitialized", 2: "invalid_argument", 3: "not_supported", 4: "no_permission", 6: "not_found",
    9: "driver_not_loaded", 10: "timeout", 12: "library_not_found", 13: "function_not_found",
    15: "gpu_lost", 16: "reset_required", 999: "unknown",
}
_FUNCTION_NOT_FOUND = 13

PENDING, ON, OFF, STOPPED = "pending", "on", "off", "stopped"


def load_nvml() -> Any:
    """The NVML binding; ImportError where nvidia-ml-py is not installed."""
    import pynvml

    return pynvml


def current_cuda_device() -> Optional[int]:
    """The calling thread's CUDA device, where torch is imported and CUDA initialised already;
    else None. Neither imports torch nor initialises CUDA (that would open a context)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
    except Exception:
        pass
    return None


def cuda_device_of_rank(event_device: Optional[int], configure_device: Optional[int],
                        local_rank: Optional[int]) -> tuple[int, str]:
    """The CUDA device index training runs on, and where it came from: the device the CUDA-event
    pool was made on (on the training thread, at the first step), else the device current when
    configure() ran, else LOCAL_RANK (one GPU per rank on a node), else 0, CUDA's default device.
    The builder thread cannot ask torch itself: the current device is per thread."""
    for index, source in ((event_device, "cuda_events"), (configure_device, "current_device"),
                          (local_rank, "local_rank")):
        if index is not None:
            return int(index), source
    return 0, "default"


class Unresolved(Exception):
    """The rank's CUDA device has no NVML handle; the message is the reason, one word."""


def visible_entries(text: str) -> list[str]:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: comma-separated entries up to the first that names
    no device (CUDA ignores it and all after it)."""
    entries = []
    for raw in text.split(","):
        entry = raw.strip()
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        entries.append(entry)
    return entries


def nvml_handle(nvml: Any, cuda_index: int, visible: Optional[str]) -> Any:
    """The NVML handle of the GPU that CUDA numbers `cuda_index` under CUDA_VISIBLE_DEVICES
    (`visible`, None when unset); a MIG device's parent GPU."""
    if visible is None:
        # every GPU visible: CUDA's order is NVML's (PCI bus order) on a node of one GPU model,
        # as training nodes are; CUDA_DEVICE_ORDER=PCI_BUS_ID makes it so on any node
        return nvml.nvmlDeviceGetHandleByIndex(cuda_index)
    entries = visible_entries(visible)
    if not 0 <= cuda_index < len(entries):
        raise Unresolved("device_not_visible")
    entry = entries[cuda_index]
    if entry.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(entry))
    if entry.startswith("MIG-"):
        try:
            mig = nvml.nvmlDeviceGetHandleByUUID(entry)
        except nvml.NVMLError:  # the old MIG-GPU-<uuid>/<gi>/<ci> form, or a MIG device gone
            raise Unresolved("mig_device_not_found") from None
        return nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
    # a GPU UUID or, as CUDA accepts, an unambiguous prefix of one
    matches = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        if _text(nvml.nvmlDeviceGetUUID(handle)).startswith(entry):
            matches.append(handle)
    if len(matches) != 1:
        raise Unresolved("uuid_not_found" if not matches else "uuid_ambiguous")
    return matches[0]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)  # older bindings return bytes


class GpuHealth:
    """One rank's GPU sampler. sample() and close() run on the span builder's thread; status()
    and `latest` are read from any thread (each is replaced whole, never changed in place)."""

    def __init__(self, mode: str, locate: Callable[[], tuple[int, str]], environ: Mapping[str, str],
                 memory: bool = False, nvml: Any = None) -> None:
        self.mode = mode  # auto, on or fake (off makes none)
        self._locate = locate
        self._environ = environ
        self._memory = memory  # read the memory in use too (the hw.gpu.memory.usage metric)
        self.nvml = nvml  # the binding: given (a fake), or loaded at the first sample
        self.state = PENDING
        self.reason = ""
        self.samples = 0
        self.errors: dict[str, int] = {}  # by kind: a fixed, small set of keys
        self.not_supported: list[str] = []  # fields left out, each counted once
        self.device_from = ""
        self.name = ""  # the GPU's name, where the hw.* metrics are on
        self.latest: dict[str, Any] = {}  # the last sample: contract attributes, and MEMORY_USED
        self.last_sample_s = 0.0
        self._handle: Any = None
        self._static: dict[str, Any] = {}
        self._readers: list[tuple[str, Callable[[Any], Any]]] = []
        self._failed_in_a_row = 0

    # -- the builder thread ----------------------------------------------------------------------

    def sample(self) -> dict[str, Any]:
        """The GPU's `training.gpu.*` attributes now; empty when off or stopped. Never raises."""
        started = time.perf_counter()
        try:
            if self.state == PENDING:
                self._start()
            if self.state != ON:
                return {}
            values = self._read()
        except Exception:
            self._count("internal_error")
            values = {}
        self.last_sample_s = time.perf_counter() - started
        self.latest = values
        return {key: value for key, value in values.items() if key in _ON_HEARTBEATS}

    def close(self) -> None:
        """Lets go of NVML (its init is reference-counted: a user's own NVML use is unaffected)."""
        if self.state == ON:
            self.state, self.reason = OFF, "shut_down"
            self._shutdown_nvml()

    # -- any thread --------------------------------------------------------------------------

    def status(self) -> dict:
        static = self._static
        return {"state": self.state, "reason": self.reason, "samples": self.samples,
                "errors": dict(self.errors), "not_supported": list(self.not_supported),
                "index": static.get(contract.GPU_INDEX), "uuid": static.get(contract.GPU_UUID),
                "device_from": self.device_from, "last_sample_us": round(self.last_sample_s * 1e6, 1)}

    # -- parts -----------------------------------------------------------------------------------

    def _start(self) -> None:
        try:
            nvml = self.nvml if self.nvml is not None else load_nvml()
        except ImportError:
            self._off("nvml_not_installed",
                      "the nvidia-ml-py package is not installed (pip install otel-straggler[gpu])")
            return
        self.nvml = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as error:
            kind = self._count_error(error)
            self._off(f"nvml_init_failed:{kind}", f"NVML did not initialise ({error})")
            return
        try:
            cuda_index, self.device_from = self._locate()
            handle = nvml_handle(nvml, cuda_index, self._environ.get("CUDA_VISIBLE_DEVICES"))
            static = {contract.GPU_INDEX: int(nvml.nvmlDeviceGetIndex(handle)),
                      contract.GPU_UUID: _text(nvml.nvmlDeviceGetUUID(handle))}
        except Unresolved as unresolved:
            self._off(str(unresolved), f"CUDA device {cuda_index} has no NVML GPU ({unresolved}; "
                                       f"CUDA_VISIBLE_DEVICES={self._environ.get('CUDA_VISIBLE_DEVICES')!r})")
            self._shutdown_nvml()
            return
        except nvml.NVMLError as error:
            kind = self._count_error(error)
            self._off(f"no_gpu:{kind}", f"NVML found no GPU for this rank ({error})")
            self._shutdown_nvml()
            return
        self._handle = handle
        self._readers = self._make_readers(nvml)
        maximum = self._read_field(contract.GPU_SM_CLOCK_MAX_MHZ,
                                   lambda h: int(nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_SM)))
        if maximum is not None:
            static[contract.GPU_SM_CLOCK_MAX_MHZ] = maximum
        if self._memory:
            self.name = self._read_field("name", lambda h: _text(nvml.nvmlDeviceGetName(h))) or ""
        self._static = static
        if self.state == PENDING:  # not stopped by a lost GPU meanwhile
            self.state = ON

    def _make_readers(self, nvml: Any) -> list[tuple[str, Callable[[Any], Any]]]:
        readers = [
            (contract.GPU_SM_CLOCK_MHZ, lambda h: int(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))),
            (contract.GPU_CLOCK_EVENT_REASONS, self._clock_event_reasons),
            (contract.GPU_TEMPERATURE_C, lambda h: int(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))),
            (contract.GPU_POWER_W, lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0),  # mW
            (contract.GPU_UTILIZATION, lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0),  # percent
            (contract.GPU_ECC_UNCORRECTED, lambda h: int(nvml.nvmlDeviceGetTotalEccErrors(
                h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC))),
            (contract.GPU_PCIE_REPLAY, lambda h: int(nvml.nvmlDeviceGetPcieReplayCounter(h))),
        ]
        if self._memory:
            readers.append((MEMORY_USED, lambda h: int(nvml.nvmlDeviceGetMemoryInfo(h).used)))
        return readers

    def _clock_event_reasons(self, handle: Any) -> int:
        """The reasons bitmask by its current name; by the older, deprecated one (same bits) where
        the binding or the driver lacks it."""
        nvml = self.nvml
        current = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if current is not None:
            try:
                return int(current(handle))
            except nvml.NVMLError as error:
                if getattr(error, "value", None) != _FUNCTION_NOT_FOUND:
                    raise
        return int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))

    def _read(self) -> dict[str, Any]:
        values = dict(self._static)
        read = 0
        for key, reader in list(self._readers):
            value = self._read_field(key, reader)
            if self.state == STOPPED:
                return {}
            if value is not None:
                values[key] = value
                read += 1
        if read or not self._readers:
            self._failed_in_a_row = 0
            self.samples += 1
            return values
        self._failed_in_a_row += 1
        if self._failed_in_a_row >= MAX_FAILED_SAMPLES:
            self._stop("failing", f"{MAX_FAILED_SAMPLES} samples in a row read nothing (errors so far: {self.errors})")
        return {}

    def _read_field(self, key: str, reader: Callable[[Any], Any]) -> Any:
        """One field's value, or None: not supported (dropped for good), an error (counted), or
        the GPU lost (the sampler stops)."""
        nvml = self.nvml
        try:
            return reader(self._handle)
        except nvml.NVMLError as error:
            kind = _ERROR_KINDS.get(getattr(error, "value", None), "nvml_error")
            if kind == "not_supported":
                self._readers = [(name, other) for name, other in self._readers if name != key]
                if key not in self.not_supported:
                    self.not_supported.append(key)
                    self._count(kind)
            else:
                self._count(kind)
                if kind == "gpu_lost":
                    self._stop(kind, "NVML says the GPU is lost")
        except Exception:
            self._count("internal_error")
        return None

    def _count_error(self, error: Exception) -> str:
        kind = _ERROR_KINDS.get(getattr(error, "value", None), "nvml_error")
        self._count(kind)
        return kind

    def _count(self, kind: str) -> None:
        self.errors = {**self.errors, kind: self.errors.get(kind, 0) + 1}

    def _off(self, reason: str, why: str) -> None:
        """Never sampled: silently where the mode is auto, with one warning where it was asked for."""
        self.state, self.reason = OFF, reason
        if self.mode != "auto":
            _log.warning("otel-straggler: OTEL_STRAGGLER_GPU_HEALTH is %s, but this rank's GPU cannot be read: %s; "
                         "heartbeats go without training.gpu.*", self.mode, why)

    def _stop(self, reason: str, why: str) -> None:
        """Stopped for good, in any mode: a GPU that stops answering is news."""
        self.state, self.reason = STOPPED, reason
        self.latest = {}
        _log.warning("otel-straggler: GPU health sampling stopped for good: %s; heartbeats go on without "
                     "training.gpu.*", why)
        self._shutdown_nvml()

    def _shutdown_nvml(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:
            pass
