"""The agent's CUDA path: a 30-layer block of smollm2-135m's shape (random weights: the shapes set
the speed) on a GPU in float32, bfloat16 and float16, against the same block in float32 on this
machine's CPU.

    python bench/gpu.py [--device cuda] [--steps 32]

Per dtype: the largest per-token deviation from the CPU float32 block over a 32-token prefill and
decode steps (1 - cosine, and the relative error), and the speed of decode steps batched over 1, 8,
32 and 64 sessions (``Block.forward`` with one token per session, after each session's 32-token
prefill): milliseconds a step and layer-tokens/s, the unit an agent's benchmark reports. Needs
only torch, transformers and safetensors (no weights to download: the checkpoint is made here).
The table goes to stdout, everything to ``bench/results/gpu.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from report import machine_line, write_json

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from worker_agent import model as models  # noqa: E402
from worker_agent.block import Block, WorkItem  # noqa: E402
from worker_agent.kvcache import SessionLimits, SessionStore  # noqa: E402

# smollm2-135m's shape (its config.json), so the figures are those of the model the demo serves.
SMOLLM2_SHAPE = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}
BATCHES = (1, 8, 32, 64)
PREFILL = 32
WARM_STEPS = 8  # untimed decode steps first: a dtype's first kernels load lazily on CUDA


def checkpoint(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).save_pretrained(folder, safe_serialization=True)
    return folder


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def deviation(block: Block, reference: Block, hidden: torch.Tensor) -> dict:
    """Worst per-token 1 - cosine and relative error of ``block`` against ``reference`` over a
    prefill of ``hidden[:-4]`` then four one-token steps."""
    outputs = []
    for run in (block, reference):
        store = SessionStore(SessionLimits())
        session = store.open("deviation", "s")
        rows = [run.forward([WorkItem(session, 0, hidden[:-4])])[0]]
        for i in range(hidden.shape[0] - 4, hidden.shape[0]):
            rows.append(run.forward([WorkItem(session, i, hidden[i : i + 1])])[0])
        outputs.append(torch.cat(rows).float().cpu())
    got, want = outputs
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    relative = (got - want).norm(dim=-1) / want.norm(dim=-1)
    return {"worst_1_minus_cosine": float(1 - cosine.min()), "worst_relative_error": float(relative.max())}


def speed(block: Block, hidden_size: int, batch: int, steps: int, device: str) -> dict:
    store = SessionStore(SessionLimits(max_sessions=batch))
    sessions = [store.open("speed", f"s{i}") for i in range(batch)]
    generator = torch.Generator().manual_seed(batch)
    prefill = torch.randn(PREFILL, hidden_size, generator=generator).to(device, block.weights.dtype)
    block.forward([WorkItem(session, 0, prefill) for session in sessions])
    step = torch.randn(1, hidden_size, generator=generator).to(device, block.weights.dtype)
    for warm in range(WARM_STEPS):
        block.forward([WorkItem(session, PREFILL + warm, step) for session in sessions])
    sync(device)
    started = time.perf_counter()
    for i in range(steps):
        block.forward([WorkItem(session, PREFILL + WARM_STEPS + i, step) for session in sessions])
    sync(device)
    elapsed = time.perf_counter() - started
    layers = block.weights.layer_end - block.weights.layer_start
    return {
        "batch": batch,
        "ms_per_step": round(1000 * elapsed / steps, 3),
        "layer_tokens_per_s": round(batch * layers * steps / elapsed, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "gpu.json")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    result: dict = {"device": args.device, "results": []}
    if args.device.startswith("cuda"):
        result["device_name"] = torch.cuda.get_device_name(torch.device(args.device))
    with tempfile.TemporaryDirectory(prefix="bench-cuda-") as tmp:
        folder = str(checkpoint(Path(tmp)))
        layers = SMOLLM2_SHAPE["num_hidden_layers"]
        reference = Block(models.load_block(folder, 0, layers, dtype="float32", device="cpu"), max_batch=64)
        hidden = torch.randn(PREFILL + 4, SMOLLM2_SHAPE["hidden_size"], generator=torch.Generator().manual_seed(1))
        cpu = {"dtype": "float32", "device": "cpu", "speed": []}
        for batch in (1, 8):
            cpu["speed"].append(speed(reference, SMOLLM2_SHAPE["hidden_size"], batch, max(4, args.steps // 4), "cpu"))
        result["results"].append(cpu)
        for dtype in args.dtypes.split(","):
            block = Block(models.load_block(folder, 0, layers, dtype=dtype, device=args.device), max_batch=64)
            entry = {"dtype": dtype, "device": args.device, **deviation(block, reference, hidden), "speed": []}
            for batch in BATCHES:
                entry["speed"].append(speed(block, SMOLLM2_SHAPE["hidden_size"], batch, args.steps, args.device))
            result["results"].append(entry)
            del block
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    result["conditions"] = {
        "machine": machine_line(),
        "torch": torch.__version__,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(
        f"{'dtype':<9} {'device':<7} {'1-cos':>9} {'rel err':>9}  "
        + "  ".join(f"B={b:<3} ms / layer-tok/s" for b in BATCHES)
    )
    for entry in result["results"]:
        cells = "  ".join(f"{s['ms_per_step']:>7.2f} / {s['layer_tokens_per_s']:>10.0f}" for s in entry["speed"])
        cos, rel = entry.get("worst_1_minus_cosine"), entry.get("worst_relative_error")
        cos_text = "-" if cos is None else f"{cos:.2e}"
        rel_text = "-" if rel is None else f"{rel:.2e}"
        print(f"{entry['dtype']:<9} {entry['device']:<7} {cos_text:>9} {rel_text:>9}  {cells}")
    write_json(args.output, result)
    print(f"written to {args.output.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
