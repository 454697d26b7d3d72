"""Parsing vLLM and SGLang /metrics text: aliases, `_total` forms, summed `engine` series."""

from __future__ import annotations

import pytest

from kvgate.routing.telemetry import TelemetryParseError, parse_metrics
from tests.routing.samples import SGLANG, VLLM_V0, VLLM_V1_DP2


def test_vllm_v1_sums_engine_series_and_reads_cache_config():
    t = parse_metrics(VLLM_V1_DP2, scraped_at=5.0)
    assert t.scraped_at == 5.0
    assert (t.running, t.waiting) == (7.0, 2.0)
    assert t.kv_usage == pytest.approx(0.375)  # a fraction: averaged, not summed
    assert (t.prefix_queries, t.prefix_hits) == (1500.0, 800.0)  # `_total`; `_created` ignored
    assert t.prompt_tokens == 1500.0
    assert (t.block_size, t.num_blocks) == (16, 54000)
    assert t.kv_tokens == 16 * 54000


def test_old_vllm_names_and_counters_without_total_suffix():
    t = parse_metrics(VLLM_V0, scraped_at=0.0)
    assert (t.running, t.waiting, t.kv_usage) == (1.0, 7.0, 0.875)
    assert (t.prefix_queries, t.prefix_hits) == (300.0, 30.0)  # sample with a timestamp
    assert t.kv_tokens is None


def test_sglang_names():
    t = parse_metrics(SGLANG, scraped_at=0.0)
    assert (t.running, t.waiting, t.kv_usage) == (12.0, 6.0, 0.42)
    assert t.prefix_queries is None
    assert (t.prefix_hits, t.prompt_tokens) == (6100.0, 10000.0)
    assert (t.block_size, t.num_blocks) == (1, 400000)


def test_simulator_exposition_parses_for_both_flavours():
    from kvgate.sim import EngineOptions, SimFleet

    for flavor in ("vllm", "sglang"):
        with SimFleet.in_thread(
            engines=1, options=EngineOptions(flavor=flavor, profile="fast", kv_blocks=500)
        ) as fleet:
            import httpx

            text = httpx.get(fleet.urls[0] + "/metrics").text
        t = parse_metrics(text, 0.0)
        assert (t.block_size, t.num_blocks) == (16, 500)


@pytest.mark.parametrize(
    "body", ["", "# only comments\n", '{"object": "list"}', "other_metric 1.0\n"]
)
def test_a_body_without_engine_metrics_is_an_error(body):
    with pytest.raises(TelemetryParseError):
        parse_metrics(body, 0.0)


def test_escaped_label_values_and_nan_are_tolerated():
    text = (
        'vllm:cache_config_info{note="a \\"quoted\\", value",block_size="32",'
        'num_gpu_blocks="10"} 1\n'
        'vllm:num_requests_waiting{engine="0"} NaN\n'
        'vllm:num_requests_running{engine="0"} 2\n'
    )
    t = parse_metrics(text, 0.0)
    assert (t.block_size, t.num_blocks, t.waiting, t.running) == (32, 10, 0.0, 2.0)
