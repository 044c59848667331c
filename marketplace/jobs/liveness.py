"""Whether the process that owns a piece of work is still alive: the web process answering an
Idempotency-Key's attempt, the coordinator worker running a job.

A process stamps the work it takes on with ``this_process()``: an id for this process's life
(``<hostname>:<pid>:<random>``), which a thread of the process then keeps alive in the cache every
SWARM_PROCESS_ALIVE_S / 5 seconds, each entry expiring after SWARM_PROCESS_ALIVE_S. ``gone(id)``
is True once the entry expired: the process wrote nothing for SWARM_PROCESS_ALIVE_S, because it
died (killed, its host lost) or was frozen that long. Its work is then another process's to end at
once (``settlement.reconcile_jobs``, ``services.stopped_answering``, ``idempotency.claim``),
rather than after SWARM_JOB_STALE_S of silence or an Idempotency-Key's LOST_AFTER_S.

Only where the cache is shared by the deployment's processes (Redis: REDIS_URL). In the embedded
default everything runs in one process, ``this_process()`` is "" and work stays unstamped: the
clocks decide, as they do for work stamped before this existed. A cache that cannot be read says
nothing: ``gone`` is then False, and the clocks decide too.

A missing sign of life proves a death only where the cache has kept the record of lives for a
whole SWARM_PROCESS_ALIVE_S: a Redis restarted (it keeps nothing on disk) or flushed has forgotten
every live process too, and until each has signed again, none of them may be judged gone (that
would fail every job in flight at once). So the first sign of life written to a cache without a
record (``RECORD_KEY``) starts one, and marks it new (``NEW_RECORD_KEY``, expiring after
SWARM_PROCESS_ALIVE_S); while it is new, or when it is missing, ``gone`` says nothing.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time

from django.conf import settings
from django.core.cache import cache

log = logging.getLogger("swarm.jobs")
KEY_PREFIX = "swarm:alive:"
RECORD_KEY = "swarm:lives-recorded"  # set with the first sign of life the cache keeps, never expires
NEW_RECORD_KEY = "swarm:lives-recorded-new"  # while set, the record is younger than SWARM_PROCESS_ALIVE_S
BEATS_PER_TTL = 5  # signs of life per SWARM_PROCESS_ALIVE_S: a process must miss this many in a row to be gone

_lock = threading.Lock()
_this: tuple[int, str] | None = None  # (pid, id): a forked child is a process of its own


def this_process() -> str:
    """This process's id, kept alive from the first call on; "" where the cache is not shared."""
    global _this
    if not settings.REDIS_URL:
        return ""
    with _lock:
        if _this is None or _this[0] != os.getpid():
            process = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
            report_alive(process)  # alive before anything is stamped with it
            threading.Thread(target=_keep_alive, args=(process,), name="liveness", daemon=True).start()
            _this = (os.getpid(), process)
        return _this[1]


def report_alive(process: str) -> None:
    """Write ``process``'s sign of life, good for SWARM_PROCESS_ALIVE_S; the first one a cache keeps
    starts its record of lives, new for SWARM_PROCESS_ALIVE_S."""
    cache.set(KEY_PREFIX + process, 1, timeout=settings.SWARM_PROCESS_ALIVE_S)
    if cache.get(RECORD_KEY) is None:
        # Marked new before it exists: no reader ever sees a record without its mark of youth.
        cache.set(NEW_RECORD_KEY, 1, timeout=settings.SWARM_PROCESS_ALIVE_S)
        cache.add(RECORD_KEY, 1, timeout=None)


def gone(process: str) -> bool:
    """Whether the process stamped ``process`` stopped signing its life: False for "" (unstamped work),
    when the cache cannot be read, and while its record of lives is missing or new."""
    if not process:
        return False
    try:
        found = cache.get_many([KEY_PREFIX + process, RECORD_KEY, NEW_RECORD_KEY])
        if RECORD_KEY not in found or NEW_RECORD_KEY in found:
            return False  # the cache forgot the lives within SWARM_PROCESS_ALIVE_S: no verdict
        return KEY_PREFIX + process not in found
    except Exception as exc:  # the cache's own (Redis) error: no verdict, the clocks decide
        log.warning("cannot tell whether %s is alive: %r", process, exc)
        return False


def _keep_alive(process: str) -> None:
    while True:
        time.sleep(settings.SWARM_PROCESS_ALIVE_S / BEATS_PER_TTL)
        try:
            report_alive(process)
        except Exception as exc:  # Redis away for a moment: the next beat tries again
            log.warning("cannot sign this process's life: %r", exc)
