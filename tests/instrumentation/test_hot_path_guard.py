"""The training thread pays only for the hot path (docs/architecture.md#the-training-thread-budget): no device sync, no collective,
no logging, no I/O, no lock, no sleep. Checked twice: statically, by scanning the hot-path
functions' code (the Python reference's and the C extension's source), and at run time, by spying
on those calls during a training loop (with whichever of the two this process runs)."""
from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import inspect
import logging
import os
import re
import socket
import textwrap
import threading
import time
from pathlib import Path

import pytest

import otel_straggler
from otel_straggler.instrumentation import hot_path_reference
from otel_straggler.integrations import megatron_timers
from otel_straggler.processors import device_events

reference = hot_path_reference
HOT_PATH = [
    reference.IntervalRecorder.start, reference.IntervalRecorder.stop, reference.IntervalRecorder.begin_step,
    reference.IntervalRecorder.end_step, reference.IntervalRecorder._give_back,
    reference.Stage.__enter__, reference.Stage.__exit__, reference.Step.__init__, reference.Step.__exit__,
    reference.Stage.__call__, reference.timed_by,
    megatron_timers.Timer.start, megatron_timers.Timer.stop, megatron_timers.Timer.elapsed,
    megatron_timers.Timer.reset, device_events.EventPool.record,
]

DEVICE_SYNC = {"synchronize", "item", "cpu", "tolist", "numpy", "elapsed_time", "wait_event", "wait_stream"}
COLLECTIVES = {"barrier", "monitored_barrier", "all_reduce", "all_gather", "all_gather_object",
               "all_gather_into_tensor", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list",
               "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "send", "recv", "isend",
               "irecv", "batch_isend_irecv"}
LOGGING = {"log", "debug", "info", "warning", "warn", "error", "exception", "critical", "getLogger", "print"}
IO = {"open", "write", "writelines", "flush", "read", "readline", "sendall", "sendto", "connect", "socket",
      "makefile", "fsync"}
BLOCKING = {"sleep", "wait", "join", "acquire"}
FORBIDDEN_ATTRIBUTES = DEVICE_SYNC | COLLECTIVES | LOGGING | IO | BLOCKING
FORBIDDEN_NAMES = {"print", "open", "input", "logging", "logger", "_logger", "socket", "sys", "os", "torch", "dist"}


def violations(function) -> list[str]:
    """Every forbidden call, attribute, name or lock in a function's code (nested ones too)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = node.attr
            if name in FORBIDDEN_ATTRIBUTES or "lock" in name.lower():
                found.append(f"{ast.unparse(node)} (line {node.lineno})")
        elif isinstance(node, ast.Name):
            if node.id in FORBIDDEN_NAMES or "lock" in node.id.lower():
                found.append(f"{node.id} (line {node.lineno})")
    return found


@pytest.mark.parametrize("function", HOT_PATH, ids=lambda function: function.__qualname__)
def test_hot_path_code_calls_nothing_forbidden(function):
    assert violations(function) == []


def _what_the_scan_must_reject(self):
    torch.cuda.synchronize()  # noqa: F821 - never run, only parsed
    sync = torch.cuda.synchronize  # noqa: F821
    dist.all_reduce(self.tensor)  # noqa: F821
    self.group.barrier()
    logging.getLogger(__name__).info("x")
    self.log.warning("x")
    print("x")
    with open("x") as handle:
        handle.write("x")
    with self._lock:
        time.sleep(0.001)
    return sync


def test_the_scan_rejects_what_it_must():
    found = " ".join(violations(_what_the_scan_must_reject))
    for forbidden in ("torch.cuda.synchronize", "all_reduce", "barrier", "getLogger", "warning", "print", "open",
                      ".write", "_lock", "time.sleep"):
        assert forbidden in found, forbidden


C_HOT_PATH = Path(hot_path_reference.__file__).with_name("_hot_path.c")
# Every function the C hot path may call that it does not define itself: the C API for objects,
# calls and errors, and the clock. A call to anything else (a lock, a sleep, printf, a write, a
# GIL release) fails the scan until it is looked at and added here.
C_ALLOWED_CALLS = {
    "clock_gettime", "offsetof", "sizeof",
    "PyErr_ExceptionMatches", "PyErr_Clear", "PyErr_Occurred", "PyErr_SetString",
    "PyErr_Fetch", "PyErr_Restore",  # an error kept while a failed interval's events go back to the pool
    "PyObject_Length", "PyObject_CallOneArg", "PyObject_CallNoArgs", "PyObject_CallMethodNoArgs",
    "PyObject_CallMethodOneArg", "PyObject_CallMethodObjArgs", "PyObject_RichCompareBool", "PyObject_GetAttrString",
    "PyObject_HasAttrString",
    "PyObject_TypeCheck", "PyObject_GC_UnTrack",
    "PyLong_FromLongLong", "PyLong_AsLongLong", "PyLong_FromLong", "PyTuple_Pack", "PyTuple_Check",
    "PyTuple_GET_SIZE", "PyTuple_GET_ITEM", "PyList_New", "PyList_Append", "PyList_SetSlice", "PyList_GET_SIZE",
    "PyList_GET_ITEM", "PyUnicode_CompareWithASCIIString", "PyUnicode_InternFromString",
    "PyArg_ParseTupleAndKeywords", "Py_INCREF", "Py_DECREF", "Py_XDECREF", "Py_NewRef", "Py_SETREF", "Py_XSETREF",
    "Py_CLEAR", "Py_VISIT", "Py_TYPE", "Py_RETURN_NONE", "Py_RETURN_FALSE", "PyVarObject_HEAD_INIT",
    "PyImport_ImportModule", "PyType_Ready", "PyModule_Create", "PyModule_AddObjectRef", "PyMODINIT_FUNC",
    "PyModule_AddIntConstant",
    "PyArg_ParseTuple", "PyDict_GET_SIZE", "PyObject_CallFunctionObjArgs",  # @stage(name): once, at decoration
    "tp_alloc", "tp_free",  # the type's own allocator, through its slots
}
C_KEYWORDS = {"if", "for", "while", "return", "switch", "sizeof", "defined", "void"}  # void: a cast
C_FORBIDDEN_MACROS = {"Py_BEGIN_ALLOW_THREADS", "Py_END_ALLOW_THREADS", "Py_BLOCK_THREADS", "Py_UNBLOCK_THREADS"}


def c_calls_outside_the_allowed(source: str) -> list[str]:
    """Names called in C source that it neither defines nor may call."""
    code = re.sub(r"/\*.*?\*/|//[^\n]*", " ", source, flags=re.S)
    code = re.sub(r'"(?:\\.|[^"\\])*"', '""', code)
    defined = set(re.findall(r"^[A-Za-z_][\w \t\*]*?\b(\w+)\s*\(", code, flags=re.M))
    called = set(re.findall(r"\b([A-Za-z_]\w*)\s*\(", code))
    macros = set(re.findall(r"\b\w+\b", code)) & C_FORBIDDEN_MACROS
    return sorted((called - defined - C_ALLOWED_CALLS - C_KEYWORDS) | macros)


def test_c_hot_path_calls_nothing_outside_its_allowed_list():
    assert c_calls_outside_the_allowed(C_HOT_PATH.read_text()) == []


def test_the_c_scan_rejects_what_it_must():
    sample = """static int stop(Recorder *self) {
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(self->lock, 1);
        usleep(10); printf("x"); PyObject_Print(self, stdout, 0); /* sleep( in a comment is fine */
        return write(2, "fsync(", 6);
    }"""
    assert c_calls_outside_the_allowed(sample) == ["PyObject_Print", "PyThread_acquire_lock", "Py_BEGIN_ALLOW_THREADS",
                                                   "printf", "usleep", "write"]


class TrainingThreadSpy:
    """Replaces forbidden functions with spies that record calls made from the training
    thread (and swallow them: no collective may really run here) and pass every call from
    another thread through to the real function."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.training_thread = threading.current_thread()
        self.watching = False
        self.from_training_thread: list[str] = []
        self.from_background: list[str] = []

    def replace(self, owner, name: str) -> None:
        original = getattr(owner, name)
        label = f"{getattr(owner, '__name__', owner)}.{name}"

        @functools.wraps(original)
        def spy(*args, **kwargs):
            if self.watching and threading.current_thread() is self.training_thread:
                self.from_training_thread.append(label)
                return None
            if self.watching:
                self.from_background.append(label)
            return original(*args, **kwargs)

        self.monkeypatch.setattr(owner, name, spy)

    @contextlib.contextmanager
    def watch(self):
        self.watching = True
        try:
            yield self
        finally:
            self.watching = False


@pytest.fixture
def spy(monkeypatch) -> TrainingThreadSpy:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    watcher = TrainingThreadSpy(monkeypatch)
    watcher.replace(torch.cuda, "synchronize")
    for collective in ("barrier", "monitored_barrier", "all_reduce", "all_gather", "broadcast", "reduce",
                       "reduce_scatter", "all_to_all", "gather", "scatter", "send", "recv", "isend", "irecv"):
        watcher.replace(dist, collective)
    for method in ("debug", "info", "warning", "error", "exception", "critical", "log"):
        watcher.replace(logging.Logger, method)
    for function in ("open", "print", "input"):
        watcher.replace(builtins, function)
    for method in ("connect", "send", "sendall", "sendto"):
        watcher.replace(socket.socket, method)
    for function in ("write", "fsync"):
        watcher.replace(os, function)
    watcher.replace(time, "sleep")
    return watcher


def test_the_spy_sees_training_thread_calls_and_passes_others_through(spy):
    import torch.distributed as dist

    with spy.watch():
        dist.barrier()
        logging.getLogger("training").warning("slow")
        worker = threading.Thread(target=logging.getLogger("background").debug, args=("fine",))
        worker.start()
        worker.join()
    assert spy.from_training_thread == ["torch.distributed.barrier", "Logger.warning"]
    assert spy.from_background == ["Logger.debug"]


def test_a_training_loop_makes_no_forbidden_call_on_the_training_thread(spy, configure, monkeypatch,
                                                                       unreachable_endpoint, wait_until):
    # Tight bounds everywhere so the background hits every loss path (and logs about them).
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "32")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "16")
    handle = configure(job_id="guard", rank=0, world_size=1, endpoint=unreachable_endpoint, protocol="grpc",
                       device_timing="fake", event_pool_size=8, queue_size=64, build_interval_ms=1.0)
    timers = otel_straggler.Timers(2, "minmax")
    with spy.watch():
        for number in range(200):
            otel_straggler.step(number, tokens=4096, samples=4)
            timers("forward-backward", log_level=1).start(barrier=True)
            with otel_straggler.stage("forward-compute"):
                with otel_straggler.stage("my-inner-stage", collective=False):
                    pass
            timers("backward-compute").start()
            timers("backward-compute").stop()
            timers("forward-backward").stop(barrier=True)
            with otel_straggler.stage("all-grads-sync"):
                pass
            timers("interval-time", log_level=0).elapsed(barrier=True)
        training_thread_calls = list(spy.from_training_thread)
        spy.training_thread = None  # waiting below polls with sleep(): background calls only from here
        # the spies are live: the exporter side logs its failed export through them
        assert wait_until(lambda: handle.status()["lost"]["exporter_queue_full"] > 0
                          and "Logger.warning" in spy.from_background)
    assert training_thread_calls == []
    status = handle.status()
    assert status["spans_built"] > 0 and status["lost"]["queue_full"] + status["lost"]["pool_exhausted"] > 0
    handle.shutdown(timeout_s=0.5)  # nothing can be delivered: do not wait for it
