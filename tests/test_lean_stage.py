"""A stage holds its layers and little else: a real ``swarm-worker serve`` process serving layers
0:10 of smollm2-135m (float32), after generating through it, never imported transformers or
tokenizers, and is resident at most its layers' bytes plus what a bare ``import torch`` holds on
the same machine, plus ``AGENT_OVERHEAD``.

The layers' bytes come from the checkpoint's safetensors headers: each tensor of
``model.layers.{0..9}.`` at 4 bytes per element, as the stage holds them (135.0 MiB). The three
agents run as ``tests/conftest.py``'s smollm2 swarm does; what the stage imported is read from the
module list the agent writes at exit (``SWARM_MODULES_REPORT``).

Why the bound is relative: a process's resident set counts the pages of the shared libraries it
has mapped, and how many of libtorch's pages the kernel maps around each fault depends on the
page cache, not on the process. The same stage measured 405 MiB on one VM and 449 and 467 MiB on
two others of the same kind; ``python -c "import torch"`` alone moved with it (232 against
267 MiB). So the reference is taken in the same test, in a fresh process, and the stage is held to
what it adds over it.

The product's target is 250 MB over the layers. On these 2-core VMs the interpreter and
``import torch`` alone take 232-267 MiB (143 MiB of it anonymous: torch's ~1100 Python modules hold
about 64 MiB, its C++ operator registry most of the rest), so that target is out of reach for any
stage built on torch; the figures are reported (``-s``) rather than asserted against one machine.
Measured part by part in one process (``/proc/self/status`` and ``/proc/self/smaps``):

- the agent's other libraries: 18 MiB, cryptography's 9.7 of it (the data plane's TLS);
- loading the block: its 135 MiB, and 9 MiB of libtorch's code paged in;
- tuning its kernels and serving three sessions: 10 and 10 MiB more (libtorch's code, the heap).

It was 568 MiB resident while the block used transformers' layers (about 160 MiB more).
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from worker_agent import model as models
from worker_agent.agent.cli import MODULES_REPORT_ENV
from worker_agent.coordinator.job import Coordinator
from worker_agent.coordinator.pipeline import StageSpec
from worker_agent.dev.local import LocalSwarm

pytestmark = pytest.mark.dataplane

MODEL = "smollm2-135m"
SPANS = [(0, 10), (10, 20), (20, 30)]
MB = 1 << 20
AGENT_OVERHEAD = 100 * MB  # what a stage may hold over its layers and a bare torch (47-64 MiB measured)
FLOAT32 = 4
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three colours."]


def _stored_shapes(folder: Path) -> dict[str, list[int]]:
    """Every tensor's shape, from the headers of the checkpoint's safetensors files (nothing else is read)."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        shapes.update({key: entry["shape"] for key, entry in header.items() if key != "__metadata__"})
    return shapes


def _layer_bytes(folder: Path, start: int, end: int) -> int:
    prefixes = tuple(f"model.layers.{index}." for index in range(start, end))
    total = 0
    for key, shape in _stored_shapes(folder).items():
        if key.startswith(prefixes):
            count = 1
            for size in shape:
                count *= size
            total += count * FLOAT32
    return total


def _status(pid: int | str, field: str) -> int:
    """A field of /proc/<pid>/status, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/{pid}/status has no {field}")


_BARE_TORCH = """
import json, torch
from pathlib import Path
fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
          if line.startswith(("VmRSS:", "RssAnon:", "RssFile:"))}
print(json.dumps(fields))
"""


def _bare_torch() -> dict[str, int]:
    """What a fresh interpreter holds once it has imported torch, on this machine now."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _BARE_TORCH], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


async def _generate(swarm: LocalSwarm) -> list[list[int]]:
    """The prompts generated concurrently through the three stages, greedy."""
    job = "job-lean"
    specs = [StageSpec(url, ticket) for url, ticket in zip(swarm.urls, swarm.tickets(job), strict=True)]
    async with Coordinator(MODEL, specs, job=job, coordinator_key=swarm.coordinator_key(job)) as coordinator:
        requests = [coordinator.request(prompt, chat=True, max_tokens=16) for prompt in PROMPTS]
        results = await asyncio.gather(*(coordinator.generate(request) for request in requests))
    return [result.token_ids for result in results]


@pytest.fixture(scope="module")
def stage(tmp_path_factory) -> dict:
    """The first of three agents after generating through them: its layers' bytes, its resident and
    peak bytes while up, and the modules it had imported when it exited."""
    # The checkpoint is built here, so that no agent builds it (which imports transformers).
    folder = models.resolve_checkpoint(MODEL)
    reports = tmp_path_factory.mktemp("modules")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(MODULES_REPORT_ENV, str(reports))
        with LocalSwarm(MODEL, SPANS, threads=1) as swarm:
            outputs = asyncio.run(_generate(swarm))
            pid = swarm.agents[0].process.pid
            resident, peak = _status(pid, "VmRSS"), _status(pid, "VmHWM")
            anonymous, files = _status(pid, "RssAnon"), _status(pid, "RssFile")
            torch_alone = _bare_torch()
    assert all(len(tokens) > 0 for tokens in outputs)
    return {
        "weights": _layer_bytes(folder, *SPANS[0]),
        "resident": resident,
        "anonymous": anonymous,
        "files": files,
        "peak": peak,
        "torch": torch_alone,
        "modules": (reports / f"{pid}.modules").read_text().split(),
    }


def _describe(stage: dict) -> str:
    weights, resident, torch_alone = stage["weights"], stage["resident"], stage["torch"]
    return (
        f"stage resident {resident / MB:.1f} MiB (anonymous {stage['anonymous'] / MB:.1f}, files "
        f"{stage['files'] / MB:.1f}; peak {stage['peak'] / MB:.1f}) = layers {weights / MB:.1f} MiB + "
        f"{(resident - weights) / MB:.1f} MiB; a bare import torch here: {torch_alone['VmRSS'] / MB:.1f} MiB "
        f"(anonymous {torch_alone['RssAnon'] / MB:.1f}, files {torch_alone['RssFile'] / MB:.1f})"
    )


def test_the_stage_never_imported_transformers_nor_the_tokenizers(stage):
    assert "worker_agent.block" in stage["modules"]  # the report is the stage's own
    assert [m for m in stage["modules"] if m.split(".")[0] in ("transformers", "tokenizers")] == []


def test_the_layers_bytes_come_from_the_checkpoints_headers(stage):
    assert stage["weights"] == 10 * 3_540_096 * FLOAT32  # q, k, v, o, gate, up, down and two norms per layer


def test_a_stage_holds_its_layers_plus_at_most_100_mib_over_a_bare_torch(stage):
    print(_describe(stage))
    added = stage["resident"] - stage["weights"] - stage["torch"]["VmRSS"]
    assert added <= AGENT_OVERHEAD, _describe(stage)


def test_the_stages_own_memory_holds_its_layers_plus_at_most_100_mib_over_a_bare_torch(stage):
    """The anonymous part (heap, tensors, Python objects) is the process's own: no page cache in it."""
    added = stage["anonymous"] - stage["weights"] - stage["torch"]["RssAnon"]
    assert added <= AGENT_OVERHEAD, _describe(stage)
