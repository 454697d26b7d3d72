"""One view of each request's prompt: every stage reads the same text and the same estimate."""

from __future__ import annotations

import pytest

from kvgate.chain.classify import Classifier
from kvgate.chain.settings import ClassificationConfig
from kvgate.chain.tenants import TenantDirectory
from kvgate.ingress import request_context
from kvgate.prompt_view import PromptView, prompt_text
from kvgate.routing.services import RoutingServices
from kvgate.routing.settings import RoutingConfig

CHAT = {
    "model": "m",
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Look: "},
                                     {"type": "image_url", "image_url": {"url": "http://i/1"}}]},
    ],
}  # fmt: skip


@pytest.mark.parametrize(
    ("route", "payload", "contents", "tokens"),
    [
        ("chat", CHAT, ["You are terse.", "Look: ", "http://i/1"], None),
        ("completions", {"prompt": "abcdefgh"}, ["abcdefgh"], 2),
        ("completions", {"prompt": ["abcd", "efghijkl"]}, ["abcd", "efghijkl"], 3),
        ("completions", {"prompt": [1, 2, 3]}, [], 3),
        ("completions", {"prompt": [[1, 2], [3]]}, [], 3),
        ("embeddings", {"input": "abcd"}, ["abcd"], 1),
    ],
)
def test_view_pieces_and_estimate(route, payload, contents, tokens):
    view = PromptView(route, payload, 4.0)
    assert view.contents == contents
    assert view.text == "\n".join(contents)
    if tokens is None:  # chat: the canonical text (roles, tools, separators) is counted
        tokens = -(-len(view.canonical) // 4)
    assert view.prompt_tokens == tokens


def test_canonical_text_is_prefix_preserving_and_what_routing_hashes():
    longer = {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "ok"}]}
    assert prompt_text(longer).startswith(prompt_text(CHAT))
    assert PromptView("chat", CHAT, 4.0).canonical == prompt_text(CHAT)


def test_classification_admission_and_routing_read_one_estimate():
    ctx = request_context("chat", dict(CHAT), chars_per_token=3.0)
    tenant = TenantDirectory(None, {}).anonymous
    intent = Classifier(ClassificationConfig(chars_per_token=3.0)).classify(ctx, tenant)
    services = RoutingServices.from_config(RoutingConfig(), chars_per_token=3.0)
    match = services.prefix_match(ctx)
    assert intent.prompt_tokens == ctx.view.prompt_tokens == match.prompt_tokens
    assert intent.reserved_tokens == ctx.view.prompt_tokens + intent.max_tokens
