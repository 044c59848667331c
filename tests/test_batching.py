"""Work computed together travels together: the coordinator's head runs a step's sessions in one
pass, and a stage sends one frame per job for a batch's outputs. What a batch is fed is checked
first: a stage's answer of the wrong width or dtype, or an output too short for its rows, fails
its own route, never another's batch."""

from __future__ import annotations

import asyncio

import pytest
import torch

from worker_agent import model as models
from worker_agent.coordinator.head import HeadRunner
from worker_agent.coordinator.pipeline import Pipeline, StageSpec, Transcript
from worker_agent.errors import StageError
from worker_agent.protocol.wire import DTYPES, Forward, Item, Result, tensor_payload
from worker_agent.server import merge_outputs, one_step_per_session
from worker_agent.stage import Output, Prepared

pytestmark = pytest.mark.dataplane


@pytest.fixture(scope="module")
def head():
    return models.load_head("tiny-llama")


def test_a_steps_logits_and_embeddings_each_run_in_one_pass_with_the_same_results(head):
    rows = [torch.randn(3, 64, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    async def main():
        runner = HeadRunner(head, "f32")
        results = await runner.logits([(tensor_payload(r, "f32"), 1) for r in rows])
        embedded = await runner.embed([[5, 6], [7]])
        return results, embedded, runner.passes, runner.rows

    results, embedded, passes, counted = asyncio.run(main())

    assert passes == 2
    assert counted == 4 + 3
    for row, logits in zip(rows, results, strict=True):
        torch.testing.assert_close(logits, head.logits(row[-1:]), rtol=1e-5, atol=1e-5)
    assert embedded[0] == tensor_payload(head.embed_tokens([5, 6]), "f32")
    assert embedded[1] == tensor_payload(head.embed_tokens([7]), "f32")


def test_rows_of_several_outputs_come_back_split_per_output(head):
    rows = torch.randn(5, 64, generator=torch.Generator().manual_seed(7))

    logits = asyncio.run(
        HeadRunner(head, "f32").logits([(tensor_payload(rows, "f32"), 3), (tensor_payload(rows[:2], "f32"), 2)])
    )

    assert [tuple(part.shape) for part in logits] == [(3, head.lm_head.out_features), (2, head.lm_head.out_features)]
    torch.testing.assert_close(logits[0], head.logits(rows[-3:]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[1], head.logits(rows[:2]), rtol=1e-5, atol=1e-5)


def test_a_failing_pass_raises_to_its_caller(head):
    with pytest.raises(IndexError):  # a token id past the vocabulary fails the embedding lookup
        asyncio.run(HeadRunner(head, "f32").embed([[10**9], [1]]))


def test_an_output_too_short_for_its_rows_is_refused_before_anything_runs(head):
    row = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    runner = HeadRunner(head, "f32")

    with pytest.raises(ValueError, match="does not hold 1 rows"):
        asyncio.run(runner.logits([(tensor_payload(row, "f32"), 1), (b"\x00" * 12, 1)]))  # not one row of 64 float32
    with pytest.raises(ValueError, match="does not hold 3 rows"):
        asyncio.run(runner.logits([(tensor_payload(row, "f32"), 3)]))  # 2 rows, not 3

    assert runner.passes == 0


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


def _answer(width: int, dtype: str = "f32") -> Result:
    item = Item("s0", 0, 0, 2)
    return Result("job", (item,), dtype, (2, width), b"\x00" * 2 * width * DTYPES[dtype].itemsize)


@pytest.mark.parametrize(("width", "dtype"), [(32, "f32"), (64, "f16")])
def test_an_answer_of_another_width_or_dtype_fails_the_route_blaming_the_last_stage(width, dtype):
    async def main():
        pipeline = Pipeline("job", [StageSpec("ws://127.0.0.1:9", b"")] * 2, hidden_size=64)
        waiting = asyncio.get_running_loop().create_future()
        pipeline._waiting[("s0", 0)] = waiting
        pipeline.on_result(1, _answer(width, dtype))
        return waiting.exception()

    error = asyncio.run(main())

    assert isinstance(error, StageError)
    assert (error.code, error.stage) == ("stage_bad_output", 1)
    assert f"stage 1 answered {dtype} rows {width} wide, not f32 x 64" in str(error)


def test_an_answer_of_the_route_s_width_and_dtype_is_delivered():
    async def main():
        pipeline = Pipeline("job", [StageSpec("ws://127.0.0.1:9", b"")] * 2, hidden_size=64)
        waiting = asyncio.get_running_loop().create_future()
        pipeline._waiting[("s0", 0)] = waiting
        pipeline.transcripts["s0"] = Transcript()
        pipeline.on_result(1, _answer(64))
        return await waiting

    assert asyncio.run(main()) == b"\x00" * 2 * 64 * 4
