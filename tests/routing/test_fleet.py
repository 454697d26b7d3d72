"""`Fleet.serving`: the one answer to "which endpoints can take this request now"."""

from __future__ import annotations

import pytest

from kvgate.routing.endpoints import SaturationLimits
from tests.routing.helpers import endpoint, fleet, telemetry


class _Open:
    def __init__(self, for_seconds: float = 30.0) -> None:
        self.for_seconds = for_seconds

    def admits(self) -> bool:
        return False

    def reopens_in(self) -> float:
        return self.for_seconds


def test_back_in_is_the_soonest_end_of_an_ejection_or_pause_when_only_they_keep_all_out():
    """The Retry-After of a `no_healthy_endpoint`: told when the gateway knows, else 1 s."""
    held = fleet(endpoint("a", breaker=_Open(12.5)), endpoint("b", breaker=_Open(40)))
    assert held.back_in("m") == 12.5
    assert held.back_in("m", exclude=[held.endpoints[0]]) == 40
    soon = fleet(endpoint("a", breaker=_Open(0.2)))
    assert soon.back_in("m") == 1.0  # never less than a second
    # Out for a reason that may change at any moment (a half-open probe busy): 1 s.
    busy = fleet(endpoint("a", breaker=_Open(0.0)), endpoint("b", breaker=_Open(40)))
    assert busy.back_in("m") == 1.0
    assert fleet(endpoint("a", healthy=False)).back_in("m") == 1.0


def test_serving_keeps_healthy_admitted_endpoints_of_the_model():
    f = fleet(
        endpoint("a"),
        endpoint("b", model="other"),
        endpoint("c", healthy=False),
        endpoint("d", breaker=_Open()),
        endpoint("e", labels={"jurisdiction": "eu"}),
        endpoint("f", pool="q"),
    )
    names = lambda eps: [e.name for e in eps]  # noqa: E731
    assert names(f.serving("m")) == ["a", "e", "f"]
    assert names(f.serving("other")) == ["b"]
    assert f.serving("nobody") == []
    assert names(f.serving("m", pools=("q",))) == ["f"]
    assert names(f.serving("m", jurisdictions=frozenset({"eu"}))) == ["e"]
    a = f.serving("m")[0]
    assert names(f.serving("m", exclude=[a])) == ["e", "f"]


def test_serving_drops_stale_endpoints_only_under_the_exclude_policy():
    stale = telemetry(age=60)
    local = fleet(endpoint("a", telemetry=stale), endpoint("b", telemetry=telemetry()))
    exclude = fleet(
        endpoint("a", telemetry=stale, limits=SaturationLimits(stale_policy="exclude")),
        endpoint("b", telemetry=telemetry(), limits=SaturationLimits(stale_policy="exclude")),
    )
    assert [e.name for e in local.serving("m")] == ["a", "b"]
    assert [e.name for e in exclude.serving("m")] == ["b"]


@pytest.mark.parametrize(
    ("waiting", "expected"),
    [((0, 0), True), ((9, 0), True), ((9, 9), False)],
)
def test_has_capacity_until_every_candidate_is_saturated(waiting, expected):
    f = fleet(
        *(endpoint(n, telemetry=telemetry(waiting=w)) for n, w in zip("ab", waiting, strict=True))
    )
    assert f.has_capacity("m", None) is expected
    assert f.has_capacity("unknown", None) is True  # picking answers 404 instead
    # A request pinned to one endpoint (a Responses continuation) waits for that one only.
    assert f.has_capacity("m", None, "a") is (waiting[0] == 0)
    assert f.has_capacity("m", None, "b") is (waiting[1] == 0)
    assert f.has_capacity("m", None, "gone") is True  # picking answers 503 instead


def test_served_models_are_those_the_engines_list_once_they_have_listed():
    """A model the config names but a vLLM engine's list leaves out is not offered to clients
    (who would get the engine's 404); before an engine lists its models, the config's stand."""
    listed = endpoint("a", model="declared-only", discovered_models=frozenset({"served"}))
    unlisted = endpoint("b", model="not-yet-listed")
    f = fleet(listed, unlisted)
    assert f.served_models() == ["not-yet-listed", "served"]
    assert f.serves("declared-only")  # still routed: the engine's own answer is relayed
    # SGLang (and most OpenAI-compatible servers) serve any name they are sent: an alias.
    alias = endpoint("c", model="alias", discovered_models=frozenset({"served"}))
    alias.engine = "sglang"
    assert fleet(alias).served_models() == ["alias", "served"]
