"""The control plane's processes set torch's CPU threads (SWARM_TORCH_THREADS, one by default) as
they load the models: each web, coordinator and verify process works on a few rows at a time, and a
team of threads per process only spins against the other processes' on a shared machine."""

from __future__ import annotations

import pytest
import torch

from marketplace import asgi
from marketplace import celery as celery_app

pytestmark = [pytest.mark.control, pytest.mark.django_db]


@pytest.fixture
def threads_kept():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("warm", [asgi.warm_models, celery_app.warm_models], ids=["web", "celery worker"])
def test_a_control_plane_process_sets_torchs_threads_as_it_loads_the_models(settings, threads_kept, warm):
    settings.SWARM_MODELS = []
    torch.set_num_threads(2)
    settings.SWARM_TORCH_THREADS = 1
    warm()
    assert torch.get_num_threads() == 1

    settings.SWARM_TORCH_THREADS = 0  # torch's own choice: left as it is
    warm()
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    warm()
    assert torch.get_num_threads() == 2
