"""`Fleet.serving`: the one answer to "which endpoints can take this request now"."""

from __future__ import annotations

import pytest

from kvgate.routing.endpoints import SaturationLimits
from tests.routing.helpers import endpoint, fleet, telemetry


class _Open:
    def admits(self) -> bool:
        return False


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
