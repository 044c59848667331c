"""TLS on the data plane, pinned to the swarm's own certificate authority.

The control plane is the certificate authority of its swarm (``marketplace/nodes/authority.py``).
An agent that serves TLS sends a certificate signing request (CSR) for its TLS key when it joins::

    SWARM_JOIN_TOKEN=swj_... swarm-worker join --control-plane https://HOST --tls auto

The join's answer carries the CA's certificate, which the agent pins in its join state (as it pins
the ticket key), and a node certificate for its key that names ``<node id>.swarm`` (and the host
it advertises). From then on:

- a stage serves ``wss://`` with its node certificate and requires a client certificate from the
  swarm CA: a job's coordinator (the control plane certifies its coordinators) or its ring
  predecessor (a node). A client with none, or with one from any other CA, fails the handshake;
- whoever connects to a stage (a coordinator, a ring predecessor, an agent measuring its link)
  trusts the swarm CA only, never the system's store, and checks that the certificate names the
  node the control plane routed it to (``server_hostname`` = ``<node>.swarm``, ``connect_options``):
  a man in the middle holding any other certificate, another node's included, is refused in the
  handshake, before a ticket or any data is sent.

Keys are EC P-256 (``--tls auto`` makes one) or Ed25519; certificates and keys travel as PEM text.
``ssl`` loads a certificate chain only from files, so an ``Identity`` is written to a private
temporary folder for as long as loading it takes.
"""

from __future__ import annotations

import datetime as dt
import os
import ssl
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes
from cryptography.x509.oid import NameOID

from worker_agent.errors import TlsError

TlsKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey  # the keys the swarm certifies (P-256 only)
SWARM_DOMAIN = "swarm"  # a node's certificate names <node id>.swarm: a name no public CA issues
PEM = serialization.Encoding.PEM


def node_hostname(node: str) -> str:
    """The DNS name a node's certificate carries, and the one its clients check for."""
    return f"{node}.{SWARM_DOMAIN}"


def describe_key(public_key: PublicKeyTypes) -> str:
    """A key's type as a person reads it: "EC secp256r1", "Ed25519", "RSA 2048-bit"."""
    if isinstance(public_key, ec.EllipticCurvePublicKey):
        return f"EC {public_key.curve.name}"
    if isinstance(public_key, ed25519.Ed25519PublicKey):
        return "Ed25519"
    if isinstance(public_key, rsa.RSAPublicKey):
        return f"RSA {public_key.key_size}-bit"
    return type(public_key).__name__


def supported_key(public_key: PublicKeyTypes) -> bool:
    """Whether the swarm certifies this key: EC P-256 or Ed25519."""
    if isinstance(public_key, ec.EllipticCurvePublicKey):
        return isinstance(public_key.curve, ec.SECP256R1)
    return isinstance(public_key, ed25519.Ed25519PublicKey)


def generate_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: TlsKey) -> str:
    return key.private_bytes(PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()


def load_key(path: Path) -> TlsKey:
    """An unencrypted PEM private key of a type the swarm certifies; raises TlsError naming the path."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TlsError(f"cannot read the TLS key {path}: {exc.strerror}", code="tls_key") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise TlsError(f"{path} does not hold an unencrypted PEM private key", code="tls_key") from None
    if isinstance(key, ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey) and supported_key(key.public_key()):
        return key
    raise TlsError(
        f"the TLS key {path} is {describe_key(key.public_key())}: use an EC P-256 or Ed25519 key", code="tls_key"
    )


def load_or_create_key(path: Path) -> TlsKey:
    """The TLS key at ``path``; a new EC P-256 key is made there (mode 0600) when there is none."""
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # O_EXCL: never over another key
        with os.fdopen(fd, "w") as handle:
            handle.write(key_pem(generate_key()))
    return load_key(path)


def make_csr(key: TlsKey, node: str) -> str:
    """The CSR an agent sends at join: ``key``'s public half, subject CN=<node>, signed by ``key``."""
    algorithm = None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)])
    return x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, algorithm).public_bytes(PEM).decode()


def load_certificate(pem: str, what: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem.encode("ascii"))
    except (ValueError, UnicodeEncodeError, AttributeError):
        raise TlsError(f"{what} is not a PEM certificate", code="tls_certificate") from None


def dns_names(certificate: x509.Certificate) -> list[str]:
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return names.get_values_for_type(x509.DNSName)


def check_issued(
    certificate: str, *, ca: str, node: str, key: TlsKey, now: dt.datetime | None = None
) -> x509.Certificate:
    """A node certificate, checked before the agent serves with it: issued by the swarm CA ``ca``
    (its signature verifies with the CA's key), for ``key``, naming ``<node>.swarm``, valid now.
    Raises TlsError saying which of these fails."""
    authority = load_certificate(ca, "the swarm CA certificate")
    issued = load_certificate(certificate, "the node certificate")
    try:
        issued.verify_directly_issued_by(authority)
    except (ValueError, TypeError, InvalidSignature):
        raise TlsError("the node certificate is not issued by the pinned swarm CA", code="tls_certificate") from None
    if issued.public_key() != key.public_key():
        raise TlsError("the node certificate is for another key than this agent's TLS key", code="tls_certificate")
    if node_hostname(node) not in dns_names(issued):
        raise TlsError(f"the node certificate does not name {node_hostname(node)}", code="tls_certificate")
    now = now or dt.datetime.now(dt.UTC)
    if not issued.not_valid_before_utc <= now < issued.not_valid_after_utc:
        raise TlsError(
            f"the node certificate is valid from {issued.not_valid_before_utc:%Y-%m-%d %H:%M} to "
            f"{issued.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now: rotate the node's join token and "
            "join again for a new one",
            code="tls_certificate_expired",
        )
    return issued


@dataclass(frozen=True)
class Identity:
    """A swarm member's TLS identity: its certificate and key, and the swarm CA it trusts."""

    ca: str  # the swarm CA's certificate (PEM): the one trust anchor, pinned
    certificate: str  # this member's certificate, issued by that CA (PEM)
    key: str = field(repr=False)  # its private key (PEM, unencrypted)

    def server_context(self) -> ssl.SSLContext:
        """A stage's: serves the certificate, and a client without a swarm certificate fails the handshake."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.verify_mode = ssl.CERT_REQUIRED
        return self._load(context)

    def client_context(self) -> ssl.SSLContext:
        """A coordinator's or a ring predecessor's: presents the certificate, and checks the stage's
        against the swarm CA and the host name given as ``server_hostname`` (``connect_options``)."""
        return self._load(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))

    def _load(self, context: ssl.SSLContext) -> ssl.SSLContext:
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_verify_locations(cadata=self.ca)  # the swarm CA only: the system's store is never loaded
        with tempfile.TemporaryDirectory(prefix="swarm-tls-") as folder:  # mode 0700
            certificate, key = Path(folder) / "certificate.pem", Path(folder) / "key.pem"
            certificate.write_text(self.certificate)
            key.touch(mode=0o600)
            key.write_text(self.key)
            try:
                context.load_cert_chain(certificate, key)
            except ssl.SSLError as exc:
                raise TlsError(f"the TLS certificate does not go with its key: {exc}", code="tls_key") from None
        return context


def node_identity(ca: str, certificate: str, key_path: Path, *, node: str) -> Identity:
    """A joined agent's identity: the CA it pinned at join, its node certificate and its TLS key, checked."""
    key = load_key(key_path)
    check_issued(certificate, ca=ca, node=node, key=key)
    return Identity(ca, certificate, key_pem(key))


def connect_options(url: str, node: str | None, context: ssl.SSLContext | None) -> dict:
    """The keywords for websockets' ``connect`` to the stage of ``node`` at ``url``: with the swarm's
    client ``context``, a ``wss://`` stage must show a certificate naming that node. None for a
    ``ws://`` URL or without a context (a ``wss://`` URL is then checked against the system's store
    and its own host). Raises TlsError when the node is not known: no certificate could be checked."""
    if context is None or not url.lower().startswith("wss://"):
        return {}
    if not node:
        raise TlsError(f"no node id to check the certificate of {url} against", code="tls_identity_unknown")
    return {"ssl": context, "server_hostname": node_hostname(node)}


def agent_key_path(node_key: Path, *, mode: str, own_key: str | None, own_certificate: str | None) -> Path | None:
    """The key a joining agent's data-plane certificate is for: ``--tls-key`` (``own_key``), or with
    ``--tls auto`` one made next to the node key; None without TLS."""
    if own_certificate:
        raise TlsError(
            "a joined agent serves the certificate the control plane issues (its peers trust the swarm's CA "
            "only): give --tls-key alone for a key of your own, or --tls auto",
            code="tls_usage",
        )
    if own_key:
        return Path(own_key)
    return node_key.with_name(node_key.name + ".tls.key") if mode == "auto" else None


def agent_contexts(
    ca: str, certificate: str, key_path: Path | None, *, node: str
) -> tuple[ssl.SSLContext, ssl.SSLContext] | tuple[None, None]:
    """A joined agent's data-plane (server, client) contexts from what it pinned at join, its TLS
    key at ``key_path``; (None, None) without TLS. A start that does not match how the node joined
    raises TlsError saying what to do."""
    if key_path is None and certificate:
        raise TlsError(
            "this node joined with TLS (a wss:// data plane): start it with --tls auto or the --tls-key it joined with",
            code="tls_usage",
        )
    if key_path is None:
        return None, None
    if not certificate:
        raise TlsError(
            "this node joined without TLS: rotate its join token and join again with --tls auto", code="tls_usage"
        )
    identity = node_identity(ca, certificate, key_path, node=node)
    return identity.server_context(), identity.client_context()
