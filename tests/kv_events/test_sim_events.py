"""End to end: simulated engines publish KV events (`--kv-events`) and the subscriber keeps
a sink in step with them, through requests, resets, evictions and event-stream faults."""

import itertools
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from kvgate.routing.kv_events import KvEventSubscriber
from kvgate.sim import EngineOptions, SimEngine, SimFleet
from kvgate.sim_chat_template import render_chat
from kvgate.sim_tokenizer import token_ids, tokenize
from tests.servers import free_base_port, port_is_free

from .helpers import RecordingSink, until

PROMPT = (
    "The quick brown fox jumps over the lazy dog while the gateway routes requests to "
    "engines that share their prefix caches across many turns of a long conversation. "
) * 3
BLOCK = 16
Changes = list[tuple[str, str]]


def _options(**overrides: Any) -> EngineOptions:
    settings: dict[str, Any] = {"profile": "fast", "kv_events": True, "speed": 20.0}
    settings.update(overrides)
    return EngineOptions(**settings)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


@pytest.fixture
async def subscribe() -> AsyncIterator[Callable[..., Any]]:
    """Subscribe to an engine's events; wait for the initial replay; return (subscriber,
    sink, mode changes)."""
    started: list[KvEventSubscriber] = []

    async def start(
        engine: SimEngine, **options: Any
    ) -> tuple[KvEventSubscriber, RecordingSink, Changes]:
        assert engine.kv_events is not None
        sink = RecordingSink()
        changes: Changes = []
        subscriber = KvEventSubscriber(
            engine.url,
            engine.kv_events.url,
            sink,
            replay_url=engine.kv_events.replay_url,
            on_mode_change=lambda endpoint, mode, reason: changes.append((mode, reason)),
            **options,
        )
        subscriber.start()
        started.append(subscriber)
        await until(lambda: subscriber.reason != "starting")
        return subscriber, sink, changes

    yield start
    for subscriber in started:
        await subscriber.stop()


async def _complete(client: httpx.AsyncClient, engine: SimEngine, prompt: str) -> None:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 40, "ignore_eos": True}
    response = await client.post(f"{engine.url}/v1/completions", json=body)
    assert response.status_code == 200


async def _caught_up(client: httpx.AsyncClient, engine: SimEngine, sink: RecordingSink) -> None:
    """Reset the engine's prefix cache and wait for the subscriber to apply it: every batch
    published before it has then reached the sink (a batch a slow-joining SUB socket missed
    is replayed when the next one shows the gap)."""
    clears = sink.calls.count(("cleared", engine.url))
    assert (await client.post(f"{engine.url}/reset_prefix_cache")).status_code == 200
    await until(lambda: sink.calls.count(("cleared", engine.url)) > clears)


def _stored_tokens(sink: RecordingSink) -> list[int]:
    """The token ids of the stored blocks, concatenated in the order stored."""
    return [token for tokens in sink.tokens() for token in tokens]


def _full_blocks(ids: list[int]) -> list[int]:
    return ids[: len(ids) // BLOCK * BLOCK]


@pytest.mark.parametrize(
    ("profile", "encoding"), [("fast", "array"), ("realistic", "map")], ids=["fast", "realistic"]
)
async def test_stored_blocks_carry_the_prompts_token_ids(client, subscribe, profile, encoding):
    options = _options(profile=profile, kv_events_encoding=encoding)
    async with SimFleet(1, options=options) as fleet:
        engine = fleet.engines[0]
        subscriber, sink, changes = await subscribe(engine)
        await _complete(client, engine, PROMPT)
        published = (await client.get(f"{engine.url}/sim/kv-events/faults")).json()
        # Published as the engine works: one batch per step that cached blocks (fast: the
        # whole request is one step).
        assert (
            published["next_seq"]
            == published["batches_published"]
            >= (1 if profile == "fast" else 3)
        )
        await _caught_up(client, engine, sink)
    prompt_ids = _full_blocks(token_ids(tokenize(PROMPT)))
    stored = _stored_tokens(sink)
    assert len(stored) > len(prompt_ids)  # the prompt's blocks, then the answer's
    assert stored[: len(prompt_ids)] == prompt_ids
    events = sink.stored_events
    assert events[0].parent_block_hash is None
    for previous, event in itertools.pairwise(events):
        assert event.parent_block_hash == previous.block_hashes[-1]
        assert (event.block_size, event.medium) == (BLOCK, "GPU")
    assert sink.calls[-1] == ("cleared", engine.url)
    assert changes == [("precise", "fresh_start")]
    assert subscriber.counters.malformed_dropped == 0


async def test_chat_prompts_are_stored_as_the_template_renders_them(client, subscribe):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    async with SimFleet(1, options=_options(profile="realistic")) as fleet:
        engine = fleet.engines[0]
        _, sink, _ = await subscribe(engine)
        body = {"model": "sim-model", "messages": messages, "max_tokens": 5}
        assert (await client.post(f"{engine.url}/v1/chat/completions", json=body)).is_success
        await _caught_up(client, engine, sink)
    rendered = render_chat(messages, add_generation_prompt=True, continue_final_message=False)
    prompt_ids = _full_blocks(token_ids(tokenize(rendered)))
    assert _stored_tokens(sink)[: len(prompt_ids)] == prompt_ids


async def test_evictions_remove_blocks_stored_before(client, subscribe):
    async with SimFleet(1, options=_options(kv_blocks=12, max_model_len=192)) as fleet:
        engine = fleet.engines[0]
        _, sink, _ = await subscribe(engine)
        for topic in ("apples", "rivers", "engines"):
            await _complete(client, engine, f"Tell me about {topic}. " * 12)
        await _caught_up(client, engine, sink)
    stored = {h for event in sink.stored_events for h in event.block_hashes}
    removed = [h for call in sink.calls if call[0] == "removed" for h in call[2]]
    assert removed
    assert set(removed) <= stored


async def test_block_hashes_are_salted_per_engine(client, subscribe):
    async with SimFleet(2, options=_options()) as fleet:
        sinks = []
        for engine in fleet.engines:
            _, sink, _ = await subscribe(engine)
            await _complete(client, engine, PROMPT)
            await _caught_up(client, engine, sink)
            sinks.append(sink)
    first, second = (sink.stored_events[0] for sink in sinks)
    assert first.token_ids == second.token_ids
    assert not set(first.block_hashes) & set(second.block_hashes)


async def test_restart_fault_goes_approximate_then_precise(client, subscribe):
    async with SimFleet(1, options=_options()) as fleet:
        engine = fleet.engines[0]
        subscriber, sink, changes = await subscribe(engine)
        await _complete(client, engine, PROMPT)
        await _caught_up(client, engine, sink)
        faults = f"{engine.url}/sim/kv-events/faults"
        answer = await client.post(faults, json={"mode": "restart"})
        assert answer.json()["next_seq"] == 0
        await _complete(client, engine, PROMPT)
        await until(lambda: subscriber.counters.restarts == 1)
        await until(lambda: subscriber.mode == "precise")
        # The restarted engine's cache was empty: the prompt is stored again, from the start.
        assert sink.stored_events[-1].parent_block_hash is None
    assert changes == [
        ("precise", "fresh_start"),
        ("approximate", "publisher_restart"),
        ("precise", "fresh_start"),
    ]


async def test_stop_fault_stalls_and_the_stream_resumes_from_replay(client, subscribe):
    async with SimFleet(1, options=_options()) as fleet:
        engine = fleet.engines[0]
        subscriber, sink, changes = await subscribe(engine, stall_after=0.3)
        await _caught_up(client, engine, sink)
        faults = f"{engine.url}/sim/kv-events/faults"
        assert (await client.post(faults, json={"mode": "stop"})).is_success
        subscriber.note_traffic()
        await _complete(client, engine, PROMPT)
        await until(lambda: subscriber.mode == "approximate")
        assert subscriber.reason == "stalled"
        assert (await client.get(faults)).json()["batches_dropped"] == 1
        assert (await client.delete(faults)).json()["fault"] is None
        await _complete(client, engine, "Something else entirely. " * 8)
        await until(lambda: subscriber.mode == "precise")
    assert subscriber.counters.gaps_filled == 1
    assert _stored_tokens(sink)[:BLOCK] == token_ids(tokenize(PROMPT))[:BLOCK]
    assert changes[-2:] == [("approximate", "stalled"), ("precise", "resumed")]


async def test_dropped_batches_missing_from_replay_need_a_reset(client, subscribe):
    engine_options = _options()
    async with SimFleet(1, options=engine_options) as fleet:
        engine = fleet.engines[0]
        subscriber, sink, _ = await subscribe(engine)
        await _caught_up(client, engine, sink)
        faults = f"{engine.url}/sim/kv-events/faults"
        lost = (await client.get(faults)).json()["next_seq"]
        spec = {"mode": "drop", "from_seq": lost, "to_seq": lost, "replay": False}
        assert (await client.post(faults, json=spec)).json()["fault"] == spec
        await _complete(client, engine, PROMPT)
        await _complete(client, engine, "Something else entirely. " * 8)
        await until(lambda: subscriber.counters.gaps_unfilled == 1)
        assert (subscriber.mode, subscriber.reason) == ("approximate", "gap_unfilled")
        await _caught_up(client, engine, sink)
        assert (subscriber.mode, subscriber.reason) == ("precise", "cleared")


async def test_fault_specs_are_validated(client):
    async with SimFleet(1, options=_options()) as fleet:
        faults = f"{fleet.urls[0]}/sim/kv-events/faults"
        for spec in (
            {"mode": "explode"},
            {"mode": "drop", "from_seq": 5, "to_seq": 2},
            {"mode": "drop"},  # no range: it would drop batch 0 alone, long past
            {"mode": "stop", "from_seq": 3},
            {"mode": "stop", "when": "now"},
        ):
            assert (await client.post(faults, json=spec)).status_code == 400
        fleet.engines[0].set_kv_event_fault({"mode": "stop"})
        assert (await client.get(faults)).json()["fault"] == {"mode": "stop"}


@pytest.mark.parametrize(
    "options",
    [
        {"kv_events_encoding": "json"},
        {"kv_events_port_offset": 1500, "kv_events_replay_port_offset": 1500},
        {"kv_events_port_offset": 0},
        {"kv_events_replay_batches": 0},
    ],
)
def test_event_options_are_validated(options):
    with pytest.raises(ValueError):
        EngineOptions(kv_events=True, **options)


async def test_without_kv_events_nothing_is_published(client):
    async with SimFleet(1, options=EngineOptions(profile="fast")) as fleet:
        assert fleet.engines[0].kv_events is None
        response = await client.get(f"{fleet.urls[0]}/sim/kv-events/faults")
        assert response.status_code == 404


@pytest.mark.parametrize("offset", [0, 2000], ids=["http port", "replay port"])
async def test_a_taken_port_fails_the_start_and_frees_the_others(offset):
    base = free_base_port(1, (0, 1000, 2000))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + offset))
        taken.listen()
        with pytest.raises(OSError):
            await SimFleet(1, base_port=base, options=_options()).start()
    assert all(port_is_free(base + port) for port in (0, 1000, 2000))


def test_cli_publishes_on_the_port_offsets_of_consecutive_engines():
    base = free_base_port(2, (0, 1000, 2000))
    code = (
        "import argparse, sys; from kvgate.sim import cli; p = argparse.ArgumentParser(); "
        "cli.add_arguments(p); sys.exit(cli.run(p.parse_args(sys.argv[1:])))"
    )
    args = ["--engines", "2", "--base-port", str(base), "--profile", "fast", "--kv-events"]
    process = subprocess.Popen(
        [sys.executable, "-c", code, *args, "--kv-events-encoding", "map"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        for engine in range(2):
            line = process.stdout.readline().split()
            assert line[4:] == [
                f"http://127.0.0.1:{base + engine}",
                "kv-events",
                f"tcp://127.0.0.1:{base + 1000 + engine}",
                "replay",
                f"tcp://127.0.0.1:{base + 2000 + engine}",
            ]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
