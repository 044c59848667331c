"""The data plane over TLS: stages served with a certificate (``--tls-cert``/``--tls-key``) speak
``wss://`` to their coordinator and to their ring successor, and the output is the plain run's; a
coordinator that does not trust the certificate cannot connect.

Two tiny-llama stages (0:3 | 3:6) run in the test's event loop, with tickets from a local issuer;
the certificate is a self-signed one for 127.0.0.1 made with ``openssl``, trusted through
``SSL_CERT_FILE`` (the system's CA store otherwise)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nacl.signing import SigningKey

from worker_agent import model as models
from worker_agent.block import Block
from worker_agent.coordinator.job import Coordinator
from worker_agent.coordinator.pipeline import StageSpec
from worker_agent.errors import StageError
from worker_agent.protocol.keys import generate_signing_key, public_key_bytes
from worker_agent.protocol.tickets import issue_ticket
from worker_agent.server import StageServer
from worker_agent.stage import Stage

pytestmark = pytest.mark.dataplane

MODEL = "tiny-llama"
SPANS = ((0, 3), (3, 6))
PROMPT = "Over TLS the ring"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make the test certificate (Debian: apt-get install openssl)")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    self_signed(cert, key, "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1")
    return cert, key


def self_signed(cert: Path, key: Path, subject: str, *extra: str) -> None:
    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    files = ("-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", subject)
    subprocess.run(["openssl", "req", "-x509", *curve, *files, *extra], check=True, capture_output=True)


@contextlib.asynccontextmanager
async def stages(issuer: SigningKey, tls: ssl.SSLContext | None) -> AsyncIterator[list[tuple[str, Stage]]]:
    tasks, served = [], []
    for start, end in SPANS:
        stage = Stage(
            Block(models.load_block(MODEL, start, end)),
            model=MODEL,
            signing_key=generate_signing_key(),
            trusted_keys=[public_key_bytes(issuer)],
        )
        bound = asyncio.get_running_loop().create_future()
        tasks.append(asyncio.create_task(StageServer(stage).serve("127.0.0.1", 0, ready=bound.set_result, tls=tls)))
        port = await asyncio.wait_for(bound, 30)
        served.append((f"{'wss' if tls else 'ws'}://127.0.0.1:{port}", stage))
    try:
        yield served
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def generate(issuer: SigningKey, served: list[tuple[str, Stage]], job: str) -> list[int]:
    key = SigningKey.generate()
    specs = [
        StageSpec(
            url,
            issue_ticket(
                issuer,
                job=job,
                node=stage.node,
                model=MODEL,
                layer_start=stage.layer_start,
                layer_end=stage.layer_end,
                coordinator_key=bytes(key.verify_key),
            ),
        )
        for url, stage in served
    ]
    async with Coordinator(MODEL, specs, job=job, topology="ring", coordinator_key=key) as coordinator:
        result = await coordinator.generate(coordinator.request(PROMPT, max_tokens=MAX_TOKENS))
    assert result.verification is not None
    return result.token_ids


def server_context(certificate: tuple[Path, Path]) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certificate)
    return context


def test_a_ring_served_over_tls_gives_the_plain_runs_output(certificate, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))  # the coordinator and the ring peer trust it
    issuer = generate_signing_key()

    async def scenario():
        async with stages(issuer, None) as plain:
            reference = await generate(issuer, plain, "job-plain")
        async with stages(issuer, server_context(certificate)) as secure:
            assert all(url.startswith("wss://") for url, _ in secure)
            return reference, await generate(issuer, secure, "job-tls")

    reference, over_tls = asyncio.run(scenario())
    assert len(reference) == MAX_TOKENS
    assert over_tls == reference


def test_a_coordinator_that_does_not_trust_the_certificate_cannot_connect(certificate, monkeypatch, tmp_path):
    other = tmp_path / "other-ca.pem"  # a store that holds no certificate of these stages
    self_signed(other, tmp_path / "other.key", "/CN=other")
    monkeypatch.setenv("SSL_CERT_FILE", str(other))
    issuer = generate_signing_key()

    async def scenario():
        async with stages(issuer, server_context(certificate)) as secure:
            await generate(issuer, secure, "job-untrusted")

    with pytest.raises(StageError) as refused:
        asyncio.run(scenario())
    assert refused.value.code == "stage_unreachable"
    assert "CERTIFICATE_VERIFY_FAILED" in str(refused.value)
