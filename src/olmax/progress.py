"""No silence over 30 seconds: a phase that can take longer (a compile, a backoff, a demo's data, a train step
between its logged lines) says at least every SILENCE seconds how long it has gone on and what it waits for."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Callable

SILENCE = 30.0  # the longest silence; a line comes after 5/6 of it, so that a late tick still keeps the promise


class _Watched:
    """A text stream that notes when it was last written to."""

    def __init__(self, stream):
        self.stream, self.written = stream, time.monotonic()

    def write(self, text: str) -> int:
        self.written = time.monotonic()
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def repeating(seconds: float, action: Callable[[], None], name: str = "olmax progress"):
    """Inside the block, `action()` every `seconds`, from a thread of its own (the block may hold this one)."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(seconds):
            action()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextlib.contextmanager
def ticking(line: Callable[[float], str], stream: str = "stderr"):
    """Inside the block, whenever sys.`stream` ("stdout" or "stderr") has been silent for 5/6 of SILENCE seconds,
    write `line(seconds since the block began)` to it."""
    watched = _Watched(getattr(sys, stream))
    setattr(sys, stream, watched)
    began = time.monotonic()

    def tick() -> None:
        if time.monotonic() - watched.written >= SILENCE * 5 / 6:
            print(line(time.monotonic() - began), file=watched, flush=True)

    try:
        with repeating(min(1.0, SILENCE / 4), tick):
            yield
    finally:
        if getattr(sys, stream) is watched:
            setattr(sys, stream, watched.stream)
