"""The model's CPU, counted apart from the control plane's own: ``worker_agent.cpu`` and the
process kinds ``marketplace.metrics`` labels it with (bench/load.py's per-process table reads both)."""

from __future__ import annotations

import threading

import pytest

from marketplace.metrics import process_kind
from worker_agent.cpu import PARTS, CpuAccount

pytestmark = pytest.mark.control


def _spin(rounds: int = 200_000) -> int:
    total = 0
    for i in range(rounds):
        total += i * i
    return total


def test_a_measured_block_adds_its_threads_cpu_time_to_its_part_and_tells_the_listeners():
    account, heard = CpuAccount(), []
    account.listen(lambda part, seconds: heard.append((part, seconds)))

    with account.measure("head"):
        _spin()
    account.tell()

    seconds = account.seconds()
    assert seconds["head"] > 0.0
    assert all(seconds[part] == 0.0 for part in PARTS if part != "head")
    assert heard == [("head", seconds["head"])]


def test_small_additions_are_told_in_sums():
    account, heard = CpuAccount(), []
    account.listen(lambda part, seconds: heard.append((part, seconds)))

    for _ in range(5):
        account.add("sampling", 0.001)
    assert heard == []  # 5 ms gathered, under TELL_AFTER_S
    account.add("sampling", 0.006)
    account.add("head", 0.002)
    account.tell()

    assert [part for part, _ in heard] == ["sampling", "head"]
    assert heard[0][1] == pytest.approx(0.011) and heard[1][1] == pytest.approx(0.002)
    assert account.seconds()["sampling"] == pytest.approx(0.011)


def test_another_threads_work_is_not_counted_in_a_block_that_waits_for_it():
    account = CpuAccount()
    worker = threading.Thread(target=_spin, args=(2_000_000,))

    with account.measure("sampling"):
        worker.start()
        worker.join()  # waiting costs this thread (almost) no CPU
    with account.measure("head"):
        _spin(2_000_000)

    assert account.seconds()["sampling"] < account.seconds()["head"] / 4


def test_an_unknown_part_is_refused():
    with pytest.raises(ValueError, match="unknown part 'network'"), CpuAccount().measure("network"):
        pass


@pytest.mark.parametrize(
    ("argv", "kind"),
    [
        (["/venv/bin/uvicorn", "marketplace.asgi:application", "--workers", "2"], "web"),
        (["/venv/bin/celery", "-A", "marketplace", "worker", "-Q", "coord.local", "--pool", "threads"], "coordinator"),
        (["/venv/bin/celery", "-A", "marketplace", "worker", "-Q", "verify"], "verifier"),
        (["/venv/bin/celery", "-A", "marketplace", "worker", "-Q", "celery"], "worker"),
        (["/venv/bin/celery", "-A", "marketplace", "beat", "-S", "x"], "beat"),
        (["/venv/bin/python", "-m", "marketplace"], "python"),
    ],
)
def test_a_process_kind_is_read_off_its_command_line(argv, kind, monkeypatch):
    monkeypatch.delenv("SWARM_PROCESS_KIND", raising=False)
    assert process_kind(argv) == kind


def test_the_environment_names_a_process_kind_first(monkeypatch):
    monkeypatch.setenv("SWARM_PROCESS_KIND", "edge")
    assert process_kind(["/venv/bin/uvicorn"]) == "edge"
