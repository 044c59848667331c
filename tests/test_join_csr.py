"""An agent that serves TLS joins with a CSR: POST /api/v1/agents/register certifies its TLS key
with the swarm's CA (``marketplace/nodes/authority.py``), and the agent pins that CA
(``worker_agent.agent.control.register``).

The CA signs only a CSR of at most 4096 characters (a longer one is refused before it is parsed)
that parses, carries a valid self-signature, an EC P-256 or Ed25519 key and the subject CN=<node
id>; anything else is refused with a message saying which, and the token stays unused. A node
certified at join reports only wss:// URLs, and ``SWARM_REQUIRE_DATA_TLS`` refuses plain ones.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from ipaddress import ip_address

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import NameOID

from marketplace.nodes import authority
from marketplace.nodes.models import Node
from marketplace.placement.errors import InvalidDataUrl
from marketplace.placement.models import AssignmentState
from marketplace.placement.placing import place_model
from marketplace.placement.readiness import report_ready
from tests.factories import MODEL, db_snapshot, join_payload
from worker_agent.agent import control
from worker_agent.agent.control import JoinError, register
from worker_agent.errors import TlsError
from worker_agent.protocol import tls
from worker_agent.protocol.keys import generate_signing_key, node_id, public_key_bytes

pytestmark = [pytest.mark.trust, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures"]

REGISTER = "/api/v1/agents/register"
DATA_URL = "wss://10.0.0.7:9100"


@pytest.fixture
def swarm_ca(settings, tmp_path) -> str:
    settings.SWARM_CA_KEY_PATH, settings.SWARM_CA_CERT_PATH = tmp_path / "ca.key", tmp_path / "ca.pem"
    settings.SWARM_NODE_CERT_DAYS = 30
    settings.SWARM_REQUIRE_DATA_TLS = False
    return authority.ca_certificate()


@pytest.fixture
def pending(provider, make_node):
    """A node its owner added, waiting for its agent: (node, join token)."""
    return make_node(provider, "gpu-1")


@pytest.fixture
def agent(client_for):
    return client_for(None)


def refusal(message: str, code: str = "invalid_csr", param: str | None = "csr") -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


def csr_for(key, subject: str, algorithm=None) -> str:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = x509.CertificateSigningRequestBuilder().subject_name(name)
    return builder.sign(key, algorithm).public_bytes(tls.PEM).decode()


@pytest.mark.parametrize("key_type", ["EC P-256", "Ed25519"])
def test_a_join_with_a_csr_is_certified_for_its_node_and_host(pending, agent, swarm_ca, key_type):
    node, token = pending
    key = generate_signing_key()
    tls_key = tls.generate_key() if key_type == "EC P-256" else ed25519.Ed25519PrivateKey.generate()
    before = datetime.now(UTC)

    response = agent.post(
        REGISTER,
        join_payload(token, key, data_url=DATA_URL, csr=tls.make_csr(tls_key, node_id(public_key_bytes(key)))),
        format="json",
    )

    assert response.status_code == 201
    answer = response.json()
    assert answer["ca_certificate"] == swarm_ca
    node.refresh_from_db()
    assert answer["node_certificate"] == node.tls_certificate
    issued = tls.check_issued(answer["node_certificate"], ca=swarm_ca, node=node.node_id, key=tls_key)
    names = issued.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [f"{node.node_id}.swarm"]
    assert names.get_values_for_type(x509.IPAddress) == [ip_address("10.0.0.7")]
    assert issued.subject.rfc4514_string() == f"CN={node.node_id}"
    lifetime = issued.not_valid_after_utc - before
    assert timedelta(days=30) - timedelta(seconds=5) < lifetime <= timedelta(days=30) + timedelta(seconds=5)


def test_a_join_without_a_csr_gets_no_certificate(pending, agent, swarm_ca):
    node, token = pending

    response = agent.post(REGISTER, join_payload(token, generate_signing_key()), format="json")

    assert response.status_code == 201
    assert "ca_certificate" not in response.json()
    node.refresh_from_db()
    assert node.tls_certificate == ""


def bad_csrs(node: str) -> list[tuple[str, str, str]]:
    """(what, CSR, the refusal's message) for CSRs the CA does not sign."""
    good = csr_for(tls.generate_key(), node, hashes.SHA256())
    der = bytearray(x509.load_pem_x509_csr(good.encode()).public_bytes(serialization.Encoding.DER))
    der[-1] ^= 0x01  # the last byte of the signature
    forged = x509.load_der_x509_csr(bytes(der)).public_bytes(tls.PEM).decode()
    return [
        ("not PEM", "hello", "the CSR is not a PEM certificate signing request"),
        (
            "RSA",
            csr_for(rsa.generate_private_key(65537, 2048), node, hashes.SHA256()),
            "the CSR's key is RSA 2048-bit: EC P-256 or Ed25519 only",
        ),
        (
            "EC P-384",
            csr_for(ec.generate_private_key(ec.SECP384R1()), node, hashes.SHA256()),
            "the CSR's key is EC secp384r1: EC P-256 or Ed25519 only",
        ),
        (
            "another node",
            csr_for(tls.generate_key(), "node-" + "0" * 16, hashes.SHA256()),
            f"the CSR's subject must be CN={node} (the node of the key that joins), not 'CN=node-0000000000000000'",
        ),
        ("forged signature", forged, "the CSR's signature does not verify with its own key"),
    ]


@pytest.mark.parametrize("index", range(5), ids=["not_pem", "rsa", "p384", "another_node", "forged_signature"])
def test_a_bad_csr_is_refused_with_what_is_wrong_and_the_token_stays_unused(pending, agent, swarm_ca, index):
    _, token = pending
    key = generate_signing_key()
    _, csr, message = bad_csrs(node_id(public_key_bytes(key)))[index]
    before = db_snapshot()

    response = agent.post(REGISTER, join_payload(token, key, data_url=DATA_URL, csr=csr), format="json")

    assert response.status_code == 400
    assert response.json() == refusal(message)
    assert db_snapshot() == before


def test_an_oversized_csr_is_refused_before_it_is_parsed(pending, agent, swarm_ca, monkeypatch):
    _, token = pending
    key = generate_signing_key()
    parsed = []
    monkeypatch.setattr(x509, "load_pem_x509_csr", lambda data: parsed.append(data))
    huge = "-----BEGIN CERTIFICATE REQUEST-----\n" + "A" * 100_000 + "\n-----END CERTIFICATE REQUEST-----\n"
    before = db_snapshot()

    response = agent.post(REGISTER, join_payload(token, key, data_url=DATA_URL, csr=huge), format="json")

    assert response.status_code == 400
    assert response.json() == refusal(f"the CSR is {len(huge)} characters long; at most 4096 are read")
    assert parsed == []
    assert db_snapshot() == before


@pytest.mark.parametrize(
    ("data_url", "with_csr", "require_tls", "expected"),
    [
        (
            "ws://10.0.0.7:9100",
            True,
            False,
            refusal(
                "data_url must be a wss:// URL when a CSR is sent: the certificate serves TLS",
                code="invalid_report",
                param=None,
            ),
        ),
        (
            DATA_URL,
            False,
            False,
            refusal(
                "a wss:// data plane needs a certificate from this control plane: send a CSR "
                "(swarm-worker join --tls auto)"
            ),
        ),
        (
            "ws://10.0.0.7:9100",
            False,
            True,
            refusal("this control plane requires TLS on the data plane: send a CSR (swarm-worker join --tls auto)"),
        ),
    ],
    ids=["csr_for_plain_ws", "wss_without_csr", "tls_required"],
)
def test_a_join_whose_data_plane_and_csr_disagree_is_refused(
    pending, agent, swarm_ca, settings, data_url, with_csr, require_tls, expected
):
    _, token = pending
    settings.SWARM_REQUIRE_DATA_TLS = require_tls
    key = generate_signing_key()
    extra = {"csr": tls.make_csr(tls.generate_key(), node_id(public_key_bytes(key)))} if with_csr else {}
    before = db_snapshot()

    response = agent.post(REGISTER, join_payload(token, key, data_url=data_url, **extra), format="json")

    assert response.status_code == 400
    assert response.json() == expected
    assert db_snapshot() == before


@pytest.mark.parametrize("require_tls", [False, True])
def test_a_node_certified_at_join_or_held_to_tls_reports_no_plain_ws_url(
    provider, make_joined_node, swarm_settings, swarm_ca, require_tls
):
    joined = make_joined_node(provider, max_layers=None)
    swarm_settings.SWARM_REQUIRE_DATA_TLS = require_tls
    if not require_tls:
        Node.objects.filter(pk=joined.node.pk).update(tls_certificate="-----BEGIN CERTIFICATE-----")
    (assignment,) = place_model(MODEL)
    url = f"ws://127.0.0.1:{9100 + joined.node.pk}"

    with pytest.raises(InvalidDataUrl) as refused:
        report_ready(joined.node.pk, assignment.pk, url, seen_from="127.0.0.1")

    reason = (
        "this control plane requires TLS on the data plane (join again with swarm-worker join --tls auto)"
        if require_tls
        else "this node joined with a TLS certificate"
    )
    assert str(refused.value) == f"data URL {url!r} must use wss://: {reason}"
    assignment.refresh_from_db()
    assert (assignment.state, assignment.error) == (AssignmentState.FAILED, f"invalid_data_url: {refused.value}")


def _answer(key, tls_key, **changes) -> dict:
    """The join's answer a control plane whose CA is the test's would give."""
    node = node_id(public_key_bytes(key))
    certificate = authority.issue_node_certificate(tls.make_csr(tls_key, node), node=node, data_url=DATA_URL)
    return {
        "node": node,
        "control_url": "wss://control.test/ws/agent/",
        "heartbeat_interval_s": 5.0,
        "ticket_key": "ab" * 32,
        "ca_certificate": authority.ca_certificate(),
        "node_certificate": certificate,
        **changes,
    }


def test_the_agent_pins_the_ca_that_certified_its_key(monkeypatch, swarm_ca):
    key, tls_key = generate_signing_key(), tls.generate_key()
    answer = _answer(key, tls_key)
    sent = []
    monkeypatch.setattr(control, "_post_json", lambda url, body: sent.append(body) or answer)

    state = register(
        "https://control.test", "swj_token", key, hardware={}, compute=1.0, data_url=DATA_URL, tls_key=tls_key
    )

    assert (state.ca_certificate, state.node_certificate) == (swarm_ca, answer["node_certificate"])
    csr = x509.load_pem_x509_csr(sent[0]["csr"].encode())
    assert csr.public_key() == tls_key.public_key()
    assert csr.subject.rfc4514_string() == f"CN={state.node}"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("another key", "the node certificate is for another key than this agent's TLS key"),
        ("another CA", "the node certificate is not issued by the pinned swarm CA"),
        ("no certificate", "the node certificate is not a PEM certificate"),
    ],
)
def test_the_agent_refuses_a_join_answer_without_a_certificate_for_its_key(
    monkeypatch, swarm_ca, settings, tmp_path, change, reason
):
    key, tls_key = generate_signing_key(), tls.generate_key()
    answer = _answer(key, tls.generate_key() if change == "another key" else tls_key)
    if change == "another CA":
        settings.SWARM_CA_KEY_PATH, settings.SWARM_CA_CERT_PATH = tmp_path / "other.key", tmp_path / "other.pem"
        answer["ca_certificate"] = authority.ca_certificate()
    if change == "no certificate":
        del answer["node_certificate"]
    monkeypatch.setattr(control, "_post_json", lambda url, body: answer)

    with pytest.raises(JoinError) as failed:
        register("https://control.test", "swj_token", key, hardware={}, compute=1.0, data_url=DATA_URL, tls_key=tls_key)

    assert str(failed.value) == f"the control plane's join answer carries no usable certificate: {reason}"


def test_the_agent_refuses_a_plain_control_channel_named_over_https(monkeypatch, swarm_ca):
    key = generate_signing_key()
    answer = _answer(key, tls.generate_key(), control_url="ws://control.test/ws/agent/")
    monkeypatch.setattr(control, "_post_json", lambda url, body: answer)

    with pytest.raises(JoinError) as failed:
        register("https://control.test", "swj_token", key, hardware={}, compute=1.0, data_url="ws://a:7001")

    assert str(failed.value) == (
        "the control plane answered over HTTPS with a plain control channel 'ws://control.test/ws/agent/'"
    )


@pytest.mark.parametrize(
    ("joined_with_tls", "starts_with_tls", "reason"),
    [
        (
            True,
            False,
            "this node joined with TLS (a wss:// data plane): start it with --tls auto or the --tls-key it joined with",
        ),
        (False, True, "this node joined without TLS: rotate its join token and join again with --tls auto"),
    ],
)
def test_an_agent_restarted_otherwise_than_it_joined_says_what_to_do(
    swarm_ca, tmp_path, joined_with_tls, starts_with_tls, reason
):
    key_path = tmp_path / "node.key.tls.key"
    tls.load_or_create_key(key_path)
    certificate = "-----BEGIN CERTIFICATE-----" if joined_with_tls else ""

    with pytest.raises(TlsError) as refused:
        tls.agent_contexts(swarm_ca, certificate, key_path if starts_with_tls else None, node="node-1")

    assert (str(refused.value), refused.value.code) == (reason, "tls_usage")


def test_an_expired_node_certificate_stops_the_agent_with_what_to_do(swarm_ca, settings, tmp_path):
    key_path = tmp_path / "node.key.tls.key"
    tls_key = tls.load_or_create_key(key_path)
    certificate = authority.issue_node_certificate(tls.make_csr(tls_key, "node-1"), node="node-1", data_url=DATA_URL)
    later = datetime.now(UTC) + timedelta(days=31)

    with pytest.raises(TlsError) as refused:
        tls.check_issued(certificate, ca=swarm_ca, node="node-1", key=tls_key, now=later)

    assert refused.value.code == "tls_certificate_expired"
    assert str(refused.value).endswith("UTC, not now: rotate the node's join token and join again for a new one")


def test_a_joining_agent_certifies_the_key_its_flags_name_and_refuses_a_certificate_of_its_own(tmp_path):
    node_key = tmp_path / "node.key"

    assert tls.agent_key_path(node_key, mode="off", own_key=None, own_certificate=None) is None
    assert (
        tls.agent_key_path(node_key, mode="auto", own_key=None, own_certificate=None) == tmp_path / "node.key.tls.key"
    )
    assert tls.agent_key_path(node_key, mode="off", own_key="/etc/mine.pem", own_certificate=None).as_posix() == (
        "/etc/mine.pem"
    )
    with pytest.raises(TlsError) as refused:
        tls.agent_key_path(node_key, mode="off", own_key="/etc/mine.pem", own_certificate="/etc/mine.crt")
    assert str(refused.value) == (
        "a joined agent serves the certificate the control plane issues (its peers trust the swarm's CA only): "
        "give --tls-key alone for a key of your own, or --tls auto"
    )
