"""Three gateway processes, one Redis, one simulated fleet: they behave as one gateway."""

from __future__ import annotations

import concurrent.futures
import hashlib
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from kvgate.sim import EngineOptions, SimFleet
from tests.metrics_text import sample_value
from tests.redis_server import RedisServer
from tests.sdk_clients import sdk_client
from tests.test_cli import _free_port, _stop, _wait_ready

pytestmark = pytest.mark.timeout(180)

FALLBACKS = "kvgate_quota_local_fallbacks_total"
SECRET = "s3cret-for-tests"
KEY = f"load-1.{SECRET}"


def _config(
    path: Path,
    urls: list[str],
    port: int,
    redis_url: str | None,
    rpm: int | None = None,
    op_timeout: float = 0.5,
) -> Path:
    tenant: dict[str, object] = {
        "name": "load",
        "tier": "gold",
        "keys": [{"id": "load-1", "sha256": hashlib.sha256(SECRET.encode()).hexdigest()}],
    }
    if rpm is not None:
        tenant["limits"] = {"requests_per_minute": rpm}
    config: dict[str, object] = {
        "server": {"host": "127.0.0.1", "port": port, "access_log": False},
        "auth": {"tenants": [tenant]},
        "pools": [
            {
                "name": "sim",
                "engine": "vllm",
                "models": ["sim-model"],
                "endpoints": [{"url": u} for u in urls],
            }
        ],
    }
    if redis_url is not None:
        config["state"] = {
            "backend": "redis",
            "url": redis_url,
            "heartbeat_interval": 0.2,
            "op_timeout": op_timeout,
        }
    path.write_text(yaml.safe_dump(config))
    return path


class Gateways:
    """`count` kvgate processes over the same fleet, each on its own port."""

    def __init__(
        self,
        tmp: Path,
        urls: list[str],
        count: int,
        redis_url: str | None,
        rpm: int | None = None,
        op_timeout: float = 0.5,
        rotated: bool = False,
    ) -> None:
        """`rotated`: gateway i lists the engines starting from the i-th (its endpoint names
        then stand for other engines than the others' do)."""
        self.bases: list[str] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        for i in range(count):
            port = _free_port()
            listed = urls[i:] + urls[:i] if rotated else urls
            config = _config(tmp / f"gw{i}.yaml", listed, port, redis_url, rpm, op_timeout)
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "kvgate.cli",
                        "serve",
                        "--config",
                        str(config),
                        "--log-level",
                        "warning",
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
            self.bases.append(f"http://127.0.0.1:{port}")
        for base, proc in zip(self.bases, self.procs, strict=True):
            _wait_ready(base, proc)

    def clients(self) -> list[openai.OpenAI]:
        return [sdk_client(base_url=b + "/v1", api_key=KEY, max_retries=0) for b in self.bases]

    def stop(self) -> None:
        for proc in self.procs:
            _stop(proc)


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


def _shared_prefix_hit_rate(clients: list[openai.OpenAI]) -> float:
    """12 groups x 16 prompts sharing a long system prompt, in three concurrent lanes; lane i
    sends through gateway i (with one gateway, all lanes share it)."""
    jobs = [(question, group) for question in range(16) for group in range(12)]

    def lane(index: int) -> tuple[int, int]:
        client = clients[index % len(clients)]
        prompt_tokens = cached = 0
        for question, group in jobs[index::3]:
            system = f"You are assistant number {group}. " + f"Rule {group}: be precise. " * 120
            answer = client.chat.completions.create(
                model="sim-model",
                max_tokens=4,
                messages=[
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"Question {question} for {group}?"},
                ],
            )
            assert answer.usage is not None
            prompt_tokens += answer.usage.prompt_tokens
            details = answer.usage.prompt_tokens_details
            cached += (details.cached_tokens or 0) if details else 0
        return prompt_tokens, cached

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        totals = list(pool.map(lane, range(3)))
    return sum(c for _, c in totals) / sum(p for p, _ in totals)


def _fleet(speed: float = 50) -> SimFleet:
    """Four engines. Replicas share load every few tens of milliseconds, so a test of routing
    quality runs the engines slowly enough that requests outlast that (speed 5: tens of ms)."""
    return SimFleet.in_thread(
        engines=4, options=EngineOptions(profile="realistic", speed=speed, kv_blocks=2000)
    )


def test_three_replicas_keep_the_prefix_hit_rate_of_one(tmp_path, redis):
    with _fleet(speed=5) as fleet:
        single = Gateways(tmp_path, list(fleet.urls), 1, None)
        try:
            one = _shared_prefix_hit_rate(single.clients())
        finally:
            single.stop()
    with _fleet(speed=5) as fleet:
        three = Gateways(tmp_path, list(fleet.urls), 3, redis.url)
        try:
            shared = _shared_prefix_hit_rate(three.clients())
        finally:
            three.stop()
    assert one > 0.5
    assert shared >= 0.95 * one


def test_replicas_listing_the_engines_in_other_orders_share_prefixes_by_engine(tmp_path, redis):
    """A rolling config change leaves replicas whose endpoint names stand for different
    engines: a prompt first served through one replica must find its prefix cached when its
    follow-up goes through the other."""
    with _fleet() as fleet:
        pair = Gateways(tmp_path, list(fleet.urls), 2, redis.url, rotated=True)
        try:
            first, second = pair.clients()
            prompt_tokens = cached = 0
            for group in range(8):
                system = f"You are assistant number {group}. " + f"Rule {group}: be exact. " * 120
                ask = [{"role": "system", "content": system}]
                first.chat.completions.create(
                    model="sim-model",
                    max_tokens=2,
                    messages=[*ask, {"role": "user", "content": "a"}],
                )
                time.sleep(0.3)  # the routing decision reaches the other replica
                answer = second.chat.completions.create(
                    model="sim-model",
                    max_tokens=2,
                    messages=[*ask, {"role": "user", "content": "b"}],
                )
                assert answer.usage is not None
                prompt_tokens += answer.usage.prompt_tokens
                details = answer.usage.prompt_tokens_details
                cached += (details.cached_tokens or 0) if details else 0
        finally:
            pair.stop()
    assert cached >= 0.8 * prompt_tokens


def test_quota_is_exact_across_three_replicas(tmp_path, redis):
    """Every reservation goes through the shared bucket: at most the limit plus what it refilled
    while the requests ran. A Redis call that takes longer than `op_timeout` falls back to this
    replica's local share (docs/redis.md), which admits outside the shared count; on a loaded
    machine the gateway's own event loop can be that late, so the timeout here is generous and
    each fallback that still happened widens the bounds by one request."""
    rpm = 30
    with _fleet() as fleet:
        gateways = Gateways(tmp_path, list(fleet.urls), 3, redis.url, rpm=rpm, op_timeout=5.0)
        try:
            started = time.monotonic()
            statuses: list[int] = []

            def call(i: int) -> int:
                return httpx.post(
                    gateways.bases[i % 3] + "/v1/chat/completions",
                    timeout=30,
                    headers={"authorization": f"Bearer {KEY}"},
                    json={
                        "model": "sim-model",
                        "max_tokens": 2,
                        "messages": [{"role": "user", "content": "hi"}],
                    },
                ).status_code

            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                statuses = list(pool.map(call, range(90)))
            elapsed = time.monotonic() - started
            fallbacks = sum(
                sample_value(httpx.get(base + "/metrics").text, FALLBACKS) or 0
                for base in gateways.bases
            )
        finally:
            gateways.stop()
    accepted = statuses.count(200)
    assert set(statuses) <= {200, 429}
    assert rpm - fallbacks <= accepted <= (rpm + rpm / 60 * elapsed) * 1.01 + fallbacks


def test_killing_redis_under_load_fails_no_request(tmp_path, redis):
    with _fleet() as fleet:
        gateways = Gateways(tmp_path, list(fleet.urls), 3, redis.url)
        try:
            clients = gateways.clients()

            def call(i: int) -> str:
                reply = clients[i % 3].chat.completions.create(
                    model="sim-model",
                    max_tokens=4,
                    messages=[{"role": "user", "content": f"request {i % 7}"}],
                )
                return reply.choices[0].finish_reason or ""

            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                pending = [pool.submit(call, i) for i in range(60)]
                time.sleep(0.5)
                redis.stop()
                time.sleep(1.5)
                redis.start()
                pending += [pool.submit(call, i) for i in range(60, 120)]
                results = [f.result(timeout=60) for f in pending]
            assert len(results) == 120
            for base in gateways.bases:
                assert httpx.get(base + "/readyz").status_code == 200
                deadline = time.monotonic() + 15
                while not _resynced(httpx.get(base + "/metrics").text):
                    assert time.monotonic() < deadline, "replica did not reconnect and resync"
                    time.sleep(0.1)
        finally:
            gateways.stop()


def _resynced(metrics: str) -> bool:
    """Connected to Redis again, and resynced at least twice: at start and after the loss."""
    resyncs = next(
        line for line in metrics.splitlines() if line.startswith("kvgate_state_resyncs_total")
    )
    return "kvgate_state_redis_connected 1.0" in metrics and float(resyncs.split()[-1]) >= 2


def test_workers_with_memory_state_refuse_to_start(tmp_path):
    config = _config(tmp_path / "memory.yaml", ["http://127.0.0.1:9"], _free_port(), None)
    result = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "serve", "--config", str(config), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert "--workers 2 needs shared state" in result.stderr


def test_workers_are_full_replicas_sharing_redis(tmp_path, redis):
    with _fleet() as fleet:
        port = _free_port()
        config = _config(tmp_path / "workers.yaml", list(fleet.urls), port, redis.url)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvgate.cli",
                "serve",
                "--config",
                str(config),
                "--workers",
                "2",
                "--log-level",
                "warning",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_ready(base, proc)
            client = sdk_client(base_url=base + "/v1", api_key=KEY, max_retries=0)
            for i in range(6):
                reply = client.chat.completions.create(
                    model="sim-model",
                    max_tokens=3,
                    messages=[{"role": "user", "content": f"hello {i}"}],
                )
                assert reply.choices[0].message.content
            deadline = time.monotonic() + 15
            # Under --workers the scrape-time views carry the answering worker's pid label.
            seen = re.compile(r'^kvgate_state_replicas\{pid="\d+"\} 2\.0$', re.MULTILINE)
            while not seen.search(httpx.get(base + "/metrics").text):
                assert time.monotonic() < deadline, "the two workers never saw each other"
                time.sleep(0.1)
        finally:
            _stop(proc)
