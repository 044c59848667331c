"""Work computed together travels together: the coordinator's head runs concurrent sessions'
requests as one batch, and a stage sends one frame per job for a batch's outputs."""

from __future__ import annotations

import asyncio

import pytest
import torch

from worker_agent import model as models
from worker_agent.coordinator.head import HeadBatcher
from worker_agent.server import merge_outputs, one_step_per_session
from worker_agent.stage import Output, Prepared
from worker_agent.wire import Forward, Item, tensor_payload

pytestmark = pytest.mark.dataplane


@pytest.fixture(scope="module")
def head():
    return models.load_head("tiny-llama")


def test_requests_of_one_turn_run_as_one_batch_with_the_same_results(head):
    rows = [torch.randn(3, 64, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    async def main():
        batcher = HeadBatcher(head, "f32")
        try:
            results = await asyncio.gather(*(batcher.logits(tensor_payload(r, "f32")) for r in rows))
            embedded = await asyncio.gather(batcher.embed([5, 6]), batcher.embed([7]))
            return results, embedded, batcher.batches, batcher.rows
        finally:
            batcher.close()

    results, embedded, batches, counted = asyncio.run(main())

    assert batches == 2
    assert counted == 4 + 3
    for row, logits in zip(rows, results, strict=True):
        torch.testing.assert_close(logits, head.logits(row[-1:])[0], rtol=1e-5, atol=1e-5)
    assert embedded[0] == tensor_payload(head.embed_tokens([5, 6]), "f32")
    assert embedded[1] == tensor_payload(head.embed_tokens([7]), "f32")


def test_a_failing_batch_fails_every_waiter(head):
    async def main():
        batcher = HeadBatcher(head, "f32")
        try:
            return await asyncio.gather(batcher.logits(b"\x00" * 12), batcher.embed([1]), return_exceptions=True)
        finally:
            batcher.close()

    results = asyncio.run(main())

    assert [type(r) for r in results] == [RuntimeError, RuntimeError]


def _output(session: str, rows: int, fill: int) -> Output:
    return Output((Item(session, 0, 0, rows),), "f32", (rows, 2), bytes([fill]) * rows * 8)


def test_outputs_of_one_batch_merge_into_one_frame_per_job():
    finished = [("j1", _output("a", 1, 1)), ("j2", _output("x", 2, 2)), ("j1", _output("b", 3, 3))]

    frames = merge_outputs(finished)

    assert [(job, [i.session for i in out.items], out.shape) for job, out in frames] == [
        ("j1", ["a", "b"], (4, 2)),
        ("j2", ["x"], (2, 2)),
    ]
    assert frames[0][1].payload == bytes([1]) * 8 + bytes([3]) * 24


def test_a_session_never_appears_twice_in_a_merged_frame():
    finished = [("j", _output("a", 1, 1)), ("j", _output("a", 1, 2)), ("j", _output("b", 1, 3))]

    frames = merge_outputs(finished)

    assert [[i.session for i in out.items] for _, out in frames] == [["a"], ["a", "b"]]


def _queued(job: str, *sessions: str) -> tuple[str, Prepared]:
    """A queued FORWARD naming ``sessions`` (only its items matter here), tagged by its sessions."""
    items = tuple(Item(session, 0, 0, 1) for session in sessions)
    forward = Forward(job, items, "f32", (len(items), 2), bytes(8 * len(items)))
    return "+".join(sessions), Prepared(forward, (), (), ())


def test_a_pass_takes_one_step_per_session_and_keeps_each_sessions_order():
    frames = [
        _queued("j", "a", "b"),  # a's and b's first chunks
        _queued("j", "a"),  # a's second chunk: waits for the next pass
        _queued("j", "c"),
        _queued("j", "b", "c"),  # b's second and c's second: wait
        _queued("j", "d", "a"),  # a's third: waits, and takes d with it
        _queued("k", "a"),  # another job's session "a" is another session
    ]

    batch, held = one_step_per_session(frames)

    assert [tag for tag, _ in batch] == ["a+b", "c", "a"]
    assert [tag for tag, _ in held] == ["a", "b+c", "d+a"]
    batch, held = one_step_per_session(held)
    assert ([tag for tag, _ in batch], [tag for tag, _ in held]) == (["a", "b+c"], ["d+a"])
