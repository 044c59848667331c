"""The data plane over TLS pinned to the swarm's certificate authority (``worker_agent/protocol/tls.py``,
``marketplace/nodes/authority.py``).

Tiny-llama stages (0:3 | 3:6) in the test's event loop serve ``wss://`` with node certificates the
control plane's CA issued from their CSRs, require a client certificate from that CA, and reach
their ring successor with their own; the coordinator connects with the control plane's coordinator
certificate and checks that each stage's names the node it was routed to. In these tests the
system's CA store (``SSL_CERT_FILE``) is empty, or holds only an impostor's CA: nothing rests on it.

- over pinned TLS a ring gives the plain run's output;
- a coordinator presenting a certificate from another CA, or none, is refused in the handshake:
  the stage never handles the connection;
- a man in the middle that ends TLS with a certificate of its own (from a public-looking CA that
  the system's store trusts, naming the node; or another node's valid swarm certificate) is refused
  by the coordinator, and reads nothing, the ticket included; the same relay holding the node's own
  certificate does read the ticket (so it is the check that stops it);
- agents joined to a live control plane with ``swarm-worker join --tls auto`` pin its CA and
  serve an API request over ``wss://``, with the plain run's output.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from ipaddress import ip_address

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import NameOID
from nacl.signing import SigningKey
from openai import OpenAI
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

from marketplace.jobs import services as jobs_services
from marketplace.jobs.models import ApiKey, Job, JobState
from marketplace.nodes import authority
from marketplace.nodes.joining import create_node
from marketplace.nodes.tickets import issuer_key
from marketplace.placement.selectors import servable_pipelines
from tests.live import LiveServer, wait_for
from worker_agent import model as models
from worker_agent.block import Block
from worker_agent.coordinator.job import Coordinator
from worker_agent.coordinator.pipeline import Pipeline, StageSpec
from worker_agent.dev.local import join_agent, stop_processes
from worker_agent.errors import StageError
from worker_agent.protocol import tls, wire
from worker_agent.protocol.keys import generate_signing_key, public_key_bytes
from worker_agent.protocol.tickets import issue_ticket
from worker_agent.server import StageServer
from worker_agent.stage import Stage

pytestmark = pytest.mark.dataplane

MODEL = "tiny-llama"
SPANS = ((0, 3), (3, 6))
PROMPT = "Over pinned TLS the ring"
MAX_TOKENS = 8
ANOTHER_NODE = "node-" + "0" * 16


@pytest.fixture
def swarm_ca(settings, tmp_path) -> str:
    """A fresh swarm CA (its certificate, PEM)."""
    settings.SWARM_CA_KEY_PATH, settings.SWARM_CA_CERT_PATH = tmp_path / "ca.key", tmp_path / "ca.pem"
    return authority.ca_certificate()


@pytest.fixture
def no_system_anchors(tmp_path, monkeypatch) -> None:
    """The system's CA store is empty: whatever connects trusts the pinned swarm CA or nothing."""
    (tmp_path / "no-system-anchors.pem").write_text("")
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "no-system-anchors.pem"))


def certified(node: str) -> tls.Identity:
    """What a node gets at join: a TLS key of its own, certified by the swarm CA from its CSR."""
    key = tls.generate_key()
    certificate = authority.issue_node_certificate(tls.make_csr(key, node), node=node, data_url="wss://127.0.0.1:7001")
    return tls.Identity(authority.ca_certificate(), certificate, tls.key_pem(key))


@dataclass
class Served:
    url: str
    stage: Stage
    handled: list[ServerConnection] = field(default_factory=list)  # connections its server took past TLS


@contextlib.asynccontextmanager
async def stages(issuer: SigningKey, spans=SPANS, *, secure: bool = True) -> AsyncIterator[list[Served]]:
    """Stages of ``spans`` trusting ``issuer``'s tickets, over pinned TLS (``secure``) or plain ws://."""
    tasks, served = [], []
    for start, end in spans:
        stage = Stage(
            Block(models.load_block(MODEL, start, end)),
            model=MODEL,
            signing_key=generate_signing_key(),
            trusted_keys=[public_key_bytes(issuer)],
        )
        identity = certified(stage.node) if secure else None
        server = StageServer(stage, peer_tls=identity.client_context() if identity else None)
        entry = Served("", stage)
        handle = server._handle

        async def recorded(ws: ServerConnection, handle=handle, entry=entry) -> None:
            entry.handled.append(ws)
            await handle(ws)

        server._handle = recorded  # counts what gets past the handshake
        bound = asyncio.get_running_loop().create_future()
        context = identity.server_context() if identity else None
        tasks.append(asyncio.create_task(server.serve("127.0.0.1", 0, ready=bound.set_result, tls=context)))
        entry.url = f"{'wss' if secure else 'ws'}://127.0.0.1:{await asyncio.wait_for(bound, 30)}"
        served.append(entry)
    try:
        yield served
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def spec(issuer: SigningKey, served: Served, job: str, key: SigningKey, url: str | None = None) -> StageSpec:
    stage = served.stage
    ticket = issue_ticket(
        issuer,
        job=job,
        node=stage.node,
        model=MODEL,
        layer_start=stage.layer_start,
        layer_end=stage.layer_end,
        coordinator_key=bytes(key.verify_key),
    )
    return StageSpec(url or served.url, ticket, node=stage.node)


async def generate(issuer: SigningKey, served: list[Served], job: str, context: ssl.SSLContext | None) -> list[int]:
    key = SigningKey.generate()
    specs = [spec(issuer, entry, job, key) for entry in served]
    async with Coordinator(MODEL, specs, job=job, topology="ring", coordinator_key=key, tls=context) as coordinator:
        result = await coordinator.generate(coordinator.request(PROMPT, max_tokens=MAX_TOKENS))
    assert result.verification is not None
    return result.token_ids


async def hello(stage: StageSpec, job: str, key: SigningKey, context: ssl.SSLContext) -> None:
    """HELLO one stage as a job's coordinator would, then leave."""
    pipeline = Pipeline(job, [stage], topology="star", coordinator_key=key, tls=context)
    try:
        await pipeline.connect()
    finally:
        await pipeline.aclose()


def test_a_ring_over_pinned_tls_gives_the_plain_runs_output(swarm_ca, no_system_anchors):
    issuer = generate_signing_key()

    async def scenario():
        async with stages(issuer, secure=False) as plain:
            reference = await generate(issuer, plain, "job-plain", None)
        async with stages(issuer) as secure:
            over_tls = await generate(issuer, secure, "job-pinned", authority.coordinator_tls())
            return reference, over_tls, secure

    reference, over_tls, secure = asyncio.run(scenario())
    assert len(reference) == MAX_TOKENS
    assert over_tls == reference
    assert [entry.url[:6] for entry in secure] == ["wss://", "wss://"]
    # The second stage took the coordinator and its ring predecessor, each with a swarm certificate.
    assert [len(entry.handled) for entry in secure] == [1, 2]


def another_swarms_coordinator(settings, tmp_path) -> tls.Identity:
    """A coordinator identity certified by another control plane's CA."""
    ours = settings.SWARM_CA_KEY_PATH, settings.SWARM_CA_CERT_PATH
    settings.SWARM_CA_KEY_PATH, settings.SWARM_CA_CERT_PATH = tmp_path / "other.key", tmp_path / "other.pem"
    try:
        return authority.coordinator_identity()
    finally:
        settings.SWARM_CA_KEY_PATH, settings.SWARM_CA_CERT_PATH = ours


@pytest.mark.parametrize("presented", ["another CA's certificate", "no certificate"])
def test_a_coordinator_without_a_swarm_certificate_is_refused_by_the_stage(
    swarm_ca, no_system_anchors, presented, settings, tmp_path
):
    issuer = generate_signing_key()
    if presented == "no certificate":
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.load_verify_locations(cadata=swarm_ca)  # it checks the stage as it should, and shows nothing
    else:
        other = another_swarms_coordinator(settings, tmp_path)
        context = tls.Identity(swarm_ca, other.certificate, other.key).client_context()

    async def scenario():
        async with stages(issuer, SPANS[:1]) as (served,):
            key = SigningKey.generate()
            with pytest.raises(StageError) as refused:
                await hello(spec(issuer, served, "job-refused", key), "job-refused", key, context)
            return refused.value, served.handled

    error, handled = asyncio.run(scenario())
    assert error.code == "stage_unreachable"
    assert error.stage == 0
    assert handled == []  # refused in the handshake: no HELLO, no ticket ever read


class Relay:
    """A man in the middle: ends the coordinator's TLS and WebSocket with ``identity``'s
    certificate, keeps every message it reads, and relays each to the stage at ``upstream``,
    itself presenting ``client`` (a valid swarm certificate)."""

    def __init__(self, identity: tls.Identity, upstream: str, client: tls.Identity) -> None:
        self.server_context = identity.server_context()
        self.server_context.verify_mode = ssl.CERT_NONE  # it takes whoever comes
        self.upstream_context = client.client_context()
        self.upstream_context.check_hostname = False  # it does not care who the stage is
        self.upstream = upstream
        self.read: list[bytes] = []  # every message it read from the coordinator
        self.url = ""

    async def _relay(self, ws: ServerConnection) -> None:
        async with connect(self.upstream, ssl=self.upstream_context, compression=None, max_size=None) as stage:

            async def pump(source, target, keep: bool) -> None:
                async for message in source:
                    if keep:
                        self.read.append(message)
                    await target.send(message)

            pumps = {asyncio.create_task(pump(ws, stage, True)), asyncio.create_task(pump(stage, ws, False))}
            _, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Relay]:
        async with serve(self._relay, "127.0.0.1", 0, ssl=self.server_context, compression=None, max_size=None) as s:
            self.url = f"wss://127.0.0.1:{next(iter(s.sockets)).getsockname()[1]}"
            yield self


def public_looking(node: str, tmp_path) -> tls.Identity:
    """A certificate naming the node (and 127.0.0.1) from a self-signed CA dressed as a public one,
    which the system's CA store (SSL_CERT_FILE) is then made to trust."""
    ca_key, key = tls.generate_key(), tls.generate_key()
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "DigiCert Inc"),
            x509.NameAttribute(NameOID.COMMON_NAME, "DigiCert Global Root G2"),
        ]
    )
    now = datetime.now(UTC)

    def signed(subject: x509.Name, public_key, *, ca: bool, names: list[x509.GeneralName]) -> str:
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(ca_key, hashes.SHA256()).public_bytes(tls.PEM).decode()

    ca = signed(name, ca_key.public_key(), ca=True, names=[])
    (tmp_path / "public-looking-ca.pem").write_text(ca)
    leaf_names = [x509.DNSName(tls.node_hostname(node)), x509.IPAddress(ip_address("127.0.0.1"))]
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)])
    leaf = signed(subject, key.public_key(), ca=False, names=leaf_names)
    return tls.Identity(ca, leaf, tls.key_pem(key))


@pytest.mark.parametrize(
    "impostor", ["a public-looking CA's certificate naming the node", "another node's certificate"]
)
def test_a_man_in_the_middle_is_refused_by_the_coordinator_and_reads_nothing(
    swarm_ca, no_system_anchors, impostor, tmp_path, monkeypatch
):
    issuer = generate_signing_key()
    another_node = certified(ANOTHER_NODE)  # a valid swarm certificate, the relay's way into the stage

    async def scenario():
        async with stages(issuer, SPANS[:1]) as (served,):
            if impostor == "another node's certificate":
                shown = another_node
            else:
                shown = public_looking(served.stage.node, tmp_path)
                monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "public-looking-ca.pem"))
            async with Relay(shown, served.url, another_node).running() as relay:
                key = SigningKey.generate()
                with pytest.raises(StageError) as refused:
                    stage = spec(issuer, served, "job-mitm", key, url=relay.url)
                    await hello(stage, "job-mitm", key, authority.coordinator_tls())
            return refused.value, relay.read, served.handled

    error, read, handled = asyncio.run(scenario())
    assert error.code == "stage_unreachable"
    assert "CERTIFICATE_VERIFY_FAILED" in str(error)
    assert read == []  # not one message: the HELLO and its ticket never left the coordinator
    assert handled == []


def test_the_same_relay_holding_the_nodes_own_certificate_reads_the_ticket(swarm_ca, no_system_anchors):
    issuer = generate_signing_key()
    another_node = certified(ANOTHER_NODE)

    async def scenario():
        async with stages(issuer, SPANS[:1]) as (served,):
            stolen = certified(served.stage.node)  # as if the node's key had leaked: the check cannot tell
            async with Relay(stolen, served.url, another_node).running() as relay:
                key = SigningKey.generate()
                stage = spec(issuer, served, "job-relayed", key, url=relay.url)
                await hello(stage, "job-relayed", key, authority.coordinator_tls())
            return stage.ticket, relay.read

    ticket, read = asyncio.run(scenario())
    first = wire.decode(read[0], max_frame=wire.MAX_HELLO_FRAME).message
    assert isinstance(first, wire.Hello)
    assert first.ticket == ticket


@pytest.mark.django_db(transaction=True)
def test_agents_joined_with_tls_auto_serve_an_api_request_over_pinned_wss(
    swarm_ca, settings, tmp_path, django_user_model
):
    settings.SWARM_MODELS = [MODEL]
    settings.SWARM_REQUIRE_DATA_TLS = True
    settings.SWARM_COORDINATOR_LAUNCH = "inprocess"  # CI's REDIS_URL would send coordinators to Celery
    settings.SWARM_EMBEDDED_SCHEDULER = True
    settings.SWARM_HEARTBEAT_INTERVAL_S = 0.5
    settings.SWARM_HEARTBEAT_TIMEOUT_S = 30.0
    settings.SWARM_SWEEP_INTERVAL_S = 0.5
    settings.SWARM_SPARES_PER_PIPELINE = 0
    settings.SWARM_DEFAULT_PRICES = (0, 0)  # free tokens: this test is about the links, not credits
    settings.SWARM_TICKET_KEY_PATH = tmp_path / "ticket.key"
    issuer_key.cache_clear()
    provider = django_user_model.objects.create_user("alice", "alice@example.test", None, is_provider=True)
    customer = django_user_model.objects.create_user("carol", "carol@example.test", None, is_customer=True)
    api_key, key = jobs_services.create_api_key(customer, "carol's app")
    ApiKey.objects.filter(pk=api_key.pk).update(requests_per_minute=1000, tokens_per_minute=1_000_000)
    server = LiveServer().start()
    agents = []
    try:
        tokens = [create_node(owner=provider, name=f"gpu-{i}")[1] for i in range(len(SPANS))]
        agents = [
            join_agent(
                server.url,
                token,
                tmp_path / f"n{i}.key",
                tmp_path / f"agent{i}.log",
                model=MODEL,
                max_layers=3,
                extra_args=["--tls", "auto"],
            )
            for i, token in enumerate(tokens)
        ]
        (pipeline,) = wait_for(lambda: _servable(agents, tmp_path), 240, "a servable pipeline over TLS", 0.5)
        assert [(stage.layer_start, stage.layer_end) for stage in pipeline] == list(SPANS)
        assert all(stage.data_url.startswith("wss://") for stage in pipeline)

        reply = OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
    finally:
        stop_processes(agents)
        server.stop()
        issuer_key.cache_clear()
    job = Job.objects.get()
    assert (job.state, job.verified) == (JobState.SUCCEEDED, True)
    assert all(stage["url"].startswith("wss://") for stage in job.route)
    for i in range(len(SPANS)):  # each agent pinned the CA that certified it
        assert json.loads((tmp_path / f"n{i}.key.join.json").read_text())["ca_certificate"] == swarm_ca

    async def plain_run():
        issuer = generate_signing_key()
        async with stages(issuer, secure=False) as plain:
            key = SigningKey.generate()
            specs = [spec(issuer, entry, "job-plain", key) for entry in plain]
            async with Coordinator(MODEL, specs, job="job-plain", coordinator_key=key) as coordinator:
                return await coordinator.generate(coordinator.request(PROMPT, max_tokens=MAX_TOKENS))

    reference = asyncio.run(plain_run())
    assert reply.usage.completion_tokens == len(reference.token_ids) == MAX_TOKENS
    assert reply.choices[0].text == reference.text


def _servable(agents, workdir):
    dead = [i for i, agent in enumerate(agents) if agent.poll() is not None]
    if dead:
        raise AssertionError(f"agent {dead[0]} exited:\n{(workdir / f'agent{dead[0]}.log').read_text()[-3000:]}")
    return servable_pipelines(MODEL)
