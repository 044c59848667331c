"""WAN emulation: the sans-I/O LinkSchedule, WanProfile specs, the asyncio WanLink, and the WAN as a
connection's transport in place of the product's DirectLink."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time

import pytest

from worker_agent.dev.wan import MAX_RETRANSMISSIONS, LinkSchedule, WanLink, WanProfile
from worker_agent.protocol.transport import DirectLink

pytestmark = pytest.mark.dataplane


class ScriptedRandom(random.Random):
    """Returns the given draws from random(), so drop and jitter outcomes are chosen by the test."""

    def __init__(self, draws: list[float]) -> None:
        super().__init__(0)
        self._draws = list(draws)

    def random(self) -> float:
        return self._draws.pop(0)


class UntouchableRandom(random.Random):
    def random(self) -> float:
        raise AssertionError("the random source must not be used")


class FakeTime:
    """A clock and a sleep that advances it, so delivery times are exact and instant."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


class Sink:
    """Records each frame with the time it was handed over; optionally fails on the n-th call."""

    def __init__(self, clock=time.monotonic, fail_on: int | None = None) -> None:
        self.clock = clock
        self.fail_on = fail_on
        self.calls = 0
        self.received: list[tuple[float, bytes]] = []
        self.failed = asyncio.Event()

    async def send(self, data: bytes) -> None:
        self.calls += 1
        if self.calls == self.fail_on:
            self.failed.set()
            raise ConnectionError("connection closed")
        self.received.append((self.clock(), data))

    @property
    def frames(self) -> list[bytes]:
        return [data for _, data in self.received]


# --- LinkSchedule ---------------------------------------------------------------------------


def test_latency_alone_delays_each_frame_by_exactly_the_one_way_latency():
    link = LinkSchedule(WanProfile(latency_ms=125))

    assert link.schedule(1.0, 100) == 1.125
    assert link.schedule(1.5, 10**9) == 1.625
    assert link.schedule(2.0, 0) == 2.125


def test_bandwidth_serializes_back_to_back_frames_on_the_uplink():
    # 8 Mbps is 1e6 bytes per second.
    link = LinkSchedule(WanProfile(bandwidth_mbps=8))

    assert link.schedule(0.0, 1_000_000) == 1.0
    assert link.schedule(0.0, 500_000) == 1.5
    assert link.schedule(0.0, 250_000) == 1.75
    # Sent while the uplink is still busy: starts when the previous frame has left.
    assert link.schedule(1.25, 250_000) == 2.0
    # Sent after the uplink went idle: starts at once.
    assert link.schedule(5.0, 250_000) == 5.25


def test_latency_is_added_after_serialization():
    link = LinkSchedule(WanProfile(latency_ms=125, bandwidth_mbps=8))

    assert link.schedule(0.0, 1_000_000) == 1.125
    assert link.schedule(0.0, 500_000) == 1.625


def test_jitter_never_reorders_frames_and_stays_within_its_spread():
    latency, jitter = 0.020, 0.015
    link = LinkSchedule(WanProfile(latency_ms=20, jitter_ms=15, seed=3))
    sent = [i * 0.0001 for i in range(2000)]

    delivered = [link.schedule(t, 1500) for t in sent]

    assert all(a <= b for a, b in itertools.pairwise(delivered))
    assert all(t + latency - jitter <= d <= t + latency + jitter for t, d in zip(sent, delivered, strict=True))
    # The spacing is far below the jitter, so FIFO must have held some frames back.
    assert any(a == b for a, b in itertools.pairwise(delivered))


def test_jitter_clamps_the_total_delay_at_zero():
    link = LinkSchedule(WanProfile(latency_ms=1, jitter_ms=10, seed=5))
    sent = [float(i) for i in range(200)]

    delays = [link.schedule(t, 100) - t for t in sent]

    assert min(delays) == 0.0
    assert max(delays) <= 0.011 + 1e-9


def test_same_seed_gives_the_same_schedule():
    profile = WanProfile(latency_ms=30, jitter_ms=10, drop=0.2, seed=42)
    first, second = LinkSchedule(profile), LinkSchedule(profile)

    assert [first.schedule(i * 0.01, 1000) for i in range(500)] == [second.schedule(i * 0.01, 1000) for i in range(500)]


def test_each_loss_adds_one_retransmission_penalty():
    # Penalty is max(200 ms, 3 x 250 ms) = 750 ms; draws below drop=0.5 are losses.
    link = LinkSchedule(WanProfile(latency_ms=250, drop=0.5), ScriptedRandom([0.1, 0.2, 0.9, 0.7]))

    assert link.schedule(0.0, 100) == 0.25 + 2 * 0.75
    assert link.schedule(10.0, 100) == 10.25
    assert link.retransmissions == 2


def test_losses_are_capped_at_five_retransmissions():
    link = LinkSchedule(WanProfile(latency_ms=250, drop=0.5), ScriptedRandom([0.0] * 10))

    assert link.schedule(0.0, 100) == 0.25 + MAX_RETRANSMISSIONS * 0.75
    assert MAX_RETRANSMISSIONS == 5
    assert link.retransmissions == 5


def test_retransmission_penalty_is_at_least_200ms():
    link = LinkSchedule(WanProfile(latency_ms=10, drop=0.5), ScriptedRandom([0.0, 0.9]))

    assert link.schedule(0.0, 100) == pytest.approx(0.010 + 0.2, abs=1e-12)
    assert WanProfile(latency_ms=10).retransmit_penalty_s == 0.2
    assert WanProfile(latency_ms=100).retransmit_penalty_s == pytest.approx(0.3, abs=1e-12)


def test_seeded_drops_add_whole_penalties_and_are_counted():
    profile = WanProfile(latency_ms=100, drop=0.3, seed=7)
    link = LinkSchedule(profile)
    penalty = profile.retransmit_penalty_s
    sent = [i * 10.0 for i in range(2000)]  # far apart: no queueing, no FIFO hold-back

    losses = [round((link.schedule(t, 100) - t - 0.1) / penalty) for t in sent]

    assert set(losses) <= set(range(MAX_RETRANSMISSIONS + 1))
    assert sum(losses) == link.retransmissions
    assert 0 < losses.count(0) < len(sent)


def test_null_profile_delivers_at_now_without_touching_the_random_source():
    link = LinkSchedule(WanProfile(seed=1), UntouchableRandom())

    assert [link.schedule(t, 10**9) for t in (3.5, 3.5, 1.0)] == [3.5, 3.5, 1.0]


def test_negative_frame_size_is_refused():
    with pytest.raises(ValueError, match="negative size"):
        LinkSchedule(WanProfile(latency_ms=1)).schedule(0.0, -1)


# --- WanProfile -----------------------------------------------------------------------------


def test_parse_reads_every_field():
    profile = WanProfile.parse("latency_ms=25,jitter_ms=2,bandwidth_mbps=100,drop=0.01,seed=1")

    assert profile == WanProfile(latency_ms=25, jitter_ms=2, bandwidth_mbps=100, drop=0.01, seed=1)
    assert isinstance(profile.latency_ms, float)


@pytest.mark.parametrize("spec", ["rtt=50ms", "rtt=50", "rtt=0.05s", " rtt = 50 ms "])
def test_parse_rtt_shorthand_is_half_the_round_trip(spec):
    assert WanProfile.parse(spec) == WanProfile(latency_ms=25)


def test_parse_accepts_units_and_spaces_on_durations():
    assert WanProfile.parse(" latency_ms = 25ms , jitter_ms=0.002s ") == WanProfile(latency_ms=25, jitter_ms=2)


@pytest.mark.parametrize("spec", ["", "   ", ","])
def test_parse_of_an_empty_spec_is_the_null_profile(spec):
    profile = WanProfile.parse(spec)

    assert profile == WanProfile()
    assert profile.is_null


@pytest.mark.parametrize(
    "profile",
    [
        WanProfile(),
        WanProfile(latency_ms=25),
        WanProfile(seed=0),
        WanProfile(latency_ms=12.5, jitter_ms=0.1, bandwidth_mbps=2.5, drop=0.01, seed=-3),
        WanProfile(latency_ms=1e-05, bandwidth_mbps=1e20, drop=0.999999),
    ],
)
def test_to_spec_round_trips_through_parse(profile):
    assert WanProfile.parse(profile.to_spec()) == profile


def test_to_spec_writes_only_non_default_fields():
    assert WanProfile().to_spec() == ""
    assert WanProfile.parse("rtt=50ms").to_spec() == "latency_ms=25"
    assert WanProfile(latency_ms=25, drop=0.01, seed=1).to_spec() == "latency_ms=25,drop=0.01,seed=1"


def test_parse_rejects_an_unknown_key_and_names_it():
    with pytest.raises(ValueError, match="unknown key 'latency'"):
        WanProfile.parse("latency=25")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("latency_ms", "expected key=value"),
        ("latency_ms=", "expected key=value"),
        ("latency_ms=abc", "latency_ms must be a number"),
        ("bandwidth_mbps=fast", "bandwidth_mbps must be a number"),
        ("seed=1.5", "seed must be an integer"),
        ("drop=0.1,drop=0.2", "'drop' given twice"),
        ("rtt=50ms,latency_ms=25", "either rtt or latency_ms"),
        ("drop=1", r"drop must be a probability in \[0, 1\)"),
        ("latency_ms=-1", "latency_ms must be >= 0"),
        ("jitter_ms=nan", "jitter_ms must be a finite number"),
        ("bandwidth_mbps=inf", "bandwidth_mbps must be a finite number"),
    ],
)
def test_parse_rejects_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        WanProfile.parse(spec)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"latency_ms": -0.5}, "latency_ms must be >= 0"),
        ({"jitter_ms": -1}, "jitter_ms must be >= 0"),
        ({"bandwidth_mbps": -10}, "bandwidth_mbps must be >= 0"),
        ({"drop": -0.1}, "drop must be >= 0"),
        ({"drop": 1.0}, "drop must be a probability"),
        ({"drop": 1.5}, "drop must be a probability"),
        ({"latency_ms": math.nan}, "latency_ms must be a finite number"),
        ({"drop": math.nan}, "drop must be a finite number"),
        ({"jitter_ms": math.inf}, "jitter_ms must be a finite number"),
    ],
)
def test_profile_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WanProfile(**kwargs)


@pytest.mark.parametrize("kwargs", [{"latency_ms": "25"}, {"drop": True}, {"seed": 1.0}, {"seed": "1"}])
def test_profile_rejects_values_of_the_wrong_type(kwargs):
    with pytest.raises(TypeError):
        WanProfile(**kwargs)


def test_is_null_only_when_every_condition_is_zero():
    assert WanProfile(seed=9).is_null
    assert not WanProfile(latency_ms=1).is_null
    assert not WanProfile(jitter_ms=1).is_null
    assert not WanProfile(bandwidth_mbps=1).is_null
    assert not WanProfile(drop=0.1).is_null


# --- WanLink --------------------------------------------------------------------------------


def test_send_returns_once_queued_and_drain_delivers_at_the_scheduled_times():
    async def scenario():
        fake = FakeTime()
        sink = Sink(fake.clock)
        link = WanLink(sink.send, WanProfile(latency_ms=125, bandwidth_mbps=8), clock=fake.clock, sleep=fake.sleep)
        frames = [b"a" * 1_000_000, b"b" * 500_000, b"c" * 250_000]
        try:
            for frame in frames:
                await link.send(frame)
            assert sink.received == []
            assert link.pending == 3
            await link.drain()
        finally:
            await link.aclose()
        return sink, link, frames

    sink, link, frames = asyncio.run(scenario())

    assert sink.received == [(1.125, frames[0]), (1.625, frames[1]), (1.875, frames[2])]
    assert link.pending == 0
    assert (link.frames_sent, link.bytes_sent) == (3, 1_750_000)


def test_link_preserves_the_order_of_100_jittered_frames_and_counts_exactly():
    async def scenario():
        fake = FakeTime()
        sink = Sink(fake.clock)
        profile = WanProfile(latency_ms=20, jitter_ms=15, bandwidth_mbps=100, drop=0.05, seed=11)
        link = WanLink(sink.send, profile, clock=fake.clock, sleep=fake.sleep)
        sent: list[tuple[float, bytes]] = []
        try:
            for i in range(100):
                fake.now = i * 0.001
                frame = i.to_bytes(2, "big") * (1 + i % 7)
                sent.append((fake.now, frame))
                await link.send(frame)
            await link.drain()
        finally:
            await link.aclose()
        return sink, link, sent

    sink, link, sent = asyncio.run(scenario())

    assert sink.frames == [frame for _, frame in sent]
    times = [t for t, _ in sink.received]
    assert all(a <= b for a, b in itertools.pairwise(times))
    assert all(d >= t + 0.020 - 0.015 for (t, _), d in zip(sent, times, strict=True))
    assert link.frames_sent == 100
    assert link.bytes_sent == sum(len(frame) for _, frame in sent)


def test_delivery_is_never_earlier_than_scheduled_on_the_real_clock():
    async def scenario():
        sink = Sink()
        link = WanLink(sink.send, WanProfile(latency_ms=2))
        sent_at: list[float] = []
        try:
            for i in range(5):
                sent_at.append(time.monotonic())
                await link.send(bytes([i]))
            await link.drain()
        finally:
            await link.aclose()
        return sink, sent_at

    sink, sent_at = asyncio.run(scenario())

    assert sink.frames == [bytes([i]) for i in range(5)]
    assert all(d >= t + 0.002 for t, (d, _) in zip(sent_at, sink.received, strict=True))


def test_a_timer_that_fires_early_does_not_deliver_early():
    class EarlyTime(FakeTime):
        """The first sleep wakes 0.5 ms before it was due, as an event loop may."""

        def __init__(self) -> None:
            super().__init__()
            self.sleeps: list[float] = []

        async def sleep(self, seconds: float) -> None:
            early = 0.0005 if not self.sleeps else 0.0
            self.sleeps.append(seconds)
            await super().sleep(seconds - early)

    async def scenario():
        fake = EarlyTime()
        sink = Sink(fake.clock)
        link = WanLink(sink.send, WanProfile(latency_ms=125), clock=fake.clock, sleep=fake.sleep)
        try:
            await link.send(b"x")
            await link.drain()
        finally:
            await link.aclose()
        return sink, fake

    sink, fake = asyncio.run(scenario())

    assert sink.received == [(0.125, b"x")]
    assert len(fake.sleeps) == 2


def test_a_sink_error_is_reraised_on_the_next_send():
    async def scenario():
        fake = FakeTime()
        sink = Sink(fake.clock, fail_on=2)
        link = WanLink(sink.send, WanProfile(latency_ms=10), clock=fake.clock, sleep=fake.sleep)
        try:
            await link.send(b"one")
            await link.send(b"two")
            await sink.failed.wait()
            with pytest.raises(ConnectionError, match="connection closed"):
                await link.send(b"three")
            with pytest.raises(ConnectionError, match="connection closed"):
                await link.send(b"four")
        finally:
            await link.aclose()
        return sink, link

    sink, link = asyncio.run(scenario())

    assert sink.frames == [b"one"]
    assert (link.frames_sent, link.bytes_sent) == (1, 3)
    assert isinstance(link.error, ConnectionError)


def test_a_sink_error_is_reraised_by_drain_and_discards_the_frames_behind_it():
    async def scenario():
        fake = FakeTime()
        sink = Sink(fake.clock, fail_on=3)
        link = WanLink(sink.send, WanProfile(latency_ms=10), clock=fake.clock, sleep=fake.sleep)
        try:
            for i in range(6):
                await link.send(bytes([i]))
            with pytest.raises(ConnectionError):
                await link.drain()
            assert link.pending == 0
        finally:
            await link.aclose()
        return sink, link

    sink, link = asyncio.run(scenario())

    assert sink.frames == [b"\x00", b"\x01"]
    assert sink.calls == 3
    assert link.frames_sent == 2


def test_null_profile_sends_straight_through_without_a_task():
    async def scenario():
        sink = Sink()
        link = WanLink(sink.send, WanProfile())
        await link.send(b"now")
        delivered_before_yielding = sink.frames
        tasks = asyncio.all_tasks()
        await link.drain()
        await link.aclose()
        return delivered_before_yielding, tasks, link

    delivered, tasks, link = asyncio.run(scenario())

    assert delivered == [b"now"]
    assert len(tasks) == 1  # only the test's own task
    assert (link.frames_sent, link.bytes_sent) == (1, 3)


def test_null_profile_raises_a_sink_error_from_the_same_send():
    async def scenario():
        link = WanLink(Sink(fail_on=1).send, WanProfile())
        with pytest.raises(ConnectionError):
            await link.send(b"x")
        return link

    link = asyncio.run(scenario())

    assert link.frames_sent == 0


def test_aclose_cancels_delivery_and_leaves_no_pending_tasks():
    async def scenario():
        sink = Sink()
        link = WanLink(sink.send, WanProfile(latency_ms=60_000))
        await link.send(b"late")
        await asyncio.sleep(0)  # let the delivery task start its long sleep
        await link.aclose()
        remaining = asyncio.all_tasks() - {asyncio.current_task()}
        with pytest.raises(RuntimeError, match="1 frame"):
            await link.drain()
        with pytest.raises(RuntimeError, match="closed"):
            await link.send(b"after")
        return sink, remaining

    sink, remaining = asyncio.run(scenario())

    assert remaining == set()
    assert sink.received == []


def test_aclose_is_idempotent_and_the_link_works_as_a_context_manager():
    async def scenario():
        fake = FakeTime()
        sink = Sink(fake.clock)
        async with WanLink(sink.send, WanProfile(latency_ms=5), clock=fake.clock, sleep=fake.sleep) as link:
            await link.send(b"x")
            await link.drain()
        await link.aclose()
        return sink, asyncio.all_tasks() - {asyncio.current_task()}

    sink, remaining = asyncio.run(scenario())

    assert sink.frames == [b"x"]
    assert remaining == set()


def test_a_queued_mutable_buffer_is_copied():
    async def scenario():
        fake = FakeTime()
        sink = Sink(fake.clock)
        link = WanLink(sink.send, WanProfile(latency_ms=5), clock=fake.clock, sleep=fake.sleep)
        buffer = bytearray(b"before")
        try:
            await link.send(buffer)
            buffer[:] = b"after!"
            await link.drain()
        finally:
            await link.aclose()
        return sink

    assert asyncio.run(scenario()).frames == [b"before"]


# --- as a transport (worker_agent/protocol/transport.py) -------------------------------------


def test_a_profiles_transport_gives_each_connection_a_wan_link_of_that_profile():
    profile = WanProfile(latency_ms=30, seed=4)
    sink = Sink()

    async def scenario():
        transport = profile.transport()
        first, second = transport(sink.send), transport(sink.send)
        await first.aclose()
        await second.aclose()
        return first, second

    first, second = asyncio.run(scenario())

    assert isinstance(first, WanLink) and isinstance(second, WanLink)
    assert first is not second
    assert (first.profile, second.profile) == (profile, profile)


def test_the_products_direct_link_sends_straight_through_and_refuses_after_close():
    async def scenario():
        sink = Sink()
        link = DirectLink(sink.send)
        await link.send(b"one")
        delivered = list(sink.frames)  # before any drain: nothing is queued
        await link.drain()
        await link.aclose()
        with pytest.raises(RuntimeError, match="send on a closed link"):
            await link.send(b"two")
        return delivered, sink.frames

    delivered, frames = asyncio.run(scenario())

    assert delivered == [b"one"]
    assert frames == [b"one"]
