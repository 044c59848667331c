"""The cyclic garbage collector in a long-lived server process: its start-up heap frozen.

A process that has imported torch, transformers and Django and loaded a model holds about half
a million objects the collector tracks (modules, functions, classes, configs, a tokenizer's
tables), and keeps them all until it exits. Each full collection walks all of them, about 230 ms
on a 2-core VM holding the GIL, to free nothing: every stream the process serves stalls that long.
Full collections are rare under a steady load (one comes once the objects that outlived two
younger collections number a quarter of those it walked last), but a long-lived server meets them.

``settle()``, once a process has loaded what it keeps for good (after its warm-up, after an
agent's block is loaded), collects what garbage there is, then moves every object alive into the
collector's permanent generation (``gc.freeze``): later collections walk only what was made
since. Objects frozen are never collected, so it is called only once the heap holds what the
process keeps; what a later load adds is frozen by calling it again.

    heap.settle()
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("swarm.heap")


def settle() -> int:
    """Collect the garbage, then freeze every object alive now out of the collector's reach;
    returns how many objects are frozen in all."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("heap settled: %d objects frozen in %.0f ms", frozen, 1000 * (time.perf_counter() - started))
    return frozen
