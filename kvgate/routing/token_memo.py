"""Token ids of text pieces a tokenizer has seen, so that a conversation's earlier turns and a
shared system prompt are tokenized once, not on every request that repeats them.

Both prompt tokenizers cut a rendered chat into pieces no token spans (the simulator's: its
messages; a Hugging Face tokenizer's: the text between special tokens) and look each piece
up here first. Bounded by the ids held; the least recently used pieces go first. Safe to share
between threads: a lookup and a store each hold a lock, the encoding between them does not.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable


class TokenMemo:
    """Ids by piece text, at most about `max_tokens` ids held (always the newest piece)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def ids(self, piece: str, encode: Callable[[str], list[int]]) -> list[int]:
        """`encode(piece)`, remembered."""
        pieces = self._pieces
        with self._lock:
            ids = pieces.get(piece)
            if ids is not None:
                pieces.move_to_end(piece)
                return ids
        ids = encode(piece)
        with self._lock:
            if piece not in pieces:
                pieces[piece] = ids
                self._held += len(ids)
            while self._held > self.max_tokens and len(pieces) > 1:
                self._held -= len(pieces.popitem(last=False)[1])
        return ids

    def __len__(self) -> int:
        return len(self._pieces)
