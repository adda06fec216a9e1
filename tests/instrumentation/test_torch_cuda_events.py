"""Which torch events the CUDA backend uses. Without a GPU only the choice can be checked here;
benchmarks/gpu_check.py checks on a GPU that the chosen events land on the current stream and
time the same device work as an isolated measurement."""
from __future__ import annotations

import pytest

import threading

torch = pytest.importorskip("torch")

from otel_straggler.processors.device_events import TorchCudaEvents  # noqa: E402

needs_cuda_build = pytest.mark.skipif(not torch.backends.cuda.is_built(),
                                      reason="this torch is built without CUDA: no CUDA event objects at all")


@pytest.fixture
def cuda_visible(monkeypatch):
    """torch as on a machine whose current GPU is cuda:3; records the devices set, by thread."""
    set_devices = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: set_devices.append((threading.get_ident(), device)))
    return set_devices


class StandInEvent:
    def __init__(self, done: bool = True, elapsed: float = 2.5) -> None:
        self.done, self.elapsed, self.compared_with = done, elapsed, None

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other) -> float:
        self.compared_with = other
        return self.elapsed


def test_no_cuda_is_an_error_so_timing_falls_back_to_host_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        TorchCudaEvents()


@needs_cuda_build
@pytest.mark.skipif(not hasattr(getattr(torch, "Event", None), "elapsed_time"),
                    reason="this torch has no device-generic torch.Event with elapsed_time")
def test_generic_events_recorded_by_their_own_c_method(cuda_visible):
    backend = TorchCudaEvents()
    assert backend.event_api == "torch.Event"
    # the pool's record_event is this very method: no Python frame between the hot path and torch
    assert backend.record is torch.Event.record
    event = backend.create_event()
    assert type(event) is torch.Event
    assert "device_type=cuda" in repr(event)
    # a timing event (BACKEND_DEFAULT flag), as torch.Event(..., enable_timing=True) makes it
    assert repr(event).split("event_flag=")[1].split(",")[0] == \
        repr(torch.Event("cuda", enable_timing=True)).split("event_flag=")[1].split(",")[0]
    assert repr(event).split("event_flag=")[1].split(",")[0] != \
        repr(torch.Event("cuda", enable_timing=False)).split("event_flag=")[1].split(",")[0]


def test_older_torch_gets_cuda_events(cuda_visible, monkeypatch):
    class EventWithoutElapsedTime:  # torch.Event as it was before elapsed_time
        pass

    monkeypatch.setattr(torch, "Event", EventWithoutElapsedTime)
    made = []

    class CudaEvent:
        def __init__(self, enable_timing=False):
            self.enable_timing = enable_timing
            self.records = 0
            made.append(self)

        def record(self):
            self.records += 1

    monkeypatch.setattr(torch.cuda, "Event", CudaEvent)
    backend = TorchCudaEvents()
    assert backend.event_api == "torch.cuda.Event"
    event = backend.create_event()
    assert made == [event] and event.enable_timing
    backend.record(event)
    assert event.records == 1


@needs_cuda_build
def test_reader_threads_adopt_the_pools_device_once_each(cuda_visible):
    """elapsed_time on a thread that never chose a device would switch back to device 0 (a
    context there, on a rank of another GPU): each reading thread first adopts the pool's device."""
    backend = TorchCudaEvents()
    backend.create_event()  # the pool is made while cuda:3 is current
    start, end = StandInEvent(), StandInEvent(done=False)
    assert backend.query(start) is True and backend.query(end) is False
    assert backend.elapsed_ms(start, end) == 2.5 and start.compared_with is end
    backend.elapsed_ms(start, end)
    me = threading.get_ident()
    assert cuda_visible == [(me, 3)]  # once for this thread, not per read

    def read_elsewhere():
        backend.elapsed_ms(start, end)

    reader = threading.Thread(target=read_elsewhere)
    reader.start()
    reader.join()
    assert [device for _, device in cuda_visible] == [3, 3] and cuda_visible[1][0] != me


def test_no_pool_yet_no_device_set(cuda_visible):
    backend = TorchCudaEvents()
    assert backend.elapsed_ms(StandInEvent(), StandInEvent()) == 2.5
    assert cuda_visible == []
