"""Response ids that name their endpoint: issued per tenant and engine id, decoded against the
fleet as it is now, each failure its own clear error (kvgate/routing/response_ids.py)."""

from __future__ import annotations

import pytest

from kvgate.errors import NotFound, Overloaded, PermissionDenied
from kvgate.routing.endpoints import Fleet, Pool
from kvgate.routing.response_ids import (
    MARK,
    check_available,
    check_residency,
    client_id,
    signing_key,
    stored_at,
)
from tests.routing.helpers import endpoint

ENGINE_ID = "resp_0f3c6d2e9a8b47c1b2d3e4f5a6b7c8d9"


def fleet(*names: str) -> Fleet:
    return Fleet([Pool("p", "vllm", "kvgate", [endpoint(n) for n in names])])


def test_an_issued_id_keeps_the_engines_and_finds_its_endpoint():
    engines = fleet("e0", "e1", "e2")
    issued = client_id(ENGINE_ID, "acme", "http://e1")
    assert issued.startswith(ENGINE_ID + MARK) and len(issued) == len(ENGINE_ID) + 20
    found, engine_id = stored_at(engines, "acme", issued, "response_id")
    assert (found.name, engine_id) == ("e1", ENGINE_ID)


def test_an_id_survives_a_fleet_that_lists_its_endpoint_elsewhere():
    """Matched by URL: another replica, or a reload that reorders or renames endpoints."""
    issued = client_id(ENGINE_ID, "acme", "http://e1")
    found, _ = stored_at(fleet("e9", "e1"), "acme", issued, "response_id")
    assert found.url == "http://e1"


@pytest.mark.parametrize(
    "given",
    [
        ENGINE_ID,  # the engine's own id
        "resp_x_kvg0123456789ABCDEF",  # upper-case digits: not one of ours
        "resp_x_kvg0123456789abcde",  # one digit short
        "resp_x_kvh0123456789abcdef",  # not the mark
        "_kvg0123456789abcdef",  # no engine id before the mark
        "",
    ],
)
def test_an_id_the_gateway_did_not_issue_is_unknown(given):
    with pytest.raises(NotFound) as refused:
        stored_at(fleet("e0"), "acme", given, "previous_response_id")
    assert refused.value.code == "unknown_response_id"
    assert refused.value.param == "previous_response_id"
    assert "did not issue" in refused.value.message


@pytest.mark.parametrize(
    "issued",
    [
        client_id(ENGINE_ID, "globex", "http://e0"),  # another tenant's
        client_id(ENGINE_ID, "acme", "http://gone"),  # an engine that left the fleet
        # A suffix taken from one's own response and put on another engine id.
        "resp_someone_elses" + client_id(ENGINE_ID, "acme", "http://e0")[len(ENGINE_ID) :],
        ENGINE_ID + MARK + "0123456789abcdef",  # forged
    ],
)
def test_an_id_no_endpoint_stores_for_the_tenant_is_not_found(issued):
    with pytest.raises(NotFound) as refused:
        stored_at(fleet("e0", "e1"), "acme", issued, "response_id")
    assert refused.value.code == "response_not_found"


@pytest.mark.parametrize(
    ("state", "generates", "refused"),
    [
        ({}, True, False),
        ({"healthy": False}, False, True),
        ({"drained": True}, True, True),
        ({"drained": True}, False, False),  # reading or cancelling lets a drain finish
    ],
)
def test_only_an_endpoint_taking_requests_is_available(state, generates, refused):
    stored = endpoint("e0", **state)
    Fleet([Pool("p", "vllm", "kvgate", [stored, endpoint("e1")])])  # not in panic
    if not refused:
        check_available(stored, generates)
        return
    with pytest.raises(Overloaded) as unavailable:
        check_available(stored, generates)
    assert unavailable.value.code == "stored_response_unavailable"
    assert unavailable.value.retry_after == 1 and "e0" in unavailable.value.message


def test_an_unhealthy_endpoint_of_a_pool_in_panic_is_still_available():
    stored = endpoint("e0", healthy=False)
    Fleet([Pool("p", "vllm", "kvgate", [stored])])  # its only endpoint: the pool panics
    check_available(stored, generates=True)


def test_a_continuation_is_refused_outside_its_residency():
    stored = endpoint("e0", labels={"jurisdiction": "us"})
    check_residency(stored, None)
    check_residency(stored, frozenset({"us", "eu"}))
    with pytest.raises(PermissionDenied) as refused:
        check_residency(stored, frozenset({"eu"}))
    assert refused.value.code == "residency_conflict"


def test_with_a_secret_only_the_gateway_can_make_an_id():
    """`auth.response_id_secret` keys the token: the unkeyed token of an engine id (what anyone
    who saw another tenant's id could compute under their own key) names nothing, nor does a
    token under another secret; the gateway's own ids are found."""
    key = signing_key("s3cret-shared-by-every-replica")
    engines = fleet("e0", "e1")
    issued = client_id(ENGINE_ID, "acme", "http://e1", key)
    found, engine_id = stored_at(engines, "acme", issued, "response_id", key)
    assert (found.name, engine_id) == ("e1", ENGINE_ID)
    for made in (
        client_id(ENGINE_ID, "acme", "http://e1"),
        client_id(ENGINE_ID, "acme", "http://e1", signing_key("another secret")),
    ):
        assert made != issued
        with pytest.raises(NotFound) as refused:
            stored_at(engines, "acme", made, "response_id", key)
        assert refused.value.code == "response_not_found"
    assert signing_key(None) == signing_key("") == b""
