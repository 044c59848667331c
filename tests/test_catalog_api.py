"""The catalog through its HTTP faces: the staff API (register, list, change), ``/v1/models`` and a
request naming a catalog model, and what placement hands the agents (the assignment's source, the
blocks of a disabled model released)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from django.test import Client

from marketplace.api import request_body
from marketplace.billing.models import ModelPrice
from marketplace.catalog.models import CatalogModel, SourceKind
from marketplace.catalog.selectors import served_models
from marketplace.flows import offerings
from marketplace.jobs import services as jobs_services
from marketplace.jobs.errors import ModelNotFound
from marketplace.placement import placing
from marketplace.placement.models import Assignment, AssignmentState, PlacementState
from marketplace.placement.selectors import AGENT_DEFAULT_POSITIONS
from tests.catalog_fixtures import CHECKPOINT_FILES as FILES
from tests.catalog_fixtures import LAYER_BYTES, content_hash_of, llama_checkpoint
from tests.factories import drf_datetime
from worker_agent.protocol import control_protocol as protocol

pytestmark = [pytest.mark.api, pytest.mark.django_db]
pytest_plugins = ["tests.factories", "tests.control_fixtures", "tests.catalog_fixtures"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return llama_checkpoint(tmp_path_factory.mktemp("llama") / "llama")


@pytest.fixture
def registered(checkpoint, catalog, swarm_settings) -> CatalogModel:
    return offerings.register(
        "llama", SourceKind.DIRECTORY, str(checkpoint), prompt_price="0.3", completion_price="0.6"
    )


def registration(checkpoint: Path, **overrides) -> dict:
    return {
        "name": "llama",
        "source_kind": "directory",
        "source": str(checkpoint),
        "prompt_price": "0.3",
        "completion_price": 0.6,
    } | overrides


def test_staff_register_a_checkpoint_and_read_back_what_was_read_from_it(client_for, admin, checkpoint, catalog):
    response = client_for(admin).post("/api/v1/catalog/", registration(checkpoint), format="json")

    assert response.status_code == 201, response.content
    entry = CatalogModel.objects.get()
    digest = content_hash_of(checkpoint, FILES)
    assert response.json() == {
        "name": "llama",
        "ref": f"llama@{digest[:16]}",
        "source_kind": "directory",
        "source": str(checkpoint),
        "source_sha256": "",
        "content_hash": digest,
        "architecture": "llama",
        "n_layers": 4,
        "context_length": 2048,
        "dtype": "float32",
        "bytes_per_layer": LAYER_BYTES,
        "min_reputation": 0.0,
        "enabled": True,
        "prompt_price": "0.3",
        "completion_price": "0.6",
        "files": [
            {
                "path": name,
                "sha256": hashlib.sha256((checkpoint / name).read_bytes()).hexdigest(),
                "size": (checkpoint / name).stat().st_size,
            }
            for name in FILES
        ],
        "created_at": drf_datetime(entry.created_at),
        "updated_at": drf_datetime(entry.updated_at),
    }
    assert list(ModelPrice.objects.values_list("model", "prompt_per_million", "completion_per_million")) == [
        ("llama", 300_000_000, 600_000_000)
    ]


def test_staff_list_and_change_an_entry(client_for, admin, registered):
    client = client_for(admin)

    listed = client.get("/api/v1/catalog/")
    changed = client.patch(
        "/api/v1/catalog/llama/", {"enabled": False, "min_reputation": 0.5, "prompt_price": "0.4"}, format="json"
    )

    assert [entry["ref"] for entry in listed.json()] == [registered.ref]
    assert changed.status_code == 200, changed.content
    body = changed.json()
    assert (body["enabled"], body["min_reputation"], body["prompt_price"], body["completion_price"]) == (
        False,
        0.5,
        "0.4",
        "0.6",
    )
    assert served_models() == ["smollm2-135m"]
    assert client.get("/api/v1/catalog/mistral/").status_code == 404


def test_a_refused_registration_answers_400_with_the_code_and_field(client_for, admin, checkpoint, catalog):
    response = client_for(admin).post("/api/v1/catalog/", registration(checkpoint, name="Llama"), format="json")

    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "a catalog name is 1 to 64 of a-z, 0-9, '.', '_' and '-', starting with a letter or digit; "
            "got 'Llama'",
            "type": "invalid_request_error",
            "param": "name",
            "code": "catalog_invalid_name",
        }
    }
    assert not CatalogModel.objects.exists()
    assert not ModelPrice.objects.exists()


@pytest.mark.parametrize("persona", ["provider", "customer", "stranger", None])
def test_only_staff_may_register_or_change(client_for, request, persona, checkpoint, registered):
    user = request.getfixturevalue(persona) if persona else None
    client = client_for(user)
    before = list(CatalogModel.objects.values())

    created = client.post("/api/v1/catalog/", registration(checkpoint, name="other"), format="json")
    changed = client.patch("/api/v1/catalog/llama/", {"enabled": False}, format="json")
    listed = client.get("/api/v1/catalog/")

    assert [created.status_code, changed.status_code, listed.status_code] == [403, 403, 403]
    assert list(CatalogModel.objects.values()) == before
    assert ModelPrice.objects.count() == 1


def test_a_request_names_a_catalog_model_by_name_or_by_ref(registered):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

    by_name, _ = request_body.parse(body | {"model": "llama"}, "chat")
    by_ref, _ = request_body.parse(body | {"model": registered.ref}, "chat")

    assert by_name == by_ref == registered.ref
    offerings.update("llama", enabled=False)
    with pytest.raises(ModelNotFound) as caught:
        request_body.parse(body | {"model": "llama"}, "chat")
    assert (caught.value.code, str(caught.value)) == ("model_not_found", "The model 'llama' does not exist.")


@pytest.fixture
def placed(registered, provider, make_joined_node) -> Assignment:
    """The catalog model placed as one ready stage on one node."""
    node = make_joined_node(provider, "gpu-1", max_layers=4).node
    PlacementState.objects.create(model=registered.ref, generation=1, dirty=False)
    return Assignment.objects.create(
        node=node,
        model=registered.ref,
        generation=1,
        pipeline=0,
        position=0,
        layer_start=0,
        layer_end=4,
        state=AssignmentState.READY,
        data_url="ws://127.0.0.1:9999",
    )


def test_models_lists_a_catalog_model_by_name_with_its_ref_prices_and_context(customer, placed, registered):
    _, key = jobs_services.create_api_key(customer, "app")

    response = Client().get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {key}")

    assert response.status_code == 200
    (listed,) = response.json()["data"]
    assert {k: listed[k] for k in ("id", "snapshot", "pricing", "context_length")} == {
        "id": "llama",
        "snapshot": registered.ref,
        "pricing": {"prompt": "0.0000003", "completion": "0.0000006"},
        "context_length": min(2048, AGENT_DEFAULT_POSITIONS),
    }


def test_an_assignment_tells_the_agent_where_to_fetch_the_checkpoint(placed, registered):
    message = placed.as_message()

    assert message == protocol.Assign(
        assignment=placed.pk,
        model=registered.ref,
        layer_start=0,
        layer_end=4,
        content_hash=registered.content_hash,
        source=f"install/models/{registered.ref}/manifest.json",
    )


def test_disabling_a_model_releases_its_blocks_and_places_it_no_more(
    placed, registered, pushed, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        offerings.update("llama", enabled=False)
        placing.place_dirty_models()

    placed.refresh_from_db()
    assert placed.state == AssignmentState.RELEASED
    assert pushed.messages == [
        (f"node.{placed.node.node_id}", {"type": "release", "assignment": placed.pk, "model": registered.ref})
    ]
    state = PlacementState.objects.get(model=registered.ref)
    assert (state.dirty, state.note, state.generation) == (False, "not served", 1)


def test_enabling_a_model_marks_it_for_placement(registered, django_capture_on_commit_callbacks):
    offerings.update("llama", enabled=False)

    with django_capture_on_commit_callbacks(execute=True):
        offerings.update("llama", enabled=True)

    assert PlacementState.objects.get(model=registered.ref).dirty is True


def test_a_node_below_the_models_minimum_reputation_is_not_placed_on_it(
    registered, swarm_settings, provider, make_joined_node, pushed, django_capture_on_commit_callbacks
):
    swarm_settings.SWARM_MODELS = []  # the catalog's model alone: no sharing of the nodes
    for name in ("a", "b"):
        make_joined_node(provider, name, max_layers=2, compute=250.0)
    doubtful = make_joined_node(provider, "doubtful", max_layers=4, compute=1000.0).node  # the fastest
    # Above placement's own threshold for every model (0.5), below this model's.
    type(doubtful).objects.filter(pk=doubtful.pk).update(reputation=0.8)
    offerings.update("llama", min_reputation=0.9)

    with django_capture_on_commit_callbacks(execute=True):
        placed = placing.place_model(registered.ref)

    assert sorted(a.node.name for a in placed) == ["a", "b"]
    assert sorted((a.layer_start, a.layer_end) for a in placed) == [(0, 2), (2, 4)]
    assert not Assignment.objects.filter(node=doubtful).exists()
