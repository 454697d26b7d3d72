"""Reload (SIGHUP, POST /admin/reload) and drain (SIGTERM) of `kvgate serve`, one worker."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import pytest

from kvgate.hot_reload import ReloadableGateway
from kvgate.sim import EngineOptions, SimFleet
from tests.metrics_text import sample_value
from tests.observability.serving import ADMIN_KEY, KEY, Serve, free_port, write_config
from tests.sdk_clients import sdk_client
from tests.servers import ServerThread

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def fleet() -> Iterator[SimFleet]:
    """An engine serving sim-model at a realistic pace (about 15 ms a token)."""
    options = EngineOptions(models=["sim-model"], profile="realistic")
    with SimFleet.in_thread(engines=1, options=options) as engines:
        yield engines


@pytest.fixture
def newcomer() -> Iterator[SimFleet]:
    """An engine serving sim-new, which only a reloaded config names."""
    options = EngineOptions(models=["sim-new"], profile="fast")
    with SimFleet.in_thread(engines=1, options=options) as engines:
        yield engines


class SlowStream:
    """A stream of `tokens` tokens read in a thread; `started` is set at its first chunk."""

    def __init__(self, base: str, tokens: int) -> None:
        self.base, self.tokens = base, tokens
        self.started = threading.Event()
        self.chunks: list[str] = []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        assert self.started.wait(20), f"the stream never started: {self.error!r}"

    def _read(self) -> None:
        try:
            client = sdk_client(base_url=self.base + "/v1", api_key=KEY, max_retries=0)
            stream = client.chat.completions.create(
                model="sim-model",
                max_tokens=self.tokens,
                stream=True,
                extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": "a long story please"}],
            )
            for chunk in stream:
                self.started.set()
                if chunk.choices:
                    self.chunks.append(chunk.choices[0].delta.content or "")
                    self.finish_reason = chunk.choices[0].finish_reason or self.finish_reason
        except BaseException as error:
            self.error = error
            self.started.set()

    def result(self) -> str | None:
        self._thread.join(60)
        assert self.error is None, repr(self.error)
        return self.finish_reason


def _models(base: str) -> list[str]:
    return [m["id"] for m in httpx.get(base + "/v1/models", timeout=5).json()["data"]]


def _chat(base: str, model: str, key: str = KEY) -> httpx.Response:
    return httpx.post(
        base + "/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        timeout=20,
    )


def _wait_for_model(base: str, model: str) -> None:
    deadline = time.monotonic() + 10
    while model not in _models(base):
        assert time.monotonic() < deadline, f"{model} never served after the reload"
        time.sleep(0.02)


def test_a_stream_across_a_reload_counts_on_its_engine_when_names_move(tmp_path, fleet, newcomer):
    """Endpoint names are positions in the config: a reload that puts another engine first
    moves `sim-0`. The stream still counts in flight on the engine it runs on (its URL), in
    the admin API and in the metric."""
    port = free_port()
    config = write_config(tmp_path / "gw.yaml", fleet.urls, port)
    with Serve(config, port) as gateway:
        stream = SlowStream(gateway.base, tokens=300)  # about 4.5 s, on sim-0 (fleet's engine)
        write_config(config, newcomer.urls + fleet.urls, port)
        gateway.signal(signal.SIGHUP)
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        deadline = time.monotonic() + 10
        while (
            len(
                listed := httpx.get(gateway.base + "/admin/endpoints", headers=admin).json()["data"]
            )
            < 2
        ):
            assert time.monotonic() < deadline, "the reload never took effect"
            time.sleep(0.05)
        in_flight = {e["url"]: e["in_flight"] for e in listed}
        assert in_flight == {newcomer.urls[0]: 0, fleet.urls[0]: 1}
        metric = httpx.get(gateway.base + "/metrics", headers=admin).text
        names = {e["url"]: e["name"] for e in listed}
        assert (
            sample_value(metric, "kvgate_endpoint_inflight_requests", endpoint=names[fleet.urls[0]])
            == 1
        )
        assert (
            sample_value(
                metric, "kvgate_endpoint_inflight_requests", endpoint=names[newcomer.urls[0]]
            )
            == 0
        )
        assert stream.result() == "length"


def test_sighup_mid_stream_finishes_the_stream_and_serves_the_new_config(tmp_path, fleet, newcomer):
    port = free_port()
    config = write_config(tmp_path / "gw.yaml", fleet.urls, port)
    with Serve(config, port) as gateway:
        assert _models(gateway.base) == ["sim-model"]
        stream = SlowStream(gateway.base, tokens=300)  # about 4.5 s
        write_config(config, fleet.urls, port, extra_pool=newcomer.urls)
        gateway.signal(signal.SIGHUP)
        _wait_for_model(gateway.base, "sim-new")
        # The stream runs on the replaced app; the endpoint still shows it in flight.
        listed = httpx.get(
            gateway.base + "/admin/endpoints",
            headers={"authorization": f"Bearer {ADMIN_KEY}"},
            timeout=5,
        ).json()["data"]
        assert {e["name"]: e["in_flight"] for e in listed}["sim-0"] == 1
        assert _chat(gateway.base, "sim-new").status_code == 200
        assert stream.result() == "length"
        assert len(stream.chunks) >= 300
        # The stream is logged when it is settled, just after the client read its end.
        deadline = time.monotonic() + 10
        while not (streamed := [line for line in gateway.lines() if line.get("stream") is True]):
            assert time.monotonic() < deadline, "the stream was never logged"
            time.sleep(0.05)
        logs = gateway.lines()
    (reloaded,) = [line for line in logs if line.get("message", "").startswith("config reloaded")]
    assert len(streamed) == 1
    # The stream ran across the reload: begun before it, ended after it.
    ended = datetime.fromisoformat(streamed[0]["ts"])
    began = ended - timedelta(milliseconds=streamed[0]["duration_ms"])
    assert began < datetime.fromisoformat(reloaded["ts"]) < ended


def _check_config_messages(config: Path) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "check-config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    return result.stderr.splitlines()[:-1]  # the last line counts the problems


def test_a_broken_config_is_refused_and_the_old_one_keeps_serving(tmp_path, fleet):
    port = free_port()
    config = write_config(tmp_path / "gw.yaml", fleet.urls, port)
    with Serve(config, port) as gateway:
        config.write_text(config.read_text().replace("engine: vllm", "engine: tgi"))
        expected = _check_config_messages(config)
        gateway.signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while not any(line["level"] == "ERROR" for line in gateway.lines()):
            assert time.monotonic() < deadline, "no log line says the reload was refused"
            time.sleep(0.05)
        refused = next(line for line in gateway.lines() if line["level"] == "ERROR")
        assert "reload refused" in refused["message"] and "tgi" in refused["message"]
        answer = httpx.post(
            gateway.base + "/admin/reload",
            headers={"authorization": f"Bearer {ADMIN_KEY}"},
            timeout=10,
        )
        assert answer.status_code == 400
        assert answer.json()["error"]["code"] == "invalid_config"
        assert {"message", "type", "param", "code"} <= set(answer.json()["error"])
        assert answer.json()["error"]["problems"] == expected
        assert _chat(gateway.base, "sim-model").status_code == 200
        assert gateway.proc.poll() is None


def test_admin_reload_needs_an_admin_key_and_applies_pools_and_keys(tmp_path, fleet, newcomer):
    port = free_port()
    config = write_config(tmp_path / "gw.yaml", fleet.urls, port)
    with Serve(config, port) as gateway:
        reload_url = gateway.base + "/admin/reload"
        assert httpx.post(reload_url, timeout=10).status_code == 401
        tenant = httpx.post(reload_url, headers={"authorization": f"Bearer {KEY}"}, timeout=10)
        assert tenant.status_code == 403
        assert _chat(gateway.base, "sim-new").status_code == 404
        write_config(
            config, fleet.urls, port, keys={"ops-2": "second-secret"}, extra_pool=newcomer.urls
        )
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        answer = httpx.post(reload_url, headers=admin, timeout=10)
        assert (answer.status_code, answer.json()) == (200, {"status": "reloaded"})
        assert _models(gateway.base) == ["sim-model", "sim-new"]
        assert _chat(gateway.base, "sim-new", key="ops-2.second-secret").status_code == 200
        assert _chat(gateway.base, "sim-model", key=KEY).status_code == 401


def test_a_reload_keeps_the_keys_read_at_start_and_says_so(tmp_path, fleet):
    """`drain_seconds` changed in the file: the reload applies the rest, warns that it waits
    for a restart, and `/admin/config` shows the values in effect, `--port` over the file's
    port included (which, unchanged in the file, is no news)."""
    port, filed = free_port(), free_port()
    config = write_config(tmp_path / "gw.yaml", fleet.urls, filed, server={"drain_seconds": 6})
    with Serve(config, port, 1, "--port", str(port)) as gateway:
        write_config(
            config,
            fleet.urls,
            filed,
            server={"drain_seconds": 7},
            keys={"ops-2": "second-secret"},
        )
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        answer = httpx.post(gateway.base + "/admin/reload", headers=admin, timeout=10)
        assert answer.status_code == 200
        assert _chat(gateway.base, "sim-model", key="ops-2.second-secret").status_code == 200
        shown = httpx.get(gateway.base + "/admin/config", headers=admin, timeout=5).json()
        server = shown["config"]["server"]
        assert (server["port"], server["drain_seconds"]) == (port, 6)
        warned = [line["message"] for line in gateway.lines() if line.get("level") == "WARNING"]
        said = [message for message in warned if "since the start" in message]
        assert len(said) == 1 and "server.drain_seconds changed" in said[0], warned
        assert "server.port" not in said[0]


def test_sigterm_lets_a_stream_longer_than_uvicorns_default_grace_finish(tmp_path, fleet):
    port = free_port()
    config = write_config(tmp_path / "gw.yaml", fleet.urls, port, server={"drain_seconds": 20})
    with Serve(config, port) as gateway:
        started = time.monotonic()
        stream = SlowStream(gateway.base, tokens=450)  # about 7 s: longer than 5 s
        gateway.signal(signal.SIGTERM)
        assert stream.result() == "length"
        assert len(stream.chunks) >= 450
        assert time.monotonic() - started > 5
        # uvicorn ends by re-raising the signal it handled, so the exit is by SIGTERM.
        assert gateway.proc.wait(timeout=30) == -signal.SIGTERM


async def _begin_drain(gateway: ReloadableGateway) -> None:
    gateway.begin_drain()


def test_readyz_answers_503_once_draining_starts(tmp_path, fleet):
    gateway = ReloadableGateway(write_config(tmp_path / "gw.yaml", fleet.urls, 0))
    with ServerThread(gateway) as server:
        assert httpx.get(server.url + "/readyz", timeout=5).status_code == 200
        server.call(_begin_drain(gateway))
        answer = httpx.get(server.url + "/readyz", timeout=5)
        assert (answer.status_code, answer.json()) == (503, {"status": "draining"})
