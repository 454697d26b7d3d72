"""Drain (SIGTERM): queued requests get 503 with Retry-After at once, requests in flight get
`server.drain_seconds` and then end with an error event, and the process exits."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from kvgate.hot_reload import ReloadableGateway
from kvgate.sim import EngineOptions, SimFleet
from tests.observability.serving import KEY, Serve, chat, free_port
from tests.observability.test_admin_api import ADMIN, config_dict, write
from tests.servers import ServerThread

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def fleet() -> Iterator[SimFleet]:
    """An engine at a realistic pace (about 15 ms a token)."""
    options = EngineOptions(models=["sim-model"], profile="realistic")
    with SimFleet.in_thread(engines=1, options=options) as engines:
        yield engines


class LongStream:
    """A stream of `tokens` tokens read in a thread: its raw body, and when it ended."""

    def __init__(self, base: str, tokens: int) -> None:
        self.base, self.tokens = base, tokens
        self.started = threading.Event()
        self.body = b""
        self.ended = 0.0
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        assert self.started.wait(20), "the stream never started"

    def _read(self) -> None:
        with httpx.stream(
            "POST",
            self.base + "/v1/chat/completions",
            headers={"authorization": f"Bearer {KEY}"},
            json={
                "model": "sim-model",
                "max_tokens": self.tokens,
                "ignore_eos": True,
                "stream": True,
                "messages": [{"role": "user", "content": "a long story please"}],
            },
            timeout=60,
        ) as stream:
            chunks = stream.iter_bytes()
            self.body = next(chunks)
            self.started.set()
            self.body += b"".join(chunks)
        self.ended = time.monotonic()

    def last_event(self) -> dict[str, Any] | str:
        self._thread.join(60)
        events = [e for e in self.body.split(b"\n\n") if e.strip()]
        data = events[-1].removeprefix(b"data: ")
        return data.decode() if data == b"[DONE]" else orjson.loads(data)


async def _begin_drain(gateway: ReloadableGateway) -> None:
    gateway.begin_drain()


def _one_at_a_time(urls: list[str], drain_seconds: float) -> dict[str, Any]:
    config = config_dict(urls, server={"drain_seconds": drain_seconds})
    config["auth"]["tenants"][0]["limits"] = {"max_concurrent": 1}
    return config


def test_queued_requests_get_503_with_retry_after_when_the_drain_starts(tmp_path, fleet):
    gateway = ReloadableGateway(write(tmp_path / "gw.yaml", _one_at_a_time(fleet.urls, 20)))
    with ServerThread(gateway) as server:
        stream = LongStream(server.url, tokens=150)
        queued: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: queued.append(chat(server.url)))
        waiter.start()
        deadline = time.monotonic() + 10
        while not httpx.get(server.url + "/admin/admission", headers=ADMIN).json()["queued"][
            "standard"
        ]:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.02)
        server.call(_begin_drain(gateway))
        waiter.join(5)
        assert not stream.ended, "the queued request was answered only when the stream ended"
        (refused,) = queued
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "draining"
        assert refused.json()["error"]["type"] == "server_error"
        # A new request is refused the same way; the one in flight finishes.
        assert chat(server.url).json()["error"]["code"] == "draining"
        assert stream.last_event() == "[DONE]"
        state = httpx.get(server.url + "/admin/admission", headers=ADMIN).json()
        assert state["queued"] == {"interactive": 0, "standard": 0, "batch": 0}
        assert state["open_reservations"] == {"requests": 0, "tokens": 0}


def test_a_stream_longer_than_the_drain_ends_with_an_error_event(tmp_path, fleet):
    gateway = ReloadableGateway(
        write(tmp_path / "gw.yaml", config_dict(fleet.urls, server={"drain_seconds": 1}))
    )
    with ServerThread(gateway) as server:
        stream = LongStream(server.url, tokens=600)  # about 9 s
        began = time.monotonic()
        server.call(_begin_drain(gateway))
        last = stream.last_event()
        assert isinstance(last, dict), last
        assert last["error"]["code"] == "drain_timeout"
        assert set(last["error"]) == {"message", "type", "param", "code"}
        assert 0.9 < stream.ended - began < 5
        assert b"[DONE]" not in stream.body


def test_sigterm_ends_a_stream_at_drain_seconds_with_an_error_event_and_exits(tmp_path, fleet):
    port = free_port()
    config = config_dict(fleet.urls, server={"drain_seconds": 2, "host": "127.0.0.1", "port": port})
    with Serve(write(tmp_path / "gw.yaml", config), port) as gateway:
        stream = LongStream(gateway.base, tokens=600)  # about 9 s
        began = time.monotonic()
        gateway.signal(signal.SIGTERM)
        last = stream.last_event()
        assert isinstance(last, dict), last
        assert last["error"]["code"] == "drain_timeout"
        assert 1.9 < stream.ended - began < 6
        assert gateway.proc.wait(timeout=30) == -signal.SIGTERM
        assert any("drain time is up" in line["message"] for line in gateway.lines())
