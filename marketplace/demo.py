"""``make demo``: the control plane, three agents serving SmolLM2-135M, and a request through the
public OpenAI-compatible API, on the embedded defaults (SQLite, in-process channel layer and
coordinator). It keeps serving until interrupted.

It creates demo accounts (a provider owning the three agents, a customer with an API key, an
admin), starts the web app on ``DEMO_HOST``:``DEMO_PORT`` (default 127.0.0.1:8000) and three
``swarm-worker join`` processes, waits until the model is servable, streams one chat completion with
the official ``openai`` client, and writes ``.demo/demo.env`` for other clients.

``DEMO_HOST`` is also the control plane's public address (SWARM_PUBLIC_URL unless set): the URL the
agents join, the dashboard's join commands and every printed URL name it. An address of this machine
on a network (``DEMO_HOST=10.0.0.5 make demo``) lets a host there join with the command the dashboard
shows; 0.0.0.0 is refused, since no one can connect to it.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

DEMO_DIR = Path(os.environ.get("DEMO_DIR", ".demo")).resolve()
HOST = os.environ.get("DEMO_HOST", "127.0.0.1")
PORT = int(os.environ.get("DEMO_PORT", "8000"))
# An address others connect to and a URL's host as it is (SWARM_PUBLIC_URL's rule): a wildcard
# listens everywhere but names nowhere, and an IPv6 literal would need brackets in every URL.
if not re.fullmatch(r"[A-Za-z0-9.\-]+", HOST) or HOST == "0.0.0.0":
    raise SystemExit(f"DEMO_HOST must be an IPv4 address or a host name of this machine, not {HOST!r}")
MODEL = "smollm2-135m"
AGENT_DRAIN_S = 10.0  # on Ctrl-C, how long the agents let the requests in flight finish first
NANO_PER_DOLLAR = 1_000_000_000

os.environ.setdefault("SWARM_DATA_DIR", str(DEMO_DIR / "data"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "marketplace.settings")
os.environ.setdefault("SWARM_HEARTBEAT_INTERVAL_S", "2")
os.environ.setdefault("SWARM_HEARTBEAT_TIMEOUT_S", "10")
# The join commands the dashboard shows name the address the other hosts were given, however this
# machine reached the dashboard; requests that name it (Host: DEMO_HOST) are let in.
os.environ.setdefault("SWARM_PUBLIC_URL", f"http://{HOST}:{PORT}")
os.environ.setdefault("DJANGO_ALLOWED_HOSTS", ",".join(dict.fromkeys([HOST, "127.0.0.1", "localhost", "[::1]"])))
# Challenges run here as anywhere (the embedded scheduler sends them), but at the production floor of
# 24 a day a node would see about one in an hour of the demo: one in four minutes shows them.
os.environ.setdefault("SWARM_CHALLENGES_MIN_PER_DAY", "360")
# A memory challenge fills every session of a node's KV budget at once (8 sessions of about 3,000
# positions of smollm2-135m, through every span and the verifier's replay): minutes of both cores of a
# laptop, which the demo's requests would wait behind. Here it holds a tenth of each session.
os.environ.setdefault("SWARM_MEMORY_CHALLENGE_FRACTION", "0.1")
# The demo prints its own account of the job; the control plane's INFO lines (this same process)
# would interleave with the streamed answer. SWARM_LOG_LEVEL=INFO shows them.
os.environ.setdefault("SWARM_LOG_LEVEL", "WARNING")


from marketplace.embedded import EmbeddedServer  # noqa: E402 - after the environment is set
from worker_agent.protocol.span import Span  # noqa: E402 - after the environment is set


def _setup_django() -> None:
    import logging

    import django
    from django.core.management import call_command

    django.setup()
    for name in ("httpx", "httpx2"):  # the demo's own client requests
        logging.getLogger(name).setLevel(logging.WARNING)
    call_command("migrate", verbosity=0)


def _accounts() -> dict:
    from django.contrib.auth import get_user_model

    # Imported after _setup_django(): models need the app registry.
    from marketplace.jobs.models import ApiKey
    from marketplace.jobs.services import create_api_key
    from marketplace.nodes.joining import create_node
    from marketplace.nodes.models import Node

    User = get_user_model()
    logins = {}
    for role, flags in (
        ("provider", {"is_provider": True}),
        ("customer", {"is_customer": True}),
        ("admin", {"is_staff": True, "is_superuser": True}),
    ):
        username = f"demo-{role}"
        password = secrets.token_urlsafe(12)
        user, _ = User.objects.update_or_create(
            username=username, defaults={"email": f"{username}@example.com", **flags}
        )
        user.set_password(password)
        user.save()
        logins[role] = (user, password)
    provider = logins["provider"][0]
    tokens = []
    for index in range(3):
        node = Node.objects.filter(owner=provider, name=f"demo-gpu-{index}").first()
        if node is None:
            node, token = create_node(owner=provider, name=f"demo-gpu-{index}")
        else:
            # Imported after _setup_django(): models need the app registry.
            from marketplace.nodes.joining import rotate_join_token

            token = rotate_join_token(node)
        tokens.append(token)
    customer = logins["customer"][0]
    ApiKey.objects.filter(user=customer, name="demo").delete()
    _, key = create_api_key(customer, "demo")
    # Imported after _setup_django(): models need the app registry.
    from marketplace.billing.services import credits, grant

    if credits(customer) < 5 * NANO_PER_DOLLAR:
        grant(customer, 5, memo="demo credits")
    return {"logins": logins, "tokens": tokens, "key": key}


def _retire_earlier_agents() -> None:
    """An earlier run's agents are gone (stopped, or killed by a Ctrl-C at any moment): take every
    node still marked live offline now, releasing its blocks, instead of waiting for its heartbeats
    to time out, so no stale stage enters a pipeline; this run's agents join them again."""
    from datetime import timedelta

    from django.conf import settings
    from django.utils import timezone

    # Imported after _setup_django(): models need the app registry.
    from marketplace.placement.lifecycle import sweep_heartbeats

    gone = sweep_heartbeats(now=timezone.now() + timedelta(seconds=settings.SWARM_HEARTBEAT_TIMEOUT_S + 1))
    if gone:
        print(f"took {len(gone)} node(s) of an earlier run offline", flush=True)


def _join(base_url: str, tokens: list[str], agents: list[subprocess.Popen]) -> None:
    """Start one agent per token, adding each to ``agents`` as it starts (so an interrupt at any moment
    still stops those already running)."""
    for index, token in enumerate(tokens):
        key = DEMO_DIR / f"agent{index}.key"
        for stale in (key, key.with_name(key.name + ".pub"), key.with_name(key.name + ".join.json")):
            stale.unlink(missing_ok=True)  # fresh nodes each run: the tokens were just issued
        agents.append(_join_agent(base_url, token, key, DEMO_DIR / f"agent{index}.log"))


def _join_agent(base_url: str, token: str, key: Path, log_path: Path) -> subprocess.Popen:
    """``swarm-worker join`` as a provider runs it, as a process of its own (the agent is a program
    apart from the control plane, which never imports it), with the join token in its environment
    (never on its command line, where ``ps`` shows it), logging to ``log_path``."""
    command = [sys.executable, "-m", "worker_agent.agent.cli", "join", "--control-plane", base_url, "--key", str(key)]
    command += ["--model", MODEL, "--threads", "1", "--max-layers", "10", "--drain-timeout", str(AGENT_DRAIN_S)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SWARM_JOIN_TOKEN": token}
    with open(log_path, "w") as log:  # the child holds its own copy of the file
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def _stop_agents(agents: list[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM every agent still running, then wait for each (killing a laggard)."""
    for agent in agents:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
    for agent in agents:
        try:
            agent.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()


def _wait_servable(agents: list[subprocess.Popen], timeout: float = 300) -> None:
    # Imported after _setup_django(): models need the app registry.
    from marketplace.placement.selectors import servable_pipelines

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if servable_pipelines(MODEL):
            return
        dead = [i for i, agent in enumerate(agents) if agent.poll() is not None]
        if dead:
            raise SystemExit(f"agent {dead[0]} exited; see {DEMO_DIR / f'agent{dead[0]}.log'}")
        time.sleep(0.5)
    raise SystemExit("the model did not become servable in time; see the agent logs in .demo/")


def _stream_one(base_url: str, key: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=120)
    prompt = "Explain in two sentences why the sky is blue."
    print(f"\nuser> {prompt}\nassistant> ", end="", flush=True)
    started = time.monotonic()
    first = None
    usage = None
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=64,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.monotonic()
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            usage = chunk.usage
    elapsed = time.monotonic() - started
    print()
    if usage is not None:
        rate = (
            (usage.completion_tokens - 1) / (elapsed - (first - started)) if first and elapsed > first - started else 0
        )
        print(
            f"\n{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens; time to first token "
            f"{(first or started) - started:.3f} s; {rate:.1f} tokens/s"
        )


def _report(base_url: str, accounts: dict) -> None:
    # Imported after _setup_django(): models need the app registry.
    from marketplace.billing.services import credits
    from marketplace.jobs.models import Job

    job = Job.objects.order_by("-created_at").first()
    deadline = time.monotonic() + 10
    while job is not None and job.settled_at is None and time.monotonic() < deadline:
        time.sleep(0.1)  # the job settles right after its last token
        job.refresh_from_db()
    if job is not None:
        print(
            f"charged ${job.charged_amount / NANO_PER_DOLLAR:.9f} (hold ${job.hold_amount / NANO_PER_DOLLAR:.9f}); "
            f"customer balance ${credits(job.customer) / NANO_PER_DOLLAR:.6f}"
        )
        route = " -> ".join(f"{s['node']}[{s['layer_start']}:{s['layer_end']}]" for s in job.route)
        print(f"job {job.public_id}: {job.state}, coordinator region {job.coordinator_region}, route {route}")
        print(f"receipts: {len(job.receipts)} stage receipts, verified={job.verified}")
        # Imported after _setup_django(): models need the app registry.
        from marketplace.payouts.models import Earning

        earned = Earning.objects.filter(job=job).select_related("node")
        if earned:
            shares = ", ".join(f"{e.node.name} ${e.amount / NANO_PER_DOLLAR:.9f}" for e in earned)
            print(f"provider earnings (pending through the challenge window): {shares}")
    logins = accounts["logins"]
    env = {
        "OPENAI_BASE_URL": f"{base_url}/v1",
        "OPENAI_API_KEY": accounts["key"],
        "DASHBOARD_URL": f"{base_url}/",
        **{f"DEMO_{role.upper()}_USER": user.username for role, (user, _) in logins.items()},
        **{f"DEMO_{role.upper()}_PASSWORD": password for role, (_, password) in logins.items()},
    }
    (DEMO_DIR / "demo.env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    print(f"\ndashboard: {base_url}/   API docs: {base_url}/api/docs/")
    for role, (user, password) in logins.items():
        print(f"  {role:<9} login: {user.username} / {password}")
    print(f"\nAPI key (customer): {accounts['key']}")
    print("any OpenAI client works; for example:\n")
    print("    from openai import OpenAI")
    print(f'    client = OpenAI(base_url="{base_url}/v1", api_key="{accounts["key"]}")')
    print(
        f'    reply = client.chat.completions.create(model="{MODEL}", '
        'messages=[{"role": "user", "content": "Hello!"}])'
    )
    print("    print(reply.choices[0].message.content)")
    print(f"\nthese values are in {DEMO_DIR / 'demo.env'}; serving until Ctrl-C ...")


def main() -> int:
    DEMO_DIR.mkdir(parents=True, exist_ok=True)
    print(f"preparing {MODEL} and the database (the first run converts the GGUF weights once) ...", flush=True)
    # Imported here: torch loads only once the database is prepared.
    from worker_agent.model import load_head, load_tokenizer

    load_head(MODEL)
    load_tokenizer(MODEL)
    _setup_django()
    _retire_earlier_agents()
    accounts = _accounts()
    try:
        server = EmbeddedServer(PORT, HOST).start()
    except RuntimeError:
        raise SystemExit(
            f"the web app could not start on {HOST}:{PORT} (set DEMO_PORT to move it, DEMO_HOST to listen elsewhere)"
        ) from None
    base_url = server.url
    agents: list[subprocess.Popen] = []
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        print(f"control plane at {base_url}; starting three agents (swarm-worker join) ...", flush=True)
        print(
            "data plane: plain ws://, not encrypted (production: agents join with --tls auto "
            "and the control plane sets SWARM_REQUIRE_DATA_TLS=1)",
            flush=True,
        )
        _join(base_url, accounts["tokens"], agents)
        _wait_servable(agents)
        # Imported after _setup_django(): models need the app registry.
        from marketplace.placement.selectors import servable_pipelines

        (pipeline, *_) = servable_pipelines(MODEL)
        print("servable: " + " -> ".join(f"{s.node}[{s.layer_start}:{s.layer_end}]" for s in pipeline))
        # Imported after _setup_django(): models need the app registry.
        from marketplace.verification.verifier import trusted_block

        for stage in pipeline:  # the verifier's own copies, for challenges and live audits
            trusted_block(Span(MODEL, stage.layer_start, stage.layer_end))
        print("verifier ready: float32 copies of the three spans for challenges and live audits")
        _stream_one(base_url, accounts["key"])
        _report(base_url, accounts)
        while not stop.is_set():
            stop.wait(1)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        print("\nstopping ...", flush=True)
        # The Ctrl-C reached the agents too: each lets its jobs in flight end first (up to its drain
        # timeout), then exits; the SIGTERM sent here is part of the same stop, not a second one.
        _stop_agents(agents, timeout_s=AGENT_DRAIN_S + 5)
        server.stop()
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except KeyboardInterrupt:  # before the web app and the agents started: nothing to stop
        print("\ninterrupted", flush=True)
        code = 130
    # The agents are stopped and the web app with them, but the control plane's daemon threads (the
    # embedded scheduler, a verifier replaying a job's audit) may still be inside torch: finalizing
    # the interpreter under them aborts the process ("terminate called without an active
    # exception"). Everything the demo keeps is committed by now, so it leaves without finalizing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
