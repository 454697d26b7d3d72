"""Relaying a Responses API answer with the engine's response ids as the client's
(kvgate/routing/response_ids.py), whole or streamed.

The ids to rewrite are those the request named (the client already holds their form) and
those of the response object the answer carries: its `id` and the `previous_response_id` it
continues, both stored on the engine that answered. A whole answer is parsed once for them (a
Responses answer is a few kilobytes); a stream's events are searched, and the first one that
carries a response object (`response.created`) parsed, until they are known; events before it
carry none of them. From then on every occurrence of such an id (the object's `id`, and any
other place the exact string appears) is relayed in the client's form, except one already
followed by the suffix's mark: that is the client's form already (text the client sent,
echoed back).

The relay hands over whole SSE events (kvgate/upstream/sse.py completes each event before
releasing it, up to a stream's last; only what an engine sends after that comes as read), so
an id does not arrive split, and the events that carry a response object, all before or at
the last, are read whole. The rewriting does not rely on it: bytes at the end of one piece
that may be the start of an id, or an id whose mark may follow, are held back and joined to
the next piece, so an id that a read splits in two is rewritten all the same.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable
from typing import Any

import orjson

from kvgate.routing.response_ids import MARK, ResponseIds, client_id
from kvgate.upstream.sse import event_data, split_events

_MARK = MARK.encode()
# An event that carries a response object: `"response": {`.
_RESPONSE_OBJECT = re.compile(rb'"response"\s*:\s*\{')


class ResponseIdRewriter:
    """One attempt's rewriting, for the answer of the endpoint at `endpoint_url`."""

    __slots__ = ("_held", "_ids", "_known", "_learning", "_pattern", "_url")

    def __init__(self, ids: ResponseIds, endpoint_url: str) -> None:
        self._ids = ids
        self._url = endpoint_url
        self._known: dict[bytes, bytes] = {}
        self._pattern: re.Pattern[bytes] | None = None
        self._held = b""
        self._learning = True
        for engine_id, given in ids.named.items():
            self._add(engine_id, given)

    def body(self, body: bytes) -> tuple[bytes, Any]:
        """A whole answer (a response object), rewritten, and the answer as decoded (None
        when it is not JSON): its usage is read from that, not decoded again."""
        parsed = None
        with contextlib.suppress(orjson.JSONDecodeError):
            parsed = orjson.loads(body)
            self._learn(parsed)
        return self._rewritten(body, final=True)[0], parsed

    def events(self, chunk: bytes) -> bytes:
        """The next bytes of a stream, rewritten (some may be held back until the next)."""
        if self._learning and _RESPONSE_OBJECT.search(chunk) is not None:
            self._learn_events(chunk)
        out, self._held = self._rewritten(self._held + chunk, final=False)
        return out

    def flush(self) -> bytes:
        """What is held back at the end of a stream."""
        out, self._held = self._rewritten(self._held, final=True)
        return out

    def text(self, message: str) -> str:
        """An error message, rewritten."""
        return self._rewritten(message.encode(), final=True)[0].decode()

    def _add(self, engine_id: str, given: str) -> None:
        key = engine_id.encode()
        if key in self._known:
            return
        self._known[key] = given.encode()
        keys = sorted(self._known, key=len, reverse=True)
        self._pattern = re.compile(b"|".join(re.escape(k) for k in keys))

    def _learn(self, response: Any) -> None:
        """Take the ids of a response object."""
        if not isinstance(response, dict):
            return
        self._learning = False
        ids = self._ids
        for name in ("id", "previous_response_id"):
            engine_id = response.get(name)
            if isinstance(engine_id, str) and engine_id:
                given = ids.named.get(engine_id) or client_id(
                    engine_id, ids.tenant, self._url, ids.key
                )
                self._add(engine_id, given)

    def _learn_events(self, chunk: bytes) -> None:
        events, _ = split_events(chunk)
        for event in events:
            data = event_data(event)
            if data is None or _RESPONSE_OBJECT.search(data) is None:
                continue
            try:
                parsed = orjson.loads(data)
            except orjson.JSONDecodeError:
                continue
            if isinstance(parsed, dict):
                self._learn(parsed.get("response"))
            if not self._learning:
                return

    def _rewritten(self, data: bytes, final: bool) -> tuple[bytes, bytes]:
        """`data` with every known id that the mark does not follow in the client's form, and
        (unless `final`) the end that a next piece could complete, held back."""
        pattern = self._pattern
        if pattern is None:
            return data, b""
        parts: list[bytes] = []
        done = 0
        cut = len(data)
        for match in pattern.finditer(data):
            end = match.end()
            after = data[end : end + len(_MARK)]
            if after == _MARK:
                continue
            if not final and len(after) < len(_MARK) and _MARK.startswith(after):
                cut = match.start()  # the mark may follow in the next piece
                break
            parts += (data[done : match.start()], self._known[match.group()])
            done = end
        else:
            if not final:
                cut = len(data) - _split_tail(data, done, self._known)
        parts.append(data[done:cut])
        return b"".join(parts), data[cut:]


def _split_tail(data: bytes, start: int, keys: Iterable[bytes]) -> int:
    """The length of the longest end of `data[start:]` that is the start of a key (and not the
    whole key): what a read may have split off an id."""
    longest = 0
    for key in keys:
        first = key[:1]
        at = data.find(first, max(start, len(data) - len(key) + 1))
        while at >= 0:
            if key.startswith(data[at:]):
                longest = max(longest, len(data) - at)
                break
            at = data.find(first, at + 1)
    return longest
