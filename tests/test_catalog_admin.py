"""The catalog's admin pages: a registration form of a name and a source (plus prices), whose
refusals show on the form; a change form where only enabled, the minimum reputation and the prices
change; no deleting."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.test import Client

from marketplace.billing.models import ModelPrice
from marketplace.catalog.models import CatalogModel
from marketplace.catalog.selectors import served_models
from tests.catalog_fixtures import llama_checkpoint

pytestmark = [pytest.mark.control, pytest.mark.django_db]
pytest_plugins = ["tests.catalog_fixtures"]

ADD = "/admin/catalog/catalogmodel/add/"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return llama_checkpoint(tmp_path_factory.mktemp("llama") / "llama")


@pytest.fixture
def browser(django_user_model, catalog, settings) -> Client:
    settings.SWARM_MODELS = []
    client = Client()
    client.force_login(django_user_model.objects.create_superuser("root", "root@example.test", "pw-root-123"))
    return client


def form(checkpoint: Path, **overrides) -> dict:
    return {
        "name": "llama",
        "source_kind": "directory",
        "source": str(checkpoint),
        "source_sha256": "",
        "min_reputation": "0.2",
        "enabled": "on",
        "prompt_price": "0.25",
        "completion_price": "0.75",
        "_save": "Save",
    } | overrides


def test_the_admin_registers_a_checkpoint_with_its_prices(browser, checkpoint):
    response = browser.post(ADD, form(checkpoint))

    entry = CatalogModel.objects.get()
    assert response.status_code == 302
    assert (entry.name, entry.n_layers, entry.min_reputation, entry.enabled) == ("llama", 4, 0.2, True)
    assert list(ModelPrice.objects.values_list("model", "prompt_per_million", "completion_per_million")) == [
        ("llama", 250_000_000, 750_000_000)
    ]
    assert served_models() == [entry.ref]


def test_a_refusal_shows_on_the_form_and_registers_nothing(browser, checkpoint, tmp_path):
    missing = tmp_path / "no-such-checkpoint"

    response = browser.post(ADD, form(checkpoint, source=str(missing)))

    assert response.status_code == 200
    errors = re.findall(r'<ul class="errorlist"[^>]*><li>(.*?)</li>', response.content.decode())
    assert errors == [f"{missing} is not a directory on the control plane&#x27;s host"]
    assert not CatalogModel.objects.exists()
    assert not ModelPrice.objects.exists()


def test_the_change_form_changes_enabled_reputation_and_prices_only(browser, checkpoint):
    browser.post(ADD, form(checkpoint))
    entry = CatalogModel.objects.get()
    change = f"/admin/catalog/catalogmodel/{entry.pk}/change/"

    page = browser.get(change)
    response = browser.post(
        change,
        {
            "min_reputation": "0.9",
            "prompt_price": "0.25",
            "completion_price": "1.5",
            "name": "renamed",
            "n_layers": "40",
            "_save": "Save",
        },
    )

    assert page.status_code == 200
    assert 'name="prompt_price" value="0.250000000"' in page.content.decode()
    assert response.status_code == 302
    entry.refresh_from_db()
    assert (entry.name, entry.n_layers, entry.min_reputation, entry.enabled) == ("llama", 4, 0.9, False)
    assert list(ModelPrice.objects.order_by("pk").values_list("prompt_per_million", "completion_per_million")) == [
        (250_000_000, 750_000_000),
        (250_000_000, 1_500_000_000),
    ]
    assert served_models() == []


def test_an_entry_cannot_be_deleted(browser, checkpoint):
    browser.post(ADD, form(checkpoint))
    entry = CatalogModel.objects.get()

    response = browser.post(f"/admin/catalog/catalogmodel/{entry.pk}/delete/", {"post": "yes"})

    assert response.status_code == 403
    assert CatalogModel.objects.filter(pk=entry.pk).exists()
