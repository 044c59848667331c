"""Registering a checkpoint in the catalog: what is read from it, the content hash, the copy kept,
its prices, and every refusal (each names what is wrong, and nothing is registered or kept)."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import shutil
import tarfile
import threading
from decimal import Decimal
from pathlib import Path

import pytest

from marketplace.billing.models import ModelPrice
from marketplace.billing.services import prices_for
from marketplace.catalog import services
from marketplace.catalog.errors import CatalogError
from marketplace.catalog.models import CatalogModel, SourceKind
from marketplace.catalog.selectors import served_models
from marketplace.flows import offerings
from tests.catalog_fixtures import CHECKPOINT_FILES as FILES
from tests.catalog_fixtures import LAYER_BYTES, content_hash_of, llama_checkpoint

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.catalog_fixtures"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A seeded random Llama in one model.safetensors, with a README that is not part of it."""
    folder = llama_checkpoint(tmp_path_factory.mktemp("llama") / "llama-untied")
    (folder / "README.md").write_text("not part of the checkpoint\n")
    return folder


def copy_of(checkpoint: Path, into: Path) -> Path:
    return Path(shutil.copytree(checkpoint, into))


def refused(call, code: str, param: str | None = "source") -> str:
    """The message of the CatalogError ``call`` raises, after checking its code and field."""
    with pytest.raises(CatalogError) as caught:
        call()
    assert (caught.value.code, caught.value.param) == (code, param)
    return caught.value.message


def nothing_registered(catalog: Path) -> bool:
    kept = [p.name for p in catalog.iterdir()] if catalog.exists() else []
    return not CatalogModel.objects.exists() and not ModelPrice.objects.exists() and kept == []


def test_registers_a_checkpoint_directory_with_what_it_reads_from_it(checkpoint, catalog):
    entry = services.register_model("llama-untied", SourceKind.DIRECTORY, str(checkpoint))

    digest = content_hash_of(checkpoint, FILES)
    entry.refresh_from_db()
    assert (entry.name, entry.ref, entry.content_hash) == ("llama-untied", f"llama-untied@{digest[:16]}", digest)
    assert (entry.architecture, entry.n_layers, entry.context_length, entry.dtype) == ("llama", 4, 2048, "float32")
    assert entry.bytes_per_layer == LAYER_BYTES == 147968
    assert (entry.min_reputation, entry.enabled, entry.source_sha256) == (0.0, True, "")
    assert entry.files == [
        {
            "path": name,
            "sha256": hashlib.sha256((checkpoint / name).read_bytes()).hexdigest(),
            "size": (checkpoint / name).stat().st_size,
        }
        for name in FILES
    ]
    kept = catalog / digest
    assert sorted(p.name for p in catalog.iterdir()) == [digest]
    assert sorted(p.name for p in kept.iterdir()) == FILES  # the README stayed behind
    assert all((kept / name).read_bytes() == (checkpoint / name).read_bytes() for name in FILES)
    assert served_models() == ["smollm2-135m", entry.ref]


def test_the_content_hash_follows_the_weights_and_nothing_else(checkpoint, catalog, tmp_path):
    same = copy_of(checkpoint, tmp_path / "same")
    (same / "notes.txt").write_text("a stray file beside the checkpoint\n")
    changed = copy_of(checkpoint, tmp_path / "changed")
    weights = bytearray((changed / "model.safetensors").read_bytes())
    weights[-1] ^= 0x01  # one bit of the last weight
    (changed / "model.safetensors").write_bytes(bytes(weights))

    first = services.register_model("first", SourceKind.DIRECTORY, str(checkpoint))
    again = services.register_model("again", SourceKind.DIRECTORY, str(same))
    other = services.register_model("other", SourceKind.DIRECTORY, str(changed))

    assert again.content_hash == first.content_hash == content_hash_of(checkpoint, FILES)
    assert other.content_hash == content_hash_of(changed, FILES) != first.content_hash
    assert (first.ref.split("@")[1], other.ref.split("@")[1]) == (first.content_hash[:16], other.content_hash[:16])
    assert sorted(p.name for p in catalog.iterdir()) == sorted([first.content_hash, other.content_hash])


def test_a_sharded_checkpoint_is_read_from_its_index(catalog, tmp_path):
    folder = llama_checkpoint(tmp_path / "sharded", shard="200KB")

    entry = services.register_model("sharded", SourceKind.DIRECTORY, str(folder))

    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) == 5
    assert [f["path"] for f in entry.files] == sorted([*FILES[:3], *shards, "model.safetensors.index.json", *FILES[4:]])
    assert (entry.n_layers, entry.bytes_per_layer) == (4, LAYER_BYTES)


def test_registration_with_prices_writes_them_in_nano_dollars_by_name(checkpoint, catalog):
    entry = offerings.register(
        "priced", SourceKind.DIRECTORY, str(checkpoint), prompt_price="0.5", completion_price=Decimal("1.25")
    )

    assert list(ModelPrice.objects.values_list("model", "prompt_per_million", "completion_per_million")) == [
        ("priced", 500_000_000, 1_250_000_000)
    ]
    assert prices_for(entry.ref) == (500_000_000, 1_250_000_000)  # the ref pays its name's prices
    assert offerings.prices("priced") == (Decimal("0.5"), Decimal("1.25"))


def test_a_price_change_is_a_new_row_and_the_same_price_none(checkpoint, catalog):
    offerings.register("priced", SourceKind.DIRECTORY, str(checkpoint), prompt_price="0.5", completion_price="1")

    offerings.update("priced", completion_price="2")
    offerings.update("priced", prompt_price="0.5", completion_price="2")

    rows = ModelPrice.objects.order_by("effective_from", "pk").values_list(
        "prompt_per_million", "completion_per_million"
    )
    assert list(rows) == [(500_000_000, 1_000_000_000), (500_000_000, 2_000_000_000)]


@pytest.mark.parametrize(
    ("price", "why"),
    [("-1", "below zero"), ("0.0000000001", "past the nano-dollar"), ("ten", "not a number"), ("1e7", "too high")],
)
def test_refuses_a_bad_price_before_reading_the_checkpoint(checkpoint, catalog, price, why):
    message = refused(
        lambda: offerings.register("priced", SourceKind.DIRECTORY, str(checkpoint), prompt_price=price),
        "catalog_invalid_price",
        "prompt_price",
    )

    assert message == (
        f"prompt_price is dollars per million tokens, from 0 to 1000000 with at most 9 decimals; got {price!r}"
    )
    assert nothing_registered(catalog)


@pytest.mark.parametrize("name", ["Llama", "-llama", "llama untied", "a" * 65, "", "llama/x"])
def test_refuses_a_bad_name(checkpoint, catalog, name):
    message = refused(
        lambda: services.register_model(name, SourceKind.DIRECTORY, str(checkpoint)), "catalog_invalid_name", "name"
    )

    assert message == (
        f"a catalog name is 1 to 64 of a-z, 0-9, '.', '_' and '-', starting with a letter or digit; got {name!r}"
    )
    assert nothing_registered(catalog)


def test_refuses_a_name_taken_and_keeps_the_first(checkpoint, catalog, tmp_path):
    first = services.register_model("llama", SourceKind.DIRECTORY, str(checkpoint))
    other = llama_checkpoint(tmp_path / "other", seed=1)

    message = refused(
        lambda: services.register_model("llama", SourceKind.DIRECTORY, str(other)), "catalog_name_taken", "name"
    )

    assert message == "the catalog already has a model named 'llama'"
    assert list(CatalogModel.objects.values_list("name", "content_hash")) == [("llama", first.content_hash)]
    assert [p.name for p in catalog.iterdir()] == [first.content_hash]


def test_refuses_a_folder_without_config_json(checkpoint, catalog, tmp_path):
    folder = copy_of(checkpoint, tmp_path / "no-config")
    (folder / "config.json").unlink()

    message = refused(lambda: services.register_model("x", SourceKind.DIRECTORY, str(folder)), "catalog_missing_config")

    assert message == f"the checkpoint at {folder} has no config.json"
    assert nothing_registered(catalog)


def test_refuses_an_architecture_the_layer_block_does_not_compute(checkpoint, catalog, tmp_path):
    folder = copy_of(checkpoint, tmp_path / "bert")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "bert"}))

    message = refused(
        lambda: services.register_model("x", SourceKind.DIRECTORY, str(folder)), "catalog_unsupported_architecture"
    )

    assert message == (
        "model type 'bert' is not one the layer block computes; supported: "
        "llama, mistral, qwen2, qwen3, gemma, gemma2, phi3, granite"
    )
    assert nothing_registered(catalog)


def test_refuses_a_truncated_safetensors_file(checkpoint, catalog, tmp_path):
    folder = copy_of(checkpoint, tmp_path / "truncated")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])

    message = refused(
        lambda: services.register_model("x", SourceKind.DIRECTORY, str(folder)), "catalog_unreadable_safetensors"
    )

    length = int.from_bytes(weights.read_bytes()[:8], "little")
    header = json.loads(weights.read_bytes()[8 : 8 + length])
    data_bytes = weights.stat().st_size - 8 - length
    # The first tensor, in the header's order, whose bytes run past the file's end.
    cut = next(k for k in header if k != "__metadata__" and header[k]["data_offsets"][1] > data_bytes)
    start, end = header[cut]["data_offsets"]
    assert message == (
        f"model.safetensors: tensor {cut!r} is malformed (its bytes {start}:{end} do not hold shape "
        f"{header[cut]['shape']} of F32 within the file)"
    )
    assert nothing_registered(catalog)


def test_refuses_a_safetensors_file_that_is_not_one(checkpoint, catalog, tmp_path):
    folder = copy_of(checkpoint, tmp_path / "garbage")
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)

    message = refused(
        lambda: services.register_model("x", SourceKind.DIRECTORY, str(folder)), "catalog_unreadable_safetensors"
    )

    assert message == (
        f"model.safetensors is not a readable safetensors file: a header of {2**64 - 1} bytes does not fit a file of 64"
    )
    assert nothing_registered(catalog)


def test_refuses_weights_that_lack_a_layer_the_config_names(checkpoint, catalog, tmp_path):
    folder = copy_of(checkpoint, tmp_path / "five")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 5}))

    message = refused(
        lambda: services.register_model("x", SourceKind.DIRECTORY, str(folder)), "catalog_unreadable_safetensors"
    )

    assert message == "the weights lack decoder layers [4] of the 5 layers config.json names"
    assert nothing_registered(catalog)


@pytest.mark.parametrize(
    ("kind", "source", "expected"),
    [
        (
            SourceKind.DIRECTORY,
            "relative/llama",
            "a directory source is an absolute path on the control plane's host, got 'relative/llama'",
        ),
        (SourceKind.DIRECTORY, "/no/such/folder", "/no/such/folder is not a directory on the control plane's host"),
        (
            SourceKind.URL,
            "ftp://example.test/llama.tar",
            "a url source is an http(s) URL of a .tar or .tar.gz archive, got 'ftp://example.test/llama.tar'",
        ),
        ("s3", "bucket/llama", "source_kind must be one of registry, directory, url, got 's3'"),
    ],
)
def test_refuses_a_source_that_does_not_fit_its_kind(catalog, kind, source, expected):
    message = refused(lambda: services.register_model("x", kind, source), "catalog_invalid_source")

    assert message == expected
    assert nothing_registered(catalog)


def test_a_registry_model_is_registered_under_its_registry_id(catalog):
    message = refused(
        lambda: services.register_model("tiny", SourceKind.REGISTRY, "tiny-llama"), "catalog_invalid_name", "name"
    )

    assert message == "a registry model is registered under its registry id: name it 'tiny-llama', not 'tiny'"
    entry = services.register_model("tiny-llama", SourceKind.REGISTRY, "tiny-llama")
    assert (entry.ref, entry.architecture, entry.n_layers) == ("tiny-llama", "llama", 6)
    assert not catalog.exists()  # every agent builds a registry model itself: nothing kept here


def test_a_checkpoint_folder_in_swarm_models_is_served_by_its_folder_name_not_its_path(checkpoint, catalog, settings):
    settings.SWARM_MODELS = ["smollm2-135m", str(checkpoint)]

    registered = services.register_settings_checkpoints()

    entry = CatalogModel.objects.get()
    assert registered == [entry.ref]
    assert (entry.name, entry.source_kind, entry.source) == ("llama-untied", SourceKind.DIRECTORY, str(checkpoint))
    assert served_models() == ["smollm2-135m", entry.ref]
    assert services.register_settings_checkpoints() == []  # registered once


def tar_of(folder: Path, *, compressed: bool) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz" if compressed else "w") as tar:
        tar.add(folder, arcname=folder.name)
    return buffer.getvalue()


@pytest.fixture
def archive_server():
    """A plain HTTP server on loopback serving the bytes put in ``files`` (path -> bytes)."""
    files: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.files = files
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield server
    server.shutdown()
    thread.join(10)


@pytest.mark.parametrize("compressed", [True, False])
def test_registers_a_url_archive_fetched_once_and_checked(checkpoint, catalog, archive_server, compressed):
    body = tar_of(checkpoint, compressed=compressed)
    archive_server.files["/llama.tar"] = body

    entry = services.register_model(
        "fetched", SourceKind.URL, f"{archive_server.url}/llama.tar", source_sha256=hashlib.sha256(body).hexdigest()
    )

    assert entry.content_hash == content_hash_of(checkpoint, FILES)
    assert (entry.source_sha256, entry.n_layers) == (hashlib.sha256(body).hexdigest(), 4)
    assert sorted(p.name for p in (catalog / entry.content_hash).iterdir()) == FILES
    assert sorted(p.name for p in catalog.iterdir()) == [entry.content_hash]  # the download is gone


def test_refuses_a_url_source_without_its_sha256(catalog, archive_server):
    message = refused(
        lambda: services.register_model("x", SourceKind.URL, f"{archive_server.url}/llama.tar"),
        "catalog_missing_sha256",
        "source_sha256",
    )

    assert message == "a url source needs the archive's sha256 (64 lowercase hex digits)"
    assert nothing_registered(catalog)


def test_refuses_an_archive_whose_sha256_differs(checkpoint, catalog, archive_server):
    body = tar_of(checkpoint, compressed=True)
    archive_server.files["/llama.tar.gz"] = body
    wrong = "0" * 64

    message = refused(
        lambda: services.register_model("x", SourceKind.URL, f"{archive_server.url}/llama.tar.gz", source_sha256=wrong),
        "catalog_checksum_mismatch",
        "source_sha256",
    )

    assert message == (
        f"the archive at {archive_server.url}/llama.tar.gz has sha256 {hashlib.sha256(body).hexdigest()}, not {wrong}"
    )
    assert [p.name for p in catalog.iterdir()] == []
    assert not CatalogModel.objects.exists()


def test_refuses_an_archive_that_writes_outside_its_folder(catalog, archive_server):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        member = tarfile.TarInfo("../escaped.json")
        member.size = 2
        tar.addfile(member, io.BytesIO(b"{}"))
    body = buffer.getvalue()
    archive_server.files["/evil.tar"] = body

    message = refused(
        lambda: services.register_model(
            "x", SourceKind.URL, f"{archive_server.url}/evil.tar", source_sha256=hashlib.sha256(body).hexdigest()
        ),
        "catalog_bad_archive",
    )

    assert message.startswith("the source is not a readable .tar or .tar.gz archive: ")
    assert "escaped.json" in message
    assert [p.name for p in catalog.iterdir()] == []
    assert not (catalog.parent / "escaped.json").exists()


def test_refuses_an_archive_that_cannot_be_fetched(catalog, archive_server):
    message = refused(
        lambda: services.register_model("x", SourceKind.URL, f"{archive_server.url}/gone.tar", source_sha256="a" * 64),
        "catalog_source_unavailable",
    )

    assert message == f"{archive_server.url}/gone.tar answered 404 Not Found"
    assert nothing_registered(catalog)
