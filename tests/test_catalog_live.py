"""A GPU owner's checkpoint served end to end from the catalog.

A live control plane (uvicorn in a thread, the test database) serves no model of its settings
(SWARM_MODELS is empty): an admin registers a seeded random Llama checkpoint folder (4 layers,
sharded about a layer per file) through the staff API, with its prices. Two ``swarm-worker join``
agents, each capped at 2 layers and each with a model cache of its own, are assigned a block each:
they fetch the files of their block from the control plane (never the embeddings' shard, nor the
other's layers), check them against the content hash and serve. A chat completion streams through
the OpenAI SDK by the catalog name; it is the checkpoint's own greedy output, its job and receipts
name the model ref (name@hash), its receipts verify and every stage's audit passes, a seeded
challenge of each node passes, and each provider is credited its share of the job's charge.

Then an agent whose cache holds a damaged shard of the checkpoint refuses its block (the control
plane records why), fetches the shard afresh at the next assignment, and serves.
"""

from __future__ import annotations

import base64
import json
import urllib.request
from pathlib import Path

import pytest
import torch
from django.contrib.auth import get_user_model
from django.test.utils import override_settings
from openai import OpenAI
from transformers import AutoTokenizer, LlamaForCausalLM

from marketplace.billing.models import AccountKind, LedgerAccount
from marketplace.billing.services import grant
from marketplace.flows import offerings
from marketplace.jobs import services as jobs_services
from marketplace.jobs.models import Job, JobState
from marketplace.nodes import joining
from marketplace.nodes.models import Node
from marketplace.nodes.tickets import issuer_key
from marketplace.payouts.models import Earning
from marketplace.placement.models import Assignment, AssignmentState
from marketplace.placement.selectors import servable_pipelines
from marketplace.verification import challenges
from marketplace.verification.models import Audit, Challenge, CheckState
from tests.catalog_fixtures import llama_checkpoint, weight_map
from tests.live import LiveServer, wait_for
from worker_agent import model as models
from worker_agent.agent.fetch import MANIFEST_COPY
from worker_agent.dev.local import join_agent, stop_processes
from worker_agent.protocol.receipts import Receipt

pytestmark = [pytest.mark.control, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.catalog_fixtures"]

NAME = "llama-owner"
PASSWORD = "correct-horse-battery-staple-42"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 8
PROMPT_PRICE, COMPLETION_PRICE = "0.5", "1.5"  # dollars per million tokens: 500 and 1500 nano-dollars a token
INDEX = "model.safetensors.index.json"


@pytest.fixture
def swarm_settings(tmp_path):
    overrides = override_settings(
        SWARM_COORDINATOR_LAUNCH="inprocess",
        SWARM_VERIFIER="inline",
        SWARM_EMBEDDED_SCHEDULER=True,
        SWARM_HEARTBEAT_INTERVAL_S=1.0,
        SWARM_HEARTBEAT_TIMEOUT_S=30.0,
        SWARM_SWEEP_INTERVAL_S=0.5,
        SWARM_MODELS=[],  # the catalog's model only
        SWARM_SPARES_PER_PIPELINE=0,
        SWARM_AUDIT_NEW_NODE_FRACTION=1.0,  # every stage of every job is audited
        SWARM_CHALLENGES_MIN_PER_DAY=0.0,  # the test sends its challenges itself
        SWARM_STRIKE_REVIEW_S=3600.0,
        SWARM_TICKET_KEY_PATH=tmp_path / "ticket.key",
        SWARM_CATALOG_DIR=tmp_path / "catalog",
        PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"],
    )
    overrides.enable()
    issuer_key.cache_clear()
    yield
    overrides.disable()
    issuer_key.cache_clear()


@pytest.fixture
def live(swarm_settings):
    server = LiveServer().start()
    agents: list = []
    server.agents = agents
    yield server
    stop_processes(agents)
    server.stop()


def own_cache(root: Path) -> Path:
    """An agent's model cache of its own: the registry model it benchmarks on (and the tokenizer
    that model borrows) linked from the shared cache; catalog checkpoints land in ``catalog/``."""
    root.mkdir(parents=True)
    for name in ("tiny-llama", "smollm2-135m"):
        (root / name).symlink_to(models.resolve_checkpoint(name))
    return root


def start_agent(live, monkeypatch, tmp_path: Path, owner, name: str, cache: Path, *, max_layers: int):
    node, token = joining.create_node(owner=owner, name=name)
    monkeypatch.setenv("SWARM_MODEL_CACHE", str(cache))  # the agent's environment: its own cache
    live.agents.append(
        join_agent(
            live.url,
            token,
            tmp_path / f"{name}.key",
            tmp_path / f"{name}.log",
            model="tiny-llama",
            max_layers=max_layers,
        )
    )
    return node


def staff_register(live, body: dict) -> dict:
    """POST the registration to the staff API as the admin (HTTP basic auth)."""
    auth = base64.b64encode(f"dave:{PASSWORD}".encode()).decode()
    request = urllib.request.Request(
        f"{live.url}/api/v1/catalog/",
        method="POST",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Basic {auth}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def servable(live, ref: str):
    for agent in live.agents:
        assert agent.poll() is None, f"an agent exited with {agent.returncode}"
    return servable_pipelines(ref)


def greedy_reference(folder: Path) -> str:
    """The checkpoint's own greedy chat completion, in one process with transformers."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    tokens = out[0, len(ids) :].tolist()
    if tokenizer.eos_token_id in tokens:
        tokens = tokens[: tokens.index(tokenizer.eos_token_id)]
    return tokenizer.decode(tokens, skip_special_tokens=True)


def shards(folder: Path, start: int, end: int) -> set[str]:
    wanted = tuple(f"model.layers.{i}." for i in range(start, end))
    return {file for key, file in weight_map(folder).items() if key.startswith(wanted)}


def pending(user) -> int:
    account = LedgerAccount.objects.filter(kind=AccountKind.PROVIDER_PENDING, owner=user).first()
    return account.balance if account else 0


def test_a_checkpoint_added_to_the_catalog_is_served_verified_challenged_and_paid(live, tmp_path, monkeypatch):
    users = get_user_model().objects
    users.create_user("dave", "dave@example.test", PASSWORD, is_staff=True)
    alice = users.create_user("alice", "alice@example.test", None, is_provider=True)
    bob = users.create_user("bob", "bob@example.test", None, is_provider=True)
    carol = users.create_user("carol", "carol@example.test", None, is_customer=True)
    grant(carol, 5, memo="test credits")
    _, key = jobs_services.create_api_key(carol, "app")
    folder = llama_checkpoint(tmp_path / "owner-checkpoint", seed=7, shard="200KB")
    reference = greedy_reference(folder)

    registered = staff_register(
        live,
        {
            "name": NAME,
            "source_kind": "directory",
            "source": str(folder),
            "prompt_price": PROMPT_PRICE,
            "completion_price": COMPLETION_PRICE,
        },
    )
    ref, digest = registered["ref"], registered["content_hash"]
    assert ref == f"{NAME}@{digest[:16]}"
    caches = {"alice": own_cache(tmp_path / "cache-alice"), "bob": own_cache(tmp_path / "cache-bob")}
    nodes = {
        name: start_agent(live, monkeypatch, tmp_path, owner, f"{name}-gpu", caches[name], max_layers=2)
        for name, owner in (("alice", alice), ("bob", bob))
    }
    (pipeline,) = wait_for(lambda: servable(live, ref), 240, "the catalog model to be servable", 0.5)
    assert [(s.layer_start, s.layer_end) for s in pipeline] == [(0, 2), (2, 4)]

    client = OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=120)
    assert [(m.id, m.model_extra["snapshot"]) for m in client.models.list().data] == [(NAME, ref)]
    chunks = list(
        client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference
    assert {c.model for c in chunks} == {ref}

    job = wait_for(lambda: Job.objects.filter(public_id=chunks[0].id, settled_at__isnull=False).first(), 60, "settle")
    assert (job.state, job.model, job.verified, job.verification_error) == (JobState.SUCCEEDED, ref, True, "")
    assert {Receipt.from_json(r).model for r in job.receipts} == {ref}
    wait_for(
        lambda: (
            Audit.objects.filter(job=job).count() == 2
            and not Audit.objects.filter(job=job, state=CheckState.PENDING).exists()
        ),
        120,
        "the job's audits to be replayed",
    )
    assert list(Audit.objects.filter(job=job).values_list("state", flat=True)) == [CheckState.PASSED] * 2

    for node in nodes.values():
        challenge = challenges.send_challenge(Node.objects.get(pk=node.pk), tokens=8)
        wait_for(
            lambda pk=challenge.pk: Challenge.objects.get(pk=pk).state not in (CheckState.SENT, CheckState.ANSWERED),
            120,
            f"challenge {challenge.pk}",
        )
        assert Challenge.objects.get(pk=challenge.pk).state == CheckState.PASSED
        assert Challenge.objects.get(pk=challenge.pk).model == ref

    charge = job.prompt_tokens * 500 + job.completion_tokens * 1500
    pool = charge - charge * 2000 // 10_000  # less the platform's 20 %
    first, second = sorted(n.node_id for n in Node.objects.filter(pk__in=[n.pk for n in nodes.values()]))
    assert job.charged_amount == charge
    assert dict(Earning.objects.filter(job=job).values_list("node__node_id", "amount")) == {
        first: pool - pool // 2,
        second: pool // 2,
    }
    assert pending(alice) + pending(bob) == pool
    assert pending(alice) > 0 and pending(bob) > 0
    assert pending(alice) == Earning.objects.get(job=job, provider=alice).amount

    # Each agent fetched the files of its own block: the config, the index and its layers' shards.
    held = {s.node: (s.layer_start, s.layer_end) for s in pipeline}
    for name, node in nodes.items():
        node.refresh_from_db()
        fetched = {p.name for p in (caches[name] / "catalog" / digest).iterdir()}
        assert fetched == {"config.json", INDEX, MANIFEST_COPY} | shards(folder, *held[node.node_id])
        assert weight_map(folder)["model.embed_tokens.weight"] not in fetched


def test_an_agent_whose_cached_shard_differs_refuses_the_block_then_fetches_it_afresh(live, tmp_path, monkeypatch):
    provider = get_user_model().objects.create_user("alice", "alice@example.test", None, is_provider=True)
    folder = llama_checkpoint(tmp_path / "owner-checkpoint", seed=3, shard="200KB")
    entry = offerings.register(NAME, "directory", str(folder))
    cache = own_cache(tmp_path / "cache")
    shard = sorted(shards(folder, 0, 1))[0]
    damaged = bytearray((folder / shard).read_bytes())
    damaged[-1] ^= 0x01
    (cache / "catalog" / entry.content_hash).mkdir(parents=True)
    (cache / "catalog" / entry.content_hash / shard).write_bytes(bytes(damaged))
    digest = next(f["sha256"] for f in entry.files if f["path"] == shard)

    start_agent(live, monkeypatch, tmp_path, provider, "gpu", cache, max_layers=4)

    refused = wait_for(
        lambda: Assignment.objects.filter(model=entry.ref, state=AssignmentState.FAILED).first(), 240, "a refusal"
    )
    assert refused.error == (
        f"the cached {shard} of {entry.ref} differs from its sha256 {digest} in the manifest (the cache was "
        "damaged or changed): refused, and removed so that the next assignment fetches it again"
    )
    (stage,) = wait_for(lambda: servable(live, entry.ref), 240, "the model to be served after the refusal", 0.5)[0]
    assert (stage.layer_start, stage.layer_end) == (0, 4)
    assert (cache / "catalog" / entry.content_hash / shard).read_bytes() == (folder / shard).read_bytes()
