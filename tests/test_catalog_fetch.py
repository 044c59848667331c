"""An agent's side of a catalog model: the files of its block fetched from a live control plane
(``/install/models/<ref>/...``), only those its layers need, each checked against the content hash
its assignment names; the cache reused, and refused where it differs from the hash. And a
checkpoint folder that SWARM_MODELS names, registered when the control plane starts."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
from django.db import connection

from marketplace.catalog import services
from marketplace.catalog.models import CatalogModel, SourceKind
from marketplace.catalog.selectors import assignment_source, served_models
from marketplace.flows import offerings
from marketplace.placement.models import PlacementState
from tests.catalog_fixtures import llama_checkpoint, weight_map
from tests.live import LiveServer
from worker_agent import checkpoints
from worker_agent.agent import fetch
from worker_agent.errors import ModelError
from worker_agent.protocol.span import Span

pytestmark = [pytest.mark.dataplane, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.catalog_fixtures"]

INDEX = "model.safetensors.index.json"


@pytest.fixture
def served(catalog, settings, tmp_path):
    """A live control plane whose catalog serves a seeded Llama sharded about a layer per file."""
    settings.SWARM_MODELS = []
    folder = llama_checkpoint(tmp_path / "sharded", shard="200KB")
    entry = services.register_model("sharded", SourceKind.DIRECTORY, str(folder))
    server = LiveServer().start()
    server.entry, server.folder = entry, folder
    server.manifest = fetch.manifest_url(server.url, assignment_source(entry.ref)["source"])
    yield server
    server.stop()


@pytest.fixture
def agent_cache(tmp_path, monkeypatch):
    """The agent's model cache, empty: catalog checkpoints land in its ``catalog`` folder."""
    monkeypatch.setenv("SWARM_MODEL_CACHE", str(tmp_path / "agent-cache"))
    return tmp_path / "agent-cache" / "catalog"


def shards(folder, start: int, end: int) -> set[str]:
    """The shards holding layers [start, end), read from the checkpoint's own index here."""
    wanted = {f"model.layers.{i}." for i in range(start, end)}
    return {file for key, file in weight_map(folder).items() if any(key.startswith(w) for w in wanted)}


def test_fetches_only_the_files_the_layers_need_each_as_the_checkpoint_holds_it(served, agent_cache):
    entry, folder = served.entry, served.folder

    first = fetch.ensure_block_files(served.manifest, Span(entry.ref, 0, 2), entry.content_hash)

    assert first == agent_cache / entry.content_hash
    assert {p.name for p in first.iterdir()} == {"config.json", INDEX, fetch.MANIFEST_COPY} | shards(folder, 0, 2)
    fetch.ensure_block_files(served.manifest, Span(entry.ref, 2, 4), entry.content_hash)
    fetched = {p.name for p in first.iterdir()} - {fetch.MANIFEST_COPY}
    assert fetched == {"config.json", INDEX} | shards(folder, 0, 4)
    assert weight_map(folder)["model.embed_tokens.weight"] not in fetched  # the coordinator's, not a stage's
    assert all((first / name).read_bytes() == (folder / name).read_bytes() for name in fetched)
    assert json.loads((first / fetch.MANIFEST_COPY).read_text())["files"] == entry.files


def test_a_second_assignment_is_served_from_the_cache_without_the_control_plane(served, agent_cache):
    entry = served.entry
    fetch.ensure_block_files(served.manifest, Span(entry.ref, 0, 2), entry.content_hash)
    served.stop()

    again = fetch.ensure_block_files(served.manifest, Span(entry.ref, 0, 2), entry.content_hash)

    assert again == agent_cache / entry.content_hash
    with pytest.raises(ModelError) as caught:  # what is not cached yet cannot come now
        fetch.ensure_block_files(served.manifest, Span(entry.ref, 2, 4), entry.content_hash)
    assert caught.value.code == "checkpoint_unavailable"


def test_a_cached_file_that_differs_from_its_digest_refuses_the_block_and_is_fetched_again(served, agent_cache):
    entry, folder = served.entry, served.folder
    cached = fetch.ensure_block_files(served.manifest, Span(entry.ref, 0, 2), entry.content_hash)
    shard = sorted(shards(folder, 0, 2))[0]
    damaged = bytearray((cached / shard).read_bytes())
    damaged[-1] ^= 0x01
    (cached / shard).write_bytes(bytes(damaged))
    digest = next(f["sha256"] for f in entry.files if f["path"] == shard)

    with pytest.raises(ModelError) as caught:
        fetch.ensure_block_files(served.manifest, Span(entry.ref, 0, 2), entry.content_hash)

    assert caught.value.code == "checkpoint_mismatch"
    assert caught.value.message == (
        f"the cached {shard} of {entry.ref} differs from its sha256 {digest} in the manifest (the cache was "
        "damaged or changed): refused, and removed so that the next assignment fetches it again"
    )
    assert not (cached / shard).exists()
    fetch.ensure_block_files(served.manifest, Span(entry.ref, 0, 2), entry.content_hash)
    assert (cached / shard).read_bytes() == (folder / shard).read_bytes()


def test_a_manifest_that_does_not_hash_to_the_assigned_content_hash_is_refused(served, agent_cache):
    entry = served.entry
    assigned = entry.content_hash[:16] + "0" * 48  # the ref's prefix, other weights

    with pytest.raises(ModelError) as caught:
        fetch.ensure_block_files(served.manifest, Span(entry.ref, 0, 2), assigned)

    assert caught.value.code == "checkpoint_mismatch"
    assert caught.value.message == (
        f"the manifest of {entry.ref} hashes to {entry.content_hash}, not to the assigned content hash {assigned}"
    )
    assert not (agent_cache / assigned).exists()  # not a byte of it kept


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def test_the_control_plane_serves_the_manifest_and_listed_files_of_an_enabled_entry_only(served, catalog):
    entry, base = served.entry, f"{served.url}/install/models/{served.entry.ref}"
    (catalog / entry.content_hash / "notes.txt").write_text("in the folder, not in the manifest\n")

    status, body = get(f"{base}/manifest.json")
    assert status == 200
    assert json.loads(body) == {
        "version": 1,
        "ref": entry.ref,
        "name": "sharded",
        "content_hash": entry.content_hash,
        "files": entry.files,
    }
    assert checkpoints.content_hash(checkpoints.parse_manifest(json.loads(body)["files"])) == entry.content_hash
    assert get(f"{base}/config.json") == (200, (served.folder / "config.json").read_bytes())
    assert get(f"{base}/notes.txt")[0] == 404
    assert get(f"{served.url}/install/models/sharded@{'0' * 16}/manifest.json")[0] == 404
    offerings.update("sharded", enabled=False)
    assert get(f"{base}/manifest.json")[0] == 404
    assert get(f"{base}/config.json")[0] == 404


def test_a_checkpoint_folder_in_swarm_models_is_registered_by_its_name_when_the_control_plane_starts(
    catalog, settings, tmp_path
):
    folder = llama_checkpoint(tmp_path / "Llama-Untied", seed=2)
    settings.SWARM_MODELS = [str(folder)]

    server = LiveServer().start()
    server.stop()

    entry = CatalogModel.objects.get()
    assert (entry.name, entry.source_kind, entry.source) == ("llama-untied", SourceKind.DIRECTORY, str(folder))
    assert served_models() == [entry.ref]  # by its ref, never by its path
    assert PlacementState.objects.get(model=entry.ref).dirty is True


def test_the_start_up_s_catalog_reads_hand_their_pooled_connection_back(catalog, settings, tmp_path):
    # The web process warms its models in a worker thread at start-up; a connection kept by that
    # thread is lost to the pool, and a process started often (a test suite's live servers) ran dry.
    from marketplace.asgi import warm_models

    settings.SWARM_MODELS = [str(llama_checkpoint(tmp_path / "warmed", seed=4))]
    held: list[bool] = []

    def start() -> None:
        warm_models()
        held.append(connection.connection is not None)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join(120)

    assert CatalogModel.objects.filter(name="warmed").exists()  # it did read and write the catalog
    assert held == [False]
