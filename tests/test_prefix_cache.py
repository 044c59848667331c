"""A stage's kept prefixes (prefixcache.py): bounded, least recently used first, yielding to live
sessions' memory, found only by the keys they were kept under; and a stage that opens a session on
one computes only the rest, with the same outputs and a receipt that says so."""

from __future__ import annotations

import pytest
import torch

from worker_agent import model as models
from worker_agent.block import Block
from worker_agent.kvcache import KVLayout, KVMemory, KVSession, position_bytes
from worker_agent.prefixcache import PrefixCache, PrefixLimits
from worker_agent.protocol.keys import generate_signing_key
from worker_agent.protocol.prefix import BLOCK, keep_keys, offer_keys
from worker_agent.protocol.receipts import Receipt, ReusedFrom
from worker_agent.protocol.wire import Forward, Item, tensor_payload
from worker_agent.stage import Stage

pytestmark = pytest.mark.dataplane

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
SALT = b"s" * 32
TOKENS = list(range(1, 4 * BLOCK + 1))
SOURCE = ReusedFrom("job-a", "s0", bytes(32))


def _filled(positions: int, memory: KVMemory | None = None, mark: float = 0.0) -> KVSession:
    """A session holding ``positions`` positions: position p of layer l keys p + l + mark."""
    kv = KVSession("job-a", "s0", memory=memory)
    kv.reserve(positions, LAYOUT)
    for layer in range(LAYOUT.layers):
        keys = torch.arange(positions, dtype=torch.float32).view(1, positions, 1) + layer + mark  # (1, positions, 1)
        kv.keys[layer][:, :positions] = keys
        kv.values[layer][:, :positions] = -keys
    kv.length = positions
    return kv


def _keys(salt: bytes = SALT, tokens: list[int] = TOKENS, held: int = 4 * BLOCK):
    return keep_keys(salt, "m", tokens, held)


def test_a_new_session_gets_a_copy_of_the_longest_kept_prefix_its_keys_name():
    cache = PrefixCache()
    kept = cache.keep(_filled(3 * BLOCK + 5), _keys(), SOURCE)
    fresh = KVSession("job-b", "s0")

    positions, source = cache.reuse(fresh, offer_keys(SALT, "m", TOKENS))

    assert (kept, positions, source) == (3 * BLOCK, 3 * BLOCK, SOURCE)
    assert fresh.length == 3 * BLOCK
    assert fresh.keys[1][0, : fresh.length, 0].tolist() == [float(p + 1) for p in range(3 * BLOCK)]
    fresh.keys[0][:, :] = 0  # the copy is the session's own: the kept prefix is untouched
    again = KVSession("job-c", "s0")
    assert cache.reuse(again, offer_keys(SALT, "m", TOKENS))[0] == 3 * BLOCK
    assert again.keys[0][0, :4, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_shorter_prompt_reuses_the_kept_prefix_up_to_its_own_boundary():
    cache = PrefixCache()
    cache.keep(_filled(4 * BLOCK), _keys(), SOURCE)
    fresh = KVSession("job-b", "s0")

    assert cache.reuse(fresh, offer_keys(SALT, "m", TOKENS[: 2 * BLOCK + 3]))[0] == 2 * BLOCK
    assert fresh.length == 2 * BLOCK


def test_salts_isolate_accounts():
    cache = PrefixCache()
    cache.keep(_filled(4 * BLOCK), _keys(), SOURCE)

    assert cache.reuse(KVSession("job-b", "s0"), offer_keys(b"t" * 32, "m", TOKENS)) == (0, None)


def test_another_prompt_finds_nothing():
    cache = PrefixCache()
    cache.keep(_filled(4 * BLOCK), _keys(), SOURCE)
    other = [token + 1 for token in TOKENS]

    assert cache.reuse(KVSession("job-b", "s0"), offer_keys(SALT, "m", other)) == (0, None)


def test_keeps_at_most_max_entries_evicting_the_least_recently_used():
    cache = PrefixCache(PrefixLimits(max_entries=2))
    prompts = [[token + 1000 * n for token in TOKENS] for n in range(3)]
    cache.keep(_filled(2 * BLOCK), _keys(tokens=prompts[0]), SOURCE)
    cache.keep(_filled(2 * BLOCK), _keys(tokens=prompts[1]), SOURCE)
    cache.reuse(KVSession("job-b", "s0"), offer_keys(SALT, "m", prompts[0]))  # prompt 0 is now the newest

    cache.keep(_filled(2 * BLOCK), _keys(tokens=prompts[2]), SOURCE)

    assert (len(cache), cache.positions, cache.evicted) == (2, 4 * BLOCK, 1)
    found = [cache.reuse(KVSession("job-c", f"s{n}"), offer_keys(SALT, "m", prompts[n]))[0] for n in range(3)]
    assert found == [2 * BLOCK, 0, 2 * BLOCK]


def test_keeps_at_most_max_positions():
    cache = PrefixCache(PrefixLimits(max_positions=3 * BLOCK))
    cache.keep(_filled(2 * BLOCK), _keys(tokens=[t + 1000 for t in TOKENS]), SOURCE)

    assert cache.keep(_filled(4 * BLOCK), _keys(), SOURCE) == 0  # over the bound alone: not kept
    assert cache.keep(_filled(2 * BLOCK), _keys(), SOURCE) == 2 * BLOCK
    assert (len(cache), cache.positions) == (1, 2 * BLOCK)


def test_kept_prefixes_yield_their_memory_to_a_live_session():
    size = position_bytes(LAYOUT)
    memory = KVMemory(6 * BLOCK * size)
    cache = PrefixCache(memory=memory)
    cache.keep(_filled(4 * BLOCK), _keys(), SOURCE)
    assert memory.caches == 4 * BLOCK * size

    live = KVSession("job-b", "s0", memory=memory)
    live.reserve(5 * BLOCK, LAYOUT)  # more than the free room: the kept prefix goes

    assert (len(cache), cache.evicted) == (0, 1)
    assert memory.caches == live.granted == 5 * BLOCK * size
    assert cache.reuse(KVSession("job-c", "s0"), offer_keys(SALT, "m", TOKENS)) == (0, None)


def test_a_prefix_that_does_not_fit_the_memory_is_not_kept():
    size = position_bytes(LAYOUT)
    memory = KVMemory(BLOCK * size)
    cache = PrefixCache(memory=memory)

    assert cache.keep(_filled(2 * BLOCK), _keys(), SOURCE) == 0
    assert (len(cache), memory.caches) == (0, 0)


def test_clear_releases_every_kept_prefix_and_stops_yielding():
    size = position_bytes(LAYOUT)
    memory = KVMemory(8 * BLOCK * size)
    cache = PrefixCache(memory=memory)
    cache.keep(_filled(4 * BLOCK), _keys(), SOURCE)

    cache.clear()

    assert (len(cache), cache.positions, memory.caches) == (0, 0, 0)
    assert memory._reclaimers == []


# --- a stage opening sessions on kept prefixes (tiny-llama) ---------------------------------


def _stage() -> Stage:
    return Stage(Block(models.load_block("tiny-llama", 0, 2)), model="tiny-llama", signing_key=generate_signing_key())


def _step(stage: Stage, job: str, session: str, step: int, start: int, rows: torch.Tensor) -> torch.Tensor:
    payload = tensor_payload(rows, "f32")
    forward = Forward(job, (Item(session, step, start, rows.shape[0]),), "f32", tuple(rows.shape), payload)
    prepared = stage.prepare(forward)
    (outputs,) = stage.compute([prepared])
    stage.finish(prepared, outputs)
    return outputs[0]


def test_a_stage_computes_only_past_a_kept_prefix_with_the_same_outputs_and_says_so_in_its_receipt():
    stage = _stage()
    torch.manual_seed(0)
    rows = torch.randn(3 * BLOCK + 7, stage.block.hidden_size)  # (positions, hidden)
    tokens = list(range(rows.shape[0]))
    stage.open("job-a", ("s0",))
    full = _step(stage, "job-a", "s0", 0, 0, rows)
    (first,) = stage.close("job-a", ("s0",), (keep_keys(SALT, "tiny-llama", tokens, rows.shape[0]),))

    reused = stage.open("job-b", ("s0",), (offer_keys(SALT, "tiny-llama", tokens),))
    rest = _step(stage, "job-b", "s0", 0, reused[0], rows[reused[0] :])
    (second,) = stage.close("job-b", ("s0",))

    assert reused == (3 * BLOCK,)
    assert torch.allclose(rest, full[3 * BLOCK :], rtol=1e-4, atol=1e-4)
    receipt = Receipt.from_dict(second)
    receipt.verify_signature()
    assert (receipt.reused, receipt.tokens) == (3 * BLOCK, 7)
    assert receipt.reused_from == ReusedFrom("job-a", "s0", Receipt.from_dict(first).chain_head)
    assert Receipt.from_json(receipt.to_json()) == receipt


def test_a_first_step_below_the_kept_prefix_cuts_what_the_receipt_says_was_reused():
    stage = _stage()
    rows = torch.randn(2 * BLOCK + 3, stage.block.hidden_size)  # (positions, hidden)
    tokens = list(range(rows.shape[0]))
    stage.open("job-a", ("s0",))
    _step(stage, "job-a", "s0", 0, 0, rows)
    stage.close("job-a", ("s0",), (keep_keys(SALT, "tiny-llama", tokens, rows.shape[0]),))

    assert stage.open("job-b", ("s0", "s1"), (offer_keys(SALT, "tiny-llama", tokens),) * 2) == (2 * BLOCK,) * 2
    _step(stage, "job-b", "s0", 0, BLOCK, rows[BLOCK:])
    _step(stage, "job-b", "s1", 0, 0, rows)
    receipts = [Receipt.from_dict(raw) for raw in stage.close("job-b", ("s0", "s1"))]

    assert [(r.reused, r.tokens) for r in receipts] == [(BLOCK, BLOCK + 3), (0, 2 * BLOCK + 3)]
    assert receipts[1].reused_from is None
