"""vLLM's KV-event wire format, as the simulator emits it.

A batch is msgpack of `EventBatch{ts, events, data_parallel_rank}`. vLLM encodes it with
msgspec; older releases use `array_like=True` structs with the event tag first, newer ones
maps with the tag under `type`:

    array: [ts, [["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium],
                 ["BlockRemoved", hashes, medium], ["AllBlocksCleared"]], dp_rank]
    map:   {"ts": ts, "events": [{"type": "BlockStored", "block_hashes": ..., ...}, ...],
            "data_parallel_rank": dp_rank}

Each message on the PUB socket is three frames: topic, the batch's sequence number as 8
big-endian bytes, the payload.
"""

from typing import Any, Literal

import msgpack

from kvgate.kv_event_fields import EVENT_FIELDS

KvEventEncoding = Literal["array", "map"]
KV_EVENT_ENCODINGS: tuple[KvEventEncoding, ...] = ("array", "map")
MEDIUM = "GPU"

Event = list[Any]  # the array form; the map form is built from it at encoding time


def block_stored(
    block_hashes: list[int], parent: int | None, token_ids: list[int], block_size: int
) -> Event:
    """A `BlockStored` event (no LoRA, GPU medium)."""
    return ["BlockStored", block_hashes, parent, token_ids, block_size, None, MEDIUM]


def block_removed(block_hashes: list[int]) -> Event:
    """A `BlockRemoved` event (GPU medium)."""
    return ["BlockRemoved", block_hashes, MEDIUM]


def all_blocks_cleared() -> Event:
    """An `AllBlocksCleared` event."""
    return ["AllBlocksCleared"]


def encode_batch(
    ts: float, events: list[Event], encoding: KvEventEncoding, data_parallel_rank: int = 0
) -> bytes:
    """The msgpack payload of one batch in `encoding`."""
    if encoding == "array":
        return msgpack.packb([ts, events, data_parallel_rank])
    mapped = [
        {"type": event[0], **dict(zip(EVENT_FIELDS[event[0]], event[1:], strict=True))}
        for event in events
    ]
    return msgpack.packb({"ts": ts, "events": mapped, "data_parallel_rank": data_parallel_rank})


def sequence_bytes(seq: int) -> bytes:
    """A sequence number as its frame: 8 bytes, big-endian, signed (the end marker is -1)."""
    return seq.to_bytes(8, "big", signed=True)
