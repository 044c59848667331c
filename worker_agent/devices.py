"""Whether this machine's torch can run on the ``--device`` the owner named, checked before any
weights load or benchmark runs, so that a CPU build of torch or a missing GPU is one clear line
rather than a traceback minutes in."""

from __future__ import annotations

SUPPORTED = ("cpu", "cuda", "mps")


def device_problem(device: str) -> str | None:
    """The one-line error (``error: ...``) saying why torch cannot run on ``device`` here, or None
    when it can."""
    import torch  # loaded by the commands that need a device, never by `keygen` or `--help`

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        return f"error: unknown --device {device!r}: use cpu, cuda or cuda:N"
    if parsed.type not in SUPPORTED:
        return f"error: --device {device}: the agent runs on {', '.join(SUPPORTED)}, not {parsed.type}"
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        return f"error: --device {device} but this machine has no MPS device; use --device cpu"
    if parsed.type != "cuda":
        return None
    build = torch.__version__
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (
            f"error: --device {device} but this torch build has no CUDA (torch {build}); "
            "install a CUDA build of torch or use --device cpu"
        )
    if not torch.cuda.is_available():
        return (
            f"error: --device {device} but no CUDA GPU is visible (torch {build}); "
            "check the GPU driver (nvidia-smi) and CUDA_VISIBLE_DEVICES, or use --device cpu"
        )
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        return f"error: --device {device} but this machine has {count} CUDA device(s): cuda:0 to cuda:{count - 1}"
    return None
