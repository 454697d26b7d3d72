"""Incremental server-sent-events scanner for relayed engine streams.

It changes no bytes but the usage the gateway asked for (below): it finds event boundaries so
the relay knows when the first event arrived, whether the stream ended with `[DONE]` (or a
Responses stream's last event) or an error event (vLLM's two shapes, and a Responses stream's
`error` event, which ends such a stream at OpenAI), and what usage the engine reported. Only
events that may carry usage, an error or the end of a Responses stream are JSON-parsed.

`feed` returns the bytes of the events it completed, so the relay forwards whole events only:
a stream that breaks mid-event never leaves half an event before the error event.

With `strip_usage` the usage-only event (`choices` empty, `usage` set: what
`stream_options.include_usage` adds before `[DONE]`) is read and left out of the returned
bytes, for clients that did not ask for it (the gateway did); an engine that puts the usage on
its last content event instead (some OpenAI-compatible servers) has that event's JSON
re-serialised without it. An error event is left out too, with everything after it: the relay
sends the client the error in OpenAI's shape instead, as the stream's last event (engines put
their own vocabulary in it, and vLLM a `[DONE]` after it).

An event may be large (a completions stream with `echo` and `logprobs` puts the whole prompt's
log-probabilities in its first event, hundreds of bytes a token): the bytes of an event still
arriving are kept as a list and joined once its end arrives, up to MAX_EVENT_BYTES.

Malformed events are detected cheaply, without parsing: a data payload other than `[DONE]`
must start with `{` and end with `}` (every engine sends one JSON object per event). A
truncated or garbage event fails that check and raises SseProtocolError before it is relayed.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from kvgate.upstream.answer_usage import in_chat_terms

_BOUNDARY = re.compile(rb"\r?\n\r?\n")
# Engines that send `"usage": null` on every chunk: nothing to read there.
_NULL_USAGE = re.compile(rb'"usage"\s*:\s*null')
# The largest event relayed (beyond it the stream is a protocol error): an echoed 100k-token
# prompt with top log-probabilities fits.
MAX_EVENT_BYTES = 64 * 2**20
# Where an event's end may straddle two reads: the last bytes of the one before are searched
# with the next for a blank line (LF LF, or CR LF CR LF; both contain one of these).
_ENDS = (b"\n\n", b"\n\r\n")
_RESPONSES_LAST_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
# Searched in an event that `_WORTH_READING` flags, before parsing it.
_RESPONSES_LAST_NAMES = tuple(f'"{name}"'.encode() for name in sorted(_RESPONSES_LAST_EVENTS))
# What an event may need reading for, in one search: "error" (a key, or vLLM's
# `"object": "error"`), a Responses stream's last event, or a usage that is not null. Content
# deltas, most of a stream, match none of it and are only counted; an event that matches gets
# the closer look below.
_WORTH_READING = re.compile(
    rb'"(?:error|'
    + b"|".join(re.escape(name.encode()) for name in sorted(_RESPONSES_LAST_EVENTS))
    + rb')"|"usage"\s*:\s*[^n\s]'
)


# What a Responses stream's `error` event says of its error (besides its `type` and
# `sequence_number`, which name the event).
_ERROR_FIELDS = ("message", "code", "param")


class SseProtocolError(Exception):
    """The upstream stream cannot be understood as server-sent events."""


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The complete events in `buffer` (without their blank-line ends) and the bytes after the
    last one (an event still arriving, or b"")."""
    # Engines end lines with LF; the regex (which also accepts CRLF) only runs when a CR is
    # present, as bytes.split is several times faster per chunk.
    events = _BOUNDARY.split(buffer) if b"\r" in buffer else buffer.split(b"\n\n")
    tail = events.pop()
    return events, tail


def event_data(event: bytes) -> bytes | None:
    """The data of one event, unstripped: its `data:` lines' values, joined; None for an event
    without a `data:` line (a ":" keep-alive, or only "event:"/"id:" fields)."""
    if event.startswith(b"data:") and b"\n" not in event:
        return event[5:]  # what engines send: one line per event
    lines = [line[5:] for line in event.splitlines() if line.startswith(b"data:")]
    return b"".join(lines) if lines else None


class SseScanner:
    """Feed raw chunks in arrival order; read `data_events`, `done`, `error`, `usage` and
    `model` (the model named by the event that carried the usage)."""

    __slots__ = (
        "_arriving",
        "_arriving_bytes",
        "data_events",
        "done",
        "error",
        "model",
        "strip_usage",
        "usage",
    )

    def __init__(self, strip_usage: bool = False) -> None:
        self.strip_usage = strip_usage
        # The bytes of an event whose end has not arrived yet, as read.
        self._arriving: list[bytes] = []
        self._arriving_bytes = 0
        self.data_events = 0
        self.done = False
        self.error: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None
        self.model: str | None = None

    @property
    def terminated(self) -> bool:
        """True once the stream ended properly: `[DONE]` or an error event."""
        return self.done or self.error is not None

    def feed(self, chunk: bytes) -> bytes:
        """Scan `chunk`; return the bytes of the events it completed (possibly b""; always
        after an error event)."""
        if self.error is not None:
            return b""
        arriving = self._arriving
        if arriving:
            edge = b"".join(arriving[-3:])[-3:] + chunk[:3]  # held parts may be 1 byte long
            if not any(end in chunk or end in edge for end in _ENDS):
                self._hold(chunk)
                return b""
            arriving.append(chunk)
            buffer = b"".join(arriving)
            arriving.clear()
            self._arriving_bytes = 0
        else:
            buffer = chunk
        events, tail = split_events(buffer)
        if tail:
            self._hold(tail)
        cut = len(buffer) - len(tail)
        changed: list[tuple[bytes, bytes]] = []
        for index, event in enumerate(events):
            instead = self._event(event)
            if self.error is not None:  # the error and what follows it are not relayed
                cut = _start_of(buffer, events, index)
                self._arriving.clear()
                self._arriving_bytes = 0
                break
            if instead is not None:
                changed.append((event, instead))
        out = buffer[:cut]
        for event, instead in changed:
            out = _replaced(out, event, instead)
        return out

    def _hold(self, part: bytes) -> None:
        """Keep `part` of an event still arriving."""
        self._arriving.append(part)
        self._arriving_bytes += len(part)
        if self._arriving_bytes > MAX_EVENT_BYTES:
            raise SseProtocolError(
                f"upstream sent an event larger than {MAX_EVENT_BYTES // 2**20} MiB"
            )

    def flush(self) -> bytes:
        """Bytes held back after the last complete event (relayed once the stream ended)."""
        tail = b"".join(self._arriving)
        self._arriving.clear()
        self._arriving_bytes = 0
        return tail

    def _event(self, event: bytes) -> bytes | None:
        """Read one event; None to relay it as it came, else the bytes to relay instead (b"":
        none, for a usage-only event the client did not ask for; the event without its usage,
        for a content event that carries it)."""
        data = event_data(event)
        if data is None:
            return None
        data = data.strip()
        if data == b"[DONE]":
            self.data_events += 1
            self.done = True
            return None
        if data[:1] != b"{" or data[-1:] != b"}":
            raise SseProtocolError("the engine sent a malformed event (not a JSON object)")
        if _WORTH_READING.search(data) is None:
            self.data_events += 1
            return None
        if any(name in data for name in _RESPONSES_LAST_NAMES):
            self._responses_event(data)
        readable = b'"error"' in data or (b'"usage"' in data and not _NULL_USAGE.search(data))
        parsed = self._inspect(data) if readable else None
        if parsed is not None and self.strip_usage and isinstance(parsed.get("usage"), dict):
            if not parsed.get("choices"):
                return b""
            self.data_events += 1
            del parsed["usage"]
            return event.replace(data, orjson.dumps(parsed), 1)
        self.data_events += 1
        return None

    def _responses_event(self, data: bytes) -> None:
        """OpenAI Responses streams have no `[DONE]`: their last event (`response.completed`,
        `.incomplete` or `.failed`) ends the stream, and carries the usage."""
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if not isinstance(parsed, dict) or parsed.get("type") not in _RESPONSES_LAST_EVENTS:
            return
        self.done = True
        response = parsed.get("response")
        if not isinstance(response, dict):
            return
        usage = response.get("usage")
        if isinstance(usage, dict):
            self.usage = in_chat_terms(usage)
            self.model = _model_of(response)

    def _inspect(self, data: bytes) -> dict[str, Any] | None:
        """Read an event that may carry an error or usage; the event's object, unless it is
        (or carries) an error or is not an object."""
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(parsed, dict):
            return None
        error = parsed.get("error")
        if isinstance(error, dict):
            self.error = error
        elif parsed.get("object") == "error":
            self.error = parsed
        elif parsed.get("type") == "error":  # a Responses stream's `error` event
            self.error = {key: parsed[key] for key in _ERROR_FIELDS if key in parsed}
        if self.error is not None:
            return None
        usage = parsed.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
            self.model = _model_of(parsed)
        return parsed


def _model_of(answer: dict[str, Any]) -> str | None:
    model = answer.get("model")
    return model if isinstance(model, str) else None


def _start_of(buffer: bytes, events: list[bytes], index: int) -> int:
    """Where `events[index]` starts in `buffer` (the events `split_events` found in it)."""
    position = 0
    for event in events[:index]:
        position = buffer.index(event, position) + len(event)
    return buffer.index(events[index], position)


def _replaced(out: bytes, event: bytes, instead: bytes) -> bytes:
    """`out` with `event` replaced by `instead`; b"": without it and the blank line that ends
    it."""
    start = out.rindex(event)
    end = start + len(event)
    if not instead:
        end += 4 if out[end : end + 2] == b"\r\n" else 2
    return out[:start] + instead + out[end:]
