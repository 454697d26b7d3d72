"""Deterministic text generation: the next token is a function of the text so far.

Only a bounded tail of the text (the last `TAIL_CHARS` characters) and the seed decide the
next token and whether the sequence ends there, so the cost per token is O(1) and a request
that continues a partial answer (its prompt ends with the partial text) produces exactly the
tokens the uninterrupted request would have produced.
"""

import zlib

TAIL_CHARS = 48

# Generated words are at most six ASCII letters and carry their leading space, so each one
# is exactly one token for kvgate.sim_tokenizer and re-tokenizing the output is stable.
_WORD_LIST = (
    "the of and to in is was for that with as on by at from his her they this are "
    "which be or had not but have one were all when there an their been has more if "
    "will would who so no she other its time into than only new some could these two "
    "may first then do any like my now over such our man me even most made after also "
    "did many off before must well back years where much your way down should since "
    "long each just state people both those three world still own see men work under "
    "last never day same us life while might great old year good house cache "
    "token block prefix model engine queue router batch decode kernel tensor memory "
    "signal vector matrix portal stream packet server client socket thread graph "
    "river stone forest cloud winter summer light shadow garden silver orange market"
)
_VOCABULARY = tuple(f" {word}" for word in _WORD_LIST.split())
# Hash bits decide the token kind: 1/16 of tokens end a sentence, 1/16 are commas, and a
# sentence end also ends the sequence 1 time in 4, so unbounded answers average ~64 tokens.
_KIND_MASK = 15
_SENTENCE_END = "."
_END_MASK = 3


class TextGenerator:
    """Next-token function of a seed; instances are immutable and shareable."""

    def __init__(self, seed: int) -> None:
        self._seed_prefix = f"{seed}\x00".encode()

    def next_token(self, tail: str) -> tuple[str, bool]:
        """Return `(token, ends_sequence)` for a text whose last characters are `tail`.

        Only `tail[-TAIL_CHARS:]` matters. `ends_sequence` is the end-of-sequence decision
        made after emitting `token` (it is only ever true after a sentence end).
        """
        digest = zlib.crc32(self._seed_prefix + tail[-TAIL_CHARS:].encode())
        kind = digest & _KIND_MASK
        if kind == 0:
            return _SENTENCE_END, (digest >> 8) & _END_MASK == 0
        if kind == 1:
            return ",", False
        return _VOCABULARY[(digest >> 4) % len(_VOCABULARY)], False
