"""The test network of namespaces (tests/netlab): who reaches whom, what a NAT router lets in, the
control plane's link to PostgreSQL and Redis, and removal that leaves nothing behind.

A tiny TCP server on a host answers each connection with the address it sees the caller at, so a
caller learns either that address or why it could not connect (an errno name, or "timeout").
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.netlab import Host
from tests.netlab.fixture import start_netlab
from tests.netlab.network import IP, listed_namespaces

pytest_plugins = ["tests.netlab.fixture"]
pytestmark = pytest.mark.netlab

ROOT = Path(__file__).resolve().parent.parent
PORT = 8000
ROLES = ("wan", "cloud", "dc1", "dc2", "client", "router1", "home1", "router2", "home2")
DIAL_TIMEOUT_S = 2.0
SERVER = """
import socket, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
while True:
    connection, (address, _) = server.accept()
    connection.sendall(address.encode())
    connection.close()
"""
DIAL = """
import errno, socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as connection:
        print(connection.recv(64).decode())
except TimeoutError:
    print("timeout")
except OSError as exc:
    print(errno.errorcode[exc.errno])
"""
# Started as a separate program, so that a signal ends it the way it ends a test run.
HOLD_A_LAB = """
import time
from tests.netlab import Netlab
lab = Netlab.start()
print(lab.prefix, flush=True)
time.sleep(60)
"""


@contextmanager
def serving(host: Host, port: int = PORT) -> Iterator[None]:
    """The address-telling server on ``host``:``port`` for the length of the block."""
    server = host.popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        assert server.stdout.readline() == "listening\n"
        yield
    finally:
        server.terminate()
        server.wait()


def dial(host: Host, address: str, port: int = PORT) -> str:
    """From ``host``: the address the server at ``address``:``port`` saw, or why there was none."""
    result = host.run([sys.executable, "-c", DIAL, address, str(port), str(DIAL_TIMEOUT_S)], check=True)
    return result.stdout.strip()


def root_links() -> str:
    return subprocess.run([IP, "-o", "link", "show"], capture_output=True, text=True, check=True).stdout


def test_public_hosts_reach_each_other_directly(netlab):
    cloud, dc1, dc2, client = (netlab.hosts[name] for name in ("cloud", "dc1", "dc2", "client"))

    with serving(cloud), serving(dc2):
        seen = {
            ("dc1", "cloud"): dial(dc1, cloud.address),
            ("dc1", "dc2"): dial(dc1, dc2.address),
            ("client", "cloud"): dial(client, cloud.address),
        }

    assert seen == {("dc1", "cloud"): "10.201.0.21", ("dc1", "dc2"): "10.201.0.21", ("client", "cloud"): "10.201.0.30"}


def test_home_host_reaches_cloud_from_its_routers_public_address(netlab):
    cloud, home1, home2 = netlab.hosts["cloud"], netlab.hosts["home1"], netlab.hosts["home2"]

    with serving(cloud):
        seen = [dial(home1, cloud.address), dial(home2, cloud.address)]

    assert (home1.address, home1.public_address) == ("192.168.11.2", "10.201.0.101")
    assert seen == ["10.201.0.101", "10.201.0.102"]


def test_nothing_opens_a_connection_to_a_home_host(netlab):
    home1 = netlab.hosts["home1"]

    with serving(home1):
        outcomes = {
            (caller, target): dial(netlab.hosts[caller], address)
            for caller in ("cloud", "dc1", "home2")
            for target, address in (("private", home1.address), ("public", home1.public_address))
        }
        from_its_own_lan = dial(home1, home1.address)

    # No public host has a route to a private network, and router1 has no port forwarded.
    assert outcomes == {
        ("cloud", "private"): "ENETUNREACH",
        ("cloud", "public"): "ECONNREFUSED",
        ("dc1", "private"): "ENETUNREACH",
        ("dc1", "public"): "ECONNREFUSED",
        ("home2", "private"): "ENETUNREACH",
        ("home2", "public"): "ECONNREFUSED",
    }
    assert from_its_own_lan == "192.168.11.2"  # the server was there to be reached


def test_router_forwards_no_new_connection_inward_even_to_a_neighbour_that_routes_through_it(netlab):
    dc1, home1, router1 = netlab.hosts["dc1"], netlab.hosts["home1"], netlab.hosts["router1"]
    lan = "192.168.11.0/24"

    dc1.run(["ip", "route", "add", lan, "via", router1.address], check=True)
    try:
        with serving(home1):
            outcome = dial(dc1, home1.address)
    finally:
        dc1.run(["ip", "route", "del", lan], check=True)

    assert outcome == "timeout"  # router1 drops the SYN, as a home router does


def test_cloud_reaches_postgresql_through_its_link_not_its_loopback(netlab):
    cloud, dc1 = netlab.hosts["cloud"], netlab.hosts["dc1"]
    query = "import psycopg, sys; print(psycopg.connect(sys.argv[1]).execute('SELECT 1').fetchone()[0])"
    link = urlsplit(netlab.database_url())

    answer = cloud.run([sys.executable, "-c", query, netlab.database_url()], check=True, timeout_s=10)

    assert answer.stdout == "1\n"
    assert dial(cloud, "127.0.0.1", 5432) == "ECONNREFUSED"
    assert dial(dc1, link.hostname, link.port) == "ENETUNREACH"  # only cloud has the link


def test_cloud_reaches_redis_through_its_link(netlab):
    ping = "import redis, sys; print(redis.Redis.from_url(sys.argv[1], socket_timeout=5).ping())"

    answer = netlab.hosts["cloud"].run([sys.executable, "-c", ping, netlab.redis_url()], check=True, timeout_s=10)

    assert answer.stdout == "True\n"
    assert dial(netlab.hosts["cloud"], "127.0.0.1", 6379) == "ECONNREFUSED"


def test_close_removes_every_namespace_link_and_process():
    lab = start_netlab()
    names = set(lab.namespaces)
    sleeper = lab.hosts["home1"].popen(["sleep", "60"])

    lab.close()

    assert names == {lab.prefix + role for role in ROLES}
    assert listed_namespaces() & names == set()
    assert lab.prefix not in root_links()
    assert sleeper.returncode == -signal.SIGTERM
    assert [thread.name for thread in threading.enumerate() if thread.name.startswith(lab.prefix)] == []


@pytest.mark.usefixtures("netlab")  # for its skip where no lab can be built
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_run_removes_its_namespaces(signum):
    # SIGINT at its default in the holder, whatever this process ignores (a child inherits an ignored
    # signal, and Python then installs no KeyboardInterrupt for it).
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_LAB],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert holder.stdout is not None
    prefix = holder.stdout.readline().strip()

    holder.send_signal(signum)
    holder.wait(120)  # its namespaces are deleted before it exits: seconds on a loaded machine

    assert holder.returncode == -signum
    assert prefix.startswith("sw")
    assert {name for name in listed_namespaces() if name.startswith(prefix)} == set()
    assert prefix not in root_links()
