"""Checkpoints for the catalog's tests: seeded random Llamas as ``save_pretrained`` writes them.

``llama_checkpoint`` builds one in a second: 4 decoder layers of hidden size 64, SmolLM2's
tokenizer and chat template (vocabulary 49152, so the OpenAI SDK's chat requests work), sharded
into files of about one layer each when asked, so that an agent holding two layers needs some
shards and not others. ``catalog`` points the control plane's catalog folder at the test's own.

Test modules load this file with ``pytest_plugins = ["tests.catalog_fixtures"]`` and import its
helpers first; it holds no assert, hence PYTEST_DONT_REWRITE.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from worker_agent import model as models

LAYERS = 4
HIDDEN = 64
INTERMEDIATE = 128
# One decoder layer's weights in float32: q, k, v, o projections (4 heads of 16; 2 KV heads),
# gate, up and down projections, and two norms.
LAYER_BYTES = 4 * (HIDDEN * 64 + 2 * HIDDEN * 32 + 64 * HIDDEN + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN)


# The files of an unsharded ``llama_checkpoint``, sorted: what a registration keeps of it.
CHECKPOINT_FILES = [
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


def llama_checkpoint(folder: Path, *, seed: int = 0, shard: str | None = None) -> Path:
    """A seeded random Llama in ``folder``; ``shard`` is ``save_pretrained``'s max_shard_size."""
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        initializer_range=0.3,  # wide: a random model with the usual 0.02 repeats one token
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    AutoTokenizer.from_pretrained(models.resolve_checkpoint("smollm2-135m")).save_pretrained(folder)
    return folder


def content_hash_of(folder: Path, names: list[str]) -> str:
    """The content hash as the catalog defines it, computed here from the files themselves."""
    digest = hashlib.sha256()
    for name in sorted(names):
        digest.update(name.encode() + b"\0" + hashlib.sha256((folder / name).read_bytes()).hexdigest().encode() + b"\n")
    return digest.hexdigest()


def weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


@pytest.fixture
def catalog(settings, tmp_path) -> Path:
    """The control plane keeps registered checkpoints under this test's own folder."""
    settings.SWARM_CATALOG_DIR = tmp_path / "catalog"
    return settings.SWARM_CATALOG_DIR
