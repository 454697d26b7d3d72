"""The subscriber against a scripted publisher on real ZMQ sockets: order, gaps, replay,
modes and their recovery, malformed input, stalls, restarts, cancellation."""

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import zmq
import zmq.asyncio

from kvgate.routing.kv_events import KvEventSubscriber

from .helpers import (
    TOPIC,
    RecordingSink,
    ScriptedPublisher,
    batch,
    block,
    cleared,
    seq_frame,
    stored,
    until,
)

ENDPOINT = "http://engine-0"
Changes = list[tuple[str, str]]


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


@pytest.fixture
async def publisher(context: zmq.asyncio.Context) -> AsyncIterator[ScriptedPublisher]:
    async with ScriptedPublisher(context) as publisher:
        yield publisher


@pytest.fixture
async def subscribe(
    context: zmq.asyncio.Context, publisher: ScriptedPublisher
) -> AsyncIterator[Callable[..., Any]]:
    """Start a subscriber on `publisher` (replay on unless replay=False) and wait until it
    has subscribed and synchronised from the replay socket; returns (subscriber, sink, mode
    changes)."""
    started: list[KvEventSubscriber] = []

    async def start(
        replay: bool = True, **options: Any
    ) -> tuple[KvEventSubscriber, RecordingSink, Changes]:
        sink = RecordingSink()
        changes: Changes = []
        subscriber = KvEventSubscriber(
            ENDPOINT,
            publisher.url,
            sink,
            replay_url=publisher.replay_url if replay else None,
            context=context,
            on_mode_change=lambda endpoint, mode, reason: changes.append((mode, reason)),
            **options,
        )
        subscriber.start()
        started.append(subscriber)
        await publisher.wait_for_subscriber()
        if replay:
            await until(lambda: subscriber.reason != "starting")
        return subscriber, sink, changes

    yield start
    for subscriber in started:
        await subscriber.stop()


async def test_fresh_publisher_then_gap_filled_from_replay_in_order(publisher, subscribe):
    subscriber, sink, changes = await subscribe()
    await until(lambda: subscriber.mode == "precise")
    assert changes == [("precise", "fresh_start")]
    await publisher.send(0, block(10))
    publisher.replay |= {1: block(11), 2: block(12)}
    await publisher.send(3, block(13))
    await until(lambda: subscriber.counters.batches_applied == 4)
    assert sink.tokens() == [(10, 10), (11, 11), (12, 12), (13, 13)]
    assert publisher.replay_requests == [0, 1]
    assert subscriber.counters.gaps_filled == 1
    assert subscriber.counters.gaps_unfilled == 0
    assert (subscriber.mode, changes) == ("precise", [("precise", "fresh_start")])
    assert subscriber.counters.last_event_lag_seconds is not None


async def test_unfillable_gap_is_approximate_until_all_blocks_cleared(publisher, subscribe):
    subscriber, sink, changes = await subscribe()
    await publisher.send(0, block(10))
    await publisher.send(1, block(11), replayable=False)  # lost on the way: see below
    await until(lambda: subscriber.counters.batches_applied == 2)
    publisher.replay.clear()
    await publisher.send(4, block(14))
    await until(lambda: subscriber.counters.gaps_unfilled == 1)
    assert (subscriber.mode, subscriber.reason) == ("approximate", "gap_unfilled")
    await publisher.send(5, block(15))
    await until(lambda: subscriber.counters.batches_applied == 4)
    assert subscriber.mode == "approximate"  # later batches alone do not restore precision
    await publisher.send(6, batch(cleared(), stored([16, 16], [16])))
    await until(lambda: subscriber.mode == "precise")
    assert subscriber.reason == "cleared"
    assert changes == [
        ("precise", "fresh_start"),
        ("approximate", "gap_unfilled"),
        ("precise", "cleared"),
    ]
    assert sink.calls[-2:] == [("cleared", ENDPOINT), ("stored", ENDPOINT, (16, 16))]


async def test_hole_inside_a_replay_is_approximate_but_keeps_what_came(publisher, subscribe):
    subscriber, sink, _ = await subscribe()
    await publisher.send(0, block(10))
    publisher.replay |= {2: block(12)}
    await publisher.send(3, block(13))
    await until(lambda: subscriber.counters.batches_applied == 3)
    assert sink.tokens() == [(10, 10), (12, 12), (13, 13)]
    assert (subscriber.mode, subscriber.reason) == ("approximate", "gap_unfilled")


async def test_malformed_input_is_counted_and_dropped(publisher, subscribe):
    subscriber, sink, _ = await subscribe()
    await publisher.send(0, block(10))
    await publisher.send_frames([TOPIC, block(99)])
    await publisher.send_frames([TOPIC, b"\x01", block(99)])
    await publisher.send(1, b"\xc1not msgpack")
    await publisher.send(2, batch(["BlockStored", [1], None, [1, 2, 3], 2, None, "GPU"]))
    await publisher.send(3, block(13))
    await until(lambda: subscriber.counters.batches_applied == 2)
    assert subscriber.counters.malformed_dropped == 4
    assert sink.tokens() == [(10, 10), (13, 13)]
    assert (subscriber.mode, subscriber.reason) == ("approximate", "malformed_batch")
    assert subscriber.counters.gaps_unfilled == 0  # a dropped batch is not a gap
    await publisher.send(4, batch(cleared()))
    await until(lambda: subscriber.mode == "precise")


async def test_other_topics_are_ignored(publisher, subscribe):
    subscriber, sink, _ = await subscribe()
    await publisher.send_frames([TOPIC + b"-other", seq_frame(0), block(99)])
    await publisher.send(0, block(10))
    await until(lambda: subscriber.counters.batches_applied == 1)
    assert sink.tokens() == [(10, 10)]
    assert subscriber.counters.malformed_dropped == 0


async def test_initial_replay_is_applied_once(publisher, subscribe):
    publisher.replay |= {0: block(10), 1: block(11)}
    subscriber, sink, changes = await subscribe()
    await until(lambda: subscriber.counters.batches_applied == 2)
    await publisher.send(1, publisher.replay[1])  # already replayed: a duplicate, not a restart
    await publisher.send(2, block(12))
    await until(lambda: subscriber.counters.batches_applied == 3)
    assert sink.tokens() == [(10, 10), (11, 11), (12, 12)]
    assert subscriber.counters.restarts == 0
    assert changes == [("precise", "fresh_start")]


async def test_joining_late_is_approximate(publisher, subscribe):
    publisher.replay |= {3: block(13)}  # the buffer no longer reaches back to 0
    subscriber, _, changes = await subscribe()
    await until(lambda: subscriber.counters.batches_applied == 1)
    assert (subscriber.mode, subscriber.reason) == ("approximate", "joined_late")
    await publisher.send(4, block(14))
    await until(lambda: subscriber.counters.batches_applied == 2)
    assert subscriber.mode == "approximate"
    assert changes == []


async def test_without_replay_the_first_batch_decides(publisher, subscribe):
    subscriber, _, _ = await subscribe(replay=False)
    assert (subscriber.mode, subscriber.reason) == ("approximate", "starting")
    await publisher.send(0, block(10))
    await until(lambda: subscriber.mode == "precise")
    late, _, _ = await subscribe(replay=False)
    await publisher.send(1, block(11))
    await until(lambda: late.counters.batches_applied == 1)
    assert (late.mode, late.reason) == ("approximate", "joined_late")


async def test_publisher_restart_clears_and_resynchronises(publisher, subscribe):
    subscriber, sink, changes = await subscribe()
    for seq in range(3):
        await publisher.send(seq, block(10 + seq))
    await until(lambda: subscriber.counters.batches_applied == 3)
    publisher.replay.clear()
    await publisher.send(0, block(20))  # a new stream: sequence back to 0, other contents
    await until(lambda: subscriber.counters.restarts == 1)
    await until(lambda: subscriber.counters.batches_applied == 4)
    assert sink.calls[-2:] == [("cleared", ENDPOINT), ("stored", ENDPOINT, (20, 20))]
    assert changes == [
        ("precise", "fresh_start"),
        ("approximate", "publisher_restart"),
        ("precise", "fresh_start"),
    ]
    publisher.replay.clear()
    await publisher.send(0, block(30))
    await until(lambda: subscriber.counters.restarts == 2)
    await publisher.send(1, block(31))
    await until(lambda: subscriber.counters.batches_applied == 6)
    assert subscriber.mode == "precise"


async def test_restart_heard_late_waits_for_a_clear(publisher, subscribe):
    subscriber, _, _ = await subscribe()
    for seq in range(3):
        await publisher.send(seq, block(10 + seq))
    await until(lambda: subscriber.counters.batches_applied == 3)
    publisher.replay.clear()
    await publisher.send(1, block(21))  # the new stream's batch 0 is gone for good
    await until(lambda: subscriber.counters.restarts == 1)
    await until(lambda: subscriber.counters.batches_applied == 4)
    assert (subscriber.mode, subscriber.reason) == ("approximate", "publisher_restart")
    await publisher.send(2, batch(cleared()))
    await until(lambda: subscriber.mode == "precise")


async def test_stall_while_serving_traffic_and_resume(publisher, subscribe):
    subscriber, _, changes = await subscribe(stall_after=0.2)
    await publisher.send(0, block(10))
    await until(lambda: subscriber.counters.batches_applied == 1)
    subscriber.note_traffic()
    await until(lambda: subscriber.mode == "approximate")
    assert (subscriber.reason, subscriber.counters.stalls) == ("stalled", 1)
    await publisher.send(1, block(11))
    await until(lambda: subscriber.mode == "precise")
    assert changes == [
        ("precise", "fresh_start"),
        ("approximate", "stalled"),
        ("precise", "resumed"),
    ]


async def test_a_batch_after_traffic_is_no_stall(publisher, subscribe):
    subscriber, _, _ = await subscribe(stall_after=1.0)
    await publisher.send(0, block(10))
    await until(lambda: subscriber.counters.batches_applied == 1)
    subscriber.note_traffic()
    await publisher.send(1, block(11))  # the answer to the traffic
    await until(lambda: subscriber.counters.batches_applied == 2)
    await asyncio.sleep(1.2)  # past stall_after since the traffic
    assert (subscriber.counters.stalls, subscriber.mode) == (0, "precise")


async def test_a_failing_sink_is_logged_and_leaves_approximate(publisher, subscribe, caplog):
    subscriber, sink, _ = await subscribe()
    await until(lambda: subscriber.mode == "precise")

    def broken(endpoint: str, event: object) -> None:
        raise RuntimeError("sink bug")

    sink.stored = broken  # type: ignore[method-assign]
    await publisher.send(0, block(10))
    await until(lambda: subscriber.mode == "approximate")
    assert subscriber.reason == "subscriber_failed"
    assert "subscriber failed" in caplog.text


async def test_stop_cancels_and_closes(context, publisher):
    subscriber = KvEventSubscriber(
        ENDPOINT, publisher.url, RecordingSink(), replay_url=publisher.replay_url
    )
    subscriber.start()
    await publisher.wait_for_subscriber()
    with pytest.raises(RuntimeError):
        subscriber.start()
    await subscriber.stop()  # its own context: terminating it would hang on an open socket


async def test_a_stream_heard_only_on_another_topic_stalls(publisher, subscribe, caplog):
    """A subscription matches topics by prefix (`kv` hears `kv-events`): messages on another
    topic are no sign of life of ours, so traffic without our batches ends in `stalled`, and
    the other topic is named in a warning once."""
    caplog.set_level("WARNING")
    subscriber, _, _ = await subscribe(stall_after=0.3)
    await publisher.send(0, block(10))
    await until(lambda: subscriber.counters.batches_applied == 1)
    subscriber.note_traffic()
    for seq in range(1, 8):  # the engine answers, on a topic that is not ours
        await publisher.send_frames([TOPIC + b"-other", seq_frame(seq), block(seq)])
        await asyncio.sleep(0.05)
    await until(lambda: subscriber.mode == "approximate")
    assert subscriber.reason == "stalled"
    named = [r for r in caplog.records if "ignoring messages on topic" in r.getMessage()]
    assert len(named) == 1


async def test_a_refused_request_owes_no_batch(publisher, subscribe):
    """The engine refused the request the gateway announced (it stores nothing): with no
    other traffic awaited, silence is no stall; with another awaited, it still is."""
    subscriber, _, _ = await subscribe(stall_after=0.3)
    await publisher.send(0, block(10))
    await until(lambda: subscriber.counters.batches_applied == 1)
    subscriber.note_traffic()
    subscriber.traffic_refused()
    await asyncio.sleep(0.6)
    assert (subscriber.counters.stalls, subscriber.mode) == (0, "precise")
    subscriber.note_traffic()
    subscriber.note_traffic()
    subscriber.traffic_refused()
    await until(lambda: subscriber.mode == "approximate")
    assert subscriber.reason == "stalled"


async def test_engine_back_is_approximate_until_the_sequence_goes_on(publisher, subscribe, caplog):
    """After a health-check outage: approximate (`engine_back`) until the next batch; one
    that continues the sequence restores precise with what the sink held. A change of reason
    while approximate is logged too."""
    caplog.set_level("INFO")
    subscriber, sink, changes = await subscribe()
    await publisher.send(0, block(10))
    await until(lambda: subscriber.counters.batches_applied == 1)
    subscriber.engine_back()
    assert (subscriber.mode, subscriber.reason) == ("approximate", "engine_back")
    await publisher.send(1, block(11))
    await until(lambda: subscriber.mode == "precise")
    assert subscriber.reason == "resumed" and sink.tokens() == [(10, 10), (11, 11)]
    assert changes[-2:] == [("approximate", "engine_back"), ("precise", "resumed")]
    subscriber.engine_back()
    await publisher.send(5, block(15))  # seqs 2-4 missing and not replayable
    await until(lambda: subscriber.reason == "gap_unfilled")
    logged = [
        r.getMessage() for r in caplog.records if "approximate (gap_unfilled)" in r.getMessage()
    ]
    assert logged  # engine_back -> gap_unfilled: still approximate, and said
