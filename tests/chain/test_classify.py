"""Classification rules, table-driven: each condition alone, order, tier caps, workflow and
deadline headers, token estimates. Pure: no server needed."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.chain.classify import Classifier
from kvgate.chain.settings import ClassificationConfig, TenantConfig
from kvgate.chain.tenants import DEFAULT_TIERS, build_tenant
from kvgate.errors import InvalidRequest
from kvgate.ingress import request_context
from kvgate.types import RequestContext

RULES: list[dict[str, Any]] = [
    {"name": "tools", "when": {"tools": True}, "then": {"class": "interactive"}},
    {
        "name": "big",
        "when": {"prompt_tokens_at_least": 1000},
        "then": {"class": "batch", "deadline": 900},
    },
    {"name": "nightly", "when": {"headers": {"X-Job": "nightly"}}, "then": {"class": "batch"}},
    {"name": "embed", "when": {"route": "embeddings"}, "then": {"class": "batch"}},
    {"name": "rank", "when": {"route": ["rerank", "score"]}, "then": {"class": "interactive"}},
    {
        "name": "llama-stream",
        "when": {"model": "llama-*", "stream": True},
        "then": {"class": "interactive"},
    },
    {
        "name": "summaries",
        "when": {"keywords": ["Summarize", "tl;dr"]},
        "then": {"class": "standard", "deadline": 30},
    },
    {"name": "eu-only", "when": {"regex": r"\bGDPR\b"}, "then": {"residency": ["eu"]}},
]


def _classifier(**extra: Any) -> Classifier:
    return Classifier(ClassificationConfig.model_validate({"rules": RULES, **extra}))


def _tenant(tier: str = "gold", **extra: Any):
    return build_tenant(TenantConfig(name="t", tier=tier, **extra), DEFAULT_TIERS[tier], None)


def _ctx(
    payload: dict[str, Any] | None = None,
    route: str = "chat",
    headers: dict[str, str] | None = None,
    model: str = "m1",
) -> RequestContext:
    payload = payload or {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return request_context(route, payload, headers=raw)


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": extra.pop("model", "m1"),
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


@pytest.mark.parametrize(
    ("ctx", "rule", "latency_class"),
    [
        (_ctx(), None, "standard"),
        (_ctx(_chat("hi", tools=[{"type": "function"}])), "tools", "interactive"),
        (_ctx(_chat("x" * 4000)), "big", "batch"),
        # the estimate counts the role and separators too: "user", "\n" and one more (6 chars)
        (_ctx(_chat("x" * 3990)), None, "standard"),
        (_ctx(headers={"x-job": "nightly"}), "nightly", "batch"),
        (_ctx(headers={"x-job": "daily"}), None, "standard"),
        (_ctx({"model": "m1", "input": "abc"}, route="embeddings"), "embed", "batch"),
        (
            _ctx({"model": "m1", "query": "q", "documents": ["d"]}, route="rerank"),
            "rank",
            "interactive",
        ),
        (_ctx({"model": "m1", "text_1": "a", "text_2": "b"}, route="score"), "rank", "interactive"),
        (_ctx({"model": "m1", "input": "abc"}, route="pooling"), None, "standard"),
        (
            _ctx(_chat("hi", model="llama-3", stream=True), model="llama-3"),
            "llama-stream",
            "interactive",
        ),
        (_ctx(_chat("hi", model="llama-3"), model="llama-3"), None, "standard"),
        (_ctx(_chat("please SUMMARIZE this")), "summaries", "standard"),
        # a rule that only sets residency chooses no class
        (_ctx(_chat("GDPR matters")), None, "standard"),
        (_ctx(_chat("xGDPRx")), None, "standard"),
        # first matching rule wins: tools beat the big prompt
        (_ctx(_chat("x" * 8000, tools=[{"type": "function"}])), "tools", "interactive"),
    ],
)
def test_rules(ctx, rule, latency_class):
    intent = _classifier().classify(ctx, _tenant())
    assert (intent.rule, intent.latency_class) == (rule, latency_class)


def test_deadlines_residency_and_estimates():
    classifier = _classifier()
    # 3994 characters of content + "user", "\n" and a separator: 4000 characters, 1000 tokens
    big = classifier.classify(_ctx(_chat("x" * 3994, max_tokens=50)), _tenant())
    assert big.deadline == 900 and big.prompt_tokens == 1000 and big.max_tokens == 50
    assert big.reserved_tokens == 1050
    summary = classifier.classify(_ctx(_chat("tl;dr please")), _tenant())
    assert summary.deadline == 30
    default = classifier.classify(_ctx(_chat("hi", n=2)), _tenant())
    assert default.max_tokens == 2 * 512 and default.deadline == 600
    eu = classifier.classify(_ctx(_chat("GDPR")), _tenant(residency=["eu", "us"]))
    assert eu.residency == frozenset({"eu"}) and eu.residency_rules == ("eu-only",)
    tokens = classifier.classify(
        _ctx({"model": "m1", "prompt": [[1, 2, 3], [4, 5]]}, route="completions"), _tenant()
    )
    assert tokens.prompt_tokens == 5


def test_tier_caps_the_class_and_client_deadline_only_shortens():
    classifier = _classifier()
    capped = classifier.classify(_ctx(_chat("hi", tools=[{}])), _tenant("bronze"))
    assert capped.latency_class == "standard" and capped.capped
    shorter = classifier.classify(_ctx(headers={"x-kvgate-deadline": "5"}), _tenant())
    assert shorter.deadline == 5
    longer = classifier.classify(_ctx(headers={"x-kvgate-deadline": "99999"}), _tenant())
    assert longer.deadline == 600


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"x-kvgate-workflow-id": "wf-1", "x-kvgate-workflow-step": "3/5"}, ("wf-1", 3, 5)),
        ({"x-kvgate-workflow-id": "wf-1", "x-kvgate-workflow-step": "2"}, ("wf-1", 2, None)),
        ({"x-kvgate-workflow-id": "wf-1"}, ("wf-1", 1, None)),
    ],
)
def test_workflow_headers(headers, expected):
    workflow = _classifier().classify(_ctx(headers=headers), _tenant()).workflow
    assert workflow is not None and (workflow.id, workflow.step, workflow.total) == expected


@pytest.mark.parametrize(
    "headers",
    [
        {"x-kvgate-workflow-step": "3/5"},
        {"x-kvgate-workflow-id": "wf 1"},
        {"x-kvgate-workflow-id": "wf", "x-kvgate-workflow-step": "6/5"},
        {"x-kvgate-workflow-id": "wf", "x-kvgate-workflow-step": "0"},
        {"x-kvgate-workflow-id": "wf", "x-kvgate-workflow-step": "three"},
        {"x-kvgate-deadline": "soon"},
        {"x-kvgate-deadline": "-1"},
        {"x-kvgate-deadline": "nan"},
    ],
)
def test_bad_headers_are_400(headers):
    with pytest.raises(InvalidRequest) as info:
        _classifier().classify(_ctx(headers=headers), _tenant())
    assert info.value.param.startswith("x-kvgate-")


def test_deterministic():
    classifier = _classifier()
    ctx = _ctx(_chat("please summarize GDPR", tools=[{}]), headers={"x-job": "nightly"})
    assert len({str(classifier.classify(ctx, _tenant()).explain()) for _ in range(20)}) == 1


@pytest.mark.parametrize("route", ["embeddings", "rerank", "score", "classify", "pooling"])
def test_routes_that_generate_nothing_reserve_no_output_tokens(route):
    ctx = _ctx({"model": "m1", "input": "abcd", "query": "q", "max_tokens": 99}, route=route)
    assert _classifier().classify(ctx, _tenant()).max_tokens == 0


def test_every_matching_residency_rule_narrows_whichever_rule_chose_the_class():
    """Residency is a constraint: a class rule matched first does not shadow a residency rule
    after it, and two residency rules intersect (with the tenant's too)."""
    rules = [
        {"name": "empty", "when": {"keywords": ["skip"]}, "then": {}},
        *RULES,
        {"name": "ch-or-eu", "when": {"keywords": ["Swiss"]}, "then": {"residency": ["ch", "eu"]}},
    ]
    classifier = Classifier(ClassificationConfig.model_validate({"rules": rules}))
    agent = classifier.classify(_ctx(_chat("a GDPR request", tools=[{}])), _tenant())
    assert (agent.rule, agent.latency_class) == ("tools", "interactive")
    assert agent.residency == frozenset({"eu"}) and agent.residency_rules == ("eu-only",)
    both = classifier.classify(_ctx(_chat("Swiss GDPR data")), _tenant())
    assert both.residency == frozenset({"eu"}) and both.residency_rules == ("eu-only", "ch-or-eu")
    tenant_ch = classifier.classify(_ctx(_chat("Swiss data")), _tenant(residency=["ch", "us"]))
    assert tenant_ch.residency == frozenset({"ch"})
    assert classifier.classify(_ctx(_chat("hi")), _tenant()).residency is None
    # a rule whose `then` is empty still claims the class slot (the tier's default), as before
    skipped = classifier.classify(_ctx(_chat("skip this", tools=[{}])), _tenant())
    assert (skipped.rule, skipped.latency_class) == ("empty", "standard")
