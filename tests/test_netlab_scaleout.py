"""The production topology across hosts, one web host and one coordinator host killed mid-run:
``bench/scaleout.py`` at a small scale (24 concurrent streams of 16 tokens, each with an
Idempotency-Key of its own, retried with it after a failure a client may retry).

PostgreSQL and Redis on hosts of their own, two web hosts behind HAProxy, two coordinator hosts,
the verify worker, periodic worker and beat on a fifth, three tiny-llama agents joined through the
load balancer. Once a third of the streams receive tokens, every process of ``web1`` and of
``coord1`` is SIGKILLed. Streams on the surviving hosts run on untouched; those on a killed host end
with an error a client may retry, and their retries complete; no key pays for two attempts; the
ledger is exact; the surviving web host answers no 5xx. (About 3 minutes on 2 cores.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.netlab import NetlabUnavailable

pytestmark = pytest.mark.netlab

ROOT = Path(__file__).resolve().parent.parent
STREAMS = 24


def bench_scaleout():
    """``bench/scaleout.py``, imported from its file (bench/ is no package)."""
    spec = importlib.util.spec_from_file_location("bench_scaleout", ROOT / "bench" / "scaleout.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    scaleout = bench_scaleout()
    reason = scaleout.missing_reason()  # not root, or no ip, iptables, HAProxy, Redis or PostgreSQL here
    if reason is not None:
        pytest.skip(reason)
    options = scaleout.parse_args(["--streams", str(STREAMS), "--max-tokens", "16"])
    try:
        return scaleout.run(options, tmp_path_factory.mktemp("scaleout"))
    except NetlabUnavailable as exc:
        pytest.skip(str(exc))


def test_streams_on_the_surviving_hosts_run_on_undisturbed(run):
    figures = run["figures"]

    assert figures["on_surviving_hosts"] >= 1
    assert figures["surviving_disrupted"] == 0
    assert {row["first"] for row in run["streams"] if not row["killed_host"]} == {"ok"}


def test_streams_cut_on_a_killed_host_end_in_retry_safe_errors_and_their_retries_complete(run):
    figures = run["figures"]
    cut = [row for row in run["streams"] if row["killed_host"] and row["first"] != "ok"]

    assert len(cut) == figures["killed_host_interrupted"] >= 1  # the kills did land mid-stream
    assert [row for row in cut if not row["retry_safe"]] == []
    assert {row["final"] for row in run["streams"]} == {"ok"}
    assert figures["completed_first_time"] + figures["completed_on_retry"] == STREAMS


def test_no_idempotency_key_pays_twice_and_the_ledger_is_exact(run):
    ledger = run["ledger"]

    assert (ledger["exact"], ledger["problems"], ledger["keys_charged_twice"]) == (True, [], 0)
    assert ledger["superseded_jobs"] >= 1  # some retry ran afresh over a lost attempt, charged once


def test_the_surviving_web_host_answers_no_5xx(run):
    assert run["figures"]["5xx_from_surviving_hosts"] == 0
