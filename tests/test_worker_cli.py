"""The `swarm-worker` command line: keygen, bench, and serve's refusals."""

from __future__ import annotations

import argparse
import json
import stat
import subprocess
import sys

import pytest

from worker_agent.agent.cli import parse_bytes
from worker_agent.protocol.keys import load_signing_key, node_id, public_key_bytes

pytestmark = pytest.mark.dataplane


def swarm_worker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "worker_agent.agent.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_keygen_writes_a_private_key_and_prints_its_node_id(tmp_path):
    key_path = tmp_path / "node.key"

    done = swarm_worker("keygen", "--out", str(key_path))

    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    public = public_key_bytes(load_signing_key(key_path))
    assert report == {"key": str(key_path), "public_key": public.hex(), "node": node_id(public)}
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert (tmp_path / "node.key.pub").read_text().strip() == public.hex()


def test_keygen_refuses_to_overwrite_a_key(tmp_path):
    key_path = tmp_path / "node.key"
    swarm_worker("keygen", "--out", str(key_path))
    before = key_path.read_bytes()

    done = swarm_worker("keygen", "--out", str(key_path))

    assert done.returncode != 0
    assert "exists" in done.stderr
    assert key_path.read_bytes() == before


def test_bench_reports_layer_tokens_per_second():
    done = swarm_worker(
        "bench",
        "--model",
        "tiny-llama",
        "--layers",
        "0:3",
        "--batch",
        "2",
        "--steps",
        "4",
        "--prompt-tokens",
        "8",
        "--threads",
        "1",
    )

    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["model"] == "tiny-llama"
    assert report["layers"] == "0:3"
    assert report["batch"] == 2
    assert report["threads"] == 1
    assert report["prefill_layer_tokens_per_s"] > 0
    assert report["decode_layer_tokens_per_s"] > 0


def test_serve_fails_loudly_on_a_bad_layer_span(tmp_path):
    done = swarm_worker(
        "serve",
        "--model",
        "tiny-llama",
        "--layers",
        "4:9",
        "--port",
        "0",
        "--key",
        str(tmp_path / "n.key"),
        "--insecure-open",
    )

    assert done.returncode == 1
    assert "bad layer span 4:9 for tiny-llama: need 0 <= start < end <= 6" in done.stderr


def test_serve_requires_a_trusted_issuer_or_insecure_open(tmp_path):
    done = swarm_worker("serve", "--model", "tiny-llama", "--layers", "0:2", "--key", str(tmp_path / "n.key"))

    assert done.returncode == 2
    assert "--trust-key" in done.stderr
    assert not (tmp_path / "n.key").exists()


def test_serve_rejects_a_malformed_span_argument(tmp_path):
    done = swarm_worker("serve", "--layers", "zero:ten", "--insecure-open", "--key", str(tmp_path / "n.key"))

    assert done.returncode == 2
    assert "layer span must look like 0:10, got 'zero:ten'" in done.stderr


@pytest.mark.parametrize(
    ("text", "size"), [("6GiB", 6 << 30), ("512MiB", 512 << 20), ("1.5 KiB", 1536), ("1048576", 1 << 20)]
)
def test_a_memory_size_reads_in_binary_units(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["", "0", "6GB", "-1GiB", "lots", f"{1 << 63}"])
def test_a_memory_size_out_of_range_or_unit_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)
