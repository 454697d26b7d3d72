"""The field order of vLLM's KV-cache events (`BlockStored`, `BlockRemoved`,
`AllBlocksCleared`): the array encoding carries the values in this order after the tag, the
map encoding names them. Shared by the simulator, which publishes events, and the gateway,
which decodes them."""

from __future__ import annotations

EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
