"""One asyncio event loop, on its own thread, for both OTLP receivers; a pool of threads for the work.

A connection, a request being read or a gRPC stream waiting for its message costs a coroutine on
the loop, not a thread: a client that sends slowly, or not at all, holds no worker any other client
needs. What takes CPU (decompressing, decoding, queueing for the engine: receiver.OtlpIntake) runs on
`workers` threads, so the loop keeps reading and answering while a large request is decoded.

    loop = IntakeLoop(workers=4)
    loop.start()
    port = loop.call(start_a_server())        # a coroutine run on the loop, its result here
    ...
    loop.stop()
"""
from __future__ import annotations

import asyncio
import threading
from concurrent import futures
from typing import Any, Callable, Coroutine, Optional, TypeVar

_T = TypeVar("_T")


class IntakeLoop:
    def __init__(self, workers: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.workers = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="straggler-intake")
        self._thread = threading.Thread(target=self._run, name="straggler-intake-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def call(self, coroutine: Coroutine[Any, Any, _T], timeout_s: Optional[float] = 30.0) -> _T:
        """Runs `coroutine` on the loop and returns its result (or raises its exception) here."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    async def work(self, function: Callable[..., _T], *args) -> _T:
        """On the loop: `function(*args)` on a worker thread, awaited."""
        return await self.loop.run_in_executor(self.workers, function, *args)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops the loop (servers should be closed first) and the workers, after what they run."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
        self.workers.shutdown(wait=True, cancel_futures=True)
        if not self._thread.is_alive() and not self.loop.is_closed():
            self.loop.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
