"""Fetching the files of a catalog checkpoint that a block needs, checked against its content hash.

An assignment of a catalog model names its ref (``name@<16 hex>``), its content hash, and the URL
of its file manifest on the control plane (``/install/models/<ref>/manifest.json``).
``ensure_block_files``

1. reads the manifest (the copy kept beside the files when the control plane cannot be reached)
   and checks that its files hash to the content hash: its digests are then the checkpoint's own;
2. picks the files the block needs: ``config.json``, the safetensors index if there is one, and
   the weight files holding tensors of its layers. The tokenizer, the embeddings and the other
   stages' shards are not fetched: the coordinator and the other agents use those;
3. checks each of them already cached against its digest, and downloads each missing one into a
   partial file, hashing as it goes, renamed into place only when its size and digest match.

Any mismatch refuses the block (``ModelError`` with code ``checkpoint_mismatch``, which the agent
reports as the assignment's failure). A cached file that differs from its digest is deleted as it
is refused: the owner's cache was damaged or changed, and the next assignment fetches it afresh.
Files live in ``<model cache>/catalog/<content hash>/``, which every agent of the machine shares
under a file lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.client
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urljoin

from worker_agent import checkpoints
from worker_agent.checkpoints import INDEX_FILE, SINGLE_FILE, FileEntry
from worker_agent.errors import ModelError
from worker_agent.protocol.span import Span

HTTP_TIMEOUT_S = 30.0  # per connect and per read of a chunk, not per file: a large shard takes its time
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
CHUNK_BYTES = 1 << 20
MANIFEST_COPY = ".manifest.json"  # the verified manifest, kept beside the files it lists
MISMATCH = "checkpoint_mismatch"
UNAVAILABLE = "checkpoint_unavailable"


def _log(message: str) -> None:
    print(f"[fetch] {message}", file=sys.stderr, flush=True)


def manifest_url(control_plane: str, source: str) -> str:
    """The manifest's URL: ``source`` as the assignment gives it, absolute or relative to the
    control plane's URL (which may carry a path prefix)."""
    return urljoin(control_plane.rstrip("/") + "/", source)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        yield


def _get(url: str, limit: int) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
            body = response.read(limit + 1)
    except urllib.error.HTTPError as exc:
        raise ModelError(f"{url} answered {exc.code} {exc.reason}", code=UNAVAILABLE) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise ModelError(f"cannot fetch {url}: {getattr(exc, 'reason', exc)}", code=UNAVAILABLE) from None
    if len(body) > limit:
        raise ModelError(f"{url} is larger than {limit} bytes", code=MISMATCH)
    return body


def _manifest(url: str, folder: Path, ref: str, content_hash: str) -> dict[str, FileEntry]:
    """The files of checkpoint ``content_hash`` by name, from a manifest whose digests hash to it."""
    copy = folder / MANIFEST_COPY
    try:
        raw = _get(url, MAX_MANIFEST_BYTES)
    except ModelError as exc:
        if exc.code != UNAVAILABLE or not copy.is_file():
            raise
        _log(f"{exc}; using the manifest kept at {copy}")
        raw = copy.read_bytes()
    try:
        files = json.loads(raw)["files"]
    except (ValueError, KeyError, TypeError):
        raise ModelError(f"the manifest of {ref} at {url} is not a manifest", code=MISMATCH) from None
    try:
        entries = checkpoints.parse_manifest(files)
    except ModelError as exc:
        raise ModelError(f"the manifest of {ref}: {exc}", code=MISMATCH) from None
    if (found := checkpoints.content_hash(entries)) != content_hash:
        raise ModelError(
            f"the manifest of {ref} hashes to {found}, not to the assigned content hash {content_hash}", code=MISMATCH
        )
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / (MANIFEST_COPY + ".part")
    partial.write_bytes(raw)
    os.replace(partial, copy)
    return {entry.path: entry for entry in entries}


def _check_cached(path: Path, entry: FileEntry, ref: str) -> bool:
    """Whether ``path`` is there, matching its digest; a file that does not match is deleted and
    the block refused."""
    if not path.is_file():
        return False
    if path.stat().st_size == entry.size and checkpoints.file_sha256(path) == entry.sha256:
        return True
    path.unlink(missing_ok=True)
    raise ModelError(
        f"the cached {entry.path} of {ref} differs from its sha256 {entry.sha256} in the manifest (the cache was "
        "damaged or changed): refused, and removed so that the next assignment fetches it again",
        code=MISMATCH,
    )


def _download(url: str, path: Path, entry: FileEntry, ref: str) -> None:
    partial = path.with_name(path.name + ".part")
    digest, size = hashlib.sha256(), 0
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response, open(partial, "wb") as out:
            while chunk := response.read(CHUNK_BYTES):
                size += len(chunk)
                if size > entry.size:
                    break
                digest.update(chunk)
                out.write(chunk)
    except urllib.error.HTTPError as exc:
        partial.unlink(missing_ok=True)
        raise ModelError(f"{url} answered {exc.code} {exc.reason}", code=UNAVAILABLE) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        partial.unlink(missing_ok=True)
        raise ModelError(f"cannot fetch {url}: {getattr(exc, 'reason', exc)}", code=UNAVAILABLE) from None
    if size != entry.size or digest.hexdigest() != entry.sha256:
        partial.unlink(missing_ok=True)
        raise ModelError(
            f"{entry.path} of {ref} from {url} does not match the manifest's size {entry.size} and sha256 "
            f"{entry.sha256}: refused",
            code=MISMATCH,
        )
    os.replace(partial, path)


def _ensure(url: str, folder: Path, entry: FileEntry, ref: str) -> None:
    path = folder / entry.path
    if not _check_cached(path, entry, ref):
        _log(f"fetching {entry.path} of {ref} ({entry.size} bytes)")
        _download(urljoin(url, quote(entry.path)), path, entry, ref)


def _needed(folder: Path, files: dict[str, FileEntry], span: Span) -> list[str]:
    """The weight files holding the layers of ``span`` (the index is in place)."""
    ref = span.model
    if INDEX_FILE in files:
        try:
            weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
            shards = checkpoints.shards_for_layers(weight_map, span.start, span.end)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ModelError(f"the safetensors index of {ref} has no weight_map", code=MISMATCH) from None
    elif SINGLE_FILE in files:
        shards = [SINGLE_FILE]
    else:
        raise ModelError(f"the manifest of {ref} lists no safetensors weights", code=MISMATCH)
    missing = [shard for shard in shards if shard not in files]
    if not shards or missing:
        raise ModelError(
            f"the checkpoint {ref} does not list the weights of layers {span.start}:{span.end} "
            f"(missing {missing[:3] or 'every shard'})",
            code=MISMATCH,
        )
    return shards


def ensure_block_files(url: str, span: Span, content_hash: str) -> Path:
    """The folder holding what the layers of ``span`` (its model a checkpoint ref) need, every file
    of it checked against the manifest at ``url`` (see the module docstring)."""
    ref = span.model
    if not checkpoints.ref_matches(ref, content_hash):
        raise ModelError(f"{ref} does not name content hash {content_hash}", code=MISMATCH)
    folder = checkpoints.cache_store() / content_hash
    with _locked(checkpoints.cache_store() / f".{content_hash}.lock"):
        files = _manifest(url, folder, ref, content_hash)
        if "config.json" not in files:
            raise ModelError(f"the manifest of {ref} lists no config.json", code=MISMATCH)
        _ensure(url, folder, files["config.json"], ref)
        if INDEX_FILE in files:
            _ensure(url, folder, files[INDEX_FILE], ref)
        for shard in _needed(folder, files, span):
            _ensure(url, folder, files[shard], ref)
    return folder
