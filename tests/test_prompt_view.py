"""One view of each request's prompt: every stage reads the same text and the same estimate."""

from __future__ import annotations

import pytest

from kvgate.chain.classify import Classifier
from kvgate.chain.settings import ClassificationConfig
from kvgate.chain.tenants import TenantDirectory
from kvgate.ingress import request_context
from kvgate.prompt_view import MEDIA_TOKENS, PromptView, prompt_text
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
        ("chat", CHAT, ["You are terse.", "Look: "], None),
        ("completions", {"prompt": "abcdefgh"}, ["abcdefgh"], 2),
        ("completions", {"prompt": ["abcd", "efghijkl"]}, ["abcd", "efghijkl"], 3),
        ("completions", {"prompt": [1, 2, 3]}, [], 3),
        ("completions", {"prompt": [[1, 2], [3]]}, [], 3),
        ("embeddings", {"input": "abcd"}, ["abcd"], 1),
        ("rerank", {"query": "abcd", "documents": ["efgh", {"text": "ijkl"}]},
         ["abcd", "efgh", "ijkl"], 3),
        ("score", {"text_1": "abcd", "text_2": ["efgh", "ijkl"]}, ["abcd", "efgh", "ijkl"], 3),
        ("classify", {"input": ["abcd", "efgh"]}, ["abcd", "efgh"], 2),
        ("classify", {"input": [1, 2, 3]}, [], 3),
        ("pooling", {"messages": [{"role": "user", "content": "abcd"}]}, ["abcd"], 1),
        # No model runs for these: the text is there for rules, the quota counts nothing.
        ("tokenize", {"prompt": "abcdefgh"}, ["abcdefgh"], 0),
        ("tokenize", {"messages": [{"role": "user", "content": "abcd"}]}, ["abcd"], 0),
        ("detokenize", {"tokens": [1, 2, 3]}, [], 0),
    ],
)  # fmt: skip
def test_view_pieces_and_estimate(route, payload, contents, tokens):
    view = PromptView(route, payload, 4.0)
    assert view.contents == contents
    assert view.text == "\n".join(contents)
    if tokens is None:  # chat: the canonical text (roles, tools, separators) is counted
        tokens = -(-len(view.canonical) // 4)
    assert view.prompt_tokens == tokens


@pytest.mark.parametrize(
    ("route", "payload"),
    [("rerank", {"query": "q" * 300, "documents": ["d" * 300]}), ("pooling", {"input": "x" * 300})],
)
def test_the_engines_own_apis_are_never_hashed_for_prefix_routing(route, payload):
    view = PromptView(route, payload, 4.0)
    assert view.contents and view.canonical == ""


RESPONSES_TURN = {
    "model": "m",
    "instructions": "Be brief.",
    "input": [
        {"role": "user", "content": "What is a river?"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Water that flows."}]},
        {"type": "function_call", "name": "f", "arguments": '{"q": 1}', "call_id": "c"},
        {"type": "function_call_output", "call_id": "c", "output": "42"},
    ],
}  # fmt: skip


def test_a_responses_conversation_renders_like_chat_and_keeps_its_prefix_as_it_grows():
    view = PromptView("responses", RESPONSES_TURN, 4.0)
    assert view.contents == ["Be brief.", "What is a river?", "Water that flows.", '{"q": 1}', "42"]
    assert view.prompt_tokens == -(-len(view.canonical) // 4)
    longer = {
        **RESPONSES_TURN,
        "input": [*RESPONSES_TURN["input"], {"role": "user", "content": "ok"}],
    }
    assert PromptView("responses", longer, 4.0).canonical.startswith(view.canonical)
    first = {**RESPONSES_TURN, "input": "What is a river?"}
    assert view.canonical.startswith(PromptView("responses", first, 4.0).canonical)


def _with_image(url: str, text: str = "What is in it?") -> dict:
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


IMAGE = "data:image/jpeg;base64," + "QUJD" * 250_000  # a megabyte of inline image


def test_an_inline_image_counts_as_one_media_estimate_not_as_its_bytes():
    view = PromptView("chat", _with_image(IMAGE), 4.0)
    text_only = {"model": "m", "messages": [{"role": "user", "content": "What is in it?"}]}
    assert view.prompt_tokens == PromptView("chat", text_only, 4.0).prompt_tokens + MEDIA_TOKENS
    assert view.contents == ["What is in it?"]  # rules never search the image's bytes
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA" * 1000, "format": "wav"}}
    spoken = {"model": "m", "messages": [{"role": "user", "content": [audio]}]}
    assert PromptView("chat", spoken, 4.0, media_tokens=300).prompt_tokens < 310


def test_the_same_media_renders_the_same_and_other_media_differently():
    same = PromptView("chat", _with_image(IMAGE), 4.0).canonical
    assert PromptView("chat", _with_image(IMAGE), 4.0).canonical == same
    other = IMAGE[:-4] + "QUJE"
    assert PromptView("chat", _with_image(other), 4.0).canonical != same
    by_url = PromptView("chat", _with_image("https://example.com/cat.png"), 4.0).canonical
    assert len(by_url) == len(same)  # by URL or inline, one estimate


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


def test_a_responses_input_image_counts_as_media():
    content = [
        {"type": "input_text", "text": "What is in it?"},
        {"type": "input_image", "image_url": IMAGE},
    ]
    payload = {"model": "m", "input": [{"role": "user", "content": content}]}
    view = PromptView("responses", payload, 4.0)
    text_only = {"model": "m", "input": [{"role": "user", "content": "What is in it?"}]}
    assert view.contents == ["What is in it?"]
    assert view.prompt_tokens == PromptView("responses", text_only, 4.0).prompt_tokens + 1000


@pytest.mark.parametrize("route", ["pooling", "classify", "embeddings"])
def test_media_in_the_messages_of_a_pooling_request_counts_as_media(route):
    """vLLM's pooling APIs (and its chat form of embeddings) take chat `messages`, images
    included (multimodal embedding models): an image counts `media_tokens`, its bytes none."""
    content = [{"type": "text", "text": "abcd"}, {"type": "image_url", "image_url": {"url": IMAGE}}]
    view = PromptView(
        route, {"model": "m", "messages": [{"role": "user", "content": content}]}, 4.0
    )
    assert view.contents == ["abcd"]
    assert view.prompt_tokens == 1 + MEDIA_TOKENS
    assert view.canonical == ""  # never hashed for prefix routing
