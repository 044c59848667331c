"""CPU seconds a process spends on the model, by part, counted where the work runs.

The control plane's cost per token is the CPU its processes spend on everything but the model
(HTTP, serialization, the broker, transactions, logging). To tell the two apart, the places that
run the model measure their own thread's CPU time around the work (``time.thread_time``, so a
thread waiting for the GIL or the cores counts nothing) and add it here:

- ``embed`` and ``head``: the coordinator's embedding lookups and LM-head passes (``HeadRunner``);
- ``sampling``: folding a chunk's logits into tokens (``GenerationState.fold``: logit processors,
  sampling or greedy choice, the check of the drafts);
- ``drafting``: a drafter's proposals;
- ``replay``: the verifier recomputing audit material and challenge answers on trusted blocks.

A listener (the control plane's Prometheus counter, ``marketplace.metrics``) is told what was added,
in sums: once at least ``TELL_AFTER_S`` of CPU or ``TELL_EVERY_S`` of time has gathered since it was
last told, and whenever ``tell`` is called (a job's end). Telling it of every LM-head pass cost the
coordinator a twentieth of its CPU (a multiprocess counter's lock and file per increment). The
totals are kept here too for a process without one.

    with MODEL_CPU.measure("head"):
        logits = head.logits(hidden)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PARTS = ("embed", "head", "sampling", "drafting", "replay")
TELL_AFTER_S = 0.01  # of CPU gathered, the listeners are told
TELL_EVERY_S = 0.5  # or once this long passed since they were last told


class CpuAccount:
    """Process-wide CPU seconds by part (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = dict.fromkeys(PARTS, 0.0)
        self._unheard = dict.fromkeys(PARTS, 0.0)  # added since the listeners were last told
        self._told_at = time.monotonic()
        self._listeners: list[Callable[[str, float], None]] = []

    @contextmanager
    def measure(self, part: str) -> Iterator[None]:
        """Adds the calling thread's CPU time inside the block to ``part``."""
        if part not in self._seconds:
            raise ValueError(f"unknown part {part!r}: one of {PARTS}")
        start = time.thread_time()
        try:
            yield
        finally:
            self.add(part, time.thread_time() - start)

    def add(self, part: str, seconds: float) -> None:
        with self._lock:
            self._seconds[part] += seconds
            self._unheard[part] += seconds
            due = sum(self._unheard.values()) >= TELL_AFTER_S or time.monotonic() - self._told_at >= TELL_EVERY_S
        if due:
            self.tell()

    def tell(self) -> None:
        """Tell the listeners what was added since they were last told."""
        with self._lock:
            unheard = {part: seconds for part, seconds in self._unheard.items() if seconds}
            self._unheard = dict.fromkeys(PARTS, 0.0)
            self._told_at = time.monotonic()
            listeners = list(self._listeners)
        for part, seconds in unheard.items():
            for listener in listeners:
                listener(part, seconds)

    def listen(self, listener: Callable[[str, float], None]) -> None:
        """Call ``listener(part, seconds)`` with what is added from now on (in sums, see above)."""
        with self._lock:
            self._listeners.append(listener)

    def seconds(self) -> dict[str, float]:
        with self._lock:
            return dict(self._seconds)


MODEL_CPU = CpuAccount()
