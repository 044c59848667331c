"""Which data-plane URL an agent may report (``marketplace.placement.data_urls``), without a database."""

from __future__ import annotations

import pytest

from marketplace.placement.data_urls import check_data_url
from marketplace.placement.errors import InvalidDataUrl


@pytest.mark.parametrize(
    ("url", "seen_from"),
    [
        ("ws://10.0.0.7:9100", "10.0.0.7"),
        ("wss://10.0.0.7:8443/agent", "10.0.0.7"),
        ("ws://10.0.0.7:1024", "::ffff:10.0.0.7"),  # an IPv4 agent seen through a dual-stack socket
        ("ws://[2001:db8::7]:65535", "2001:db8::7"),
        ("ws://127.0.0.1:7001", "127.0.0.1"),
    ],
)
def test_a_url_on_the_address_the_agent_connects_from_is_accepted(url, seen_from):
    assert check_data_url(url, seen_from=seen_from) == url


def test_an_allowed_host_name_is_accepted_from_any_address():
    url = "wss://Agents.Example.net:8443/n1"

    assert check_data_url(url, seen_from="192.0.2.1", allowed_hosts=["agents.example.net"]) == url


@pytest.mark.parametrize(
    ("url", "seen_from", "message"),
    [
        (
            "ws://10.0.0.8:9100",
            "10.0.0.7",
            "data URL 'ws://10.0.0.8:9100' must point at the address this agent connects from (10.0.0.7) "
            "or a host allowed by SWARM_AGENT_URL_HOSTS",
        ),
        (
            "ws://10.0.0.7:9100",
            None,
            "data URL 'ws://10.0.0.7:9100' must point at the address this agent connects from (unknown) "
            "or a host allowed by SWARM_AGENT_URL_HOSTS",
        ),
        ("http://10.0.0.7:9100", "10.0.0.7", "data URL 'http://10.0.0.7:9100' must use ws:// or wss://, not 'http'"),
        ("ws://10.0.0.7:1023", "10.0.0.7", "data URL 'ws://10.0.0.7:1023' must name a port in 1024-65535, not 1023"),
        ("ws://10.0.0.7", "10.0.0.7", "data URL 'ws://10.0.0.7' must name a port in 1024-65535, not None"),
        (
            "ws://u:p@10.0.0.7:9100",
            "10.0.0.7",
            "data URL 'ws://u:p@10.0.0.7:9100' may carry no credentials, query or fragment",
        ),
        (
            "ws://10.0.0.7:9100/?x=1",
            "10.0.0.7",
            "data URL 'ws://10.0.0.7:9100/?x=1' may carry no credentials, query or fragment",
        ),
        ("ws://:9100", "10.0.0.7", "data URL 'ws://:9100' names no host"),
    ],
)
def test_a_url_the_control_plane_will_not_route_to_is_refused(url, seen_from, message):
    with pytest.raises(InvalidDataUrl) as refused:
        check_data_url(url, seen_from=seen_from)

    assert (refused.value.code, refused.value.message) == ("invalid_data_url", message)


@pytest.mark.parametrize("url", ["ws://10.0.0.7:99999", "ws://10.0.0.7:port", "ws://[::1:9100"])
def test_a_url_that_does_not_parse_is_refused(url):
    with pytest.raises(InvalidDataUrl) as refused:
        check_data_url(url, seen_from="10.0.0.7")

    assert refused.value.code == "invalid_data_url"
    assert refused.value.message.startswith(f"data URL {url!r} is not a valid URL: ")
