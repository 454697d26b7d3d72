"""The policy picker over in-process endpoints: prefix stickiness, spill, guards, fallback,
affinity, explain, exclusions; and exactly-once load accounting per attempt."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from kvgate.errors import NotFound, Overloaded
from kvgate.routing.affinity import SessionAffinity
from kvgate.routing.policy import build_policy
from kvgate.routing.policy_catalog import builtin_policy
from kvgate.routing.router import ModelFallbackStage, PickStage, PolicyPicker, PoolRouter
from kvgate.routing.services import RoutingServices
from kvgate.routing.settings import RoutingConfig
from tests.routing.helpers import ctx, endpoint, fleet, telemetry

SYSTEM = "You are a careful assistant. " * 40  # ~1,200 characters shared by a group


def _picker(*endpoints, policy=None, explain="never"):
    services = RoutingServices.from_config(RoutingConfig(explain=explain))
    f = fleet(*endpoints)
    return PolicyPicker(f, "p", policy or builtin_policy("kvgate"), services), services


def _dispatch(e, request):
    e.begin_attempt(request)


def test_shared_prefix_sticks_to_one_endpoint_and_a_new_prefix_goes_elsewhere():
    a, b, c = endpoint("a"), endpoint("b"), endpoint("c")
    picker, _ = _picker(a, b, c)
    first = picker.choose(ctx(SYSTEM + "question 0"))
    for i in range(1, 6):
        assert picker.choose(ctx(SYSTEM + f"question {i}")) is first
    request = ctx(SYSTEM + "question 9")
    picker.choose(request)
    assert request.prefix is not None and request.prefix.matched[first.name] > 0


def test_hot_prefix_spills_when_its_endpoint_saturates():
    a, b = endpoint("a"), endpoint("b")
    picker, _ = _picker(a, b)
    first = picker.choose(ctx(SYSTEM + "q"))
    first.telemetry = telemetry(waiting=33)  # above kvgate's max_waiting=32
    second = picker.choose(ctx(SYSTEM + "q2"))
    assert second is not first
    # now both hold the prefix; once the first recovers, ties are broken by load
    first.telemetry = telemetry()
    assert {picker.choose(ctx(SYSTEM + f"q{i}")).name for i in range(3, 40)} <= {"a", "b"}


def test_queued_work_outweighs_a_cache_hit():
    a, b = endpoint("a"), endpoint("b")
    picker, _ = _picker(a, b)
    first = picker.choose(ctx(SYSTEM + "q"))
    first.prefill_tokens, first.prefill_requests = 5000, 10  # a long prefill queue
    assert picker.choose(ctx(SYSTEM + "q2")) is not first


def test_imbalance_gate_takes_an_overloaded_holder_out():
    a, b = endpoint("a"), endpoint("b")
    picker, _ = _picker(a, b)
    first = picker.choose(ctx(SYSTEM + "q"))
    first.inflight = 100
    first.decoding = 0
    assert picker.choose(ctx(SYSTEM + "q2")) is not first


def test_a_group_spilled_off_an_overloaded_holder_moves_to_one_new_holder():
    endpoints = [endpoint(name) for name in "abcde"]
    picker, _ = _picker(*endpoints)
    holder = picker.choose(ctx(SYSTEM + "q"))
    holder.inflight = 100  # over the gate: 64 more than the others and 1.5x their load
    new_holder = picker.choose(ctx(SYSTEM + "q1"))
    assert new_holder is not holder
    assert all(picker.choose(ctx(SYSTEM + f"q{i}")) is new_holder for i in range(2, 12))
    holder.inflight = 0  # recovered: the group may use both holders, never the others
    assert {picker.choose(ctx(SYSTEM + f"r{i}")) for i in range(20)} <= {holder, new_holder}


def test_session_affinity_from_user_field_and_headers():
    a, b, c = endpoint("a"), endpoint("b"), endpoint("c")
    picker, services = _picker(a, b, c)
    first = picker.choose(ctx("short", user="u1"))  # too short to hash: affinity only
    assert all(picker.choose(ctx("short", user="u1")) is first for _ in range(5))
    header = [(b"x-kvgate-session-id", b"s-1")]
    chosen = picker.choose(ctx("tiny", headers=header))
    assert picker.choose(ctx("tiny", headers=header)) is chosen
    assert len(services.affinity) == 2


def test_session_affinity_is_the_tenants_own_and_long_ids_are_kept_as_digests():
    """A tenant naming another tenant's session id neither finds its endpoint nor moves it;
    a session id of a megabyte costs the table no more than a short one."""
    a, b = endpoint("a"), endpoint("b")
    picker, services = _picker(a, b)
    acme, mallory = SimpleNamespace(name="acme"), SimpleNamespace(name="mallory")
    header = [(b"x-kvgate-session-id", b"victim-42")]
    theirs = ctx("tiny", headers=header)
    theirs.tenant = acme
    held = picker.choose(theirs)
    held.inflight = 5  # the other endpoint is now the least loaded
    mine = ctx("tiny", headers=header)
    mine.tenant = mallory
    assert picker.choose(mine) is not held
    huge = ctx("tiny", user="u" * 1_000_000)
    huge.tenant = acme
    picker.choose(huge)
    assert max(len(key) for key in services.affinity._sessions) < 400


def test_expired_sessions_leave_the_table_and_are_not_carried_over_a_reload():
    """Sessions that never come back drain while traffic lasts (not kept until 100,000
    others push them out), and a reload does not copy sessions that have expired."""
    table = SessionAffinity(ttl=10.0)
    start = time.monotonic() - 1_000.0
    for i in range(1_000):
        table.set(f"old-{i}", "a", now=start + i / 1_000)
    for i in range(300):
        table.set(f"new-{i}", "b", now=start + 100.0 + i / 100)
    assert len(table) == 300
    assert table.get("new-0", now=start + 105.0) == "b"
    kept = SessionAffinity(ttl=10.0)
    table.set("fresh", "b")
    kept.adopt(table, {"a": "a", "b": "b"})
    assert [*kept._sessions] == ["fresh"]


def test_exclusions_and_errors():
    a, b = endpoint("a"), endpoint("b")
    picker, _ = _picker(a, b)
    assert picker.choose(ctx(), exclude=[a]) is b
    with pytest.raises(Overloaded):
        picker.choose(ctx(), exclude=[a, b])
    with pytest.raises(NotFound):
        picker.choose(ctx(model="unknown"))


def test_when_saturated_queue_reject_and_fallbacks():
    a = endpoint("a", telemetry=telemetry(waiting=9))
    big = endpoint("big", pool="spare", telemetry=telemetry())
    small = endpoint("small", model="m-small", pool="spare")
    queue, _ = _picker(a, big, small)
    assert queue.choose(ctx()) is a  # saturated, but the engine queues it
    reject, _ = _picker(a, big, small, policy=build_policy({"when_saturated": "reject"}, "p"))
    with pytest.raises(Overloaded) as caught:
        reject.choose(ctx())
    assert caught.value.code == "all_endpoints_saturated"
    to_pool, _ = _picker(
        a, big, small, policy=build_policy({"fallback": {"pool": "spare"}}, "p"), explain="always"
    )
    request = ctx(headers=[(b"x-kvgate-explain", b"1")])
    assert to_pool.choose(request) is big
    explained = dict(request.response_headers)[b"x-kvgate-route-explain"].decode()
    assert "fallback_pool=spare (every endpoint of p saturated)" in explained
    queued, _ = _picker(a, big, small, policy=build_policy({}, "p"), explain="always")
    request = ctx(headers=[(b"x-kvgate-explain", b"1")])
    assert queued.choose(request) is a
    explained = dict(request.response_headers)[b"x-kvgate-route-explain"].decode()
    assert "saturated (every candidate; when_saturated=queue)" in explained


def _fallback_router(
    a, small, model: str, explain: str = "never"
) -> tuple[PoolRouter, PolicyPicker]:
    """Pool `p` (endpoint `a`, a policy falling back to `model`) and pool `spare` (`small`,
    kvgate's policy), and the picker of `p`."""
    picker, services = _picker(
        a, small, policy=build_policy({"fallback": {"model": model}}, "p"), explain=explain
    )
    spare = PolicyPicker(picker.fleet, "spare", builtin_policy("kvgate"), services)
    return PoolRouter(picker.fleet, {"p": picker, "spare": spare}), picker


async def _model_after_fallback(router: PoolRouter, request=None) -> str:
    """The model a request (a fresh one by default) has after the fallback stage."""
    request = ctx() if request is None else request
    await ModelFallbackStage(router)(request)
    return request.model


async def test_model_fallback_is_settled_before_admission_and_picking_follows():
    a = endpoint("a", telemetry=telemetry(waiting=9))
    small = endpoint("small", model="m-small", pool="spare")
    router, to_model = _fallback_router(a, small, "m-small", explain="always")
    request = ctx(headers=[(b"x-kvgate-explain", b"1")])
    assert to_model.choose(request) is a  # picking alone never changes the model
    request.response_headers.clear()
    assert await _model_after_fallback(router, request) == "m-small"
    assert request.payload["model"] == "m-small" and b'"m-small"' in request.body
    assert router.choose(request) is small
    explained = dict(request.response_headers)[b"x-kvgate-route-explain"].decode()
    assert "fallback_model=m-small (every endpoint of m saturated)" in explained
    a.telemetry = telemetry(waiting=0)
    assert await _model_after_fallback(router) == "m"  # not saturated
    # No endpoint to use at all is not saturation: the request keeps its model (and gets
    # the 503 that says why), whether the endpoints are drained or kept out by residency.
    a.telemetry = telemetry(waiting=9)
    a.drained = True
    assert await _model_after_fallback(router) == "m"
    a.drained = False
    elsewhere = ctx()
    elsewhere.allowed_jurisdictions = frozenset({"cn"})
    assert await _model_after_fallback(router, elsewhere) == "m"


async def test_no_fallback_to_a_model_that_cannot_take_the_request_either():
    """The smaller model is taken only where its own pool has an endpoint to use that is
    not saturated; otherwise the request keeps the model it asked for (and queues for it)."""
    a = endpoint("a", telemetry=telemetry(waiting=9))
    small = endpoint("small", model="m-small", pool="spare", telemetry=telemetry(waiting=0))
    unserved = ctx()
    assert await _model_after_fallback(_fallback_router(a, small, "m-x")[0], unserved) == "m"
    assert unserved.payload["model"] == "m"
    router, _ = _fallback_router(a, small, "m-small")
    small.telemetry = telemetry(waiting=99)  # beyond the kvgate policy's max_waiting
    assert await _model_after_fallback(router) == "m"
    small.telemetry = telemetry(waiting=0)
    small.drained = True
    assert await _model_after_fallback(router) == "m"
    small.drained = False
    assert await _model_after_fallback(router) == "m-small"


async def test_a_request_pinned_to_its_stored_conversation_keeps_its_model_and_endpoint():
    """A `previous_response_id` continues where its conversation is stored (`ctx.pinned`): no
    fallback model, no pick, and that endpoint checked again when the request would be sent."""
    a = endpoint("a", telemetry=telemetry(waiting=9))
    b = endpoint("b", telemetry=telemetry(waiting=20), prefill_tokens=5000)
    small = endpoint("small", model="m-small", pool="spare")
    picker, services = _picker(
        a, b, small, policy=build_policy({"fallback": {"model": "m-small"}}, "p")
    )
    spare = PolicyPicker(picker.fleet, "spare", builtin_policy("kvgate"), services)
    router = PoolRouter(picker.fleet, {"p": picker, "spare": spare})
    assert await _model_after_fallback(router) == "m-small"  # saturated: unpinned falls back
    assert router.choose(ctx()) is a
    request = ctx()
    request.pinned = b
    assert await _model_after_fallback(router, request) == "m"
    await PickStage(router)(request)
    assert request.endpoint is b and request.prefix is None  # not routed by prefix
    b.drained = True
    with pytest.raises(Overloaded) as unavailable:
        await PickStage(router)(request)
    assert unavailable.value.code == "stored_response_unavailable"


def test_jurisdiction_filter_applies_residency():
    us = endpoint("us", labels={"jurisdiction": "us"})
    eu = endpoint("eu", labels={"jurisdiction": "eu"})
    picker, _ = _picker(us, eu)
    request = ctx(SYSTEM)
    request.allowed_jurisdictions = frozenset({"eu"})
    assert picker.choose(request) is eu
    request = ctx(SYSTEM)
    request.allowed_jurisdictions = frozenset({"cn"})
    with pytest.raises(Overloaded):
        picker.choose(request)


@pytest.mark.parametrize(
    ("mode", "header", "shown"),
    [
        ("always", b"1", True),
        ("always", b"0", False),
        ("never", b"1", False),
        ("admin", b"1", False),
    ],
)
def test_explain_header(mode, header, shown):
    picker, _ = _picker(endpoint("a"), endpoint("b"), explain=mode)
    request = ctx(SYSTEM, headers=[(b"x-kvgate-explain", header)])
    picker.choose(request)
    explained = dict(request.response_headers).get(b"x-kvgate-route-explain")
    assert (explained is not None) == shown
    if shown:
        assert explained.startswith(b"policy=kvgate; rule=default; objective=latency; ")
        assert b"; a score=" in explained and b"predicted_ttft=" in explained
        for term in (b"prompt_tokens=", b"held_blocks=", b"uncached=", b"evicts_age=room",
                     b"free_blocks=", b"queued_tokens=", b"decoding=", b"waiting="):  # fmt: skip
            assert term in explained


@pytest.mark.parametrize("name", ["random", "round_robin", "least_loaded"])
def test_builtin_pickers_spread_over_endpoints(name):
    eps = [endpoint(n) for n in "abc"]
    picker, _ = _picker(*eps, policy=builtin_policy(name))
    seen = set()
    for i in range(60):
        chosen = picker.choose(ctx(SYSTEM + str(i)))
        chosen.begin_attempt(request := ctx())
        seen.add(chosen.name)
        if name == "least_loaded":
            assert max(e.inflight for e in eps) - min(e.inflight for e in eps) <= 1
        chosen.end_attempt(request)
    assert seen == {"a", "b", "c"}


def test_pool_router_sends_each_model_to_its_pool():
    a, b = endpoint("a", pool="p1", model="m1"), endpoint("b", pool="p2", model="m2")
    f = fleet(a, b)
    services = RoutingServices.from_config(RoutingConfig())
    router = PoolRouter(
        f, {p: PolicyPicker(f, p, builtin_policy("kvgate"), services) for p in ("p1", "p2")}
    )
    assert router.choose(ctx(model="m1")) is a
    assert router.choose(ctx(model="m2")) is b
    with pytest.raises(NotFound):
        router.choose(ctx(model="m3"))


def test_load_accounting_is_exactly_once_per_attempt():
    a, b = endpoint("a"), endpoint("b")
    picker, _ = _picker(a, b)
    request = ctx(SYSTEM + "q")
    chosen = picker.choose(request)
    chosen.begin_attempt(request)
    chosen.begin_attempt(request)  # a duplicate begin is ignored
    assert (chosen.inflight, chosen.prefill_requests) == (1, 1)
    assert chosen.prefill_tokens == request.prefix.prompt_tokens  # nothing cached before
    chosen.first_token(request)
    chosen.first_token(request)
    assert (chosen.prefill_requests, chosen.prefill_tokens, chosen.decoding) == (0, 0, 1)
    chosen.end_attempt(request)
    chosen.end_attempt(request)
    assert (chosen.inflight, chosen.decoding, chosen.prefill_tokens) == (0, 0, 0)
    retry = ctx(SYSTEM + "q")
    other = picker.choose(retry, exclude=[chosen])
    other.begin_attempt(retry)
    other.end_attempt(retry)  # ended before its first token
    assert (other.inflight, other.prefill_requests, other.prefill_tokens) == (0, 0, 0)


def test_telemetry_corrects_the_view_upwards_and_goes_stale():
    e = endpoint("a", prefill_requests=1, prefill_tokens=100, decoding=2)
    e.telemetry = telemetry(waiting=3, running=7, kv_usage=0.5)
    load = e.load()
    assert (load.queued_requests, load.active_sequences, load.kv_usage) == (3, 7, 0.5)
    assert load.queued_tokens == 100 + 2 * e.mean_prompt_tokens
    assert load.requests == 10 and not load.stale
    e.peer_inflight, e.peer_queued_tokens = 2, 40  # another replica's queued work is known
    assert e.load().queued_tokens == 100 + 40
    assert e.load().total_inflight == 2
    e.telemetry = telemetry(age=60, waiting=3, running=7)
    load = e.load()
    assert e.stale and load.stale
    assert (load.queued_requests, load.active_sequences, load.kv_usage) == (1, 2, 0.0)
    assert e.routable  # stale policy `local` keeps it
    from kvgate.routing.endpoints import SaturationLimits

    e.limits = SaturationLimits(stale_policy="exclude")
    assert not e.routable


def test_a_short_queue_at_the_prefix_holder_does_not_send_its_group_away():
    """Below kvgate's saturation threshold the cost decides, and a cold prefill elsewhere
    costs twice its tokens: six waiting requests do not move a group off its holder."""
    a, b = endpoint("a"), endpoint("b")
    picker, _ = _picker(a, b)
    long_system = SYSTEM * 4  # ~4,800 characters: a cold prefill of ~1,200 tokens
    first = picker.choose(ctx(long_system + "q"))
    other = b if first is a else a
    first.telemetry, other.telemetry = telemetry(waiting=6), telemetry(waiting=0)
    first.prefill_requests, first.prefill_tokens = 6, 6 * 40  # six cheap cached requests
    assert picker.choose(ctx(long_system + "q2")) is first


def _big_pool(count: int, max_candidates: int):
    endpoints = [endpoint(f"e{i}") for i in range(count)]
    services = RoutingServices.from_config(
        RoutingConfig(explain="always", max_candidates=max_candidates)
    )
    return PolicyPicker(fleet(*endpoints), "p", builtin_policy("kvgate"), services), endpoints


def _scored(request) -> list[str]:
    header = dict(request.response_headers)[b"x-kvgate-route-explain"].decode()
    return [p.split()[0] for p in header.split("; ") if "=" not in p.split()[0]]


def test_a_large_pool_scores_a_shortlist_that_keeps_prefix_holders_and_the_session():
    picker, _ = _big_pool(40, 8)
    explain = [(b"x-kvgate-explain", b"1")]
    holder = picker.choose(ctx(SYSTEM + "q0", user="alice"))
    for i in range(1, 30):  # the holder is always scored, so the group stays on it
        request = ctx(SYSTEM + f"q{i}", headers=explain)
        assert picker.choose(request) is holder
        scored = _scored(request)
        assert len(scored) == 8 and holder.name in scored and len(set(scored)) == 8
    holder.telemetry = telemetry(waiting=40)  # saturated: the group spills to a sampled one
    request = ctx(SYSTEM + "q-spill", headers=explain, user="alice")
    assert picker.choose(request) is not holder
    scored = _scored(request)  # the saturated holder was shortlisted, then filtered out
    assert len(scored) == 7 and holder.name not in scored
    sampled = set()
    for i in range(40):  # cold prompts: a window at a fresh random offset each time
        request = ctx(f"cold prompt number {i} " * 8, headers=explain)
        picker.choose(request)
        scored = _scored(request)
        assert 7 <= len(scored) == len(set(scored)) <= 8  # 8, less the saturated holder
        sampled.update(scored)
    assert len(sampled) > 20


def test_max_candidates_zero_scores_every_endpoint():
    picker, endpoints = _big_pool(24, 0)
    request = ctx(SYSTEM + "q", headers=[(b"x-kvgate-explain", b"1")])
    picker.choose(request)
    assert sorted(_scored(request)) == sorted(e.name for e in endpoints)


def test_the_engine_queue_is_carried_forward_between_scrapes():
    """A burst arrives faster than /metrics is scraped: the scraped waiting count grows with
    every stream sent there and shrinks with every first token (or early end), until the next
    scrape replaces it; saturation follows the carried-forward count."""
    e = endpoint("a")
    e.observe_telemetry(telemetry(waiting=4))
    assert e.load().waiting == 4 and not e.saturated
    streams = [ctx(f"burst {i}") for i in range(3)]
    for request in streams:
        e.begin_attempt(request)
    unary = ctx("not a stream")
    unary.stream = False
    e.begin_attempt(unary)  # its first token is never seen: left to the next scrape
    assert e.load().waiting == 7 and e.saturated  # above max_waiting=5
    e.first_token(streams[0])
    e.end_attempt(streams[1])  # ended before its first token: left the queue too
    assert e.load().waiting == 5 and not e.saturated
    e.observe_telemetry(telemetry(waiting=1))  # a new scrape starts from the engine's word
    assert e.load().waiting == 1
    e.first_token(streams[2])
    e.first_token(streams[2])  # counted once
    assert e.load().waiting == 0  # never below zero


def _full_index(services, touched: dict[str, float], capacity: int = 40) -> None:
    """Every endpoint's index entries full, each endpoint's blocks last touched when given."""
    now = time.monotonic()
    for n, (name, age) in enumerate(touched.items()):
        services.index.set_capacity(name, capacity)
        services.index.record(name, [1_000_000 * (n + 1) + i for i in range(capacity)], now - age)


@pytest.mark.parametrize("ties", ["eviction", "load"])
def test_a_new_prompt_goes_where_it_evicts_the_least_recently_used_blocks(ties):
    """Near ties (idle, equally loaded endpoints, nobody holds the prompt) go where the new
    blocks push out the oldest ones, as one LRU over the whole fleet would; `ties: load`
    decides them by load alone."""
    endpoints = [endpoint(name) for name in "abc"]
    policy = build_policy(
        {"objective": "latency", "picker": {"type": "max_score", "params": {"ties": ties}}}, "t"
    )
    picker, services = _picker(*endpoints, policy=policy)
    prompts = [ctx(f"{i} " + "new prompt nobody holds " * 40) for i in range(12)]
    blocks = len(services.hasher.chain(prompts[0].view.canonical, "m", None))
    # Each prompt fills half of an endpoint's entries, b's are the oldest, then c's, then a's.
    _full_index(services, {"a": 30.0, "b": 90.0, "c": 60.0}, capacity=2 * blocks)
    chosen = "".join(picker.choose(request).name for request in prompts)
    if ties == "eviction":
        assert chosen == "bbccaabbccaa"
    else:
        assert chosen != "bbccaabbccaa"


def test_an_endpoint_with_room_takes_a_new_prompt_before_any_eviction():
    endpoints = [endpoint(name) for name in "abc"]
    picker, services = _picker(*endpoints)
    _full_index(services, {"a": 300.0, "b": 200.0})
    services.index.set_capacity("c", 1_000)
    services.index.record("c", [7, 8, 9])
    chosen = {picker.choose(ctx(f"{i} " + "new prompt nobody holds " * 40)).name for i in range(8)}
    assert chosen == {"c"}


def test_among_endpoints_with_room_a_new_prompt_goes_to_the_emptiest():
    endpoints = [endpoint(name) for name in "abc"]
    picker, services = _picker(*endpoints)
    for name, held in (("a", 600), ("b", 100), ("c", 300)):
        services.index.set_capacity(name, 1_000)
        services.index.record(name, [10_000 * (ord(name) - 96) + i for i in range(held)])
    assert picker.choose(ctx("new prompt nobody holds " * 40)).name == "b"


def test_new_prefix_groups_on_idle_endpoints_each_start_on_an_endpoint_of_their_own():
    """Every idle endpoint is a near tie for a prompt nobody holds, and a group's later
    requests follow its first: three groups started on four idle endpoints must not share one
    (they would, by chance, more often than not if room did not decide the tie)."""
    groups = [f"You are agent kind {g}. " * 60 for g in range(3)]
    for _ in range(10):
        picker, services = _picker(*(endpoint(name) for name in "abcd"))
        for name in "abcd":
            services.index.set_capacity(name, 1_000)
        homes = [picker.choose(ctx(system + "task 0")).name for system in groups]
        assert len(set(homes)) == 3
        for task in range(1, 4):
            for system, home in zip(groups, homes, strict=True):
                assert picker.choose(ctx(system + f"task {task}")).name == home


@pytest.mark.parametrize(
    ("queued_tokens", "hold_margin", "stays"),
    [
        (2_600, 0.15, True),
        (2_600, 0.0, False),
        (6_000, 0.15, False),
        (3_300, 0.15, False),
        (3_300, None, True),
        (6_000, None, False),
    ],
)
def test_the_holder_keeps_a_prompt_unless_moving_saves_more_than_the_hold_margin(
    queued_tokens, hold_margin, stays
):
    """Leaving the endpoint that holds the prompt must be predicted to save more than the
    cost model's own error: a 10% cheaper cold prefill elsewhere does not move the prompt,
    a prefill queue twice its size does. The default margin (None) allows for the errors of
    both predictions a move compares: a holder predicted about 1.3 times as costly keeps the
    prompt, where a margin for one prediction's error (0.15) lets it go."""
    a, b = endpoint("a"), endpoint("b")
    params = {} if hold_margin is None else {"hold_margin": hold_margin}
    policy = build_policy(
        {"objective": "latency", "picker": {"type": "max_score", "params": params}}, "t"
    )
    picker, _ = _picker(a, b, policy=policy)
    long_system = SYSTEM * 4  # ~1,200 tokens: a cold prefill costs ~2,550 prefill tokens
    holder = picker.choose(ctx(long_system + "q"))
    holder.prefill_requests, holder.prefill_tokens = 1, queued_tokens
    assert (picker.choose(ctx(long_system + "q2")) is holder) is stays
