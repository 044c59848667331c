"""Privacy a customer chooses: trusted nodes (marked by admins, with a reason), pipelines of their
own, and requests routed only through them (``trusted_only``), or with only their first and last
stages on them (``trusted_ends``), per request (the "provider" object) or per API key. A request
whose route cannot be had is refused with 503 ``no_trusted_capacity``, never sent elsewhere."""

from __future__ import annotations

import pytest

from marketplace.api import request_body
from marketplace.billing.models import Transfer
from marketplace.billing.services import grant
from marketplace.flows import admission
from marketplace.jobs import services
from marketplace.jobs.errors import InvalidRequest, NoTrustedCapacity
from marketplace.jobs.models import ApiKey, Job
from marketplace.jobs.params import RequestParams
from marketplace.jobs.services import create_api_key, mark_running, set_key_privacy
from marketplace.nodes.errors import NodeNotAllowed, TrustMarkRefused
from marketplace.nodes.models import Node, Privacy, strictest
from marketplace.placement.allocation import NodeCapacity
from marketplace.placement.lifecycle import set_trusted
from marketplace.placement.models import Assignment, AssignmentState
from marketplace.placement.placing import place_model
from marketplace.placement.readiness import assignment_ready
from marketplace.placement.selectors import route_request, servable_pipelines
from marketplace.placement.trusted import place_with_trusted

pytestmark = pytest.mark.trust
pytest_plugins = ["tests.factories", "tests.control_fixtures"]

MODEL = "tiny-llama"
VETTED = "audited the host and its operator on site"


def ready(model: str = MODEL) -> None:
    for assignment in place_model(model):
        assignment_ready(assignment.node_id, assignment.pk, f"ws://127.0.0.1:{9000 + assignment.node_id}")


@pytest.fixture
def swarm(settings, provider, admin, make_joined_node, swarm_settings, measure_ring):
    """Four nodes of three layers each, gpu-0 and gpu-2 trusted (returned first), placed and ready.
    The cheapest ring visits gpu-0, 1, 2, 3 in turn: left to itself, placement would pair gpu-0
    with gpu-1."""
    settings.SWARM_MODELS = [MODEL]
    settings.SWARM_JOBS_PER_NODE = 4
    nodes = [make_joined_node(provider, f"gpu-{i}", max_layers=3).node for i in range(4)]
    measure_ring(nodes)
    for node in (nodes[0], nodes[2]):
        set_trusted(node, True, by=admin, reason=VETTED)
    ready()
    return [Node.objects.get(pk=nodes[i].pk) for i in (0, 2, 1, 3)]


@pytest.fixture
def api_key(customer):
    grant(customer, 10, memo="credits")
    return create_api_key(customer, "private")[0]


def admit(api_key, privacy: str = Privacy.ANY) -> Job:
    params = RequestParams(max_tokens=4, temperature=0.0, prompt="Once upon a time", privacy=privacy)
    (job,) = admission.admit_jobs(
        api_key=api_key,
        kind="completion",
        model=MODEL,
        params=params,
        prompt_ids=services.tokenize_prompt(MODEL, params),
    )
    return job


def route_nodes(job: Job) -> set[str]:
    return {stage["node"] for stage in job.route}


def ids(nodes) -> set[str]:
    return {n.node_id for n in nodes}


@pytest.mark.django_db
def test_trusted_nodes_that_can_hold_the_model_get_a_pipeline_of_their_own(swarm):
    pipelines = [{stage.node for stage in pipeline} for pipeline in servable_pipelines(MODEL)]
    assert sorted(pipelines, key=sorted) == sorted([ids(swarm[:2]), ids(swarm[2:])], key=sorted)
    node = Node.objects.get(pk=swarm[0].pk)
    assert (node.trusted, node.trusted_reason, node.trusted_by.is_staff) == (True, VETTED, True)
    assert not Node.objects.get(pk=swarm[2].pk).trusted


def test_placement_keeps_trusted_nodes_apart_only_when_they_can_hold_the_model():
    caps = [NodeCapacity(f"n{i}", compute=100.0, max_layers=3) for i in range(4)]
    apart = place_with_trusted(caps, {"n2", "n3"}, 6, spares_per_pipeline=0)
    assert [sorted(s.node for s in p) for p in apart.pipelines] == [["n2", "n3"], ["n0", "n1"]]  # trusted first
    # One trusted node cannot hold six layers: nothing is kept apart.
    mixed = place_with_trusted(caps, {"n3"}, 6, spares_per_pipeline=0)
    assert sum(len(p) for p in mixed.pipelines) + len(mixed.spares) == 4
    # The others cannot hold the model alone: they keep warm blocks of the trusted pipeline's spans.
    lone = place_with_trusted([*caps[:2], NodeCapacity("n9", compute=100.0, max_layers=2)], {"n0", "n1"}, 6,
                              spares_per_pipeline=0)  # fmt: skip
    assert [{s.node for s in p} for p in lone.pipelines] == [{"n0", "n1"}]
    assert [(s.node, s.layers) for s in lone.spares] == [("n9", 2)]


@pytest.mark.django_db
def test_a_trusted_only_job_is_routed_through_trusted_nodes_only_while_the_others_are_idle(swarm, api_key):
    before = servable_pipelines(MODEL)
    job = admit(api_key, Privacy.TRUSTED_ONLY)
    assert route_nodes(job) == ids(swarm[:2])
    assert job.privacy == Privacy.TRUSTED_ONLY
    assert servable_pipelines(MODEL) == before  # the untrusted pipeline is ready, and carries nothing
    assert Job.objects.exclude(pk=job.pk).count() == 0


@pytest.mark.django_db
def test_with_no_trusted_route_ready_a_trusted_only_request_is_refused_and_nothing_is_held(
    swarm, api_key, admin, settings
):
    set_trusted(swarm[1], False, by=admin, reason="its operator changed hands")
    transfers = Transfer.objects.count()
    with pytest.raises(NoTrustedCapacity) as refused:
        admit(api_key, Privacy.TRUSTED_ONLY)
    assert refused.value.code == "no_trusted_capacity"
    assert "trusted nodes only (trusted_only)" in str(refused.value)
    assert (Job.objects.count(), Transfer.objects.count()) == (0, transfers)
    # The same request without the requirement is served at once.
    assert admit(api_key).route


@pytest.mark.django_db
def test_trusted_ends_pins_the_first_and_last_stages_only(settings, provider, admin, make_joined_node, swarm_settings,
                                                          measure_ring, api_key):  # fmt: skip
    settings.SWARM_MODELS = [MODEL]
    nodes = [make_joined_node(provider, f"gpu-{i}", max_layers=2).node for i in range(3)]
    measure_ring(nodes)
    ready()
    (pipeline,) = servable_pipelines(MODEL)
    first, middle, last = (stage.node for stage in pipeline)
    for node_id in (first, last):
        set_trusted(Node.objects.get(node_id=node_id), True, by=admin, reason=VETTED)
    ready()  # marking re-plans; the nodes keep their blocks
    assert [s.node for s in servable_pipelines(MODEL)[0]] == [first, middle, last]
    assert route_request(MODEL, privacy=Privacy.TRUSTED_ONLY) is None  # the middle is not trusted
    job = admit(api_key, Privacy.TRUSTED_ENDS)
    assert [stage["node"] for stage in job.route] == [first, middle, last]
    set_trusted(Node.objects.get(node_id=last), False, by=admin, reason="failed its audit")
    with pytest.raises(NoTrustedCapacity):
        admit(api_key, Privacy.TRUSTED_ENDS)


@pytest.mark.django_db
def test_a_key_s_setting_applies_to_every_request_of_the_key_and_a_request_cannot_lower_it(swarm, api_key):
    set_key_privacy(api_key, Privacy.TRUSTED_ONLY)
    for asked in (Privacy.ANY, Privacy.TRUSTED_ENDS, Privacy.TRUSTED_ONLY):
        job = admit(api_key, asked)
        assert (job.privacy, route_nodes(job)) == (Privacy.TRUSTED_ONLY, ids(swarm[:2]))
    assert strictest(Privacy.TRUSTED_ENDS, Privacy.ANY) == Privacy.TRUSTED_ENDS
    with pytest.raises(InvalidRequest):
        set_key_privacy(api_key, "nobody")


@pytest.mark.django_db
def test_a_trusted_only_job_heals_onto_trusted_nodes_or_not_at_all(swarm, api_key, make_joined_node, provider,
                                                                   admin, measure_ring):  # fmt: skip
    job = admit(api_key, Privacy.TRUSTED_ONLY)
    mark_running(job.pk)
    failed = job.route[0]["node"]
    # Untrusted stages hold the failed span, ready and idle: the job is not moved onto them.
    assert services.heal_job(job.pk, failed, "stage died") is None
    assert route_nodes(Job.objects.get(pk=job.pk)) == ids(swarm[:2])
    # A trusted spare of that span: the job heals onto it.
    spare = make_joined_node(provider, "gpu-spare", max_layers=3).node
    set_trusted(spare, True, by=admin, reason=VETTED)
    lost = Assignment.objects.get(node__node_id=failed, state=AssignmentState.READY)
    Assignment.objects.create(
        node=spare, model=MODEL, generation=lost.generation, pipeline=9, position=0, layer_start=lost.layer_start,
        layer_end=lost.layer_end, is_spare=True, state=AssignmentState.READY, data_url="ws://127.0.0.1:9999",
    )  # fmt: skip
    healed = services.heal_job(job.pk, failed, "stage died", report=False)
    assert healed is not None and {s["node"] for s in healed} <= ids([*swarm[:2], spare]) - {failed}


@pytest.mark.django_db
def test_only_admins_mark_nodes_trusted_and_always_with_a_reason(swarm, provider, admin):
    node = swarm[3]
    with pytest.raises(NodeNotAllowed):
        set_trusted(node, True, by=provider, reason=VETTED)
    with pytest.raises(TrustMarkRefused, match="A reason is required"):
        set_trusted(node, True, by=admin, reason="   ")
    with pytest.raises(TrustMarkRefused, match="at most 500"):
        set_trusted(node, True, by=admin, reason="x" * 501)
    assert not Node.objects.get(pk=node.pk).trusted


@pytest.mark.parametrize(
    ("provider", "expected"),
    [
        (None, Privacy.ANY),
        ({}, Privacy.ANY),
        ({"trusted_only": False}, Privacy.ANY),
        ({"trusted_ends": True}, Privacy.TRUSTED_ENDS),
        ({"trusted_only": True}, Privacy.TRUSTED_ONLY),
        ({"trusted_only": True, "trusted_ends": True}, Privacy.TRUSTED_ONLY),
    ],
)
@pytest.mark.django_db
def test_the_provider_object_of_a_request_asks_for_trusted_nodes(settings, provider, expected):
    settings.SWARM_MODELS = [MODEL]
    body = {"model": MODEL, "prompt": "Hi", "provider": provider}
    assert request_body.parse(body, "completion")[1].privacy == expected


@pytest.mark.parametrize(
    ("provider", "param", "message"),
    [
        ("trusted", "provider", "'provider' must be an object"),
        ({"trusted_only": "yes"}, "provider.trusted_only", "'provider.trusted_only' must be a boolean."),
        ({"order": ["a"]}, "provider.order", "provider.order is not supported"),
    ],
)
@pytest.mark.django_db
def test_a_bad_provider_object_is_refused_by_name(settings, provider, param, message):
    settings.SWARM_MODELS = [MODEL]
    with pytest.raises(InvalidRequest) as refused:
        request_body.parse({"model": MODEL, "prompt": "Hi", "provider": provider}, "completion")
    assert refused.value.param == param
    assert message in str(refused.value)


@pytest.mark.django_db
def test_a_customer_sets_a_key_s_privacy_through_the_api(customer, client_for):
    client = client_for(customer)
    created = client.post("/api/v1/keys/", {"name": "app", "privacy": "trusted_ends"}, format="json")
    assert (created.status_code, created.json()["privacy"]) == (201, "trusted_ends")
    key = created.json()["id"]
    changed = client.patch(f"/api/v1/keys/{key}/", {"privacy": "trusted_only"}, format="json")
    assert (changed.status_code, changed.json()["privacy"]) == (200, "trusted_only")
    refused = client.patch(f"/api/v1/keys/{key}/", {"privacy": "everyone"}, format="json")
    assert (refused.status_code, list(refused.json())) == (400, ["privacy"])
    assert ApiKey.objects.get(pk=key).privacy == Privacy.TRUSTED_ONLY


@pytest.mark.django_db
def test_the_swarm_map_shows_trusted_nodes_and_the_all_trusted_pipeline(swarm, admin, client_for):
    page = client_for(admin).get("/swarm/health/").content.decode()
    assert page.count('data-field="trusted-pipeline"') == 1  # the trusted pair's pipeline, not the other
    assert page.count("trusted since ") == 2 * 2  # two trusted nodes: the badge's text and its title
    assert f"{VETTED}" in page


@pytest.mark.django_db
def test_a_provider_sees_its_node_s_trust_mark(swarm, provider, client_for):
    client = client_for(provider)
    trusted = client.get(f"/provider/nodes/{swarm[0].pk}/trust/").content.decode()
    assert f"Marked trusted by the swarm's admins on {swarm[0].trusted_at:%Y-%m-%d}: " in trusted
    assert VETTED in trusted
    assert "Not marked trusted." in client.get(f"/provider/nodes/{swarm[2].pk}/trust/").content.decode()


@pytest.mark.django_db
def test_a_customer_sets_a_key_s_nodes_in_the_console_and_reads_who_sees_what(customer, client_for, stranger):
    client = client_for(customer)
    created = client.post("/customer/keys/", {"name": "app", "privacy": "trusted_ends"})
    api_key = ApiKey.objects.get(user=customer, name="app")
    assert (created.status_code, api_key.privacy) == (200, Privacy.TRUSTED_ENDS)
    assert client.post(f"/customer/keys/{api_key.pk}/privacy/", {"privacy": "trusted_only"}).status_code == 302
    assert ApiKey.objects.get(pk=api_key.pk).privacy == Privacy.TRUSTED_ONLY
    client.post(f"/customer/keys/{api_key.pk}/privacy/", {"privacy": "everyone"})  # refused by the form
    assert ApiKey.objects.get(pk=api_key.pk).privacy == Privacy.TRUSTED_ONLY
    page = client.get("/customer/keys/").content.decode()
    assert '<option value="trusted_only" selected>Trusted nodes only</option>' in page
    who = client.get("/customer/privacy/").content.decode()
    assert "An embedding maps back to its token at once" in who
    assert "refused with 503 <code>no_trusted_capacity</code>" in who
    assert client_for(stranger).get("/customer/privacy/").status_code == 403
