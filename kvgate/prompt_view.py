"""One view of a request's prompt, computed once and read by every stage.

Classification reads the text pieces (message contents, completion prompts, embedding inputs)
and the token estimate; admission reserves quota with the same estimate; routing hashes the
canonical text and prices uncached tokens with the same estimate. Everything is computed on
first use and kept: a request that no rule and no scorer looks at costs one pass that only
collects references to the strings the JSON parser made.

The canonical text is not the engine's chat template (the gateway does not know it); it only
has to be deterministic and prefix-preserving: a conversation extended by more messages
renders to text that starts with the shorter conversation's text, so multi-turn sessions share
their prefix. Tools come first because templates put them in the system prompt. A Responses
API request renders the same way: its `instructions` as the system message, then its `input`
(a string as one user message, or its items in order), so a conversation that the client
resends whole, turn by turn, keeps its prefix too.

The token estimate is characters ÷ `chars_per_token` (no tokenizer on the hot path), plus the
prompt tokens given directly as token ids. A media part of a message (an image, audio or video,
by URL or inline) is not text: it renders as a marker drawn from a digest of the media, as
many characters long as `media_tokens` tokens are, so the same media renders the same, the
estimate counts it as `media_tokens` however many bytes it has, and rules never search it.

The engines' own APIs (rerank, score, classify, pooling, tokenize, detokenize) have their text
in fields of their own (`ENGINE_TEXT_FIELDS`), as has vLLM's chat form of embeddings
(`messages` instead of `input`): rules read it and quotas count it, a media part of their
messages as `media_tokens`, but it is never hashed for prefix routing (those requests leave no
conversation to come back to), and tokenize and detokenize count no tokens at all: no model
runs for them.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import orjson

_MESSAGE_END = "\x1e"  # record separator: cannot be confused with message text boundaries
_MEDIA_START = "\x1f"  # unit separator: begins a media part's marker
_SORTED = orjson.OPT_SORT_KEYS
_SAMPLED_ABOVE = 32 * 1024  # characters of media source digested whole
# Prompt tokens one media part of a message is estimated at: the gateway decodes no media, and
# an engine's count depends on the model and the size (a 1024x1024 image: 576 tokens for
# LLaVA-1.5's fixed 336-pixel grid, 765 in OpenAI's accounting, about 1,300 for Qwen2-VL's
# 28-pixel patches); this is the order of a one-megapixel image in them.
MEDIA_TOKENS = 1000
# The keys of a content part that carry media (vLLM's; OpenAI's `input_audio`; a Responses
# `input_image` part's `image_url`, a string there).
MEDIA_KEYS = (
    "image_url",
    "image_embeds",
    "audio_url",
    "input_audio",
    "audio_embeds",
    "video_url",
)
# Where the text of a request to one of the engines' own APIs is, by route (vLLM's field names,
# older and newer, and SGLang's).
ENGINE_TEXT_FIELDS: dict[str, tuple[str, ...]] = {
    "tokenize": ("prompt", "messages"),
    "detokenize": (),
    "rerank": ("query", "documents"),
    "score": ("text_1", "text_2", "queries", "documents", "data_1", "data_2", "query", "items"),
    "classify": ("input", "messages"),
    "pooling": ("input", "messages"),
}
# Routes whose prompt is rendered as chat messages: their roles and separators count as tokens.
_RENDERED = frozenset({"chat", "responses"})
# Routes whose prompt may be given as token ids.
_ID_CARRIERS = frozenset({"completions", "embeddings", "classify", "pooling"})
# Routes on which no model runs, only the engine's tokenizer.
_TOKENIZER_ONLY = frozenset({"tokenize", "detokenize"})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sampled(source: str) -> str:
    """`source`, or for a long one (inline media) what identifies it at a bounded cost: its
    length, its first and last 4 KiB and 64 slices of 128 characters spread between. Two
    different compressed media of one length differ in those almost surely; where they did
    not, a prefix would be guessed where it is not (a routing miss, never a wrong answer).
    Digesting a whole megabyte took 1.5 ms of the event loop per request."""
    size = len(source)
    if size <= _SAMPLED_ABOVE:
        return source
    step = (size - 8192) // 64
    middle = "".join(source[i : i + 128] for i in range(4096, size - 4096 - 127, step))
    return f"{size}:{source[:4096]}{middle}{source[-4096:]}"


def _media_marker(part: dict[str, Any], chars: int) -> str | None:
    """The canonical text of a media part (an image, audio or video, by URL, inline data or
    embeddings), or None for any other part: `chars` characters drawn from a digest of the
    media, so the same media renders the same and its length carries its token estimate."""
    for key in MEDIA_KEYS:
        value = part.get(key)
        if value is None:
            continue
        if isinstance(value, dict) and isinstance(value.get("url"), str):
            value = value["url"]
        source = value if isinstance(value, str) else orjson.dumps(value, option=_SORTED).decode()
        digest = hashlib.blake2b(_sampled(source).encode(), digest_size=16).hexdigest()
        return _MEDIA_START + (digest * (chars // len(digest) + 1))[: max(chars - 1, 0)]
    return None


def _content_pieces(content: Any, media_chars: int) -> tuple[list[str], list[str]]:
    """A message's content as (its texts, its canonical pieces): a string, or its parts' texts,
    with a media part's marker (`_media_marker`) among the pieces only."""
    if isinstance(content, str):
        return [content], [content]
    texts: list[str] = []
    pieces: list[str] = []
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict):
                continue
            text = part.get("text")
            if isinstance(text, str):
                texts.append(text)
                pieces.append(text)
            else:
                marker = _media_marker(part, media_chars)
                if marker is not None:
                    pieces.append(marker)
    return texts, pieces


def _content_texts(content: Any, into: list[str]) -> int:
    """A message's content's texts into `into` (no media marker made); the number of its
    media parts."""
    if isinstance(content, str):
        into.append(content)
        return 0
    media = 0
    for part in content if isinstance(content, list) else ():
        if not isinstance(part, dict):
            continue
        text = part.get("text")
        if isinstance(text, str):
            into.append(text)
        elif any(part.get(key) is not None for key in MEDIA_KEYS):
            media += 1
    return media


def _texts(value: Any, into: list[str]) -> int:
    """Every text in `value` into `into`: a string, the strings of a list, a message's or a
    document's `content` or `text`; the number of media parts among them."""
    if isinstance(value, str):
        into.append(value)
    elif isinstance(value, list):
        return sum(_texts(item, into) for item in value)
    elif isinstance(value, dict):
        if "content" in value:
            return _content_texts(value["content"], into)
        return _texts(value.get("text"), into)
    return 0


class PromptView:
    """The prompt of one request's payload (see the module docstring)."""

    __slots__ = ("_canonical", "_contents", "_media", "_pieces", "_text", "_tokens",
                 "chars_per_token", "media_chars", "payload", "route")  # fmt: skip

    def __init__(
        self,
        route: str,
        payload: dict[str, Any],
        chars_per_token: float,
        media_tokens: int = MEDIA_TOKENS,
    ) -> None:
        self.route = route
        self.payload = payload
        self.chars_per_token = chars_per_token
        self.media_chars = math.ceil(media_tokens * chars_per_token)
        self._pieces: list[str] | None = None
        self._contents: list[str] | None = None
        self._canonical: str | None = None
        self._text: str | None = None
        self._tokens: int | None = None
        self._media = 0  # media parts among the contents (the text-only routes)

    def _collect(self) -> None:
        """One pass: the canonical text's pieces and the content pieces among them."""
        pieces: list[str] = []
        contents: list[str] = []
        payload = self.payload
        engine_fields = ENGINE_TEXT_FIELDS.get(self.route)
        messages = payload.get("messages") if self.route == "chat" else None
        if engine_fields is not None:
            self._media = sum(_texts(payload.get(field), contents) for field in engine_fields)
        elif self.route == "embeddings" and "input" not in payload:
            self._media = _texts(payload.get("messages"), contents)  # vLLM's chat embeddings
        elif self.route == "responses":
            self._collect_items(payload, pieces, contents)
        elif isinstance(messages, list):
            tools = payload.get("tools")
            if tools:
                pieces.append(orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode())
                pieces.append(_MESSAGE_END)
            for message in messages:
                if isinstance(message, dict):
                    texts, parts = _content_pieces(message.get("content"), self.media_chars)
                    pieces += (str(message.get("role", "")), "\n", *parts, _MESSAGE_END)
                    contents += texts
        else:
            carrier = payload.get("prompt" if self.route == "completions" else "input")
            if isinstance(carrier, str):
                pieces.append(carrier)
                contents.append(carrier)
            elif isinstance(carrier, list) and carrier:
                strings = [p for p in carrier if isinstance(p, str)]
                contents += strings
                first = carrier[0]
                if isinstance(first, str):
                    pieces.append(first)  # a batch of prompts: the first one decides the route
                elif _is_int(first):
                    pieces.append(" ".join(map(str, carrier)))  # same ids, same prefix
        self._pieces = pieces
        self._contents = contents

    def _collect_items(
        self, payload: dict[str, Any], pieces: list[str], contents: list[str]
    ) -> None:
        """A Responses API request rendered as chat messages are: the `instructions` first
        (the system prompt), then its `input`: a string as one user message, or each item's
        role and text (a message's `content`; a tool call's `arguments`, its result's
        `output`)."""
        instructions = payload.get("instructions")
        if isinstance(instructions, str):
            pieces += ("system", "\n", instructions, _MESSAGE_END)
            contents.append(instructions)
        given = payload.get("input")
        if isinstance(given, str):
            given = [{"role": "user", "content": given}]
        for item in given if isinstance(given, list) else ():
            if not isinstance(item, dict):
                continue
            if "content" in item:
                texts, parts = _content_pieces(item["content"], self.media_chars)
            else:
                texts = parts = [
                    v for v in (item.get("arguments"), item.get("output")) if isinstance(v, str)
                ]
            role = item.get("role", item.get("type", ""))
            pieces += (str(role), "\n", *parts, _MESSAGE_END)
            contents += texts

    def release(self) -> None:
        """Keep the token estimate, drop the payload and the text taken from it: `contents`,
        `text` and `canonical` read empty from now on."""
        self._tokens = self.prompt_tokens
        self.payload = {}  # what the dropped fields are computed from again, if read
        self._pieces = self._contents = None
        self._canonical = self._text = None

    @property
    def contents(self) -> list[str]:
        """The prompt's text pieces: message contents, completion prompts, embedding inputs."""
        if self._contents is None:
            self._collect()
        assert self._contents is not None
        return self._contents

    @property
    def text(self) -> str:
        """The text pieces joined by newlines: what classification rules search."""
        if self._text is None:
            self._text = "\n".join(self.contents)
        return self._text

    @property
    def canonical(self) -> str:
        """The canonical prompt text the prefix index hashes ('' when there is none)."""
        if self._canonical is None:
            if self._pieces is None:
                self._collect()
            assert self._pieces is not None
            self._canonical = "".join(self._pieces)
        return self._canonical

    @property
    def prompt_tokens(self) -> int:
        """The one estimate of the prompt's tokens every stage uses."""
        if self._tokens is None:
            if self.route in _TOKENIZER_ONLY:
                self._tokens = 0
                return 0
            if self._pieces is None:
                self._collect()
            assert self._pieces is not None
            # Chat: roles and tools are prompt tokens too, so the canonical pieces count (a
            # media part among them as its marker); elsewhere the texts and the media parts.
            pieces = self._pieces if self.route in _RENDERED else self.contents
            chars = sum(map(len, pieces)) + self._media * self.media_chars
            self._tokens = math.ceil(chars / self.chars_per_token) + self.token_ids
        return self._tokens

    @property
    def token_ids(self) -> int:
        """Prompt tokens given directly as token ids (completions, embeddings, classify and
        pooling only)."""
        if self.route not in _ID_CARRIERS:
            return 0
        carrier = self.payload.get("prompt" if self.route == "completions" else "input")
        if isinstance(carrier, list) and carrier and not isinstance(carrier[0], str):
            return sum(len(p) if isinstance(p, list) else 1 for p in carrier)
        return 0


def prompt_text(payload: dict[str, Any]) -> str:
    """Canonical text of a chat or completions payload ('' when it has no prompt)."""
    route = "chat" if isinstance(payload.get("messages"), list) else "completions"
    return PromptView(route, payload, 4.0).canonical
