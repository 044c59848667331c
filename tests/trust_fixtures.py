"""A live control plane with three providers' agents as real processes, for the trust tests.

``make_swarm(cheat=...)`` starts the control plane on uvicorn in a thread of the test process
(sharing the test database), adds one node for each of alice, bob and mallory, and joins a
``swarm-worker join`` agent for each, capped so that the model is placed as one 3-stage pipeline;
mallory's agent runs the given test-only cheat mode. A customer (carol) has an API key and $5.
Every stage of every job is audited (a new node's audit fraction is 1 here) and the checks are
verified inline; challenges are sent by the tests, and strikes stay open until a test decides them.

Test modules load this file with ``pytest_plugins = ["tests.trust_fixtures"]``; it holds no
assert statement of its own but the liveness checks, hence PYTEST_DONT_REWRITE.
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test.utils import override_settings
from openai import OpenAI

from marketplace.billing.models import AccountKind, LedgerAccount
from marketplace.billing.services import grant
from marketplace.jobs import services as jobs_services
from marketplace.jobs.models import Job
from marketplace.nodes import joining
from marketplace.nodes.models import Node
from marketplace.nodes.tickets import issuer_key
from marketplace.placement.selectors import servable_pipelines
from marketplace.verification import challenges as challenge_checks
from marketplace.verification.models import Audit, Challenge, CheckState
from tests.live import LiveServer, wait_for
from worker_agent.dev.local import join_agent, stop_processes

MODEL = "tiny-llama"
PROVIDERS = ("alice", "bob", "mallory")  # mallory runs the cheat
STRIKES_TO_EJECT = 3


class Swarm:
    def __init__(self, url, users, nodes, agents, key, model=MODEL):
        self.model = model
        self.url, self.users, self.nodes, self.agents, self.key = url, users, nodes, agents, key
        self.customer = get_user_model().objects.get(username="carol")
        self.client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)

    @property
    def cheater(self) -> Node:
        return Node.objects.get(pk=self.nodes["mallory"].pk)

    @property
    def honest(self) -> list[Node]:
        return list(Node.objects.filter(pk__in=[self.nodes[name].pk for name in ("alice", "bob")]))

    def pending(self, name: str) -> int:
        account = LedgerAccount.objects.filter(kind=AccountKind.PROVIDER_PENDING, owner=self.users[name]).first()
        return account.balance if account else 0

    def run_job(self, prompt: str) -> Job:
        completion = self.client.completions.create(model=self.model, prompt=prompt, max_tokens=4, temperature=0)
        job = Job.objects.get(public_id=completion.id)
        # Settled, and every audit of the job replayed (verification runs inline on the server).
        wait_for(lambda: Job.objects.get(pk=job.pk).settled_at is not None, 60, "the job to settle")
        wait_for(
            lambda: (
                Audit.objects.filter(job=job).count() == len(job.audit_stages)
                and not Audit.objects.filter(job=job, state=CheckState.PENDING).exists()
            ),
            60,
            "the job's audits to be checked",
        )
        return Job.objects.get(pk=job.pk)

    def challenge(self, node: Node, seed: int | None = None) -> Challenge:
        challenge = challenge_checks.send_challenge(node, tokens=8, seed=seed)
        wait_for(
            lambda: Challenge.objects.get(pk=challenge.pk).state not in (CheckState.SENT, CheckState.ANSWERED),
            60,
            f"challenge {challenge.pk} to be decided",
        )
        return Challenge.objects.get(pk=challenge.pk)


@pytest.fixture
def make_swarm(transactional_db, tmp_path, settings):
    started: list = []

    def make(
        *, cheat: str | None, dtype: str = "float32", model: str = MODEL, max_layers: int = 2, **settings_overrides
    ) -> Swarm:
        overrides = override_settings(
            **{
                "SWARM_COORDINATOR_LAUNCH": "inprocess",
                "SWARM_VERIFIER": "inline",
                "SWARM_EMBEDDED_SCHEDULER": True,
                "SWARM_HEARTBEAT_INTERVAL_S": 1.0,
                "SWARM_HEARTBEAT_TIMEOUT_S": 30.0,
                "SWARM_SWEEP_INTERVAL_S": 0.5,
                "SWARM_MODELS": [model],
                "SWARM_SPARES_PER_PIPELINE": 0,
                "SWARM_AUDIT_NEW_NODE_FRACTION": 1.0,  # every stage of every job is audited
                "SWARM_CHALLENGES_MIN_PER_DAY": 0.0,  # the tests send the challenges themselves (unless overridden)
                "SWARM_STRIKE_REVIEW_S": 3600.0,  # strikes stay open until the test decides them
                "SWARM_STRIKES_TO_EJECT": STRIKES_TO_EJECT,
                "SWARM_TICKET_KEY_PATH": tmp_path / "ticket.key",
                **settings_overrides,  # a test's own values win
            }
        )
        overrides.enable()
        issuer_key.cache_clear()
        users = {
            name: get_user_model().objects.create_user(name, f"{name}@example.test", None, is_provider=True)
            for name in PROVIDERS
        }
        customer = get_user_model().objects.create_user("carol", "carol@example.test", None, is_customer=True)
        grant(customer, 5, memo="test credits")
        _, key = jobs_services.create_api_key(customer, "adversarial")
        server = LiveServer().start()
        agents = []
        nodes = {}
        started.append((overrides, server, agents))
        for name in PROVIDERS:
            node, token = joining.create_node(owner=users[name], name=f"{name}-gpu")
            nodes[name] = node
            agents.append(
                join_agent(
                    server.url,
                    token,
                    tmp_path / f"{name}.key",
                    tmp_path / f"{name}.log",
                    model=model,
                    max_layers=max_layers,
                    dtype=dtype,
                    cheat=cheat if name == "mallory" else None,
                )
            )

        def servable():
            for index, agent in enumerate(agents):
                if agent.poll() is not None:
                    log = (tmp_path / f"{PROVIDERS[index]}.log").read_text()[-3000:]
                    raise AssertionError(f"agent {PROVIDERS[index]} exited:\n{log}")
            return servable_pipelines(model)

        wait_for(servable, 180, "a servable pipeline", 0.5)
        return Swarm(server.url, users, nodes, agents, key, model)

    yield make
    for overrides, server, agents in started:
        stop_processes(agents)
        server.stop()
        overrides.disable()
    issuer_key.cache_clear()
