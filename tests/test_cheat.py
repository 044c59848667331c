"""Test-only cheat modes: what each one makes a stage return, and who may switch one on (only the dev
entry point ``python -m worker_agent.dev.agent``: the product's ``swarm-worker`` has no such option)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from worker_agent import model as models
from worker_agent.agent import cli
from worker_agent.agent.parts import Parts
from worker_agent.block import Block, WorkItem
from worker_agent.dev import agent as dev_agent
from worker_agent.dev.cheat import Cheat, CheatingStage, cheat_from_option, impostor_weights
from worker_agent.dev.local import LocalSwarm
from worker_agent.errors import SwarmError
from worker_agent.kvcache import SessionLimits, SessionStore
from worker_agent.protocol import wire
from worker_agent.protocol.keys import generate_signing_key
from worker_agent.stage import Stage

from .wire_client import raw_client

pytestmark = pytest.mark.trust

MODEL = "tiny-llama"
HIDDEN = 64


@pytest.fixture(scope="module")
def block() -> Block:
    return Block(models.load_block(MODEL, 0, 6))


def _stage(block: Block, cheat: str) -> CheatingStage:
    return CheatingStage(
        block, cheat=Cheat.parse(cheat), model=MODEL, signing_key=generate_signing_key(), insecure_open=True
    )


def _hidden(seed: int, tokens: int) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))  # (tokens, hidden)


def _step(stage: Stage, job: str, inputs: dict[str, torch.Tensor], *, step: int, start: int) -> dict[str, torch.Tensor]:
    """One FORWARD carrying each session's rows; the stage's output per session."""
    items = tuple(wire.Item(session, step, start, rows.shape[0]) for session, rows in inputs.items())
    tensor = torch.cat(list(inputs.values()))  # (rows, hidden)
    forward = wire.Forward(job, items, "f32", tuple(tensor.shape), wire.tensor_payload(tensor, "f32"))
    (outputs,) = stage.compute([stage.prepare(forward)])
    return dict(zip(inputs, outputs, strict=True))


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal up to float32 rounding: batched and lone runs differ by a few ulps (see test_block.py)."""
    return torch.allclose(actual, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def _honest(block: Block, steps: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
    """The block's own outputs for one session's (start, rows) steps."""
    kv = SessionStore(SessionLimits()).open("reference", "s")
    return [block.forward([WorkItem(kv, start, rows)])[0] for start, rows in steps]


@pytest.mark.parametrize(
    ("text", "mode", "fraction"),
    [
        ("garbage", "garbage", 1.0),
        ("identity", "identity", 1.0),
        ("other-weights", "other-weights", 1.0),
        ("selective:0.25", "selective", 0.25),
        ("selective:1", "selective", 1.0),
        ("ring-only", "ring-only", 1.0),
        ("with-successor", "with-successor", 1.0),
    ],
)
def test_parses_every_mode_and_prints_it_back(text, mode, fraction):
    cheat = Cheat.parse(text)

    assert (cheat.mode, cheat.fraction) == (mode, fraction)
    assert Cheat.parse(str(cheat)).fraction == fraction


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "honest",
            "unknown cheat mode 'honest': use one of "
            "garbage, identity, other-weights, selective, ring-only, with-successor, claim-memory",
        ),
        ("claim-memory", "claim-memory needs a factor > 1, e.g. claim-memory:2, got 'claim-memory'"),
        ("claim-memory:1", "claim-memory takes a factor in (1, 1000], and only it: got claim-memory with 1.0"),
        ("claim-memory:nan", "claim-memory takes a factor in (1, 1000], and only it: got claim-memory with nan"),
        ("selective", "selective needs a fraction in (0, 1], e.g. selective:0.5, got 'selective'"),
        ("selective:half", "selective needs a fraction in (0, 1], e.g. selective:0.5, got 'selective:half'"),
        ("selective:0", "a cheat's fraction must be in (0, 1], got 0.0"),
        ("selective:1.5", "a cheat's fraction must be in (0, 1], got 1.5"),
        ("garbage:0.5", "cheat mode 'garbage' takes no argument, got 'garbage:0.5'"),
    ],
)
def test_refuses_a_malformed_mode(text, message):
    with pytest.raises(SwarmError) as refused:
        Cheat.parse(text)

    assert (str(refused.value), refused.value.code) == (message, "cheat_invalid")


def test_claim_memory_reports_more_memory_and_computes_honestly():
    cheat = Cheat.parse("claim-memory:2")

    assert (str(cheat), cheat.reported_memory(3 << 20), cheat.cheats_on("job", "s0")) == (
        "claim-memory:2",
        6 << 20,
        False,
    )
    report = {"device": "cpu", "memory_bytes": 3 << 20}
    assert Parts(reported=cheat.reported_hardware).report(report) == {"device": "cpu", "memory_bytes": 6 << 20}
    assert Parts().report(report) == Cheat.parse("garbage").reported_hardware(report) == report


def test_the_option_is_refused_unless_the_environment_allows_cheating():
    with pytest.raises(SwarmError) as refused:
        cheat_from_option("garbage", environ={"SWARM_ALLOW_CHEAT": "yes"})

    assert refused.value.code == "cheat_refused"
    assert "refused unless SWARM_ALLOW_CHEAT=1 is set" in str(refused.value)
    assert cheat_from_option(None, environ={}) is None
    assert cheat_from_option("identity", environ={"SWARM_ALLOW_CHEAT": "1"}).mode == "identity"


@pytest.mark.parametrize("command", ["serve", "join"])
@pytest.mark.parametrize("option", [["--cheat", "garbage"], ["--wan", "rtt=50ms"]])
def test_the_product_command_has_no_cheat_or_wan_option(command, option, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("SWARM_ALLOW_CHEAT", "1")
    key = tmp_path / "node.key"
    given = {"serve": ["--layers", "0:6", "--insecure-open"], "join": ["--control-plane", "http://127.0.0.1:9"]}

    with pytest.raises(SystemExit) as refused:
        cli.main([command, "--model", MODEL, *given[command], "--key", str(key), *option])

    assert refused.value.code == 2
    assert f"unrecognized arguments: {' '.join(option)}" in capsys.readouterr().err
    assert not key.exists()


def test_serve_with_a_cheat_exits_with_a_clear_error_when_not_allowed(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("SWARM_ALLOW_CHEAT", raising=False)
    key = tmp_path / "node.key"

    code = dev_agent.main(
        ["--cheat", "garbage", "serve", "--model", MODEL, "--layers", "0:6", "--insecure-open", "--key", str(key)]
    )

    assert code == 1
    assert "refused unless SWARM_ALLOW_CHEAT=1 is set (cheat_refused)" in capsys.readouterr().err
    assert not key.exists()  # refused before anything was created


def test_identity_returns_the_input(block):
    stage = _stage(block, "identity")
    stage.open("job", ("s",))
    rows = _hidden(1, 5)

    out = _step(stage, "job", {"s": rows}, step=0, start=0)["s"]

    assert torch.equal(out, rows)


def test_garbage_is_seeded_finite_noise_of_the_blocks_shape_and_dtype(block):
    rows = _hidden(1, 5)
    outputs = []
    for _ in range(2):
        stage = _stage(block, "garbage")
        stage.open("job", ("s",))
        outputs.append(_step(stage, "job", {"s": rows}, step=0, start=0)["s"])
    (honest,) = _honest(block, [(0, rows)])

    assert outputs[0].shape == (5, HIDDEN)
    assert outputs[0].dtype == block.weights.dtype
    assert torch.isfinite(outputs[0]).all()
    assert torch.equal(outputs[0], outputs[1])
    assert not _close(outputs[0], honest)


def test_other_weights_runs_the_same_span_with_seeded_random_weights(block):
    stage = _stage(block, "other-weights")
    stage.open("job", ("s",))
    prompt, step = _hidden(1, 5), _hidden(2, 1)

    live = [
        _step(stage, "job", {"s": prompt}, step=0, start=0)["s"],
        _step(stage, "job", {"s": step}, step=1, start=5)["s"],
    ]

    impostor = Block(impostor_weights(block.weights))
    expected = _honest(impostor, [(0, prompt), (5, step)])
    honest = _honest(block, [(0, prompt), (5, step)])
    for out, want, real in zip(live, expected, honest, strict=True):
        assert torch.equal(out, want)
        assert not _close(out, real)
    impostor_layer = dict(impostor.weights.layers[0].named_parameters())
    for name, parameter in block.weights.layers[0].named_parameters():
        assert impostor_layer[name].shape == parameter.shape


def test_selective_cheats_whole_sessions_for_its_fraction(block):
    cheat = Cheat.parse("selective:0.5")
    stage = _stage(block, "selective:0.5")
    sessions = [f"s{i}" for i in range(32)]
    stage.open("job", tuple(sessions))
    prompts = {session: _hidden(i, 3) for i, session in enumerate(sessions)}
    steps = {session: _hidden(100 + i, 1) for i, session in enumerate(sessions)}

    first = _step(stage, "job", prompts, step=0, start=0)
    second = _step(stage, "job", steps, step=1, start=3)

    cheated = {session for session in sessions if cheat.cheats_on("job", session)}
    assert 0 < len(cheated) < len(sessions)
    for session in sessions:
        honest = _honest(block, [(0, prompts[session]), (3, steps[session])])
        same = [_close(first[session], honest[0]), _close(second[session], honest[1])]
        assert same == ([False, False] if session in cheated else [True, True]), session
    everyone = Cheat.parse("selective:1")
    assert all(everyone.cheats_on("job", session) for session in sessions)


@pytest.mark.parametrize(
    ("mode", "cheated"),
    [
        # job: (topology, next_url) its coordinator's HELLO gave; unseen: no HELLO came for it
        ("ring-only", {"ring-middle", "ring-last"}),
        ("with-successor", {"ring-middle"}),
    ],
)
def test_a_route_cheat_chooses_its_jobs_by_what_their_hello_said(block, mode, cheated):
    stage = _stage(block, mode)
    jobs = {
        "ring-middle": ("ring", "ws://next:1"),
        "ring-last": ("ring", None),
        "star": ("star", None),
        "unseen": None,
    }
    rows = _hidden(1, 4)
    (honest,) = _honest(block, [(0, rows)])
    faked = set()
    for job, route in jobs.items():
        if route is not None:
            stage.cheat.saw_hello(job, *route)
        stage.open(job, ("s",))
        if not _close(_step(stage, job, {"s": rows}, step=0, start=0)["s"], honest):
            faked.add(job)

    assert faked == cheated


def test_a_cheated_session_keeps_its_positions_through_a_rollback(block):
    stage = _stage(block, "garbage")
    stage.open("job", ("s",))
    _step(stage, "job", {"s": _hidden(1, 6)}, step=0, start=0)

    # A rejected speculative draft: the next step starts before the session's end.
    out = _step(stage, "job", {"s": _hidden(2, 2)}, step=1, start=4)["s"]

    assert out.shape == (2, HIDDEN)
    assert stage.store.get("job", "s").length == 6


def test_a_served_agent_with_a_cheat_warns_and_cheats_over_the_wire():
    rows = _hidden(3, 4)

    async def exchange(swarm: LocalSwarm) -> wire.Message:
        async with raw_client(swarm.urls[0]) as client:
            hello = await client.hello("job", swarm.tickets("job")[0], key=swarm.coordinator_key("job"))
            assert isinstance(hello, wire.Hello)
            await client.send(wire.Open("job", ("s",)))
            assert isinstance(await client.recv(), wire.Open)
            payload = wire.tensor_payload(rows, "f32")
            await client.send(wire.Forward("job", (wire.Item("s", 0, 0, 4),), "f32", (4, HIDDEN), payload))
            return await client.recv()

    with LocalSwarm(MODEL, [(0, 6)], cheat="identity") as swarm:
        reply = asyncio.run(exchange(swarm))
        log = swarm.agents[0].log_path.read_text()

    assert isinstance(reply, wire.Result)
    assert torch.equal(reply.tensor(), rows)
    assert "WARNING: --cheat identity: this agent returns WRONG RESULTS on purpose" in log
