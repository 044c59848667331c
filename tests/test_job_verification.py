"""A job's coordinator verifies the stages' receipts before the job is recorded.

The job is admitted through the jobs service onto a route of in-process StageServers (tiny-llama)
that trust the control plane's ticket key, and run by ``runner.run_job`` as a coordinator
process would. A stage that sends other bytes than its own signature covers is refused at the next hop and
blamed; a receipt that contradicts what its stage signed it sent leaves the job unverified,
naming the liar."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from asgiref.sync import sync_to_async

from marketplace.flows import runner
from marketplace.jobs import services
from marketplace.jobs.models import Job, JobState
from marketplace.jobs.params import RequestParams
from marketplace.verification.models import Strike, StrikeKind
from tests import stage_fixtures
from tests.stage_fixtures import stage_servers
from worker_agent.protocol.keys import generate_signing_key, public_key_bytes
from worker_agent.protocol.receipts import digest
from worker_agent.stage import Output, Stage

pytestmark = [pytest.mark.api, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.factories"]

SPANS = [(0, 2), (2, 4), (4, 6)]
MAX_TOKENS = 5


class TamperingStage(Stage):
    """Signs a receipt for its real output, then sends something else."""

    def finish(self, prepared, outputs) -> Output:
        output = super().finish(prepared, outputs)
        flipped = bytes([output.payload[0] ^ 0x01]) + output.payload[1:]
        return dataclasses.replace(output, payload=flipped)


@pytest.fixture
def control_plane(settings, tmp_path):
    """In-memory channel layer (whatever REDIS_URL says), a ticket key of this test's own, free tokens."""
    with stage_fixtures.in_memory_control_plane(
        settings,
        tmp_path,
        SWARM_DEFAULT_PRICES=(0, 0),  # free: these jobs are about receipts, not credits
        SWARM_STALL_TIMEOUT_S=3.0,  # a rogue's unsigned output is no progress: it stalls, then is blamed
    ) as plane:
        yield plane


@pytest.fixture
def api_key(customer):
    api_key, _ = services.create_api_key(customer, "verification")
    return api_key


def admit(api_key, route, monkeypatch) -> Job:
    params = RequestParams(max_tokens=MAX_TOKENS, temperature=0.0, prompt="Hello there")
    return stage_fixtures.admit(api_key, route, params, monkeypatch)


def run_admitted_job(api_key, monkeypatch, **stage_options) -> tuple[str, Job, list[dict]]:
    """Admit a job on a fresh route of in-process stages, run it; (final state, job, its events)."""

    async def scenario():
        options = {"rogue_class": TamperingStage, **stage_options}
        async with stage_servers(SPANS, **options) as route:
            job = await sync_to_async(admit)(api_key, route, monkeypatch)
            state = await runner.run_job(job.pk)
            return state, job.pk, await stage_fixtures.events_until_final(job.public_id, 30)

    state, job_pk, events = asyncio.run(scenario())
    return state, Job.objects.get(pk=job_pk), events


def tokens_of(events: list[dict]) -> list[int]:
    return [event["token_id"] for event in events if event["type"] == "job.token" and event["token_id"] is not None]


def test_honest_route_ends_succeeded_and_verified(control_plane, api_key, monkeypatch):
    state, job, events = run_admitted_job(api_key, monkeypatch)

    assert state == JobState.SUCCEEDED
    assert job.state == JobState.SUCCEEDED
    assert job.verified is True
    assert job.verification_error == ""
    delivered = tokens_of(events)
    assert 1 <= len(delivered) <= MAX_TOKENS
    assert events[-1] == {
        "type": "job.done",
        "finish_reason": job.finish_reason,
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": len(delivered),
        "cached_tokens": 0,  # a short prompt: no 32-token block of it to keep or reuse
    }
    assert job.completion_tokens == len(delivered)
    assert job.finish_reason == ("length" if len(delivered) == MAX_TOKENS else "stop")
    assert [(r["job"], r["node"], r["node_key"], r["layer_start"], r["layer_end"]) for r in job.receipts] == [
        (job.public_id, stage["node"], stage["node_key"], stage["layer_start"], stage["layer_end"])
        for stage in job.route
    ]
    assert job.error_code == ""


@pytest.mark.parametrize("rogue", [0, 1, 2])
def test_stage_sending_other_bytes_than_it_signed_is_refused_and_blamed(control_plane, api_key, monkeypatch, rogue):
    # Every item a stage puts out carries its signature over those bytes: its successor (or, for the
    # last stage, the coordinator) refuses bytes the signature does not cover, and the coordinator,
    # which saw the same forgery in the rogue's taps, blames the rogue, never the stage that refused.
    state, job, events = run_admitted_job(api_key, monkeypatch, rogue=rogue)

    assert state == JobState.FAILED
    assert tokens_of(events) == [] and job.completion_tokens == 0
    assert events[-1]["type"] == "job.error"
    assert job.error_message.endswith(f"no replacement for stage {rogue} is available")


def test_route_whose_stage_does_not_trust_the_control_plane_fails_before_any_token(control_plane, api_key, monkeypatch):
    stranger_key = public_key_bytes(generate_signing_key())

    state, job, events = run_admitted_job(api_key, monkeypatch, trusted=stranger_key)

    assert state == JobState.FAILED
    assert job.state == JobState.FAILED
    assert job.error_code == "ticket_untrusted"
    assert job.error_message.startswith(f"stage 0 ({job.route[0]['url']}) refused HELLO: ticket is signed by an ")
    assert (job.completion_tokens, job.verified, job.receipts) == (0, None, [])
    # The customer reads the code and what it means for them; the node's address stays in the record.
    public = runner.public_failure("ticket_untrusted", job.error_message)
    assert events == [{"type": "job.error", "code": "ticket_untrusted", "message": public}]
    assert "ws://" not in public and "ticket_untrusted" in public


class LyingReceiptStage(Stage):
    """Forwards, taps and signs its true output, but its receipt lists the hash of another one."""

    def open(self, job, sessions, offers=()):
        reused = super().open(job, sessions, offers)
        for session in sessions:
            builder = self._sessions[(job, session)].receipt
            honest = builder.add_step

            def lying(in_hash, out_hash, tokens, link=b"", honest=honest):
                honest(in_hash, digest(b"a copy with one float changed" + out_hash), tokens, link)

            builder.add_step = lying
        return reused


class ReceiptlessStage(Stage):
    """Closes its sessions like any stage, but keeps its receipt to itself."""

    def close(self, job, sessions, keep=()):
        super().close(job, sessions, keep)
        return []


@pytest.mark.parametrize(
    ("rogue", "rogue_class", "code"),
    [
        (1, ReceiptlessStage, "receipt_missing"),
        (0, LyingReceiptStage, "receipt_broken_link"),
        (1, LyingReceiptStage, "receipt_broken_link"),
        (2, LyingReceiptStage, "receipt_endpoint_mismatch"),
    ],
)
def test_a_stage_that_unambiguously_spoils_the_receipts_is_struck_and_only_it(
    control_plane, api_key, monkeypatch, provider, make_joined_node, rogue, rogue_class, code
):
    keys = [generate_signing_key() for _ in SPANS]
    nodes = [make_joined_node(provider, f"gpu-{i}", key=key).node for i, key in enumerate(keys)]

    state, job, _ = run_admitted_job(api_key, monkeypatch, rogue=rogue, rogue_class=rogue_class, keys=keys)

    assert state == JobState.SUCCEEDED
    assert job.verified is False
    assert job.verification_error.endswith(f"({code})")
    # Only the rogue is struck: for its receipt, and (when the job drew an audit of its stage) for the
    # audit its lying receipt fails too.
    assert set(Strike.objects.values_list("node_id", flat=True)) == {nodes[rogue].pk}
    (strike,) = Strike.objects.filter(kind=StrikeKind.RECEIPT)
    assert strike.evidence["job"] == job.public_id
