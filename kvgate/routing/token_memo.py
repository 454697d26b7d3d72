"""Token ids of text pieces a tokenizer has seen, so that a conversation's earlier turns and a
shared system prompt are tokenized once, not on every request that repeats them.

Both prompt tokenizers cut a rendered chat into pieces no token spans (the simulator's: its
messages; a Hugging Face tokenizer's: the text between special tokens) and look each piece
up here first, the ones it lacks encoded together in one call. Bounded by the ids held; the
least recently used pieces go first. Safe to share between threads: the lookups and the stores
hold a lock, the encoding between them does not.

Ids are kept as tuples: a tuple of ints is taken out of the garbage collector's tracking at its
first collection, where a list stays tracked and every full collection walks each of its ids
(about 16 ms for a full memo of a million ids on a 2-core VM, a pause for every request in
flight; 1 ms with tuples).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

# Token ids a tokenizer remembers (least recently used dropped first): a shared system prompt
# or the earlier turns of a conversation are tokenized once. At the bound: ≈ 40 MB with a
# Hugging Face tokenizer (measured with tracemalloc, docs/routing.md); about 12 MB with the
# simulator's, whose ids are shared objects (estimated: references and text).
MEMO_TOKENS = 1_000_000


class TokenMemo:
    """Ids by piece text, at most about `max_tokens` ids held (always the newest piece)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def ids_of(
        self, pieces: Sequence[str], encode: Callable[[list[str]], list[list[int]]]
    ) -> list[tuple[int, ...]]:
        """The ids of each of `pieces`: those remembered looked up, the others encoded in one
        call, `encode(missing)` (one id list per text, in order), and remembered."""
        remembered = self._pieces
        with self._lock:
            found = [remembered.get(piece) for piece in pieces]
            for piece, ids in zip(pieces, found, strict=True):
                if ids is not None:
                    remembered.move_to_end(piece)
        missing = list(
            dict.fromkeys(p for p, ids in zip(pieces, found, strict=True) if ids is None)
        )
        if not missing:
            return found  # type: ignore[return-value]  # every piece was remembered
        encoded = dict(zip(missing, map(tuple, encode(missing)), strict=True))
        with self._lock:
            for piece, ids in encoded.items():
                if piece not in remembered:
                    remembered[piece] = ids
                    self._held += len(ids)
            while self._held > self.max_tokens and len(remembered) > 1:
                self._held -= len(remembered.popitem(last=False)[1])
        return [
            ids if ids is not None else encoded[p] for p, ids in zip(pieces, found, strict=True)
        ]

    def __len__(self) -> int:
        return len(self._pieces)
