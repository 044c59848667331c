"""A catalog checkpoint's identity: its files, their digests, the content hash and the model ref.

The control plane's catalog names a checkpoint by a *model ref*, ``<name>@<16 hex>``: the catalog
name and the first 16 hex digits of the checkpoint's content hash. The ref, never a path, is what
placement, tickets and receipts carry, so two checkpoints with the same name but other weights
can never be mistaken for one another. The content hash is sha256 over the checkpoint's files in
the order of their names, each as ``name NUL sha256-hex LF`` (``content_hash``): an agent can
check a file manifest against it without downloading the files, then check each file it
downloads against the manifest. Only the files a checkpoint needs count (``is_checkpoint_file``:
configs, tokenizer, safetensors weights and their index), so a README or a stray log beside them
changes nothing.

Folders holding catalog checkpoints are named by their content hash (64 hex). They live in
*stores*: the agent's model cache (``$SWARM_MODEL_CACHE/catalog``), plus any folder the host
process adds (``add_store``: the control plane adds its catalog directory). ``find`` maps a ref
to its folder. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from worker_agent.errors import ModelError

NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")  # a catalog name: what customers ask for
REF = re.compile(r"(?P<name>[a-z0-9][a-z0-9._-]{0,63})@(?P<prefix>[0-9a-f]{16})")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # a checkpoint file: flat, no path parts
# The files a checkpoint needs: what transformers reads for its config and tokenizer, and the weights.
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "*.safetensors",
    "model.safetensors.index.json",
)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CHUNK_BYTES = 1 << 20

_stores: list[Path] = []  # added by the host process, searched before the model cache


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint, as a manifest lists it."""

    path: str  # the file's name inside the checkpoint folder (flat: no directories)
    sha256: str  # hex digest of its bytes
    size: int  # bytes

    def to_json(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, "size": self.size}


def is_checkpoint_file(name: str) -> bool:
    return any(fnmatch(name, pattern) for pattern in CHECKPOINT_FILES)


def model_ref(name: str, content_hash: str) -> str:
    """The ref of checkpoint ``content_hash`` registered as ``name``."""
    return f"{name}@{content_hash[:16]}"


def is_ref(model: str) -> bool:
    return REF.fullmatch(model) is not None


def ref_name(model: str) -> str:
    """The catalog name of a ref; any other model id (a registry id) is its own name."""
    match = REF.fullmatch(model)
    return match["name"] if match else model


def ref_matches(ref: str, content_hash: str) -> bool:
    """Whether ``ref`` names the checkpoint whose content hash is ``content_hash``."""
    match = REF.fullmatch(ref)
    return (
        match is not None
        and SHA256_HEX.fullmatch(content_hash) is not None
        and content_hash.startswith(match["prefix"])
    )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def content_hash(entries: Iterable[FileEntry]) -> str:
    """sha256 over each file's name and digest, in name order (see the module docstring)."""
    digest = hashlib.sha256()
    for entry in sorted(entries, key=lambda e: e.path):
        digest.update(f"{entry.path}\0{entry.sha256}\n".encode())
    return digest.hexdigest()


def checkpoint_file_names(folder: Path) -> list[str]:
    """The checkpoint files directly in ``folder``, by name."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and is_checkpoint_file(p.name))


def manifest_entries(folder: Path) -> list[FileEntry]:
    """Each checkpoint file of ``folder`` with its digest and size (reads every byte once)."""
    return [
        FileEntry(name, file_sha256(folder / name), (folder / name).stat().st_size)
        for name in checkpoint_file_names(folder)
    ]


def parse_manifest(files: object, limit: int = 10_000) -> list[FileEntry]:
    """A manifest's ``files`` list, checked entry by entry; ModelError (``bad_manifest``) names the
    first bad one. Names must be flat checkpoint file names: a manifest cannot make its reader
    write outside the checkpoint's folder."""
    if not isinstance(files, list) or not 0 < len(files) <= limit:
        raise ModelError(f"a checkpoint manifest lists 1 to {limit} files, got {str(files)[:80]}", code="bad_manifest")
    entries, seen = [], set()
    for item in files:
        if not isinstance(item, dict):
            raise ModelError(f"a manifest entry must be an object, got {str(item)[:80]}", code="bad_manifest")
        path, sha256, size = item.get("path"), item.get("sha256"), item.get("size")
        if not (isinstance(path, str) and FILE_NAME.fullmatch(path) and is_checkpoint_file(path)) or path in seen:
            raise ModelError(f"a manifest names a bad or repeated file {str(path)[:80]!r}", code="bad_manifest")
        if not (isinstance(sha256, str) and SHA256_HEX.fullmatch(sha256)):
            raise ModelError(f"the manifest's sha256 of {path} is not 64 hex digits", code="bad_manifest")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ModelError(f"the manifest's size of {path} is not a byte count", code="bad_manifest")
        seen.add(path)
        entries.append(FileEntry(path, sha256, size))
    return entries


def shards_for_layers(weight_map: dict[str, str], layer_start: int, layer_end: int) -> list[str]:
    """The safetensors files of a sharded checkpoint (its index's ``weight_map``) that hold any
    tensor of decoder layers ``[layer_start, layer_end)``."""
    wanted = tuple(f"model.layers.{index}." for index in range(layer_start, layer_end))
    return sorted({file for key, file in weight_map.items() if key.startswith(wanted)})


def cache_root() -> Path:
    """The agent's model cache (``$SWARM_MODEL_CACHE``, default ``~/.cache/swarm-marketplace/models``)."""
    return Path(os.environ.get("SWARM_MODEL_CACHE", Path.home() / ".cache" / "swarm-marketplace" / "models"))


def cache_store() -> Path:
    """Where an agent keeps the catalog checkpoints it fetched, one folder per content hash."""
    return cache_root() / "catalog"


def add_store(folder: Path) -> None:
    """Search ``folder`` for catalog checkpoints too (before the model cache); idempotent."""
    folder = Path(folder)
    if folder not in _stores:
        _stores.insert(0, folder)


def stores() -> Sequence[Path]:
    return [*_stores, cache_store()]


def find(ref: str) -> Path:
    """The folder of the checkpoint ``ref`` names, from the first store that holds it."""
    match = REF.fullmatch(ref)
    if match is None:
        raise ModelError(f"{ref!r} is not a model ref (name@16 hex digits)", code="bad_model_ref")
    for store in stores():
        found = [
            folder
            for folder in (store.glob(f"{match['prefix']}*") if store.is_dir() else [])
            if SHA256_HEX.fullmatch(folder.name) and (folder / "config.json").is_file()
        ]
        if len(found) > 1:
            raise ModelError(f"{ref} matches {len(found)} checkpoints in {store}", code="ambiguous_model_ref")
        if found:
            return found[0]
    raise ModelError(
        f"checkpoint {ref} is not here: an agent fetches it from the control plane when it is assigned a block of it",
        code="checkpoint_missing",
    )
