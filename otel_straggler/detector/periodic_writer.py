"""The lifecycle the detector's evidence writers share (emit.py, window_record.py): a thread of
their own that wakes every flush interval, or at stop(), and calls `flush()`; stop() flushes what
was queued so far, then `close()`s."""
from __future__ import annotations

import threading
from typing import Optional


class PeriodicWriter:
    """Subclasses queue under `self._wake` (a Condition) and implement flush() and close()."""

    def __init__(self, thread_name: str, flush_interval_s: float) -> None:
        self._thread_name = thread_name
        self._flush_interval_s = flush_interval_s
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None

    def flush(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> bool:
        """Writes everything queued so far and closes; False if that took longer than `timeout_s`."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return False
        else:
            self.flush()
        self.close()
        return True

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._stopping:
                    self._wake.wait(self._flush_interval_s)
                stopping = self._stopping
            self.flush()
            if stopping:
                return
