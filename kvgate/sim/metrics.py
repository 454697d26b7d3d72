"""Prometheus text exposition of one engine's state, with vLLM's or SGLang's metric names.

Written directly (not through prometheus_client) so several engines can live in one process
without registries, and so each scrape costs a few string joins.
"""

from .engine_core import EngineCore
from .options import EngineOptions
from .stats import EngineCounters, Histogram


class _Exposition:
    """Accumulates metric families in text format 0.0.4."""

    def __init__(self, labels: dict[str, str]) -> None:
        self._labels = labels
        self._lines: list[str] = []

    def _label_text(self, extra: dict[str, str] | None = None) -> str:
        labels = {**self._labels, **(extra or {})}
        return ",".join(f'{key}="{value}"' for key, value in labels.items())

    def gauge(
        self, name: str, help_text: str, value: float, extra: dict[str, str] | None = None
    ) -> None:
        self._lines += [
            f"# HELP {name} {help_text}",
            f"# TYPE {name} gauge",
            f"{name}{{{self._label_text(extra)}}} {float(value)!r}",
        ]

    def counter(self, name: str, help_text: str, value: float) -> None:
        """`name` without the `_total` suffix; like prometheus_client's 0.0.4 output, the
        HELP/TYPE lines and the sample all use `name_total`."""
        self._lines += [
            f"# HELP {name}_total {help_text}",
            f"# TYPE {name}_total counter",
            f"{name}_total{{{self._label_text()}}} {float(value)!r}",
        ]

    def histogram(self, name: str, help_text: str, histogram: Histogram) -> None:
        labels = self._label_text()
        self._lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        self._lines += [
            f'{name}_bucket{{{labels},le="{le}"}} {float(count)!r}'
            for le, count in histogram.cumulative()
        ]
        self._lines += [
            f"{name}_count{{{labels}}} {float(histogram.count)!r}",
            f"{name}_sum{{{labels}}} {histogram.sum!r}",
        ]

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def render_metrics(options: EngineOptions, core: EngineCore, counters: EngineCounters) -> str:
    """The `/metrics` body for the engine's flavour."""
    if options.flavor == "sglang":
        return _sglang(options, core, counters)
    return _vllm(options, core, counters)


def _vllm(options: EngineOptions, core: EngineCore, counters: EngineCounters) -> str:
    out = _Exposition({"engine": "0", "model_name": options.models[0]})
    out.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        len(core.running),
    )
    out.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        len(core.waiting),
    )
    out.gauge(
        "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", core.pool.usage
    )
    out.counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        counters.prefix_queries,
    )
    out.counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        counters.prefix_hits,
    )
    out.gauge(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        1,
        {
            "block_size": str(options.block_size),
            "num_gpu_blocks": str(options.kv_blocks),
            "enable_prefix_caching": "True",
            "cache_dtype": "auto",
        },
    )
    out.counter(
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        counters.preemptions,
    )
    out.counter("vllm:prompt_tokens", "Number of prefill tokens processed.", counters.prompt_tokens)
    out.counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        counters.generation_tokens,
    )
    out.counter(
        "vllm:request_success",
        "Count of successfully processed requests.",
        counters.requests_completed,
    )
    out.histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        counters.time_to_first_token,
    )
    out.histogram(
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        counters.inter_token_latency,
    )
    out.histogram(
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        counters.e2e_latency,
    )
    return out.text()


def _sglang(options: EngineOptions, core: EngineCore, counters: EngineCounters) -> str:
    out = _Exposition({"model_name": options.models[0]})
    capacity = options.kv_blocks * options.block_size
    hit_rate = counters.prefix_hits / counters.prefix_queries if counters.prefix_queries else 0.0
    out.gauge("sglang:num_running_reqs", "The number of running requests.", len(core.running))
    out.gauge(
        "sglang:num_queue_reqs", "The number of requests in the waiting queue.", len(core.waiting)
    )
    out.gauge("sglang:num_used_tokens", "The number of used tokens.", core.num_used_tokens)
    out.gauge("sglang:max_total_num_tokens", "Maximum total number of tokens", capacity)
    out.gauge("sglang:token_usage", "The token usage.", core.pool.usage)
    out.gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", hit_rate)
    out.gauge(
        "sglang:cache_config_info",
        "Information of the cache config",
        1,
        {"page_size": str(options.block_size), "num_pages": str(options.kv_blocks)},
    )
    out.counter("sglang:cached_tokens", "Number of cached prompt tokens.", counters.prefix_hits)
    out.counter(
        "sglang:prompt_tokens", "Number of prefill tokens processed.", counters.prompt_tokens
    )
    out.counter(
        "sglang:generation_tokens",
        "Number of generation tokens processed.",
        counters.generation_tokens,
    )
    out.counter("sglang:num_requests", "Number of requests processed.", counters.requests_completed)
    out.counter(
        "sglang:num_retracted_reqs",
        "Number of retracted (preempted) requests.",
        counters.preemptions,
    )
    out.histogram(
        "sglang:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        counters.time_to_first_token,
    )
    out.histogram(
        "sglang:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        counters.inter_token_latency,
    )
    out.histogram(
        "sglang:e2e_request_latency_seconds",
        "Histogram of End-to-end request latency in seconds",
        counters.e2e_latency,
    )
    return out.text()
