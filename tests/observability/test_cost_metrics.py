"""Cost, successful tasks and inter-token latency read from /metrics (and the access log)
after known traffic on the simulator."""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import openai
import pytest

from kvgate.observability.log_format import FIELDS
from kvgate.sim import EngineOptions, SimFleet
from tests.conftest import gateway_config
from tests.metrics_text import sample_value
from tests.observability.serving import KEY, SECRET, digest
from tests.sdk_clients import sdk_client

_PRICE = {"input_per_mtok": 2.0, "cached_input_per_mtok": 0.5, "output_per_mtok": 8.0}
_LABELS = {"tenant": "ops", "model": "sim-model", "pool": "default"}
_CONTEXT = "the shared context of every question here. " * 40


def _auth() -> dict[str, Any]:
    return {"tenants": [{"name": "ops", "keys": [{"id": "ops-1", "sha256": digest(SECRET)}]}]}


def _dollars(usage: Any) -> float:
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    return 1e-6 * (
        (usage.prompt_tokens - cached) * _PRICE["input_per_mtok"]
        + cached * _PRICE["cached_input_per_mtok"]
        + usage.completion_tokens * _PRICE["output_per_mtok"]
    )


def _wait_for(base: str, name: str, expected: float, **labels: str) -> str:
    """The /metrics text once sample `name` reaches `expected` (the last request is settled
    just after its answer)."""
    deadline = time.monotonic() + 5
    while True:
        text = httpx.get(base + "/metrics", timeout=5).text
        value = sample_value(text, name, **labels)
        if value is not None and value == pytest.approx(expected, rel=1e-9):
            return text
        assert time.monotonic() < deadline, (name, value, expected)
        time.sleep(0.02)


def test_cost_successes_and_access_log_after_known_traffic(start_gateway, caplog):
    caplog.set_level(logging.INFO, logger="kvgate.access")
    config = gateway_config([], auth=_auth(), pool={"price": _PRICE})
    with SimFleet.in_thread(engines=1, options=EngineOptions(profile="fast")) as fleet:
        config["pools"][0]["endpoints"] = [{"url": u} for u in fleet.urls]
        config["server"]["access_log"] = True
        _, server = start_gateway(config)
        client = sdk_client(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        dollars, used = 0.0, 0
        # Three plain requests, then a workflow of two steps and one step of an unfinished
        # workflow: four tasks of kind `request`, one of kind `workflow`.
        steps = [None, None, None, ("wf-1", "1/2"), ("wf-1", "2/2"), ("wf-2", "1/3")]
        for i, step in enumerate(steps):
            headers = {} if step is None else {
                "x-kvgate-workflow-id": step[0], "x-kvgate-workflow-step": step[1],
            }  # fmt: skip
            usage = client.chat.completions.create(
                model="sim-model",
                max_tokens=5,
                messages=[{"role": "user", "content": f"{_CONTEXT} question {i}"}],
                extra_headers=headers,
            ).usage
            assert usage is not None
            dollars += _dollars(usage)
            used += usage.total_tokens
        stream = client.chat.completions.create(
            model="sim-model",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": f"{_CONTEXT} a streamed question"}],
        )
        final = [c.usage for c in stream if c.usage is not None][-1]
        dollars += _dollars(final)
        used += final.total_tokens
        text = _wait_for(server.url, "kvgate_cost_dollars_total", dollars, **_LABELS)
    tasks = "kvgate_successful_tasks_total"
    assert sample_value(text, tasks, **_LABELS, kind="request") == 4
    assert sample_value(text, tasks, **_LABELS, kind="workflow") == 1
    # Quota: every request settled to its usage; each had reserved its prompt estimate plus
    # max_tokens.
    assert sample_value(text, "kvgate_quota_settled_tokens_total", tenant="ops") == used
    reserved = sample_value(text, "kvgate_quota_reserved_tokens_total", tenant="ops")
    assert reserved is not None and reserved >= 7 * 5
    logged = [r.__dict__[FIELDS] for r in caplog.records if r.name == "kvgate.access"]
    assert len(logged) == 7
    assert sum(line["cost_dollars"] for line in logged) == pytest.approx(dollars, rel=1e-9)


def test_a_failed_request_costs_without_success(start_gateway):
    """A stream the engine cuts after some tokens is charged, and is no success."""
    fault = {"mode": "crash_after_tokens", "tokens": 3}
    with SimFleet.in_thread(engines=1, options=EngineOptions(profile="fast", fault=fault)) as f:
        config = gateway_config(f.urls, auth=_auth(), pool={"price": _PRICE})
        config["resilience"] = {"retries": {"max_attempts": 1}}
        _, server = start_gateway(config)
        client = sdk_client(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        stream = client.chat.completions.create(
            model="sim-model",
            max_tokens=20,
            stream=True,
            messages=[{"role": "user", "content": "tell me a story"}],
        )
        received = 0
        with pytest.raises(openai.APIError):
            for chunk in stream:
                received += bool(chunk.choices and chunk.choices[0].delta.content)
        deadline = time.monotonic() + 5
        while True:
            text = httpx.get(server.url + "/metrics", timeout=5).text
            cost = sample_value(text, "kvgate_cost_dollars_total", **_LABELS)
            if cost is not None or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    # At least the tokens relayed before the cut, at the output price.
    assert received >= 1
    assert cost is not None and cost >= received * _PRICE["output_per_mtok"] * 1e-6
    assert sample_value(text, "kvgate_successful_tasks_total", **_LABELS, kind="request") is None


def test_a_stream_the_client_leaves_is_charged_what_it_received(start_gateway):
    """A client that closes a stream after some events is charged, in quota and dollars, its
    estimated prompt plus one token per event relayed (docs/tenants.md), not nothing: else
    leaving just before the end would take any number of tokens past the quota."""
    with SimFleet.in_thread(engines=1, options=EngineOptions(profile="realistic")) as fleet:
        config = gateway_config(fleet.urls, auth=_auth(), pool={"price": _PRICE})
        _, server = start_gateway(config)
        body = {
            "model": "sim-model",
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
            "messages": [{"role": "user", "content": "tell me a long story"}],
        }
        received = 0
        with httpx.stream(
            "POST",
            server.url + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {KEY}"},
            timeout=30,
        ) as answer:
            for line in answer.iter_lines():
                received += line.startswith("data: {")
                if received == 20:
                    break
        deadline = time.monotonic() + 5
        while True:
            text = httpx.get(server.url + "/metrics", timeout=5).text
            settled = sample_value(text, "kvgate_quota_settled_tokens_total", tenant="ops")
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    assert settled is not None and settled >= received
    cost = sample_value(text, "kvgate_cost_dollars_total", **_LABELS)
    assert cost is not None and cost >= received * _PRICE["output_per_mtok"] * 1e-6


def test_inter_token_latency_counts_the_gaps_of_a_stream(start_gateway):
    with SimFleet.in_thread(engines=1, options=EngineOptions(profile="realistic")) as fleet:
        _, server = start_gateway(gateway_config(fleet.urls))
        client = sdk_client(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="sim-model",
            max_tokens=8,
            stream=True,
            messages=[{"role": "user", "content": "count to eight"}],
        )
        contents = [c for c in stream if c.choices and c.choices[0].delta.content]
        assert len(contents) == 8
        text = httpx.get(server.url + "/metrics", timeout=5).text
    count = sample_value(text, "kvgate_inter_token_latency_seconds_count", route="chat")
    total = sample_value(text, "kvgate_inter_token_latency_seconds_sum", route="chat")
    # Tokens come one engine step (~15 ms) apart, so each is its own chunk: at least the
    # seven gaps between eight tokens, each at least a few milliseconds.
    assert count is not None and total is not None
    assert 7 <= count <= 10
    assert total / count > 0.005
    for edge in ("0.005", "0.5", "1.0", "2.0", "5.0", "300.0"):
        le = sample_value(text, "kvgate_inter_token_latency_seconds_bucket", route="chat", le=edge)
        assert le is not None, f"no inter-token bucket at {edge} s"
    assert sample_value(text, "kvgate_time_to_upstream_seconds_count", route="chat") == 1
