"""The ``netlab`` fixture: one Netlab per test module, removed after its last test, failed or not.

Test modules load it with ``pytest_plugins = ["tests.netlab.fixture"]`` and carry the ``netlab``
marker. Where this machine cannot make network namespaces (not root, no ``ip`` or ``iptables``, or
the kernel refuses), the tests that take it are skipped, saying which.

It holds no assert, hence PYTEST_DONT_REWRITE (test modules also import ``start_netlab`` from it).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.netlab.network import Netlab, NetlabUnavailable, missing_netlab_reason


def start_netlab() -> Netlab:
    """A new Netlab, or skip the test saying what this machine lacks."""
    reason = missing_netlab_reason()
    if reason is not None:
        pytest.skip(reason)
    try:
        return Netlab.start()
    except NetlabUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def netlab() -> Iterator[Netlab]:
    with start_netlab() as lab:
        yield lab
