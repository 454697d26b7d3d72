"""Decoding vLLM's KV-cache event messages into small typed values.

A message on the engine's ZMQ PUB socket has three frames: the topic, the batch's sequence
number (8 bytes, big-endian) and a msgpack `EventBatch{ts, events, data_parallel_rank}`.
vLLM encodes with msgspec; older releases write structs as arrays with the event tag first
(`[ts, [["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium], ...], rank]`),
newer ones as maps with the tag under `type`. Both are accepted, with trailing fields a newer
release adds (`lora_name`, `extra_keys`, ...) ignored and trailing defaults msgspec omits
(`data_parallel_rank`, `lora_id`, `medium`) read as None.

Everything that is not a well-formed batch raises `KvEventDecodeError` and nothing else.
"""

from dataclasses import dataclass
from typing import Any

import msgpack

from kvgate.kv_event_fields import EVENT_FIELDS

BlockHash = int | bytes  # vLLM sends the low 64 bits as an int; some releases send bytes


class KvEventDecodeError(ValueError):
    """A frame or payload that is not a well-formed KV-event message."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks now cached: `block_hashes[i]` holds
    `token_ids[i * block_size : (i + 1) * block_size]`; the first block chains after
    `parent_block_hash` (None: the prompt's first block)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from `medium`."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine forgot every cached block (prefix cache reset)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published batch: wall-clock `ts` (seconds since the epoch) and its events."""

    ts: float
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class EventMessage:
    """The frames of one PUB message, not yet decoded."""

    topic: str
    seq: int
    payload: bytes


def split_message(frames: list[bytes]) -> EventMessage:
    """Split the three frames of a PUB message."""
    if len(frames) != 3:
        raise KvEventDecodeError(f"expected 3 frames, got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise KvEventDecodeError(f"sequence frame has {len(seq)} bytes, not 8")
    try:
        topic_text = topic.decode()
    except UnicodeDecodeError:
        raise KvEventDecodeError("topic is not UTF-8") from None
    return EventMessage(topic_text, int.from_bytes(seq, "big", signed=True), payload)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one msgpack `EventBatch` in either encoding."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise KvEventDecodeError(f"not msgpack: {error}") from None
    if isinstance(raw, list):
        if len(raw) < 2:
            raise KvEventDecodeError("batch array needs ts and events")
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        if "ts" not in raw or "events" not in raw:
            raise KvEventDecodeError("batch map needs ts and events")
        ts, events, rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    else:
        raise KvEventDecodeError(f"batch is a {type(raw).__name__}")
    if not _is_number(ts):
        raise KvEventDecodeError("ts is not a number")
    if not isinstance(events, list):
        raise KvEventDecodeError("events is not a list")
    if rank is not None and not _is_int(rank):
        raise KvEventDecodeError("data_parallel_rank is not an integer")
    return EventBatch(float(ts), tuple(_event(event) for event in events), rank)


_REQUIRED = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}


def _event(raw: Any) -> KvEvent:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag, values = raw[0], raw[1:]
        fields = EVENT_FIELDS.get(tag)
        if fields is None:
            raise KvEventDecodeError(f"unknown event type {tag!r}")
        if len(values) < _REQUIRED[tag]:
            raise KvEventDecodeError(f"{tag} array has {len(values)} fields")
        named = dict(zip(fields, values, strict=False))
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag, named = raw["type"], raw
        fields = EVENT_FIELDS.get(tag)
        if fields is None:
            raise KvEventDecodeError(f"unknown event type {tag!r}")
        missing = [name for name in fields[: _REQUIRED[tag]] if name not in named]
        if missing:
            raise KvEventDecodeError(f"{tag} lacks {missing}")
    else:
        raise KvEventDecodeError("event is neither a tagged array nor a map with a type")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    hashes = _hashes(named["block_hashes"])
    medium = _optional_str(named.get("medium"), "medium")
    if tag == "BlockRemoved":
        return BlockRemoved(hashes, medium)
    parent = named["parent_block_hash"]
    if parent is not None and not _is_hash(parent):
        raise KvEventDecodeError("parent_block_hash is not a hash")
    block_size, tokens, lora_id = named["block_size"], named["token_ids"], named.get("lora_id")
    if not _is_int(block_size) or block_size < 1:
        raise KvEventDecodeError("block_size is not a positive integer")
    if not isinstance(tokens, list) or not all(_is_int(token) for token in tokens):
        raise KvEventDecodeError("token_ids is not a list of integers")
    if len(tokens) != len(hashes) * block_size:
        raise KvEventDecodeError(
            f"{len(tokens)} token ids for {len(hashes)} blocks of {block_size}"
        )
    if lora_id is not None and not _is_int(lora_id):
        raise KvEventDecodeError("lora_id is not an integer")
    return BlockStored(hashes, parent, tuple(tokens), block_size, lora_id, medium)


def _hashes(raw: Any) -> tuple[BlockHash, ...]:
    if not isinstance(raw, list) or not all(_is_hash(value) for value in raw):
        raise KvEventDecodeError("block_hashes is not a list of hashes")
    return tuple(raw)


def _optional_str(raw: Any, name: str) -> str | None:
    if raw is not None and not isinstance(raw, str):
        raise KvEventDecodeError(f"{name} is not a string")
    return raw


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)


def _is_hash(value: Any) -> bool:
    return type(value) in (int, bytes)
