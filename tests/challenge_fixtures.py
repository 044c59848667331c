"""What a challenged node's part of a job looks like once the coordinator kept it: ``AuditMaterial``
of real activations (a prompt through the layers before the node's span), and outputs computed
honestly (in float32 or bfloat16), or made up by the test. And the start of a test's worker process
that needs Django (``django_process``)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from worker_agent import model as models
from worker_agent.block import Block, WorkItem
from worker_agent.coordinator.job import encode_prompt
from worker_agent.kvcache import KVSession
from worker_agent.protocol import wire
from worker_agent.protocol.audit import AuditMaterial

PROMPT = "Explain in two sentences why the sky is blue."
DECODE_STEPS = 3  # single-row steps after the prefill, as a generating session sends them


def real_inputs(model: str, layer_start: int, prompt: str = PROMPT) -> torch.Tensor:
    """The hidden states entering layer ``layer_start`` for a chat prompt: (tokens, hidden) float32."""
    ids = encode_prompt(models.load_tokenizer(model), prompt, chat=True)
    hidden = models.load_head(model).embed_tokens(list(ids))  # (tokens, hidden)
    if layer_start > 0:
        prefix = Block(models.load_block(model, 0, layer_start))
        (hidden,) = prefix.forward([WorkItem(KVSession("prefix", "s0"), 0, hidden)])
    return hidden.detach().to(torch.float32)


def steps_of(tokens: int) -> tuple[tuple[int, int], ...]:
    """A prefill of all but the last DECODE_STEPS rows, then one row per step."""
    prefill = tokens - DECODE_STEPS
    return ((0, prefill), *((prefill + i, 1) for i in range(DECODE_STEPS)))


def block_outputs(model: str, layer_start: int, layer_end: int, dtype: str = "float32") -> Callable:
    """Outputs as a node running the span in ``dtype`` computes them, step by step."""
    block = Block(models.load_block(model, layer_start, layer_end, dtype=dtype))

    def run(inputs: torch.Tensor, steps) -> torch.Tensor:
        kv = KVSession("node", "s0")
        rows = [block.forward([WorkItem(kv, start, inputs[start : start + count])])[0] for start, count in steps]
        return torch.cat(rows).to(torch.float32)  # (tokens, hidden)

    return run


def material(
    *,
    node: str,
    model: str,
    layer_start: int,
    layer_end: int,
    outputs: Callable[[torch.Tensor, tuple], torch.Tensor] | None = None,
    prompt: str = PROMPT,
    stage: int = 1,
) -> AuditMaterial:
    """The node's material for a challenge's job: real inputs, and ``outputs(inputs, steps)`` as
    its output rows (default: an honest float32 block's)."""
    inputs = real_inputs(model, layer_start, prompt)  # (tokens, hidden)
    steps = steps_of(inputs.shape[0])
    out = (outputs or block_outputs(model, layer_start, layer_end))(inputs, steps)  # (tokens, hidden)

    def chunks(rows: torch.Tensor) -> tuple[bytes, ...]:
        return tuple(wire.tensor_payload(rows[start : start + count], "f32") for start, count in steps)

    return AuditMaterial(
        job="chatcmpl-" + "0" * 32,
        session="s0",
        stage=stage,
        node=node,
        model=model,
        layer_start=layer_start,
        layer_end=layer_end,
        dtype="f32",
        hidden_size=inputs.shape[1],
        steps=steps,
        inputs=chunks(inputs),
        outputs=chunks(out),
    )


def django_process(settings_module: str, overrides: dict[str, object]) -> None:
    """Start a spawned worker process of a test (``ProcessPoolExecutor``'s initializer): Django set
    up from ``settings_module`` with the test's ``overrides``, before any task of the test's module
    is unpickled there (importing it needs the apps). Its INFO logging is off: a few lines for every
    connection and session of a busy route would cost the process more than the work they report."""
    import logging

    import django
    from django.conf import settings

    os.environ["DJANGO_SETTINGS_MODULE"] = settings_module
    django.setup()
    for name, value in overrides.items():
        setattr(settings, name, value)
    logging.disable(logging.INFO)
