"""The marketplace across hosts: the control plane on ``cloud`` (PostgreSQL and Redis over the
namespace network), agents that join from ``dc1`` and two homes behind NAT routers with the one-line
command the dashboard shows, and from ``dc2`` with the node API's, each run verbatim in a fresh shell
(a HOME of its own, system paths only, no pip configuration: nothing but Python 3.11), installing
from a package index inside the network; a customer on ``client`` streams through the OpenAI API.

The homes cannot be reached: the control plane finds that out itself and they serve through relays,
with no flag. One relay records what it forwards: TLS records only. Killing the relay of a serving
stage mid-stream heals the request, with the same text."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.live import wait_for
from tests.netlab.recording_relay import tls_records
from tests.netlab.swarm import MODEL, CloudSwarm
from worker_agent import model as models

pytestmark = pytest.mark.netlab
pytest_plugins = ["tests.netlab.fixture"]

LAYER_CAP = 10  # each node holds a third of the model: one pipeline of three stages, and a spare
JOIN_TIMEOUT_S = 900  # four installs (torch included) and four first loads, side by side on a small machine
PROMPT = "Write a long story about a lighthouse keeper and a storm."
MAX_TOKENS = 48

CLIENT_SCRIPT = f"""
import json, sys, time
from openai import OpenAI

url, key, prompt, max_tokens, progress = sys.argv[1:6]
client = OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=600)
stream = client.chat.completions.create(
    model={MODEL!r}, messages=[{{"role": "user", "content": prompt}}], temperature=0,
    max_tokens=int(max_tokens), stream=True,
)
text, chunks, job = "", 0, None
for chunk in stream:
    job = chunk.id
    if chunk.choices and chunk.choices[0].delta.content:
        text += chunk.choices[0].delta.content
        chunks += 1
        with open(progress, "w") as file:
            file.write(str(chunks))
print(json.dumps({{"text": text, "job": job}}))
"""


@pytest.fixture(scope="module")
def swarm(netlab, tmp_path_factory) -> Iterator[CloudSwarm]:
    workdir = tmp_path_factory.mktemp("netlab-swarm")
    swarm = CloudSwarm.start(netlab, workdir, recording_relay=True)
    try:
        # dc1 and the homes take the dashboard's command; dc2 the node API's: the same line.
        nodes = swarm.add_on_dashboard(["dc1", "home1", "home2"], max_layers=LAYER_CAP)
        nodes.append(swarm.add_node("dc2", max_layers=LAYER_CAP))
        assert len({node.command.split("SWARM_JOIN_TOKEN=")[0] for node in nodes}) == 1
        for node in nodes:
            swarm.join(netlab.hosts[node.name], node)
        swarm.joined = {node.name: node for node in nodes}
        yield swarm
    finally:
        for name in ("cloud", "relay-r1", "relay-r2"):
            print(f"--- {name} (tail)\n{swarm.tail(name, 3000)}")
        swarm.close()


def wait_serving(swarm: CloudSwarm) -> dict[str, dict]:
    def ready() -> dict | None:
        dead = [n.name for n in swarm.joined.values() if n.process is not None and n.process.poll() is not None]
        if dead:
            logs = "\n".join(f"--- {name}\n{swarm.joined[name].log.read_text()[-3000:]}" for name in dead)
            raise AssertionError(f"agents exited: {dead}\n{logs}")
        serving = swarm.query(
            "SELECT n.name FROM placement_assignment a JOIN nodes_node n ON n.id = a.node_id "
            "WHERE a.state = 'ready' AND NOT a.is_spare"
        )
        nodes = swarm.nodes()
        up = all(nodes[name]["state"] == "active" and nodes[name]["reachability"] != "unchecked" for name in nodes)
        return nodes if len(serving) == 3 and up else None

    try:
        return wait_for(ready, JOIN_TIMEOUT_S, "three stages served and every node checked", interval=2)
    except AssertionError:
        for node in swarm.joined.values():
            print(f"--- agent {node.name}\n{node.log.read_text()[-3000:] if node.log else ''}")
        raise


@functools.cache
def reference_text(max_tokens: int) -> str:
    """Greedy ``generate`` of the whole model in this process: what every stream must equal."""
    from transformers import AutoModelForCausalLM

    tokenizer = models.load_tokenizer(MODEL)
    model = AutoModelForCausalLM.from_pretrained(models.resolve_checkpoint(MODEL), dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)["input_ids"]
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def stream(swarm: CloudSwarm, progress: Path) -> subprocess.Popen:
    argv = [sys.executable, "-c", CLIENT_SCRIPT, swarm.url, swarm.accounts["api_key"], PROMPT, str(MAX_TOKENS)]
    return swarm.lab.hosts["client"].popen(
        [*argv, str(progress)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finished(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def job_row(swarm: CloudSwarm, public_id: str) -> tuple[str, bool | None]:
    return wait_for(
        lambda: next(
            (
                row
                for row in swarm.query("SELECT state, verified FROM jobs_job WHERE public_id = %s", public_id)
                if row[1] is not None
            ),
            None,
        ),
        120,
        f"job {public_id} to end verified or not",
    )


def test_every_host_joins_with_the_command_as_given_and_the_homes_serve_through_relays(swarm):
    nodes = wait_serving(swarm)

    assert {name: node["state"] for name, node in nodes.items()} == dict.fromkeys(nodes, "active")
    assert nodes["dc1"]["reachability"] == nodes["dc2"]["reachability"] == "direct"
    assert nodes["home1"]["reachability"] == nodes["home2"]["reachability"] == "relayed"
    for home in ("home1", "home2"):
        assert nodes[home]["relay"] in ("r1", "r2")
        assert nodes[home]["data_url"] == f"wss://{swarm.relays[nodes[home]['relay']][0].address}:7700"
    assert nodes["dc1"]["data_url"].startswith(f"wss://{swarm.lab.hosts['dc1'].address}:")  # what cloud saw


def test_a_streamed_chat_through_direct_and_relayed_stages_equals_local_generate(swarm, tmp_path):
    wait_serving(swarm)
    serving = swarm.query(
        "SELECT n.reachability FROM placement_assignment a JOIN nodes_node n ON n.id = a.node_id "
        "WHERE a.state = 'ready' AND NOT a.is_spare"
    )
    assert {row[0] for row in serving} == {"direct", "relayed"}  # a mixed pipeline, whichever three

    answer = finished(stream(swarm, tmp_path / "progress"))

    assert answer["text"] == reference_text(MAX_TOKENS)
    assert job_row(swarm, answer["job"]) == ("succeeded", True)


def test_the_relay_forwarded_tls_records_only(swarm, tmp_path):
    wait_serving(swarm)
    answer = finished(stream(swarm, tmp_path / "progress"))
    recordings = sorted((swarm.workdir / "r1.recording").glob("*")) + sorted((swarm.workdir / "r2.recording").glob("*"))

    assert recordings, "no connection went through a relay"
    words = [word.encode() for word in answer["text"].split() if len(word) >= 6] + [PROMPT.encode()]
    for path in recordings:
        stream_bytes = path.read_bytes()
        records = tls_records(stream_bytes)  # raises at the first byte that is not a TLS record
        assert records, path.name
        assert not [word for word in words if word in stream_bytes], path.name


def test_killing_the_relay_of_a_serving_stage_mid_stream_heals_with_the_same_text(swarm, tmp_path):
    wait_serving(swarm)
    relayed = swarm.query(
        "SELECT n.relay FROM placement_assignment a JOIN nodes_node n ON n.id = a.node_id "
        "WHERE a.state = 'ready' AND NOT a.is_spare AND n.reachability = 'relayed'"
    )
    victim = relayed[0][0]
    progress = tmp_path / "progress"
    client = stream(swarm, progress)
    wait_for(lambda: progress.exists() and int(progress.read_text() or 0) >= 8, 300, "eight streamed chunks")

    swarm.kill_relay(victim)
    answer = finished(client)

    assert answer["text"] == reference_text(MAX_TOKENS)
    assert job_row(swarm, answer["job"]) == ("succeeded", True)  # receipts across the heal verify
    ((heals,),) = swarm.query("SELECT heals FROM jobs_job WHERE public_id = %s", answer["job"])
    assert len(heals) >= 1, heals  # the route was healed, not restarted
