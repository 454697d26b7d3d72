"""The token ids a pool's engines will see for a request: what precise routing keys blocks by.

A pool's `tokenizer:` picks the implementation: `sim` (the simulator's tokenizer and
ChatML template, `kvgate/sim_tokenizer.py`), `hf` (a Hugging Face tokenizer directory,
`kvgate/routing/hf_tokenizer.py`, needs the `hf` extra) or `none` (no ids: the pool routes on
the approximate index only). A tokenizer answers None for a request it cannot reproduce
(an unknown message shape, a template error, a route without a prompt): that request is
routed approximately.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any, Protocol

from kvgate.config import Config, ConfigError
from kvgate.routing.settings import TokenizerConfig
from kvgate.routing.token_memo import MEMO_TOKENS, TokenMemo
from kvgate.sim_chat_template import TemplateError, render_chat_parts, responses_messages
from kvgate.sim_tokenizer import tokenize

# Distinct token texts whose ids the sim tokenizer remembers (a token's id is the CRC-32 of
# its text; a dict lookup is a third of the call). Cleared when full: a bound, not an LRU.
_SIM_VOCABULARY = 200_000


class PromptTokenizer(Protocol):
    # Whether its encoding releases the GIL, so that a worker thread takes it off the event
    # loop (a Hugging Face tokenizer); a pure-Python one would only add the thread hop.
    off_loop: bool

    def prompt_ids(self, route: str, payload: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as the engine will see them (the chat template applied
        for `chat`, and for `responses` to the messages the engine builds from the request),
        or None when this request cannot be reproduced."""
        ...


class SimTokenizer:
    """The simulator's tokenizer and template: ids equal to those its KV events carry.

    A chat is tokenized message by message (`render_chat_parts`: no token spans two
    messages), each rendered message's ids remembered, so only new messages cost a pass."""

    off_loop = False

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._messages = TokenMemo(MEMO_TOKENS)

    def prompt_ids(self, route: str, payload: dict[str, Any]) -> list[int] | None:
        if route in ("chat", "responses"):
            try:
                if route == "chat":
                    parts = render_chat_parts(
                        payload.get("messages") or [],
                        add_generation_prompt=bool(payload.get("add_generation_prompt", True)),
                        continue_final_message=bool(payload.get("continue_final_message", False)),
                    )
                else:
                    parts = render_chat_parts(
                        responses_messages(payload),
                        add_generation_prompt=True,
                        continue_final_message=False,
                    )
            except TemplateError:
                return None
            ids: list[int] = []
            for part_ids in self._messages.ids_of(parts, self._encode):
                ids += part_ids
            return ids
        if route == "completions":
            prompt = payload.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if not isinstance(prompt, str):
                return None
            return self._token_ids(tokenize(prompt))
        return None

    def _encode(self, parts: list[str]) -> list[list[int]]:
        return [self._token_ids(tokenize(part)) for part in parts]

    def _token_ids(self, tokens: list[str]) -> list[int]:
        ids = self._ids
        if len(ids) > _SIM_VOCABULARY:
            ids.clear()
        for token in set(tokens).difference(ids):
            ids[token] = zlib.crc32(token.encode())
        return list(map(ids.__getitem__, tokens))


def build_tokenizer(config: TokenizerConfig, folder: Path | None) -> PromptTokenizer | None:
    """The pool's tokenizer (None for `kind: none`); a relative `path` is read from `folder`
    (the config file's). Raises ValueError when an `hf` directory cannot be loaded."""
    if config.kind == "sim":
        return SimTokenizer()
    if config.kind == "hf":
        try:  # the optional `hf` extra
            from kvgate.routing.hf_tokenizer import HfTokenizer
        except ImportError as error:
            hint = "kind 'hf' needs the hf extra (pip install 'kvgate[hf]')"
            raise ValueError(f"{hint}: {error}") from None

        assert config.path is not None
        path = Path(config.path)
        if not path.is_absolute() and folder is not None:
            path = folder / path
        return HfTokenizer.load(path)
    return None


def load_tokenizers(config: Config) -> dict[str, PromptTokenizer]:
    """Every pool's tokenizer, by pool name (pools with `kind: none` have none); ConfigError
    lists every pool whose tokenizer cannot be loaded (also run by `kvgate check-config`)."""
    tokenizers: dict[str, PromptTokenizer] = {}
    problems: list[str] = []
    for i, pool in enumerate(config.pools):
        try:
            tokenizer = build_tokenizer(pool.tokenizer, config.folder)
        except ValueError as error:
            problems.append(f"pools[{i}].tokenizer: {error}")
            continue
        if tokenizer is not None:
            tokenizers[pool.name] = tokenizer
    if problems:
        raise ConfigError(config.source, problems)
    return tokenizers
