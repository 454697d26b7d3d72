"""`kvgate serve --workers N`: one scrape shows the whole process, and every worker logs JSON."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvgate.sim import EngineOptions, SimFleet
from tests.metrics_text import sample_value
from tests.observability.serving import (
    ADMIN_KEY,
    KEY,
    SECRET,
    Serve,
    free_port,
    write_config,
)
from tests.observability.test_drain import LongStream
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
PROMPT = "tell me the confidential plan for project kestrel"


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


def _send(base: str, count: int, stream: bool) -> list[httpx.Response]:
    """`count` requests, six at a time, each on a connection of its own (so the kernel spreads
    them over the workers)."""

    def one(i: int) -> httpx.Response:
        body = {
            "model": "sim-model",
            "max_tokens": 4,
            "stream": stream,
            "messages": [{"role": "user", "content": f"{PROMPT} {i}"}],
        }
        headers = {"authorization": f"Bearer {KEY}"}
        with httpx.Client(timeout=30) as client:
            response = client.post(base + "/v1/chat/completions", json=body, headers=headers)
            response.read()
            return response

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        return list(pool.map(one, range(count)))


def _send_until_spread(gateway: Serve, workers: int, stream: bool) -> list[httpx.Response]:
    """Rounds of six requests until `workers` processes have answered some (which worker
    accepts a connection is the kernel's choice; a round may all land on one)."""
    answers: list[httpx.Response] = []
    for _ in range(40):
        answers += _send(gateway.base, 6, stream)
        if len({line["pid"] for line in _access(gateway)}) >= workers:
            return answers
        time.sleep(0.05)
    raise AssertionError(f"{len(answers)} requests never reached {workers} workers")


def _access(gateway: Serve) -> list[dict[str, Any]]:
    return [line for line in gateway.lines() if line["logger"] == "kvgate.access"]


def _wait_settled(gateway: Serve, requests: int) -> None:
    """Until every request has been settled (counted, then logged): a client may read the end
    of its answer just before the gateway settles the request."""
    deadline = time.monotonic() + 10
    while len(_access(gateway)) < requests:
        assert time.monotonic() < deadline, f"{len(_access(gateway))} of {requests} logged"
        time.sleep(0.05)


def _requests_total(text: str) -> tuple[float, set[str]]:
    """The sum of kvgate_requests_total over its labels, and the pids on the per-process views."""
    total, pids = 0.0, set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvgate_requests_total":
                total += sample.value
            if sample.name == "kvgate_endpoint_healthy":
                pids.add(sample.labels["pid"])
    return total, pids


def test_every_scrape_of_three_workers_reads_the_exact_request_total(tmp_path, redis):
    with SimFleet.in_thread(engines=2, options=EngineOptions(profile="fast")) as fleet:
        port = free_port()
        config = write_config(tmp_path / "gw.yaml", fleet.urls, port, redis_url=redis.url)
        temp = tmp_path / "tmp"
        temp.mkdir()
        with Serve(config, port, 3, env={"TMPDIR": str(temp)}) as gateway:
            answers = _send_until_spread(gateway, 3, stream=False)
            requests = len(answers)
            assert [r.status_code for r in answers] == [200] * requests
            _wait_settled(gateway, requests)
            for _ in range(8):
                with httpx.Client(timeout=10) as client:
                    total, pids = _requests_total(client.get(gateway.base + "/metrics").text)
                assert total == requests
                assert len(pids) == 1  # the views are the answering worker's own
            (metrics_dir,) = temp.glob("kvgate-metrics-*")
            assert any(metrics_dir.glob("counter_*.db"))
        assert not any(temp.iterdir()), "kvgate serve left its metrics directory behind"


def test_every_worker_writes_one_json_access_line_per_request(tmp_path, redis):
    with SimFleet.in_thread(engines=2, options=EngineOptions(profile="fast")) as fleet:
        port = free_port()
        config = write_config(tmp_path / "gw.yaml", fleet.urls, port, redis_url=redis.url)
        with Serve(config, port, 2) as gateway:
            answers = _send_until_spread(gateway, 2, stream=True)
            requests = len(answers)
            assert [r.status_code for r in answers] == [200] * requests
            _wait_settled(gateway, requests)
            text = gateway.stderr()
            lines = gateway.lines()  # every line is JSON
    for line in lines:
        assert {"ts", "level", "logger", "pid"} <= line.keys()
    access = [line for line in lines if line["logger"] == "kvgate.access"]
    assert len(access) == requests
    assert {line["request_id"] for line in access} == {r.headers["x-request-id"] for r in answers}
    for line in access:
        assert (line["tenant"], line["key_id"], line["model"]) == ("ops", "ops-1", "sim-model")
        assert line["status"] == 200 and line["level"] == "INFO"
        assert line["ttft_ms"] > 0 and line["duration_ms"] >= line["ttft_ms"]
        assert line["usage"]["prompt_tokens"] > 0 and line["usage"]["completion_tokens"] > 0
    assert PROMPT not in text and "kestrel" not in text and SECRET not in text


def test_cost_successes_and_capped_labels_add_up_over_workers(tmp_path, redis):
    """Two workers, each capping labels and pricing alike: one scrape's cost is the sum of
    every worker's access-log costs, and every request is one successful task."""
    with SimFleet.in_thread(engines=2, options=EngineOptions(profile="fast")) as fleet:
        port = free_port()
        config = write_config(tmp_path / "gw.yaml", fleet.urls, port, redis_url=redis.url)
        data = yaml.safe_load(config.read_text())
        data["pools"][0]["price"] = {"input_per_mtok": 3.0, "output_per_mtok": 15.0}
        data["observability"] = {"max_label_values": 1}
        config.write_text(yaml.safe_dump(data))
        with Serve(config, port, 2) as gateway:
            answers = _send_until_spread(gateway, 2, stream=True)
            requests = len(answers)
            assert [r.status_code for r in answers] == [200] * requests
            _wait_settled(gateway, requests)
            logged = sum(line["cost_dollars"] for line in _access(gateway))
            with httpx.Client(timeout=10) as client:
                text = client.get(gateway.base + "/metrics").text
    labels = {"tenant": "ops", "model": "sim-model", "pool": "sim"}
    assert sample_value(text, "kvgate_cost_dollars_total", **labels) == pytest.approx(logged)
    tasks = sample_value(text, "kvgate_successful_tasks_total", **labels, kind="request")
    assert tasks == requests


def _messages(gateway: Serve) -> list[str]:
    return [line["message"] for line in gateway.lines() if "message" in line]


def _models_seen(base: str, scrapes: int) -> set[tuple[str, ...]]:
    """The model lists of `scrapes` answers, each on a connection of its own."""
    seen = set()
    for _ in range(scrapes):
        with httpx.Client(timeout=5) as client:
            data = client.get(base + "/v1/models").json()["data"]
        seen.add(tuple(m["id"] for m in data))
    return seen


def test_workers_reload_in_place_keeping_their_connections_and_refuse_a_broken_config(
    tmp_path, redis
):
    """SIGHUP (or `/admin/reload`) reaches every worker, and each reloads the file in place as
    one process does: no worker is replaced, so a client's keep-alive connections and its
    requests on them go on throughout; a file that does not load leaves every worker on the
    config it has."""
    fast = EngineOptions(profile="fast")
    with (
        SimFleet.in_thread(engines=1, options=fast) as fleet,
        SimFleet.in_thread(engines=1, options=EngineOptions(models=["sim-new"])) as newcomer,
    ):
        port = free_port()
        config = write_config(tmp_path / "gw.yaml", fleet.urls, port, redis_url=redis.url)
        with Serve(config, port, 2) as gateway, _KeepAliveTraffic(gateway.base) as traffic:
            started = _worker_starts(gateway)
            assert len(started) == 2
            good = config.read_text()
            config.write_text(good.replace("engine: vllm", "engine: tgi"))
            gateway.signal(signal.SIGHUP)
            deadline = time.monotonic() + 30
            while _count(gateway, "config reload refused") < 2:
                assert time.monotonic() < deadline, "some worker never refused the config"
                time.sleep(0.1)
            assert _models_seen(gateway.base, 6) == {("sim-model",)}
            refused = httpx.post(gateway.base + "/admin/reload", headers=ADMIN, timeout=10)
            assert refused.status_code == 400 and "tgi" in refused.text
            write_config(config, fleet.urls, port, redis_url=redis.url, extra_pool=newcomer.urls)
            answer = httpx.post(gateway.base + "/admin/reload", headers=ADMIN, timeout=10)
            assert (answer.status_code, answer.json()) == (202, {"status": "reloading_workers"})
            deadline = time.monotonic() + 30
            while _models_seen(gateway.base, 6) != {("sim-model", "sim-new")}:
                assert time.monotonic() < deadline, "some worker never served the new config"
                time.sleep(0.2)
            assert _count(gateway, "config reloaded from") == 2
            assert _worker_starts(gateway) == started  # the same two processes
            assert gateway.proc.poll() is None
        assert traffic.failures == [] and traffic.answered > 0


class _KeepAliveTraffic:
    """Requests one after another on one keep-alive connection, in a thread, until the block
    ends: a worker replaced under it would close it between two requests."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.answered = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _KeepAliveTraffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        body = {
            "model": "sim-model",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "x"}],
        }
        headers = {"authorization": f"Bearer {KEY}"}
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                try:
                    answer = client.post(
                        self.base + "/v1/chat/completions", json=body, headers=headers
                    )
                except httpx.TransportError as error:
                    self.failures.append(repr(error))
                    continue
                if answer.status_code != 200:
                    self.failures.append(answer.text)
                self.answered += 1
                time.sleep(0.05)


def _count(gateway: Serve, text: str) -> int:
    return sum(text in m for m in _messages(gateway))


def _worker_starts(gateway: Serve) -> list[str]:
    return [m for m in _messages(gateway) if m.startswith("Started server process")]


def test_a_killed_workers_queue_gauge_leaves_the_sums(tmp_path, redis):
    """A worker that dies without stopping (SIGKILL, out of memory) cannot take its live
    gauges out of the summed metrics itself: the supervisor does, as it replaces it."""
    options = EngineOptions(models=["sim-model"], profile="realistic")
    with SimFleet.in_thread(engines=1, options=options) as fleet:
        port = free_port()
        config = write_config(tmp_path / "gw.yaml", fleet.urls, port, redis_url=redis.url)
        written = yaml.safe_load(config.read_text())
        written["pools"][0]["endpoints"][0]["max_inflight"] = 1  # the others queue
        config.write_text(yaml.safe_dump(written))
        temp = tmp_path / "tmp"
        temp.mkdir()
        with Serve(config, port, 2, env={"TMPDIR": str(temp)}) as gateway:
            (metrics_dir,) = temp.glob("kvgate-metrics-*")
            queued: set[int] = set()
            for _ in range(10):
                _send(gateway.base, 6, stream=False)
                queued = {int(f.stem.rsplit("_", 1)[1]) for f in metrics_dir.glob("gauge_live*")}
                if queued:
                    break
            assert queued, "no request ever queued"
            dead = next(iter(queued))
            os.kill(dead, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while not any(f"Child process [{dead}] died" in m for m in _messages(gateway)):
                assert time.monotonic() < deadline, "the supervisor never replaced the worker"
                time.sleep(0.1)
            # The supervisor forgets it once the replacement has started.
            while list(metrics_dir.glob(f"gauge_live*_{dead}.db")):
                assert time.monotonic() < deadline, "the dead worker's gauges stayed"
                time.sleep(0.1)


def test_a_draining_multi_worker_gateway_refuses_new_connections_and_finishes_its_stream(
    tmp_path, redis
):
    """As one process does: on SIGTERM the listener closes at once, so a client or load balancer
    that connects during the drain is refused instead of waiting in a backlog nobody reads (and
    being reset when the process exits), while the stream in flight finishes."""
    options = EngineOptions(models=["sim-model"], profile="realistic")
    with SimFleet.in_thread(engines=1, options=options) as fleet:
        port = free_port()
        config = write_config(
            tmp_path / "gw.yaml", fleet.urls, port, redis_url=redis.url,
            server={"drain_seconds": 20},
        )  # fmt: skip
        with Serve(config, port, 2) as gateway:
            stream = LongStream(gateway.base, tokens=200)  # about 3 s
            gateway.signal(signal.SIGTERM)
            refused_at = None
            deadline = time.monotonic() + 10
            while refused_at is None and time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                except ConnectionRefusedError:
                    refused_at = time.monotonic()
                time.sleep(0.05)
            assert refused_at is not None, "the draining gateway still accepted connections"
            assert stream.last_event() == "[DONE]"
            assert stream.ended > refused_at  # refused while the stream still ran
