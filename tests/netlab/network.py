"""A small internet for tests, made of Linux network namespaces: a control plane, two data-centre
hosts and a customer on a public network, and two homes behind NAT routers.

    lab = Netlab.start()                     # or `with Netlab.start() as lab:`
    cloud, home1 = lab.hosts["cloud"], lab.hosts["home1"]
    server = cloud.popen([sys.executable, "-m", "http.server", "8000"])
    home1.run(["curl", "-s", f"http://{cloud.address}:8000/"])   # seen on cloud from router1's address
    lab.close()

Hosts (``lab.hosts``; each its own namespace, named ``<lab.prefix><role>``):

    role      address          on
    cloud     10.201.0.10      the public network 10.201.0.0/24, a bridge in namespace ``<prefix>wan``
    dc1       10.201.0.21      (public: every public host reaches every other one directly)
    dc2       10.201.0.22
    client    10.201.0.30
    router1   10.201.0.101     WAN leg; its LAN leg is 192.168.11.1/24
    router2   10.201.0.102     WAN leg; its LAN leg is 192.168.12.1/24
    home1     192.168.11.2     behind router1 (default route via 192.168.11.1)
    home2     192.168.12.2     behind router2 (default route via 192.168.12.1)

``Netlab.start(extra_hosts={"lb": "10.201.0.40", ...})`` adds more public hosts, each a role and its
address on the public network (``tests/netlab/scaleout.py`` puts a load balancer, web, coordinator,
database and agent hosts there).

A router masquerades its LAN behind its WAN address and forwards new connections only from LAN to
WAN, like a home router with no port forwarding: a home host reaches the public hosts (which see
its router's address), and nothing reaches a home host first.

PostgreSQL and Redis listen only on the root namespace's loopback (127.0.0.1:5432 and :6379), so
``cloud`` reaches them over a link of its own, the one thing this touches in the root namespace: a
veth ``<prefix>db`` whose root side holds the first address of a /30 in 10.202.0.0/16 (picked per
run, free of the root namespace's addresses, so that runs side by side do not clash) and ``cloud``'s
side (``db0``) the second, plus a ``TcpForwarder`` thread per service bound to the root side.
``lab.database_url()`` and ``lab.redis_url()`` are the URLs that work from ``cloud``; ``cloud``'s
own loopback has neither service, so its database traffic crosses a link as it would across hosts.

``close()`` kills what was started through ``Host.popen`` (by process group), stops the forwarders,
deletes the root veth and every namespace (their veths and the bridge go with them), then checks
that ``ip netns list`` and ``ip link`` hold none of its names, raising ``NetlabError`` if any is
left. It also runs at interpreter exit (Ctrl-C ends a run through ``KeyboardInterrupt``) and on
SIGTERM, so an interrupted run leaves nothing behind; only SIGKILL can.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import random
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Self

from tests.netlab.forward import TcpForwarder

# Debian keeps ip and iptables in /usr/sbin, which is not on every user's PATH.
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
IP = shutil.which("ip", path=SBIN_PATH) or "ip"  # missing_netlab_reason says when there is none
IPTABLES_BACKENDS = ("iptables", "iptables-legacy")  # nf_tables first; legacy where the kernel lacks nft NAT
COMMAND_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0  # for a process to end after SIGTERM, before SIGKILL

WAN_PREFIX_LEN = 24
WAN = ipaddress.IPv4Network("10.201.0.0/24")
PUBLIC_HOSTS = {"cloud": "10.201.0.10", "dc1": "10.201.0.21", "dc2": "10.201.0.22", "client": "10.201.0.30"}
DB_LINKS = ipaddress.IPv4Network("10.202.0.0/16")
POSTGRES_UPSTREAM = ("127.0.0.1", 5432)
REDIS_UPSTREAM = ("127.0.0.1", 6379)
BRIDGE = "br0"
UPLINK = "eth0"  # every host's leg towards its network: the WAN, or a home host's LAN
LAN_LEG = "lan0"  # a router's leg towards its home host
DB_LEG = "db0"  # cloud's leg towards the root namespace


@dataclass(frozen=True)
class Home:
    """A home host behind its own NAT router."""

    name: str
    router: str
    router_address: str  # the router's WAN address, which the home host's connections come from
    lan: ipaddress.IPv4Network  # the router holds its first address, the home host its second


HOMES = (
    Home("home1", "router1", "10.201.0.101", ipaddress.IPv4Network("192.168.11.0/24")),
    Home("home2", "router2", "10.201.0.102", ipaddress.IPv4Network("192.168.12.0/24")),
)


class NetlabError(Exception):
    """A command that builds or removes the network failed, or removal left something behind."""


class NetlabUnavailable(NetlabError):
    """This machine cannot make network namespaces (a missing capability, not a bug)."""


@dataclass(frozen=True)
class Host:
    """One namespace, seen as a machine: run programs on it, reach it at ``address``."""

    name: str  # its role: "cloud", "dc1", "home1", "router1", ...
    netns: str  # the namespace's name, for `ip netns exec`
    address: str  # its IPv4 address on its own network (for a home host, a private one)
    public_address: str  # where its connections come from on the WAN: its router's address for a home host
    _processes: list[subprocess.Popen[Any]] = field(repr=False, compare=False)

    def command(self, argv: Sequence[str]) -> list[str]:
        return [IP, "netns", "exec", self.netns, *argv]

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on this host in a process group of its own, which the lab's ``close`` kills
        if it is still running then. ``kwargs`` go to ``subprocess.Popen``."""
        process = subprocess.Popen(self.command(argv), env=env, start_new_session=True, **kwargs)
        self._processes.append(process)
        return process

    def run(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float = 30.0, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on this host to its end (or ``subprocess.TimeoutExpired``), output captured as text."""
        return subprocess.run(self.command(argv), env=env, capture_output=True, text=True, timeout=timeout_s, **kwargs)


def tool_path(name: str) -> str | None:
    return shutil.which(name, path=SBIN_PATH)


def missing_netlab_reason() -> str | None:
    """Why this machine cannot build a Netlab, or None when it has what it takes."""
    if os.geteuid() != 0:
        return f"netlab needs root (uid 0) to make network namespaces; this runs as uid {os.geteuid()}"
    if shutil.which(IP) is None:
        return "netlab needs iproute2's `ip` to make network namespaces (apt-get install iproute2)"
    if not any(tool_path(backend) for backend in IPTABLES_BACKENDS):
        return "netlab needs iptables for its NAT routers (apt-get install iptables)"
    return None


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)


def _check(argv: Sequence[str]) -> str:
    result = _run(argv)
    if result.returncode != 0:
        raise NetlabError(f"`{' '.join(argv)}` failed (exit {result.returncode}): {result.stderr.strip()}")
    return result.stdout


def _ip(*args: str, netns: str | None = None) -> str:
    return _check([IP, *(["-n", netns] if netns else []), *args])


def listed_namespaces() -> set[str]:
    """The names in `ip netns list` (whose lines read "name" or "name (id: 3)")."""
    return {line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()}


def _checked_extra_hosts(extra: Mapping[str, str]) -> dict[str, str]:
    """``extra`` if each role is a new one whose name fits an interface (it names the host's port on
    the bridge) and each address a free one of the public network; ValueError otherwise."""
    taken_roles = {*PUBLIC_HOSTS, "wan", "db"} | {name for home in HOMES for name in (home.name, home.router)}
    taken_addresses = {*PUBLIC_HOSTS.values()} | {home.router_address for home in HOMES}
    for role, address in extra.items():
        if role in taken_roles or not role.isalnum() or len(role) > 15:
            raise ValueError(f"extra host {role!r}: a role must be new, alphanumeric and at most 15 characters")
        if ipaddress.IPv4Address(address) not in WAN or address in taken_addresses:
            raise ValueError(f"extra host {role!r}: {address} is not a free address of {WAN}")
        taken_roles.add(role)
        taken_addresses.add(address)
    return dict(extra)


def _free_db_link() -> ipaddress.IPv4Network:
    """A /30 in DB_LINKS that overlaps no address of the root namespace."""
    taken = [
        ipaddress.IPv4Interface(fields[3]).network
        for fields in (line.split() for line in _ip("-4", "-o", "addr", "show").splitlines())
    ]
    candidates = list(DB_LINKS.subnets(new_prefix=30))
    random.shuffle(candidates)
    for subnet in candidates:
        if not any(subnet.overlaps(network) for network in taken):
            return subnet
    raise NetlabError(f"every /30 of {DB_LINKS} is taken in the root namespace")


class Netlab:
    """The network described at the top of this module; build it with ``Netlab.start()``."""

    def __init__(self, extra_hosts: Mapping[str, str] | None = None) -> None:
        self.prefix = f"sw{secrets.token_hex(3)}-"  # 9 chars: `<prefix>db`, its root-namespace veth, fits in 15
        self.public_hosts = {**PUBLIC_HOSTS, **_checked_extra_hosts(extra_hosts or {})}
        self.hosts: dict[str, Host] = {}
        self.namespaces: list[str] = []  # every namespace made so far, in order
        self.root_link: str | None = None  # the root side of cloud's database link, once made
        self._forwarders: dict[tuple[str, int], TcpForwarder] = {}
        self._processes: list[subprocess.Popen[Any]] = []
        self._iptables: str | None = None
        self._closed = False

    @classmethod
    def start(cls, extra_hosts: Mapping[str, str] | None = None) -> Netlab:
        """Build the whole network, with ``extra_hosts`` (role -> address on the public network) beside
        the hosts above; on any failure remove what was made and raise."""
        lab = cls(extra_hosts)
        _watch(lab)
        try:
            lab._build()
        except BaseException:
            lab.close()
            raise
        return lab

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def database_url(self, name: str = "postgres") -> str:
        """PostgreSQL's URL as ``cloud`` reaches it (user postgres, database ``name``)."""
        host, port = self._service_address(POSTGRES_UPSTREAM)
        return f"postgres://postgres@{host}:{port}/{name}"

    def redis_url(self, db: int = 0) -> str:
        """Redis's URL as ``cloud`` reaches it (database number ``db``)."""
        host, port = self._service_address(REDIS_UPSTREAM)
        return f"redis://{host}:{port}/{db}"

    def _service_address(self, upstream: tuple[str, int]) -> tuple[str, int]:
        forwarder = self._forwarders[upstream]
        return forwarder.listen_host, forwarder.port

    def _build(self) -> None:
        wan = self._add_namespace("wan")
        _ip("link", "add", BRIDGE, "type", "bridge", netns=wan)
        _ip("link", "set", BRIDGE, "up", netns=wan)
        for role, address in self.public_hosts.items():
            netns = self._add_namespace(role)
            self._plug_into_wan(role, netns, address)
            self.hosts[role] = Host(role, netns, address, address, self._processes)
        for home in HOMES:
            self._add_home(home)
        self._link_cloud_to_root()

    def _add_namespace(self, role: str) -> str:
        netns = self.prefix + role
        result = _run([IP, "netns", "add", netns])
        if result.returncode != 0:
            if not self.namespaces and "not permitted" in result.stderr:
                raise NetlabUnavailable(f"netlab cannot make network namespaces here: {result.stderr.strip()}")
            raise NetlabError(f"`ip netns add {netns}` failed (exit {result.returncode}): {result.stderr.strip()}")
        self.namespaces.append(netns)
        _ip("link", "set", "lo", "up", netns=netns)
        return netns

    def _plug_into_wan(self, role: str, netns: str, address: str) -> None:
        """A veth from the WAN bridge (its port named for the role) to ``netns``'s uplink at ``address``."""
        wan = self.prefix + "wan"
        _ip("link", "add", role, "type", "veth", "peer", "name", UPLINK, "netns", netns, netns=wan)
        _ip("link", "set", role, "master", BRIDGE, "up", netns=wan)
        _ip("addr", "add", f"{address}/{WAN_PREFIX_LEN}", "dev", UPLINK, netns=netns)
        _ip("link", "set", UPLINK, "up", netns=netns)

    def _add_home(self, home: Home) -> None:
        router = self._add_namespace(home.router)
        self._plug_into_wan(home.router, router, home.router_address)
        gateway, address = (str(a) for a in list(home.lan.hosts())[:2])
        netns = self._add_namespace(home.name)
        _ip("link", "add", LAN_LEG, "type", "veth", "peer", "name", UPLINK, "netns", netns, netns=router)
        _ip("addr", "add", f"{gateway}/{home.lan.prefixlen}", "dev", LAN_LEG, netns=router)
        _ip("link", "set", LAN_LEG, "up", netns=router)
        _ip("addr", "add", f"{address}/{home.lan.prefixlen}", "dev", UPLINK, netns=netns)
        _ip("link", "set", UPLINK, "up", netns=netns)
        _ip("route", "add", "default", "via", gateway, netns=netns)
        self._make_nat_router(router)
        self.hosts[home.router] = Host(home.router, router, home.router_address, home.router_address, self._processes)
        self.hosts[home.name] = Host(home.name, netns, address, home.router_address, self._processes)

    def _make_nat_router(self, netns: str) -> None:
        # A new namespace starts with forwarding off, whatever the root namespace has.
        _check([IP, "netns", "exec", netns, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])
        masquerade = ["-t", "nat", "-A", "POSTROUTING", "-o", UPLINK, "-j", "MASQUERADE"]
        if self._iptables is None:
            self._iptables = self._iptables_backend(netns, masquerade)
        else:
            self._iptables_in(netns, masquerade)
        self._iptables_in(netns, ["-P", "FORWARD", "DROP"])
        self._iptables_in(
            netns, ["-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
        )
        self._iptables_in(netns, ["-A", "FORWARD", "-i", LAN_LEG, "-o", UPLINK, "-j", "ACCEPT"])

    def _iptables_backend(self, netns: str, masquerade: list[str]) -> str:
        """The first iptables that installs the masquerade rule in ``netns`` (which it then holds)."""
        failures = []
        for backend in IPTABLES_BACKENDS:
            path = tool_path(backend)
            if path is None:
                continue
            # -w: wait for the xtables lock, which every namespace shares, rather than fail on it.
            result = _run([IP, "netns", "exec", netns, path, "-w", "5", *masquerade])
            if result.returncode == 0:
                return path
            failures.append(f"{backend}: {result.stderr.strip()}")
        raise NetlabError(f"no iptables can masquerade in a namespace here: {'; '.join(failures)}")

    def _iptables_in(self, netns: str, rule: list[str]) -> None:
        assert self._iptables is not None  # chosen by the first router's masquerade rule
        _check([IP, "netns", "exec", netns, self._iptables, "-w", "5", *rule])

    def _link_cloud_to_root(self) -> None:
        cloud = self.hosts["cloud"].netns
        root_address, cloud_address = (str(a) for a in _free_db_link().hosts())
        link = self.prefix + "db"
        _ip("link", "add", link, "type", "veth", "peer", "name", DB_LEG, "netns", cloud)
        self.root_link = link
        _ip("addr", "add", f"{root_address}/30", "dev", link)
        _ip("link", "set", link, "up")
        _ip("addr", "add", f"{cloud_address}/30", "dev", DB_LEG, netns=cloud)
        _ip("link", "set", DB_LEG, "up", netns=cloud)
        for upstream in (POSTGRES_UPSTREAM, REDIS_UPSTREAM):
            forwarder = TcpForwarder(root_address, upstream, name=f"{self.prefix}forward-{upstream[1]}")
            self._forwarders[upstream] = forwarder
            forwarder.start()

    def close(self) -> None:
        """Remove everything this lab made; idempotent. Raises NetlabError if something is left."""
        if self._closed:
            return
        self._closed = True
        _unwatch(self)
        self._stop_processes()
        for forwarder in self._forwarders.values():
            forwarder.close()
        failures = []
        if self.root_link is not None:
            result = _run([IP, "link", "del", self.root_link])
            if result.returncode != 0 and "Cannot find device" not in result.stderr:
                failures.append(result.stderr.strip())
        for netns in reversed(self.namespaces):
            result = _run([IP, "netns", "del", netns])
            if result.returncode != 0:
                failures.append(result.stderr.strip())
        left = sorted(listed_namespaces() & set(self.namespaces))
        links = [line for line in _ip("-o", "link", "show").splitlines() if self.prefix in line]
        if failures or left or links:
            raise NetlabError(f"netlab {self.prefix} left namespaces {left}, links {links}; errors: {failures}")

    def _stop_processes(self) -> None:
        """SIGTERM the process group of each process started on a host that still runs, SIGKILL the
        groups that outlive STOP_TIMEOUT_S. A group is signalled only while its leader is unreaped,
        so its id cannot have passed to anything else."""
        running = [process for process in self._processes if process.poll() is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in running:
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


# The labs still open in this process, for SIGTERM to close; the handler is ours only while one is.
_open_labs: set[Netlab] = set()
_sigterm_before: Any = None  # the handler ours replaced (None: not set from Python, so the default)
_sigterm_ours = False


def _watch(lab: Netlab) -> None:
    global _sigterm_before, _sigterm_ours
    atexit.register(lab.close)
    # Signal handlers can only be set on the main thread; other threads rely on atexit alone.
    if not _sigterm_ours and threading.current_thread() is threading.main_thread():
        _sigterm_before = signal.signal(signal.SIGTERM, _close_then_resignal)
        _sigterm_ours = True
    _open_labs.add(lab)


def _unwatch(lab: Netlab) -> None:
    global _sigterm_ours
    atexit.unregister(lab.close)
    _open_labs.discard(lab)
    if not _open_labs and _sigterm_ours:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if _sigterm_before is None else _sigterm_before)
        _sigterm_ours = False


def _close_then_resignal(signum: int, frame: FrameType | None) -> None:
    """Remove every open lab, then take SIGTERM as before (by default, die of it)."""
    try:
        for lab in list(_open_labs):
            lab.close()
    finally:
        os.kill(os.getpid(), signum)
