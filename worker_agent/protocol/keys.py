"""Ed25519 node and issuer keys on disk.

A private key file holds the 32-byte seed as 64 hex characters and a newline, mode 0600; next
to it, ``<path>.pub`` holds the 32-byte public key the same way, mode 0644::

    from worker_agent.protocol.keys import generate_signing_key, write_key, load_signing_key
    write_key("node.key", generate_signing_key())      # node.key + node.key.pub
    key = load_signing_key("node.key")

A node is named after its public key (``node_id``), so a name cannot be claimed without the key.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from nacl.signing import SigningKey

from worker_agent.errors import SwarmError

_KEY_BYTES = 32
_HEX_CHARS = 2 * _KEY_BYTES


class KeyFileError(SwarmError, ValueError):
    """A key file is missing or does not hold a key; the message names the path."""

    code = "key_file"


def generate_signing_key() -> SigningKey:
    return SigningKey.generate()


def public_key_bytes(key: SigningKey) -> bytes:
    """The 32 raw bytes of ``key``'s ed25519 public key."""
    return bytes(key.verify_key)


def node_id(public_key: bytes) -> str:
    """A node's stable name, derived from its public key: ``node-`` + 16 hex chars of sha256."""
    if not isinstance(public_key, bytes) or len(public_key) != _KEY_BYTES:
        raise KeyFileError(f"a public key is {_KEY_BYTES} bytes, got {public_key!r}")
    return "node-" + hashlib.sha256(public_key).hexdigest()[:16]


def _pub_path(path: Path) -> Path:
    return path.with_name(path.name + ".pub")


def _write_text(path: Path, text: str, mode: int, force: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    fd = os.open(path, flags, mode)
    try:
        # The umask may have narrowed or, with force, an older file may have widened the mode.
        os.fchmod(fd, mode)
        os.write(fd, text.encode("ascii"))
    finally:
        os.close(fd)


def write_key(path: str | Path, key: SigningKey, *, force: bool = False) -> Path:
    """Write ``key``'s seed to ``path`` (0600) and its public key to ``<path>.pub`` (0644).

    Without ``force`` an existing key or public key file is never overwritten: losing a node's
    key loses its identity, reputation and pending pay. Returns the private key's path.
    """
    path = Path(path)
    pub = _pub_path(path)
    if not force:
        for existing in (path, pub):
            if existing.exists():
                raise FileExistsError(
                    f"{existing} already exists; refusing to overwrite a key (pass force=True to replace it)"
                )
    # O_EXCL still guards the race between the check above and the create.
    _write_text(path, bytes(key).hex() + "\n", 0o600, force)
    _write_text(pub, public_key_bytes(key).hex() + "\n", 0o644, force)
    return path


def _parse_hex_key(text: str) -> bytes | None:
    text = text.strip()
    if len(text) != _HEX_CHARS:
        return None
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        return None
    # fromhex skips inner spaces, so 64 characters can still decode to fewer bytes.
    return raw if len(raw) == _KEY_BYTES else None


def _read_hex_file(path: Path, what: str) -> bytes:
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        raise KeyFileError(f"{what} file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"cannot read {what} file {path}: {exc}") from None
    raw = _parse_hex_key(text)
    if raw is None:
        raise KeyFileError(f"{what} file {path} does not hold {_HEX_CHARS} hex characters")
    return raw


def load_signing_key(path: str | Path) -> SigningKey:
    """Load a private key written by ``write_key``."""
    return SigningKey(_read_hex_file(Path(path), "private key"))


def load_verify_key(path_or_hex: str | Path) -> bytes:
    """Return 32 raw public key bytes from a 64-hex string, a ``.pub`` file or a private key file.

    A string of exactly 64 hex characters is taken as the key itself, never as a file name. A
    file whose name ends in ``.pub`` holds a public key; any other file is read as a private
    key and its public key derived.
    """
    if isinstance(path_or_hex, str):
        raw = _parse_hex_key(path_or_hex)
        if raw is not None:
            return raw
    path = Path(path_or_hex)
    if path.name.endswith(".pub"):
        return _read_hex_file(path, "public key")
    return public_key_bytes(load_signing_key(path))
