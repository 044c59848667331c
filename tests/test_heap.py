"""A long-lived control-plane process freezes the heap it keeps for good once it has loaded its
models (``worker_agent.heap``): a full collection then walks only what was made since, not the
half million objects of torch, transformers, Django and the model that it would walk to free
nothing."""

from __future__ import annotations

import gc
import weakref

import pytest

from marketplace import asgi
from marketplace import celery as celery_app
from worker_agent import heap

pytestmark = pytest.mark.control


@pytest.fixture
def thawed():
    gc.unfreeze()
    yield
    gc.unfreeze()  # this test process goes on collecting as before


class Cycle:
    def __init__(self) -> None:
        self.itself = self


def test_settling_freezes_the_objects_alive_and_leaves_the_later_ones_to_the_collector(thawed):
    kept = Cycle()
    assert gc.get_freeze_count() == 0
    frozen = heap.settle()
    # Other threads of this process (a live server's) may free some frozen objects meanwhile.
    assert frozen > 1000 and gc.get_freeze_count() > 1000
    assert not any(obj is kept for obj in gc.get_objects())  # frozen: no collection walks it

    later = Cycle()
    gone = weakref.ref(later)
    del later
    gc.collect()
    assert gone() is None  # garbage made after the freeze is still collected


def test_garbage_alive_before_settling_is_collected_first_not_frozen(thawed):
    cycle = Cycle()
    gone = weakref.ref(cycle)
    del cycle
    heap.settle()
    assert gone() is None


@pytest.mark.django_db
@pytest.mark.parametrize("warm", [asgi.warm_models, celery_app.warm_models], ids=["web", "celery worker"])
def test_a_control_plane_process_settles_its_heap_once_its_models_are_loaded(settings, thawed, warm):
    settings.SWARM_MODELS = []
    settings.SWARM_FREEZE_HEAP = False  # a process embedding the control plane, as this one (conftest)
    warm()
    assert gc.get_freeze_count() == 0
    settings.SWARM_FREEZE_HEAP = True  # the control plane's own processes: the default
    warm()
    assert gc.get_freeze_count() > 1000
