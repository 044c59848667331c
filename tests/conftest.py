"""Shared fixtures: local swarms of real agent processes on loopback."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import torch
from channels.layers import channel_layers
from django.conf import settings

from worker_agent.dev.local import LocalSwarm, even_spans

SMOLLM2_SPANS = [(0, 10), (10, 20), (20, 30)]
REDIS_DATABASES = 16  # Redis's default `databases`: numbers 0..15
NETLAB_FILES = "test_netlab"  # how the files of netlab tests are named
NETLAB_SCOPE = "netlab"
# The files that take minutes (measured under `make test`), longest first: xdist hands them out
# before all others, so that none of them starts last and runs on while the other workers idle.
# Only the run's length depends on this list: a stale one slows `make test`, it breaks nothing.
SLOW_SCOPES_FIRST = [
    "tests/test_adversarial_agents.py",
    NETLAB_SCOPE,
    "tests/test_pipeline_generate.py",
    "tests/test_api_schema_fuzz.py",
    "tests/test_structured_output.py",
    "tests/test_openai_api.py",
    "tests/test_request_limits.py",
    "tests/test_heal_any_spare.py",
    "tests/test_join_cli.py",
    "tests/test_speculative_pipeline.py",
    "tests/test_billing_concurrency.py",
    "tests/test_speculation_sampling.py",
    "tests/test_audit.py",
    "tests/test_healing.py",
    "tests/test_replacement_live.py",
    "tests/test_router.py",
    "tests/test_celery_coordinator.py",
    "tests/test_fuzz.py",
    "tests/test_multi_model_live.py",
    "tests/test_architectures.py",
    "tests/test_control_plane_e2e.py",
]


def _redis_url_of_worker(url: str, worker: str) -> str:
    """``url`` with its database number moved up by the xdist worker's index (gw0 keeps it, gw1
    takes the next one, ...): each worker's channel groups, cache keys and Celery queues are its own,
    while one Redis serves them all."""
    parts = urlsplit(url)
    base = int(parts.path.strip("/") or 0)
    number = base + int(worker.removeprefix("gw"))
    if number >= REDIS_DATABASES:
        raise pytest.UsageError(f"{url} leaves no Redis database for xdist worker {worker}: use a lower number")
    return urlunsplit(parts._replace(path=f"/{number}"))


def _give_this_worker_its_own_redis() -> None:
    """Under pytest-xdist, workers run tests side by side: on one Redis database they would read each
    other's channel messages, cache entries (rate limits, locks) and Celery tasks. Django has read
    REDIS_URL before this file is imported (pytest-django sets it up first), so the settings made from
    it are rewritten here, before any test opens a connection; the environment is too, for the agents,
    Celery workers and settings subprocesses that tests start."""
    worker, url = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("REDIS_URL")
    if not worker or not url or url != settings.REDIS_URL:
        return
    own = _redis_url_of_worker(url, worker)
    os.environ["REDIS_URL"] = own
    settings.REDIS_URL = own
    if url == settings.CELERY_BROKER_URL:
        settings.CELERY_BROKER_URL = own
    for layer in settings.CHANNEL_LAYERS.values():
        for host in layer.get("CONFIG", {}).get("hosts", []):
            if isinstance(host, dict) and host.get("address") == url:
                host["address"] = own
    for cache in settings.CACHES.values():
        if cache.get("LOCATION") == url:
            cache["LOCATION"] = own
    channel_layers.backends = {}


def _one_thread_per_worker() -> None:
    """Under pytest-xdist, each worker is one of several processes on a machine of few cores (make
    test runs three on two): torch's and OpenMP's teams of threads in every one of them (and in the
    agents, Celery workers and process pools they start, which inherit OMP_NUM_THREADS) would spin
    against each other, which slows a busy-waiting team tenfold rather than twofold."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def _no_frozen_heap() -> None:
    """The live servers tests start run the real ASGI app in this process, whose lifespan would
    freeze the heap (``worker_agent.heap``): every fixture and event loop alive then would never be
    collected, test after test. The processes tests start (web, Celery workers) freeze theirs."""
    settings.SWARM_FREEZE_HEAP = False


_give_this_worker_its_own_redis()
_one_thread_per_worker()
_no_frozen_heap()


@pytest.fixture
def fresh_channel_layer():
    """A channel layer of this test's own, for tests that drive the ASGI app in an event loop of
    their own (``asyncio.run``): a Redis layer made in an earlier test's loop keeps a receive lock
    bound to that loop, and a consumer in the next loop fails on it."""
    channel_layers.backends = {}
    yield
    channel_layers.backends = {}


@pytest.fixture(scope="session")
def smollm2_swarm():
    """Three `swarm-worker serve` processes holding layers 0:10, 10:20, 20:30 of smollm2-135m."""
    with LocalSwarm("smollm2-135m", SMOLLM2_SPANS, threads=1) as swarm:
        yield swarm


@pytest.fixture(scope="session")
def tiny_swarm():
    """Three agents serving the seeded random tiny-llama (6 layers), for fast protocol tests."""
    with LocalSwarm("tiny-llama", even_spans(6, 3), threads=1) as swarm:
        yield swarm


def _xdist_scope(nodeid: str) -> str:
    """The work unit of a test under ``--dist loadfile``: its file, except that all netlab files
    are one unit. A unit runs on one worker, in order, so a file's module fixtures (live control
    planes, swarms of agents) start once; and netlab namespaces, bridges and NAT routers have fixed
    names, so two labs must never exist at once."""
    path = nodeid.split("::", 1)[0]
    return NETLAB_SCOPE if Path(path).name.startswith(NETLAB_FILES) else path


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, on the process that hands out tests
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileNetlabTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _xdist_scope(nodeid)

        def _assign_work_unit(self, node) -> None:
            # The queue holds the files by number of tests, most first; the slow ones go to its front.
            for scope in reversed(SLOW_SCOPES_FIRST):
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return LoadFileNetlabTogether(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    """The xdist scheduler knows tests by id only, hence netlab files by name: hold them to it."""
    for item in items:
        if item.get_closest_marker("netlab") and _xdist_scope(item.nodeid) != NETLAB_SCOPE:
            raise pytest.UsageError(f"{item.nodeid} is a netlab test: its file's name must start with {NETLAB_FILES}")


def pytest_report_header(config) -> str | None:
    """Say up front when the browser tests of the dashboards cannot run here."""
    from tests.browser import missing_browser_reason

    return missing_browser_reason()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Repeat it at the end, where nobody misses it: skipped web tests are untested dashboards."""
    from tests.browser import missing_browser_reason

    reason = missing_browser_reason()
    if reason:
        terminalreporter.write_sep("!", "WEB DASHBOARD TESTS SKIPPED", red=True, bold=True)
        terminalreporter.write_line(reason, red=True, bold=True)


LOG_TAIL_LINES = 60  # of each process log a failed test leaves in its tmp_path
LOG_FILES_SHOWN = 8


def _work_folders(funcargs: dict) -> list[Path]:
    """The folders a test's fixtures handed it: its tmp_path, and a module fixture's work folder
    (returned alone or in a tuple, as a live swarm's is)."""
    found = []
    for value in funcargs.values():
        for candidate in value if isinstance(value, tuple | list) else (value,):
            if isinstance(candidate, Path) and candidate.is_dir() and candidate not in found:
                found.append(candidate)
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's agents, relays and coordinators logged to files in its folders (tmp_path, a
    module fixture's): their last lines go into the failure's report, so a failure on CI carries
    the other processes' side."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed or call.when == "collect":
        return
    logs = [log for folder in _work_folders(getattr(item, "funcargs", {})) for log in folder.rglob("*.log")]
    newest = sorted(logs, key=lambda path: path.stat().st_mtime, reverse=True)[:LOG_FILES_SHOWN]
    for log in sorted(newest):
        lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        report.sections.append((f"last {len(lines)} lines of {log}", "\n".join(lines)))
