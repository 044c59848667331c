"""The swarm's certificate authority: the control plane certifies its nodes and its coordinators
for the data plane's TLS (``worker_agent/protocol/tls.py`` says what each side then checks).

An EC P-256 key and a self-signed CA certificate, created on first use (``SWARM_CA_KEY_PATH``,
``SWARM_CA_CERT_PATH``, next to the ticket-signing key). The key never reaches an agent: the
control plane's own processes sign with it, its coordinator workers included (as they sign tickets).

- A node: an agent that serves TLS sends a certificate signing request with its join
  (``issue_node_certificate``). The CSR is read only if it is at most ``MAX_CSR_CHARS`` long, must
  parse, carry a valid self-signature, an EC P-256 or Ed25519 key and the subject CN=<node id>;
  anything else is refused with ``InvalidCsr`` saying which. The certificate names
  ``<node id>.swarm`` (what clients check) and the host of the node's data-plane URL (an IP address
  or a DNS name; another host is left out), for serving and for connecting to its ring successor,
  valid ``SWARM_NODE_CERT_DAYS`` days; a join issues a new one.
- A coordinator: each process that runs coordinators (the web process in the embedded default, a
  Celery worker in production) makes a key of its own and has the CA certify it as
  ``coordinator.swarm`` for ``COORDINATOR_VALIDITY``, renewed before it expires (``coordinator_tls``).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import re
import secrets
import ssl
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from django.conf import settings

from marketplace.nodes.errors import InvalidCsr
from worker_agent.protocol.tls import PEM, Identity, describe_key, generate_key, key_pem, node_hostname, supported_key

MAX_CSR_CHARS = 4096  # a P-256 or Ed25519 CSR in PEM is under 600 characters
CA_VALIDITY = timedelta(days=3650)
CLOCK_SKEW = timedelta(minutes=5)  # a certificate is valid from this long before it is issued
COORDINATOR_VALIDITY = timedelta(days=1)
COORDINATOR_RENEWAL = timedelta(hours=1)  # a coordinator certificate is replaced this long before it expires
COORDINATOR_NAME = "coordinator"  # named coordinator.swarm: no node id ("node-...") is this
_DNS_NAME = re.compile(r"(?=.{1,253}$)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")


@dataclass(frozen=True)
class Authority:
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate

    @property
    def pem(self) -> str:
        return self.certificate.public_bytes(PEM).decode()

    def sign(
        self,
        public_key: CertificatePublicKeyTypes,
        subject: str,
        names: list[x509.GeneralName],
        *,
        usage: list[x509.ObjectIdentifier],
        lifetime: timedelta,
    ) -> x509.Certificate:
        """A leaf certificate for ``public_key``: CN=``subject``, these alternative names and
        extended key usages, valid for ``lifetime`` from now (less the clock skew)."""
        now = datetime.now(UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(self.certificate.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + lifetime)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )


def _create(key_path: Path, cert_path: Path) -> None:
    """A new CA key (mode 0600, never over another) and its self-signed certificate."""
    if not key_path.exists():
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(key_pem(generate_key()))
    if cert_path.exists():
        return
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise RuntimeError(f"the swarm CA key {key_path} is not an EC key")
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "swarm marketplace"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"swarm CA {secrets.token_hex(4)}"),
        ]
    )
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path.write_bytes(certificate.public_bytes(PEM))


@cache
def _authority(key_path: Path, cert_path: Path) -> Authority:
    key_path.parent.mkdir(parents=True, exist_ok=True)
    cert_path.parent.mkdir(parents=True, exist_ok=True)
    with open(key_path.parent / ".ca.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several web and worker processes may start at once
        _create(key_path, cert_path)
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    certificate = x509.load_pem_x509_certificate(cert_path.read_bytes())
    if not isinstance(key, ec.EllipticCurvePrivateKey) or certificate.public_key() != key.public_key():
        raise RuntimeError(f"the swarm CA certificate {cert_path} is not for the key {key_path}")
    return Authority(key, certificate)


def authority() -> Authority:
    """The swarm's CA, created on first use."""
    return _authority(settings.SWARM_CA_KEY_PATH, settings.SWARM_CA_CERT_PATH)


def ca_certificate() -> str:
    """The CA's certificate (PEM): what an agent pins at join."""
    return authority().pem


def read_csr(pem: str, *, node: str) -> x509.CertificateSigningRequest:
    """A join's CSR for ``node``, or ``InvalidCsr`` saying what is wrong with it (fails closed)."""
    if not isinstance(pem, str) or not pem.strip():
        raise InvalidCsr("csr must be a PEM certificate signing request", param="csr")
    if len(pem) > MAX_CSR_CHARS:
        raise InvalidCsr(f"the CSR is {len(pem)} characters long; at most {MAX_CSR_CHARS} are read", param="csr")
    try:
        csr = x509.load_pem_x509_csr(pem.encode("ascii"))
    except (ValueError, UnicodeEncodeError):
        raise InvalidCsr("the CSR is not a PEM certificate signing request", param="csr") from None
    try:
        public_key = csr.public_key()
    except ValueError:
        raise InvalidCsr("the CSR's key cannot be read", param="csr") from None
    if not supported_key(public_key):
        raise InvalidCsr(f"the CSR's key is {describe_key(public_key)}: EC P-256 or Ed25519 only", param="csr")
    if not csr.is_signature_valid:
        raise InvalidCsr("the CSR's signature does not verify with its own key", param="csr")
    subject = csr.subject.rfc4514_string()
    if subject != f"CN={node}":
        raise InvalidCsr(f"the CSR's subject must be CN={node} (the node of the key that joins), not {subject!r}",
                         param="csr")  # fmt: skip
    return csr


def _host_name(data_url: str) -> list[x509.GeneralName]:
    """The host of a data-plane URL as an alternative name, if it can be one."""
    host = (urlsplit(data_url).hostname or "").lower()
    try:
        return [x509.IPAddress(ipaddress.ip_address(host))]
    except ValueError:
        return [x509.DNSName(host)] if _DNS_NAME.fullmatch(host) else []


def issue_node_certificate(csr_pem: str, *, node: str, data_url: str) -> str:
    """The node certificate (PEM) for a join's CSR: names ``<node>.swarm`` and the data URL's host,
    for serving and for connecting to a ring successor. Raises ``InvalidCsr``."""
    csr = read_csr(csr_pem, node=node)
    names: list[x509.GeneralName] = [x509.DNSName(node_hostname(node)), *_host_name(data_url)]
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    lifetime = timedelta(days=settings.SWARM_NODE_CERT_DAYS)
    certificate = authority().sign(csr.public_key(), node, names, usage=usage, lifetime=lifetime)
    return certificate.public_bytes(PEM).decode()


def coordinator_identity() -> Identity:
    """A fresh coordinator identity: a new key, certified as ``coordinator.swarm`` for clients only."""
    ca = authority()
    key = generate_key()
    certificate = ca.sign(
        key.public_key(),
        COORDINATOR_NAME,
        [x509.DNSName(node_hostname(COORDINATOR_NAME))],
        usage=[ExtendedKeyUsageOID.CLIENT_AUTH],
        lifetime=COORDINATOR_VALIDITY,
    )
    return Identity(ca.pem, certificate.public_bytes(PEM).decode(), key_pem(key))


_coordinator_lock = threading.Lock()  # a coordinator worker's threads share one context
_coordinator_contexts: dict[tuple[Path, Path], tuple[datetime, ssl.SSLContext]] = {}  # CA -> (renew at, context)


def held_coordinator_tls() -> ssl.SSLContext | None:
    """``coordinator_tls``'s context while it holds one that is still good, without making one (no
    file or key work): an event loop asks this first and goes to a thread only when it is None."""
    with _coordinator_lock:
        held = _coordinator_contexts.get((settings.SWARM_CA_KEY_PATH, settings.SWARM_CA_CERT_PATH))
    return held[1] if held is not None and datetime.now(UTC) < held[0] else None


def coordinator_tls() -> ssl.SSLContext:
    """The client context this process's coordinators (jobs' and challenges') connect to stages
    with: its coordinator certificate, and the swarm CA as the only anchor; renewed before it expires."""
    where = (settings.SWARM_CA_KEY_PATH, settings.SWARM_CA_CERT_PATH)
    now = datetime.now(UTC)
    with _coordinator_lock:
        held = _coordinator_contexts.get(where)
        if held is None or now >= held[0]:
            held = (now + COORDINATOR_VALIDITY - COORDINATOR_RENEWAL, coordinator_identity().client_context())
            _coordinator_contexts[where] = held
    return held[1]
