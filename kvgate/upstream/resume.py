"""Resuming a broken stream on another endpoint, so the client sees one continuous answer.

Opt-in per pool (`pools[].resume: true`). For an eligible request the relay parses every event
(only then) and this module keeps a transcript of what the client received. When the stream
breaks after the commit point, the forwarder asks `continuation_body` for a request that
continues the answer on another endpoint serving the model:

- chat: the text so far is appended as a partial assistant message, with
  `continue_final_message: true` and `add_generation_prompt: false` (vLLM's continuation);
- completions: the prompt plus the text so far;
- `max_tokens` / `max_completion_tokens` (and `min_tokens`) reduced by the content events
  already relayed (one per token on vLLM and SGLang without speculative decoding);
- `stream_options.include_usage` forced on, to learn the continuation's usage.

The continuation is relayed in the same stream: its role-only opening delta is skipped and
`id`, `created` and `model` are rewritten to the original's; nothing else in a content event
changes. Its usage chunk (if the client asked for usage) is rewritten to count what the user
received: completion tokens = tokens relayed before the break + the continuation's; prompt
tokens = the continuation's prompt minus the re-fed text. The re-read prompt is the resume
overhead (`overhead_tokens`), reported separately.

Eligible: streamed chat or completions, n = 1, no tools/functions, no logprobs (completions'
`logprobs: 0` included) or prompt logprobs, no token ids in the output
(`return_tokens_as_token_ids`, `return_token_ids`), no `echo`, `best_of` ≤ 1, a string prompt,
not already a continuation, no per-chunk usage stats.
"""

from __future__ import annotations

from typing import Any

import orjson

from kvgate.types import RequestContext
from kvgate.upstream.sse import SseProtocolError, event_data, split_events

_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's (and OpenAI's) default for /v1/completions
# Output a grammar constrains (structured outputs: vLLM's fields, older and newer, and
# SGLang's): a continuation would start the grammar over, in the middle of the output.
_CONSTRAINED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "regex",
    "json_schema",
    "ebnf",
)


def resume_eligible(ctx: RequestContext) -> bool:
    payload = ctx.payload
    if not ctx.stream or ctx.route not in ("chat", "completions"):
        return False
    if payload.get("n", 1) not in (1, None) or payload.get("best_of") not in (1, None):
        return False
    if any(
        payload.get(k)
        for k in (
            "tools",
            "functions",
            "top_logprobs",
            "echo",
            "continue_final_message",
            "return_tokens_as_token_ids",
            "return_token_ids",
        )
    ):
        return False
    # Completions' `logprobs: 0` still returns the sampled token's; prompt logprobs would be
    # computed again over the re-fed text.
    logprobs = payload.get("logprobs")
    if (logprobs is not None and logprobs is not False) or payload.get(
        "prompt_logprobs"
    ) is not None:
        return False
    options = payload.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return False
    form = payload.get("response_format")
    if isinstance(form, dict) and form.get("type", "text") != "text":
        return False
    if any(payload.get(k) is not None for k in _CONSTRAINED):
        return False
    if ctx.route == "chat":
        return isinstance(payload.get("messages"), list)
    return isinstance(payload.get("prompt"), str)


class StreamTranscript:
    """What the client of one resumable stream has received, and the rewriting of a
    continuation into that stream. `shape(block)` takes complete SSE events and returns the
    bytes to relay."""

    def __init__(self, ctx: RequestContext) -> None:
        self.chat = ctx.route == "chat"
        options = ctx.payload.get("stream_options")
        self.client_wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        self.pieces: list[str] = []
        self.content_events = 0
        # A reasoning model's thinking was relayed (`reasoning_content` / `reasoning` deltas):
        # a continuation could not carry it, and its tokens are not counted in `content_events`.
        self.reasoned = False
        self.finished = False
        self.identity: tuple[Any, Any, Any] | None = None
        self.continuing = False
        self.resumed_at_events = 0
        self.overhead_tokens = 0
        self.usage: dict[str, Any] | None = None
        self._opening_skipped = False

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def begin_continuation(self) -> None:
        self.continuing = True
        self.resumed_at_events = self.content_events
        self._opening_skipped = False

    def shape(self, block: bytes) -> bytes:
        out: list[bytes] = []
        events, _ = split_events(block)
        for event in events:
            shaped = self._event(event)
            if shaped is not None:
                out.append(shaped)
        return b"".join(out)

    def _event(self, event: bytes) -> bytes | None:
        data = (event_data(event) or b"").strip()
        if not data or data == b"[DONE]":
            return event + b"\n\n"
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise SseProtocolError("the engine sent a data event that is not JSON") from None
        if not isinstance(chunk, dict) or "error" in chunk or chunk.get("object") == "error":
            return event + b"\n\n"
        if not self.continuing:
            if self.identity is None:
                self.identity = (chunk.get("id"), chunk.get("created"), chunk.get("model"))
            self._record(chunk)
            return event + b"\n\n"
        return self._continuation_event(chunk)

    def _continuation_event(self, chunk: dict[str, Any]) -> bytes | None:
        if self.identity is not None:
            chunk["id"], chunk["created"], chunk["model"] = self.identity
        usage = chunk.get("usage")
        if isinstance(usage, dict) and not chunk.get("choices"):
            self._account(usage)
            if not self.client_wants_usage:
                return None
            chunk["usage"] = self.usage
        elif not self._opening_skipped and self.chat and _role_only(chunk):
            self._opening_skipped = True
            return None
        else:
            self._opening_skipped = True
            self._record(chunk)
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def _record(self, chunk: dict[str, Any]) -> None:
        choices = chunk.get("choices")
        if not choices or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        delta = (choice.get("delta") or {}) if self.chat else {}
        text = delta.get("content") if self.chat else choice.get("text")
        if delta.get("reasoning_content") or delta.get("reasoning"):
            self.reasoned = True
        if isinstance(text, str) and text:
            self.pieces.append(text)
            self.content_events += 1
        if choice.get("finish_reason") is not None:
            self.finished = True

    def _account(self, usage: dict[str, Any]) -> None:
        refed = self.resumed_at_events
        prompt = max(0, int(usage.get("prompt_tokens") or 0) - refed)
        completion = refed + int(usage.get("completion_tokens") or 0)
        self.overhead_tokens += int(usage.get("prompt_tokens") or 0)
        self.usage = {
            **usage,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.usage["prompt_tokens_details"] = {
                **details,
                "cached_tokens": min(details["cached_tokens"], prompt),
            }


def _role_only(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices")
    if not choices or not isinstance(choices[0], dict):
        return False
    delta = choices[0].get("delta") or {}
    return "role" in delta and not delta.get("content") and not delta.get("tool_calls")


def continuation_body(ctx: RequestContext, transcript: StreamTranscript) -> bytes | None:
    """The request that continues the answer, or None when it cannot be continued: nothing is
    left to generate, or a reasoning model's thinking was relayed (the continuation would
    think again from the start, without it, in a budget that did not count it)."""
    if transcript.reasoned:
        return None
    sent = transcript.content_events
    body = dict(ctx.payload)
    if transcript.chat:
        body["messages"] = [
            *ctx.payload["messages"],
            {"role": "assistant", "content": transcript.text},
        ]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        body["prompt"] = ctx.payload["prompt"] + transcript.text
        body.setdefault("max_tokens", _COMPLETIONS_DEFAULT_MAX_TOKENS)
    for key in ("max_tokens", "max_completion_tokens"):
        limit = body.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if limit - sent <= 0:
                return None
            body[key] = limit - sent
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool):
        body["min_tokens"] = max(0, min_tokens - sent)
    options = body.get("stream_options")
    body["stream_options"] = {
        **(options if isinstance(options, dict) else {}),
        "include_usage": True,
    }
    return orjson.dumps(body)
