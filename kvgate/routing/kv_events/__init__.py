"""KV-cache events from the engines (vLLM's ZMQ publisher): decoding and subscribing.

`KvEventSubscriber` keeps one endpoint's `KvEventSink` in step with the engine's cache and
reports whether that view is exact (`precise`) or not (`approximate`, with a reason).
"""

from .decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventMessage,
    KvEvent,
    KvEventDecodeError,
    decode_batch,
    split_message,
)
from .replay import fetch_replay
from .subscriber import (
    APPROXIMATE,
    PRECISE,
    KvEventSink,
    KvEventSubscriber,
    Mode,
    SubscriberCounters,
)

__all__ = [
    "APPROXIMATE",
    "PRECISE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventMessage",
    "KvEvent",
    "KvEventDecodeError",
    "KvEventSink",
    "KvEventSubscriber",
    "Mode",
    "SubscriberCounters",
    "decode_batch",
    "fetch_replay",
    "split_message",
]
