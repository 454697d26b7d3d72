"""Shell-style patterns (`llama-*`, `gpt-?o`) as config uses them for model names and header
values: compiled once at load into one regular expression, matched case-sensitively."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

_NOTHING = "(?!)"


def compile_globs(patterns: Iterable[str]) -> re.Pattern[str]:
    """One regex whose `fullmatch` is true when a value matches any of `patterns` (none: never)."""
    alternatives = [f"(?:{fnmatch.translate(p)})" for p in patterns]
    return re.compile("|".join(alternatives) or _NOTHING)
