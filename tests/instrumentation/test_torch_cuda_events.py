"""Which torch events the CUDA backend uses. Without a GPU only the choice can be checked here;
benchmarks/gpu_check.py checks on a GPU that the chosen events land on the current stream and
time the same device work as an isolated measurement."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from otel_straggler.processors.device_events import TorchCudaEvents  # noqa: E402


@pytest.fixture
def cuda_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_no_cuda_is_an_error_so_timing_falls_back_to_host_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        TorchCudaEvents()


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
