"""Hosts in Linux network namespaces for tests: public hosts, homes behind NAT, and the control plane's
link to PostgreSQL and Redis (see ``tests/netlab/network.py``). Test modules take the ``netlab``
fixture with ``pytest_plugins = ["tests.netlab.fixture"]`` and the ``netlab`` marker."""

from tests.netlab.network import Host, Netlab, NetlabError, NetlabUnavailable, missing_netlab_reason

__all__ = ["Host", "Netlab", "NetlabError", "NetlabUnavailable", "missing_netlab_reason"]
