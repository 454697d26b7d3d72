"""A deterministic, regex-based tokenizer that behaves like a BPE tokenizer where it matters.

Token boundaries follow words, digits, punctuation and whitespace (long words are split
every six letters, a leading space sticks to the word after it), so they do not fall on
fixed character offsets, and English text averages about four characters per token.
Concatenating the tokens of a text gives the text back exactly.

Shared by the simulator (what its engines see) and the gateway (a pool's `tokenizer: {kind:
sim}`, which reproduces the ids the engines publish in their KV events).
"""

import re
import zlib
from collections.abc import Sequence

# Alternatives are tried in order at each position; together they match every character.
_TOKEN_PATTERN = re.compile(
    r" ?[A-Za-z]{1,6}"  # a word, or a six-letter piece of a long one
    r"| ?[0-9]{1,3}"  # numbers in groups of up to three digits
    r"|<\|[a-z_]+\|>"  # chat-template markers are single special tokens
    r"| ?[^\w\s]"  # one punctuation mark
    r"|[^\S ]+"  # a run of newlines or tabs
    r"| +"  # a run of spaces not followed by a word
    r"|\w"  # any other letter or digit (non-ASCII scripts), one per token
)


def tokenize(text: str) -> list[str]:
    """Split `text` into tokens; `"".join(tokenize(text)) == text` always holds."""
    return _TOKEN_PATTERN.findall(text)


def count_tokens(text: str) -> int:
    """Return `len(tokenize(text))`."""
    return len(_TOKEN_PATTERN.findall(text))


def token_ids(tokens: Sequence[str]) -> list[int]:
    """Integer ids of `tokens`: the CRC-32 of each token's UTF-8 text.

    The simulator has no vocabulary; a fixed function of the text gives every process (the
    engine's KV events, a gateway reproducing the engine's tokens) the same ids.
    """
    return [zlib.crc32(token.encode()) for token in tokens]
