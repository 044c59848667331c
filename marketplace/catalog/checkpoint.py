"""What a checkpoint folder holds, read from its own files: ``config.json`` and the safetensors
headers (the 8-byte length and the JSON that open each weight file), never a tensor's bytes.

``describe`` refuses a folder the swarm could not serve, each time with a message naming what is
wrong: no readable config.json, a model type the layer block does not compute
(``worker_agent.architectures``), no tokenizer, a weight file whose header cannot be read or
whose tensors run past its end, a decoder layer or the embeddings missing from the weights.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from marketplace.catalog.errors import CatalogError
from worker_agent.architectures import SUPPORTED_MODEL_TYPES
from worker_agent.checkpoints import INDEX_FILE, SINGLE_FILE

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors refuses larger headers too
MAX_CONFIG_BYTES = 1024 * 1024
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # any one of them makes a tokenizer
# safetensors dtype -> (the name torch gives it, bytes per element)
DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}


@dataclass(frozen=True)
class Tensor:
    file: str  # the weight file holding it
    dtype: str  # safetensors dtype, a key of DTYPES
    nbytes: int


@dataclass(frozen=True)
class Description:
    """A checkpoint as the catalog records it (its files and their hash are counted apart)."""

    architecture: str  # config.json's model_type
    n_layers: int
    context_length: int | None  # max_position_embeddings; None when the config sets none
    dtype: str  # the decoder layers' weights as stored: the dtype holding most of layer 0's bytes
    bytes_per_layer: int  # of layer 0's tensors


def _refuse(message: str, code: str) -> CatalogError:
    return CatalogError(message, param="source", code=code)


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise _refuse(f"the checkpoint at {folder} has no config.json", "catalog_missing_config")
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ValueError(f"over {MAX_CONFIG_BYTES} bytes")
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise _refuse(f"the checkpoint's config.json is not readable JSON: {exc}", "catalog_missing_config") from None
    if not isinstance(config, dict):
        raise _refuse("the checkpoint's config.json is not a JSON object", "catalog_missing_config")
    return config


def read_header(path: Path) -> dict[str, Tensor]:
    """The tensors a safetensors file declares, each checked to lie inside the file."""
    unreadable = "catalog_unreadable_safetensors"
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if size < 8 or length > min(size - 8, MAX_HEADER_BYTES):
                raise ValueError(f"a header of {length} bytes does not fit a file of {size}")
            header = json.loads(handle.read(length))
    except (OSError, ValueError) as exc:
        raise _refuse(f"{path.name} is not a readable safetensors file: {exc}", unreadable) from None
    if not isinstance(header, dict):
        raise _refuse(f"{path.name}: the safetensors header is not a JSON object", unreadable)
    data_bytes = size - 8 - length
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            nbytes = math.prod(shape) * DTYPES[dtype][1]
            if not (0 <= start <= end <= data_bytes and end - start == nbytes):
                raise ValueError(f"its bytes {start}:{end} do not hold shape {shape} of {dtype} within the file")
        except (KeyError, TypeError, ValueError) as exc:
            raise _refuse(f"{path.name}: tensor {key!r} is malformed ({exc})", unreadable) from None
        tensors[key] = Tensor(path.name, dtype, nbytes)
    return tensors


def read_tensors(folder: Path) -> dict[str, Tensor]:
    """Every tensor of the checkpoint, from one model.safetensors or the shards its index names."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _refuse(
                f"{INDEX_FILE} has no readable weight_map ({exc})", "catalog_unreadable_safetensors"
            ) from None
    elif (folder / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise _refuse(
            f"the checkpoint at {folder} has no {SINGLE_FILE} (or {INDEX_FILE}): only safetensors weights are served",
            "catalog_unreadable_safetensors",
        )
    tensors: dict[str, Tensor] = {}
    for name in files:
        if "/" in name or not (folder / name).is_file():
            raise _refuse(f"{INDEX_FILE} names {name!r}, which is not in the folder", "catalog_unreadable_safetensors")
        tensors |= read_header(folder / name)
    return tensors


def _count(config: dict, name: str, *, minimum: int) -> int | None:
    value = config.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _refuse(f"config.json's {name} must be an integer >= {minimum}, got {value!r}", "catalog_missing_config")
    return value


def describe(folder: Path) -> Description:
    """The catalog's fields of the checkpoint in ``folder``; CatalogError when it cannot be served."""
    config = read_config(folder)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _refuse(
            f"model type {model_type!r} is not one the layer block computes; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}",
            "catalog_unsupported_architecture",
        )
    n_layers = _count(config, "num_hidden_layers", minimum=1)
    if n_layers is None:
        raise _refuse("config.json does not set num_hidden_layers", "catalog_missing_config")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise _refuse(
            f"the checkpoint has no tokenizer (one of {', '.join(TOKENIZER_FILES)}): its coordinators need one",
            "catalog_missing_config",
        )
    tensors = read_tensors(folder)
    absent = [i for i in range(n_layers) if not any(key.startswith(f"model.layers.{i}.") for key in tensors)]
    if absent or "model.embed_tokens.weight" not in tensors:
        what = f"decoder layers {absent[:5]}" if absent else "model.embed_tokens.weight"
        raise _refuse(
            f"the weights lack {what} of the {n_layers} layers config.json names", "catalog_unreadable_safetensors"
        )
    first = [tensor for key, tensor in tensors.items() if key.startswith("model.layers.0.")]
    by_dtype: dict[str, int] = {}
    for tensor in first:
        by_dtype[tensor.dtype] = by_dtype.get(tensor.dtype, 0) + tensor.nbytes
    return Description(
        architecture=model_type,
        n_layers=n_layers,
        context_length=_count(config, "max_position_embeddings", minimum=1),
        dtype=DTYPES[max(by_dtype, key=by_dtype.__getitem__)][0],
        bytes_per_layer=sum(by_dtype.values()),
    )
