"""A heartbeat for jobs whose stderr is not a terminal (a log file, a CI job, a notebook
cell), where the progress bar is off: one line every ~10 s saying what the job is doing
(compiling, requests done), so a long compile does not look like a hang."""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Optional, Union


class Heartbeat:
    """`with Heartbeat() as beat: beat.set("compiling"); ...`: while the block runs, a
    daemon thread writes `[N s] <status>` every `every` seconds. The status is a string
    or a callable giving one (read at each beat). Off when `stream` is a terminal."""

    def __init__(self, stream=None, every: float = 10.0, enabled: Optional[bool] = None):
        self.stream = stream or sys.stderr
        self.every = every
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = not (isatty and isatty())
        self.enabled = enabled
        self._status: Union[str, Callable[[], str]] = "starting"
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._t0 = time.monotonic()

    def set(self, status: Union[str, Callable[[], str]]) -> None:
        self._status = status

    def line(self) -> str:
        status = self._status() if callable(self._status) else self._status
        return f"[{time.monotonic() - self._t0:.0f} s] {status}"

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                print(self.line(), file=self.stream, flush=True)
            except (OSError, ValueError):  # the stream went away (closed pipe, file)
                return

    def __enter__(self) -> "Heartbeat":
        self._t0 = time.monotonic()
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
