"""Every supported model type, on seeded random tiny checkpoints built here, against transformers.

- In-process: the coordinator's head (embeddings, final norm, LM head) around two blocks of two
  layers each gives the hidden states of Hugging Face's own decoder layers (read by a hook on its
  final norm) and its logits, for two sessions batched in every call with ragged steps.
- End to end: the checkpoint served by two real ``swarm-worker serve`` processes (layers 0:2 and
  2:4) and driven by a ``Coordinator`` gives the greedy tokens of single-process ``generate``,
  decoding plainly and with n-gram speculation (multi-token verification passes).
- Any other model type is refused at load, naming every supported one.

The configs exercise what each type adds: Qwen2's sliding layers next to full ones, Mistral's
window for every layer, Qwen3's head norms and biases, Gemma's scaled embeddings and
``x * (1 + w)`` norms, Gemma 2's sandwich norms, attention and final soft-caps, a
query_pre_attn_scalar other than head_dim and alternating sliding layers, Phi-3's fused
projections and partial rotary, Granite's four multipliers. Windows of 8 positions are shorter
than every sequence here, so the window masks matter. Norm weights get seeded noise on top of
their initial values, so a norm computed as ``x * w`` instead of ``x * (1 + w)`` (or the reverse)
cannot pass. The weights' standard deviation of 0.3 (and Gemma 2's untied LM head, whose tied one
makes its random model repeat the first token it emits) keep the greedy output from collapsing
to one repeated token; the end-to-end test asserts at least 3 distinct tokens in the reference,
so it can fail. Greedy argmax is blind to the final soft-cap and Granite's logits_scaling (both
monotone): the in-process test compares the logits themselves.
"""

from __future__ import annotations

import asyncio
from functools import cache
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers import models as tokenizer_models
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GemmaConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from worker_agent import model as models
from worker_agent.architectures import SUPPORTED_MODEL_TYPES
from worker_agent.block import Block, WorkItem
from worker_agent.coordinator.job import Coordinator
from worker_agent.coordinator.pipeline import StageSpec
from worker_agent.coordinator.speculation import SpeculationSettings
from worker_agent.dev.local import LocalSwarm
from worker_agent.errors import ModelError
from worker_agent.kvcache import KVSession

pytestmark = pytest.mark.dataplane

VOCAB = 256  # ids 0..3 are the tokenizer's unk, eos, pad and bos; prompts draw from 4..255
EOS, PAD, BOS = 1, 2, 3
LAYERS = 4
SPANS = [(0, 2), (2, 4)]
NEW_TOKENS = 16
WINDOW = 8
# Each session's steps (first position, tokens): a prefill, decode steps, speculative-sized chunks.
STEPS_A = [(0, 7), (7, 1), (8, 1), (9, 5), (14, 1), (15, 5)]
STEPS_B = [(0, 3), (3, 6), (9, 1), (10, 1), (11, 4), (15, 5)]


def _common(**extra) -> dict:
    return {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "initializer_range": 0.3,
        **extra,
    }


CONFIGS = {
    "llama": lambda: LlamaConfig(**_common()),
    "mistral": lambda: MistralConfig(**_common(sliding_window=WINDOW)),
    # Layers 2 and 3 slide, 0 and 1 attend to everything.
    "qwen2": lambda: Qwen2Config(**_common(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
    "qwen3": lambda: Qwen3Config(**_common(head_dim=16, attention_bias=True)),
    "gemma": lambda: GemmaConfig(**_common(head_dim=16)),
    "gemma2": lambda: Gemma2Config(
        **_common(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=6.0,
            tie_word_embeddings=False,
        )
    ),
    "phi3": lambda: Phi3Config(**_common(partial_rotary_factor=0.5)),
    "granite": lambda: GraniteConfig(
        **_common(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0)
    ),
}


def _tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``VOCAB`` made-up words ``<t0>``..: the coordinator needs one
    (to know the EOS id and to detokenize), and nothing may be downloaded."""
    words = Tokenizer(tokenizer_models.WordLevel({f"<t{i}>": i for i in range(VOCAB)}, unk_token="<t0>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<t0>", eos_token=f"<t{EOS}>", pad_token=f"<t{PAD}>", bos_token=f"<t{BOS}>"
    )


def _checkpoint(folder: Path, config: PretrainedConfig) -> Path:
    """A seeded random checkpoint of ``config`` with a tokenizer, as ``save_pretrained`` writes it."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.add_(0.3 * torch.randn_like(weight))
    model.save_pretrained(folder, safe_serialization=True)
    _tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("architectures")
    return {kind: _checkpoint(root / kind, make()) for kind, make in CONFIGS.items()}


@cache
def _hugging_face(folder: Path):
    """The checkpoint as transformers runs it, with its default attention for the type (eager for
    Gemma 2, whose soft-cap torch's fused kernel lacks)."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _ids(seed: int, count: int) -> list[int]:
    return torch.randint(EOS + 3, VOCAB, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to within 1e-5 of the expected values' largest magnitude (see tests/test_block.py)."""
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def test_every_supported_type_is_tested_here():
    assert ", ".join(SUPPORTED_MODEL_TYPES) == "llama, mistral, qwen2, qwen3, gemma, gemma2, phi3, granite"
    assert tuple(CONFIGS) == SUPPORTED_MODEL_TYPES


# --- in-process: head and blocks against Hugging Face's forward ---------------------------


@torch.inference_mode()
def _reference(folder: Path, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What Hugging Face's forward over ``ids`` (causal, no cache) feeds its first decoder layer,
    gets from its last and returns as logits: (tokens, hidden), (tokens, hidden), (tokens, vocab)."""
    model = _hugging_face(folder)
    first, last = [], []
    hooks = [
        model.model.layers[0].register_forward_pre_hook(lambda module, args: first.append(args[0][0])),
        model.model.norm.register_forward_hook(lambda module, args, output: last.append(args[0][0])),
    ]
    try:
        logits = model(torch.tensor([ids])).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    return first[0], last[0], logits


@pytest.mark.parametrize("kind", SUPPORTED_MODEL_TYPES)
def test_head_and_two_blocks_equal_hugging_faces_forward_for_batched_ragged_steps(checkpoints, kind):
    # Given the head and two blocks of the model, and two sessions on two 20-token sequences
    model = str(checkpoints[kind])
    head = models.load_head(model)
    blocks = [Block(models.load_block(model, start, end)) for start, end in SPANS]
    ids = {"a": _ids(1, 20), "b": _ids(2, 20)}
    sessions = {name: [KVSession("job-1", f"{name}{i}") for i in range(len(blocks))] for name in ids}
    hidden: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    logits: dict[str, list[torch.Tensor]] = {"a": [], "b": []}

    # When both take their ragged steps together, each call holding one step of each session
    for step_a, step_b in zip(STEPS_A, STEPS_B, strict=True):
        steps = {"a": step_a, "b": step_b}
        rows = [head.embed_tokens(ids[name][start : start + count]) for name, (start, count) in steps.items()]
        for index, block in enumerate(blocks):
            rows = block.forward(
                [WorkItem(sessions[name][index], steps[name][0], x) for name, x in zip(steps, rows, strict=True)]
            )
        for name, out in zip(steps, rows, strict=True):
            hidden[name].append(out)
            logits[name].append(head.logits(out))

    # Then the embeddings, the layers' output and the logits are those of Hugging Face's forward
    for name, sequence in ids.items():
        embedded, layers_out, expected_logits = _reference(checkpoints[kind], sequence)
        _assert_close(head.embed_tokens(sequence), embedded)
        _assert_close(torch.cat(hidden[name]), layers_out)
        _assert_close(torch.cat(logits[name]), expected_logits)


# --- end to end: two agent processes against generate -------------------------------------


@pytest.fixture(scope="module", params=SUPPORTED_MODEL_TYPES)
def served(request, checkpoints):
    """(model type, checkpoint folder, swarm): two agents serving layers 0:2 and 2:4 of it."""
    with LocalSwarm(str(checkpoints[request.param]), SPANS, threads=1) as swarm:
        yield request.param, checkpoints[request.param], swarm


def _greedy(folder: Path, prompt: list[int]) -> list[int]:
    """Single-process greedy ``generate``'s new tokens, without a trailing EOS."""
    with torch.inference_mode():
        out = _hugging_face(folder).generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    tokens = out[0, len(prompt) :].tolist()
    return tokens[:-1] if tokens[-1:] == [EOS] else tokens


async def _pipeline(swarm: LocalSwarm, model: str, prompts: list[list[int]], speculation: SpeculationSettings):
    """The prompts generated concurrently through the swarm's two stages."""
    job = f"job-{speculation.drafter or 'plain'}"
    specs = [StageSpec(url, ticket) for url, ticket in zip(swarm.urls, swarm.tickets(job), strict=True)]
    async with Coordinator(
        model, specs, job=job, coordinator_key=swarm.coordinator_key(job), speculation=speculation
    ) as coordinator:
        requests = [coordinator.request_ids(prompt, max_tokens=NEW_TOKENS) for prompt in prompts]
        return await asyncio.gather(*(coordinator.generate(request) for request in requests))


@pytest.mark.parametrize(
    "speculation",
    [SpeculationSettings(enabled=False), SpeculationSettings(drafter="ngram", k=4)],
    ids=["plain", "ngram"],
)
def test_greedy_tokens_of_two_agent_processes_equal_generate(served, speculation):
    # Given a prompt of random ids, and one that repeats itself (so n-gram drafts get verified)
    kind, folder, swarm = served
    prompts = [_ids(3, 7), _ids(4, 6) * 2]
    expected = [_greedy(folder, prompt) for prompt in prompts]
    assert all(len(set(tokens)) >= 3 for tokens in expected), f"{kind}: degenerate reference {expected}"

    # When the pipeline generates them concurrently
    results = asyncio.run(_pipeline(swarm, str(folder), prompts, speculation))

    # Then it emits exactly generate's tokens, with receipts that verify
    assert [result.token_ids for result in results] == expected
    assert all(result.verification is not None for result in results)
    if speculation.enabled:
        assert sum(result.drafted for result in results) > 0


# --- refusals -----------------------------------------------------------------------------


def test_refuses_any_other_model_type_at_load_naming_every_supported_type(tmp_path):
    # OLMo 2 has a Llama's parts but norms each sublayer's output, not its input: it must not run as Llama.
    folder = str(_checkpoint(tmp_path / "olmo2", Olmo2Config(**_common())))
    message = (
        "olmo2: model type 'olmo2' is not one the layer block computes; "
        "supported: llama, mistral, qwen2, qwen3, gemma, gemma2, phi3, granite"
    )

    for load in (lambda: models.load_block(folder, 0, 2), lambda: models.load_head(folder)):
        with pytest.raises(ModelError) as err:
            load()
        assert err.value.code == "model_unsupported"
        assert str(err.value) == message


def test_refuses_layers_that_attend_bidirectionally_before_reading_a_weight(tmp_path):
    config = GemmaConfig(**_common(head_dim=16, use_bidirectional_attention=True))
    folder = str(_checkpoint(tmp_path / "encoder", config))

    for load in (lambda: models.load_block(folder, 1, 3), lambda: models.load_head(folder)):
        with pytest.raises(ModelError) as err:
            load()
        assert err.value.code == "model_unsupported"
        assert str(err.value) == (
            "encoder: its layers attend bidirectionally; the layer block computes causal attention only"
        )
