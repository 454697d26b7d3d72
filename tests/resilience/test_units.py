"""Pure building blocks of the resilience layer, driven by a fake clock: no sockets, no sleeps."""

from __future__ import annotations

import random

import orjson
import pytest

from kvgate.config import TimeoutsConfig, parse_config
from kvgate.errors import (
    InvalidRequest,
    Overloaded,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnavailable,
    upstream_error_from_body,
)
from kvgate.ingress import request_context
from kvgate.types import RequestContext
from kvgate.upstream.attempts import judge
from kvgate.upstream.backoff import full_jitter_delay
from kvgate.upstream.breaker import BreakerState, EjectionGroup, EndpointBreaker
from kvgate.upstream.observer import NullObserver
from kvgate.upstream.request_timeouts import resolve_timeouts
from kvgate.upstream.resume import StreamTranscript, continuation_body, resume_eligible
from kvgate.upstream.retry_budget import RetryBudget
from kvgate.upstream.settings import BreakerConfig, RetryBudgetConfig, ThrottleConfig
from kvgate.upstream.throttle import AdaptiveThrottle
from kvgate.upstream.window import RollingCounts


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recorder(NullObserver):
    def __init__(self) -> None:
        self.transitions: list[tuple[str, str, str]] = []
        self.skipped: list[str] = []

    def breaker_transition(self, endpoint: str, old: str, new: str) -> None:
        self.transitions.append((endpoint, old, new))

    def ejection_skipped(self, endpoint: str) -> None:
        self.skipped.append(endpoint)


def ctx_for(
    route: str = "chat",
    payload: dict | None = None,
    headers=None,
    tier: str = "",
    stream: bool = True,
) -> RequestContext:
    payload = (
        payload
        if payload is not None
        else {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    )
    ctx = request_context(
        route, payload, headers=headers or [], body=orjson.dumps(payload), upstream_path="/v1/x"
    )
    ctx.tier = tier
    return ctx


# --- window and back-off -------------------------------------------------------------------


def test_rolling_counts_forget_after_the_window():
    window = RollingCounts(10, series=2)
    window.add(0, 100.0)
    window.add(1, 105.0, 3)
    assert (window.total(0, 105.0), window.total(1, 105.0)) == (1, 3)
    assert window.total(0, 110.5) == 0
    assert window.total(1, 114.0) == 3
    assert window.total(1, 200.0) == 0


@pytest.mark.parametrize(
    "retry,ceiling", [(1, 0.025), (2, 0.05), (3, 0.1), (4, 0.2), (5, 0.25), (12, 0.25)]
)
def test_full_jitter_stays_within_the_exponential_ceiling(retry, ceiling):
    rng = random.Random(1)
    delays = [full_jitter_delay(retry, 0.025, 0.25, rng) for _ in range(500)]
    assert all(0 <= d <= ceiling for d in delays)
    assert max(delays) > ceiling * 0.8  # spread over the whole range, not clustered


# --- retry budget ----------------------------------------------------------------------------


def test_concurrency_budget_has_a_floor_and_scales_with_active_requests():
    clock = Clock()
    budget = RetryBudget(RetryBudgetConfig(percent_of_requests=None), clock)
    for _ in range(5):
        budget.request_started()
    assert [budget.try_acquire() for _ in range(4)] == [True, True, True, False]  # floor of 3
    for _ in range(45):
        budget.request_started()  # 50 active: 20% = 10 retries in flight
    assert sum(budget.try_acquire() for _ in range(20)) == 7
    budget.release()
    assert budget.try_acquire()


def test_rate_budget_allows_percent_of_requests_plus_a_reserve():
    clock = Clock()
    config = RetryBudgetConfig(
        percent_of_active=None, percent_of_requests=20, min_per_second=1, window=10
    )
    budget = RetryBudget(config, clock)
    for _ in range(100):
        budget.request_started()
        budget.request_finished()
    granted = 0
    for _ in range(100):
        if budget.try_acquire():
            granted += 1
            budget.release()
    assert granted == 30  # 20% of 100 + 1/s x 10 s
    clock.now += 11
    assert budget.try_acquire()  # the window moved on


# --- throttle --------------------------------------------------------------------------------


def test_throttle_follows_the_sre_formula_and_recovers():
    clock = Clock()
    throttle = AdaptiveThrottle(ThrottleConfig(min_requests=0, window=10), clock, random.Random(0))
    for _ in range(100):
        assert throttle.admit()
        throttle.record(accepted=True)
    assert throttle.rejection_probability() == 0
    clock.now += 11
    for _ in range(100):
        if throttle.admit():
            throttle.record(accepted=False)  # a failing pool
    assert throttle.rejection_probability() == pytest.approx(100 / 101)
    rejected = sum(not throttle.admit() for _ in range(200))
    assert rejected > 150
    clock.now += 11
    assert throttle.rejection_probability() == 0


def test_throttle_counts_outcomes_not_attempts_in_flight():
    throttle = AdaptiveThrottle(ThrottleConfig(min_requests=0), Clock())
    for _ in range(100):
        assert throttle.admit()  # long streams still waiting for their first token
    assert throttle.rejection_probability() == 0


def test_throttle_ignores_a_quiet_pool_and_can_be_disabled():
    throttle = AdaptiveThrottle(ThrottleConfig(min_requests=20), Clock())
    for _ in range(19):
        throttle.record(accepted=False)
    assert throttle.rejection_probability() == 0
    disabled = AdaptiveThrottle(ThrottleConfig(enabled=False, min_requests=0), Clock())
    assert all(disabled.admit() for _ in range(100))


# --- breaker ---------------------------------------------------------------------------------


def breakers(
    n: int, clock: Clock, recorder: Recorder | None = None, **config: float
) -> list[EndpointBreaker]:
    cfg = BreakerConfig(**{"base_ejection": 30, "max_ejection": 300, **config})
    group = EjectionGroup(cfg.max_ejected_fraction)
    return [EndpointBreaker(f"e{i}", cfg, group, recorder or Recorder(), clock) for i in range(n)]


def fail(breaker: EndpointBreaker, times: int = 1) -> None:
    for _ in range(times):
        breaker.failure(breaker.begin())


def test_consecutive_failures_open_the_breaker_and_success_resets_the_count():
    clock, recorder = Clock(), Recorder()
    b, _ = breakers(2, clock, recorder)
    fail(b, 4)
    b.success(b.begin())
    fail(b, 4)
    assert b.state is BreakerState.CLOSED and b.admits()
    fail(b)
    assert b.state is BreakerState.OPEN and not b.admits()
    assert recorder.transitions == [("e0", "closed", "open")]


def test_failure_rate_over_the_window_opens_the_breaker():
    clock = Clock()
    b, _ = breakers(
        2, clock, consecutive_failures=100, failure_rate=0.5, failure_rate_min_requests=10
    )
    for i in range(10):
        token = b.begin()
        b.failure(token) if i % 2 else b.success(token)
    assert b.state is BreakerState.OPEN


def test_ejection_time_grows_with_each_ejection_up_to_the_cap():
    clock = Clock()
    b, _ = breakers(2, clock, half_open_probes=1)
    durations = []
    for _ in range(12):
        fail(b, 5) if b.state is BreakerState.CLOSED else fail(b)
        durations.append(b.open_until - clock.now)
        clock.now = b.open_until
        assert b.admits()  # ejection over: a probe may go
        assert b.refresh() is BreakerState.HALF_OPEN
    assert durations[:3] == [30, 60, 90]
    assert max(durations) == 300


def test_half_open_admits_limited_probes_and_a_committed_probe_closes(caplog):
    caplog.set_level("INFO", logger="kvgate.resilience")
    clock, recorder = Clock(), Recorder()
    b, _ = breakers(2, clock, recorder, half_open_probes=2)
    fail(b, 5)
    # An ejection and a return are logged, as health changes are.
    assert "endpoint e0 ejected by its breaker for 30 s" in caplog.text
    clock.now += 31
    first, second = b.begin(), b.begin()
    assert b.is_probe(first) and b.is_probe(second)
    assert not b.admits()
    b.release(second)  # a client disconnect frees the slot without a verdict
    assert b.admits()
    b.success(first)
    assert b.state is BreakerState.CLOSED
    assert [t[2] for t in recorder.transitions] == ["open", "half_open", "closed"]
    assert "endpoint e0 back in rotation: its breaker closed" in caplog.text


def test_a_probe_that_never_reports_cannot_wedge_half_open():
    clock = Clock()
    b, _ = breakers(2, clock, half_open_probes=1, probe_timeout=5)
    fail(b, 5)
    clock.now += 31
    b.begin()  # a probe that hangs forever
    assert not b.admits()
    clock.now += 6
    assert b.refresh() is BreakerState.OPEN  # the silent probe counts as a failure
    clock.now = b.open_until
    assert b.admits()


def test_never_more_than_half_of_a_pool_is_ejected():
    clock, recorder = Clock(), Recorder()
    pool = breakers(4, clock, recorder)
    for b in pool:
        fail(b, 5)
    assert [b.state for b in pool].count(BreakerState.OPEN) == 2
    assert recorder.skipped == ["e2", "e3"]
    single = breakers(1, clock)[0]
    fail(single, 50)
    assert single.state is BreakerState.CLOSED and single.admits()


def test_health_recovery_ends_the_ejection_and_retry_after_holds_without_ejecting():
    clock = Clock()
    b, other = breakers(2, clock)
    fail(b, 5)
    b.health_recovered()
    assert b.state is BreakerState.HALF_OPEN and b.admits()
    other.hold(3)
    assert not other.admits() and other.state is BreakerState.CLOSED
    clock.now += 3
    assert other.admits()


def test_client_errors_never_count():
    clock = Clock()
    b, _ = breakers(2, clock)
    for _ in range(50):
        b.release(b.begin())
    assert b.state is BreakerState.CLOSED and b.consecutive_failures == 0


# --- the retry policy ------------------------------------------------------------------------


def upstream(status: int, retry_after: float | None = None):
    return upstream_error_from_body(status, b"{}", retry_after)


@pytest.mark.parametrize(
    "error,retriable,failure,overload",
    [
        (UpstreamUnavailable("x", code="upstream_connect_failed"), True, True, True),
        (UpstreamUnavailable("x", code="upstream_connection_lost"), True, True, True),
        (UpstreamTimeout("x", code="upstream_connect_timeout"), True, True, True),
        (UpstreamTimeout("x", code="upstream_first_token_timeout"), True, True, True),
        (UpstreamTimeout("x", code="deadline_exceeded"), False, True, True),
        (UpstreamProtocolError("x", code="upstream_malformed_event"), True, True, True),
        (upstream(502), True, True, True),
        (upstream(503), True, True, True),
        (upstream(504), True, True, True),
        (upstream(500), False, True, True),
        (upstream(429), False, False, True),
        (upstream(429, retry_after=2), True, False, True),
        (upstream(400), False, False, False),
        (upstream(404), False, False, False),
        (upstream(413), False, False, False),
        (upstream(422), False, False, False),
        (Overloaded("x", code="upstream_pool_exhausted"), False, False, False),
    ],
)
def test_judge(error, retriable, failure, overload):
    verdict = judge(error)
    assert (verdict.retriable, verdict.endpoint_failure, verdict.overload) == (
        retriable,
        failure,
        overload,
    )


def test_timeouts_the_client_shortened_are_not_the_engines_fault():
    error = UpstreamTimeout("x", code="upstream_first_token_timeout")
    assert not judge(error, client_shortened=True).endpoint_failure
    stall = UpstreamTimeout("x", code="upstream_stall_timeout")
    assert judge(stall, client_shortened=True).endpoint_failure


def test_retry_after_is_held():
    assert judge(upstream(503, retry_after=4)).hold == 4
    assert judge(upstream(429, retry_after=2)).hold == 2


# --- timeouts --------------------------------------------------------------------------------

TIMEOUTS = TimeoutsConfig(
    first_token=30, total=100, tiers={"gold": {"first_token": 5, "total": 50}}
)


def test_tier_overrides_and_headers_only_shorten():
    ctx = ctx_for(
        tier="gold",
        headers=[
            (b"x-kvgate-timeout-ms", b"999999999"),
            (b"x-kvgate-first-token-timeout-ms", b"2000"),
        ],
    )
    limits = resolve_timeouts(ctx, TIMEOUTS)
    assert limits.first_token == 2
    assert limits.deadline == pytest.approx(ctx.started + 50)
    assert limits.client_shortened
    plain = resolve_timeouts(ctx_for(tier="bronze"), TIMEOUTS)
    assert (plain.first_token, plain.client_shortened) == (30, False)
    assert plain.deadline == pytest.approx(plain.deadline)


def test_chain_deadline_wins_when_earlier():
    ctx = ctx_for()
    ctx.deadline = ctx.started + 3
    limits = resolve_timeouts(ctx, TIMEOUTS)
    assert limits.deadline == ctx.deadline and limits.client_shortened


@pytest.mark.parametrize("value", [b"", b"0", b"-5", b"1.5", b"abc", b"1234567890"])
def test_malformed_timeout_header_is_a_client_error(value):
    with pytest.raises(InvalidRequest) as caught:
        resolve_timeouts(ctx_for(headers=[(b"x-kvgate-timeout-ms", value)]), TIMEOUTS)
    assert caught.value.param == "x-kvgate-timeout-ms"


def test_config_cross_checks_resilience():
    from kvgate.config import ConfigError

    pools = [{"name": "p", "endpoints": [{"url": "http://a"}]}]
    with pytest.raises(ConfigError) as caught:
        parse_config(
            {
                "pools": pools,
                "resilience": {
                    "retries": {"backoff_base": 1, "backoff_cap": 0.5},
                    "breaker": {"base_ejection": 60, "max_ejection": 30},
                },
            }
        )
    assert "resilience.retries.backoff_cap" in str(caught.value)
    assert "resilience.breaker.max_ejection" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        parse_config({"pools": pools, "resilience": {"throttle": {"k": 0.5}}})
    assert "resilience.throttle.k" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        parse_config({"pools": [{**pools[0], "resume": "maybe"}]})
    assert "pools[0].resume" in str(caught.value)


# --- resume ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra,eligible",
    [
        ({}, True),
        ({"n": 2}, False),
        ({"tools": [{"type": "function"}]}, False),
        ({"logprobs": True}, False),
        ({"logprobs": False}, True),
        ({"prompt_logprobs": 0}, False),
        ({"return_tokens_as_token_ids": True}, False),
        ({"return_token_ids": True}, False),
        ({"continue_final_message": True}, False),
        ({"stream_options": {"continuous_usage_stats": True}}, False),
        # Structured outputs: a continuation would start the grammar over mid-output.
        ({"response_format": {"type": "text"}}, True),
        ({"response_format": {"type": "json_object"}}, False),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, False),
        ({"guided_json": {"type": "object"}}, False),
        ({"guided_choice": ["yes", "no"]}, False),
        ({"structured_outputs": {"regex": "[a-z]+"}}, False),
    ],
)
def test_resume_eligibility(extra, eligible):
    payload = {
        "model": "m",
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
        **extra,
    }
    assert resume_eligible(ctx_for(payload=payload)) is eligible
    assert not resume_eligible(ctx_for(stream=False))


@pytest.mark.parametrize("logprobs,eligible", [(None, True), (0, False), (2, False)])
def test_completions_logprobs_zero_is_not_resumed(logprobs, eligible):
    """vLLM's completions `logprobs: 0` returns the sampled token's logprob in every chunk."""
    payload = {"model": "m", "stream": True, "prompt": "hi", "logprobs": logprobs}
    assert resume_eligible(ctx_for("completions", payload)) is eligible


def chunk(
    content: str | None,
    role: bool = False,
    finish: str | None = None,
    ident: str = "orig",
    delta: dict | None = None,
) -> bytes:
    if delta is None:
        delta = {"role": "assistant", "content": ""} if role else {"content": content}
    body = {
        "id": ident,
        "object": "chat.completion.chunk",
        "created": 7 if ident == "orig" else 99,
        "model": "m" if ident == "orig" else "other",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(body) + b"\n\n"


def test_transcript_relays_the_original_unchanged_and_rewrites_the_continuation():
    payload = {
        "model": "m",
        "stream": True,
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}],
    }
    ctx = ctx_for(payload=payload)
    transcript = StreamTranscript(ctx)
    original = chunk(None, role=True) + chunk("Hello") + chunk(" wor")
    assert transcript.shape(original) == original
    body = orjson.loads(continuation_body(ctx, transcript))
    assert body["messages"][-1] == {"role": "assistant", "content": "Hello wor"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 8 and body["stream_options"] == {"include_usage": True}
    transcript.begin_continuation()
    usage = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 99,
        "model": "other",
        "choices": [],
        "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15},
    }
    continued = transcript.shape(
        chunk(None, role=True, ident="c")
        + chunk("ld", ident="c")
        + chunk("!", finish="stop", ident="c")
        + b"data: "
        + orjson.dumps(usage)
        + b"\n\n"
        + b"data: [DONE]\n\n"
    )
    events = [e for e in continued.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    parsed = [orjson.loads(e[6:]) for e in events[:-1]]
    assert len(parsed) == 2  # role chunk skipped, usage dropped (the client did not ask)
    assert {(p["id"], p["created"], p["model"]) for p in parsed} == {("orig", 7, "m")}
    assert transcript.text == "Hello world!"
    assert transcript.usage == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    assert transcript.overhead_tokens == 12


def test_a_stream_that_relayed_reasoning_is_not_continued():
    """A reasoning model's thinking (vLLM's `reasoning_content`, newer `reasoning`) is not in
    the transcript's text: a continuation would think again from the start, so the stream
    ends with an error event instead, as without resume."""
    payload = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    for field in ("reasoning_content", "reasoning"):
        ctx = ctx_for(payload=payload)
        transcript = StreamTranscript(ctx)
        transcript.shape(chunk(None, delta={field: "Let me think"}) + chunk("The answer"))
        assert transcript.reasoned and continuation_body(ctx, transcript) is None
    plain = StreamTranscript(ctx_for(payload=payload))
    plain.shape(chunk("The answer"))
    assert not plain.reasoned


def test_continuation_of_a_completion_is_prompt_plus_text_and_respects_the_limit():
    payload = {"model": "m", "stream": True, "prompt": "Once"}
    ctx = ctx_for(route="completions", payload=payload)
    transcript = StreamTranscript(ctx)
    event = {
        "id": "x",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": " upon", "finish_reason": None}],
    }
    transcript.shape(b"data: " + orjson.dumps(event) + b"\n\n")
    body = orjson.loads(continuation_body(ctx, transcript))
    assert body["prompt"] == "Once upon" and body["max_tokens"] == 15
    limited = ctx_for(route="completions", payload={**payload, "max_tokens": 1})
    assert continuation_body(limited, transcript) is None
