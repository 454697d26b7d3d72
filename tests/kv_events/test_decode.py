"""Decoding KV-event messages from byte fixtures of the exact frame layout.

The fixtures were produced once with msgpack (as msgspec writes them: float64 timestamps,
the smallest integer encodings) and are checked here against the simulator's encoder, so
both sides are pinned to the same bytes.
"""

import contextlib
import random

import msgpack
import pytest

from kvgate.routing.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventDecodeError,
    decode_batch,
    split_message,
)
from kvgate.sim.kv_event_wire import (
    all_blocks_cleared,
    block_removed,
    block_stored,
    encode_batch,
    sequence_bytes,
)

TOPIC_FRAME = bytes.fromhex("6b762d6576656e7473")  # "kv-events"
SEQ_FRAME = bytes.fromhex("0000000000000005")  # 5

# [1700000000.5, [["BlockStored", [0x1122334455667788, 42], 7, [1, 2, 3, 4, 500, 600, 70000,
#  8], 4, None, "GPU"], ["BlockRemoved", [42], "GPU"], ["AllBlocksCleared"]], 0]
ARRAY_PAYLOAD = bytes.fromhex(
    "93cb41d954fc402000009397ab426c6f636b53746f72656492cf11223344556677882a0798010203"
    "04cd01f4cd0258ce000111700804c0a347505593ac426c6f636b52656d6f766564912aa347505591"
    "b0416c6c426c6f636b73436c656172656400"
)
# The same batch as maps: {"ts", "events": [{"type": "BlockStored", "block_hashes", ...}, ...],
#  "data_parallel_rank"}
MAP_PAYLOAD = bytes.fromhex(
    "83a27473cb41d954fc40200000a66576656e74739387a474797065ab426c6f636b53746f726564ac"
    "626c6f636b5f68617368657392cf11223344556677882ab1706172656e745f626c6f636b5f686173"
    "6807a9746f6b656e5f6964739801020304cd01f4cd0258ce0001117008aa626c6f636b5f73697a65"
    "04a76c6f72615f6964c0a66d656469756da347505583a474797065ac426c6f636b52656d6f766564"
    "ac626c6f636b5f686173686573912aa66d656469756da347505581a474797065b0416c6c426c6f63"
    "6b73436c6561726564b2646174615f706172616c6c656c5f72616e6b00"
)
# A newer release's array: bytes hashes, trailing lora_name and extra_keys, the batch's
# data_parallel_rank omitted (msgspec's omit_defaults drops a trailing default):
# [1.25, [["BlockStored", [b"\x01" * 8], None, [1, 2], 2, None, "GPU", "adapter", [["salt"]]]]]
NEWER_ARRAY_PAYLOAD = bytes.fromhex(
    "92cb3ff40000000000009199ab426c6f636b53746f72656491c4080101010101010101c092010202"
    "c0a3475055a7616461707465729191a473616c74"
)

EXPECTED = EventBatch(
    ts=1700000000.5,
    events=(
        BlockStored(
            block_hashes=(0x1122334455667788, 42),
            parent_block_hash=7,
            token_ids=(1, 2, 3, 4, 500, 600, 70000, 8),
            block_size=4,
            lora_id=None,
            medium="GPU",
        ),
        BlockRemoved(block_hashes=(42,), medium="GPU"),
        AllBlocksCleared(),
    ),
    data_parallel_rank=0,
)


def _fixture_events() -> list:
    return [
        block_stored([0x1122334455667788, 42], 7, [1, 2, 3, 4, 500, 600, 70000, 8], 4),
        block_removed([42]),
        all_blocks_cleared(),
    ]


@pytest.mark.parametrize("payload", [ARRAY_PAYLOAD, MAP_PAYLOAD], ids=["array", "map"])
def test_both_encodings_decode_from_the_frames(payload: bytes):
    message = split_message([TOPIC_FRAME, SEQ_FRAME, payload])
    assert (message.topic, message.seq) == ("kv-events", 5)
    assert decode_batch(message.payload) == EXPECTED


def test_newer_array_fields_are_ignored_and_omitted_defaults_read_as_none():
    assert decode_batch(NEWER_ARRAY_PAYLOAD) == EventBatch(
        ts=1.25,
        events=(BlockStored((b"\x01" * 8,), None, (1, 2), 2, None, "GPU"),),
        data_parallel_rank=None,
    )


def test_the_simulator_writes_the_fixture_bytes():
    assert encode_batch(1700000000.5, _fixture_events(), "array") == ARRAY_PAYLOAD
    assert encode_batch(1700000000.5, _fixture_events(), "map") == MAP_PAYLOAD
    assert sequence_bytes(5) == SEQ_FRAME
    assert sequence_bytes(-1) == b"\xff" * 8


def _pack(value: object) -> bytes:
    return msgpack.packb(value)


MALFORMED_PAYLOADS = {
    "empty": b"",
    "reserved byte": b"\xc1",
    "truncated": ARRAY_PAYLOAD[:-1],
    "trailing bytes": ARRAY_PAYLOAD + b"\x00",
    "invalid utf-8": b"\xa2\xff\xfe",
    "integer batch": _pack(5),
    "short batch": _pack([1.0]),
    "map without events": _pack({"ts": 1.0}),
    "string ts": _pack(["now", [], 0]),
    "events not a list": _pack([1.0, {}, 0]),
    "bool rank": _pack([1.0, [], True]),
    "unknown event": _pack([1.0, [["BlockMoved", [1]]], 0]),
    "untagged event": _pack([1.0, [[[1], None, [1, 2], 2]], 0]),
    "map event without type": _pack([1.0, [{"block_hashes": [1]}], 0]),
    "map event missing field": _pack([1.0, [{"type": "BlockStored", "block_hashes": [1]}], 0]),
    "short stored": _pack([1.0, [["BlockStored", [1], None, [1, 2]]], 0]),
    "token count": _pack([1.0, [["BlockStored", [1], None, [1, 2, 3], 2, None, "GPU"]], 0]),
    "bool token": _pack([1.0, [["BlockStored", [1], None, [1, True], 2, None, "GPU"]], 0]),
    "string hash": _pack([1.0, [["BlockRemoved", ["a"], "GPU"]], 0]),
    "zero block size": _pack([1.0, [["BlockStored", [], None, [], 0, None, "GPU"]], 0]),
    "float parent": _pack([1.0, [["BlockStored", [1], 1.5, [1, 2], 2, None, "GPU"]], 0]),
    "string lora": _pack([1.0, [["BlockStored", [1], None, [1, 2], 2, "x", "GPU"]], 0]),
    "int medium": _pack([1.0, [["BlockRemoved", [1], 3]], 0]),
    "deep nesting": b"\x91" * 5000,
}


@pytest.mark.parametrize("payload", MALFORMED_PAYLOADS.values(), ids=MALFORMED_PAYLOADS.keys())
def test_malformed_payloads_raise_the_decode_error(payload: bytes):
    with pytest.raises(KvEventDecodeError):
        decode_batch(payload)


@pytest.mark.parametrize(
    "frames",
    [
        [TOPIC_FRAME, ARRAY_PAYLOAD],
        [TOPIC_FRAME, SEQ_FRAME, ARRAY_PAYLOAD, b""],
        [TOPIC_FRAME, b"\x05", ARRAY_PAYLOAD],
        [b"\xff", SEQ_FRAME, ARRAY_PAYLOAD],
    ],
    ids=["two frames", "four frames", "short sequence", "binary topic"],
)
def test_malformed_frames_raise_the_decode_error(frames: list[bytes]):
    with pytest.raises(KvEventDecodeError):
        split_message(frames)


def test_damaged_bytes_decode_or_raise_only_the_decode_error():
    rng = random.Random(15)
    for payload in (ARRAY_PAYLOAD, MAP_PAYLOAD, NEWER_ARRAY_PAYLOAD):
        for length in range(len(payload)):
            with pytest.raises(KvEventDecodeError):
                decode_batch(payload[:length])
        for _ in range(2000):
            damaged = bytearray(payload)
            for _ in range(rng.randint(1, 3)):
                damaged[rng.randrange(len(damaged))] = rng.randrange(256)
            with contextlib.suppress(KvEventDecodeError):
                decode_batch(bytes(damaged))
