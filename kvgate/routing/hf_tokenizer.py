"""A Hugging Face tokenizer directory as a pool's `PromptTokenizer` (`tokenizer: {kind: hf}`).

Read from a local directory (no model hub): `tokenizer.json` (the `tokenizers` library) and
the chat template — `chat_template` in `tokenizer_config.json` (a string, or a list of named
templates of which `default` is used) or a `chat_template.jinja` file beside it. The template
is rendered as `transformers` renders it (a sandboxed jinja2 environment with `trim_blocks`,
`lstrip_blocks`, loop controls, `tojson` and `raise_exception`), with `bos_token` and
`eos_token` from the config. As vLLM does, a rendered chat is encoded without adding special
tokens (the template writes them) and a completion prompt with them.

A rendered chat is encoded piece by piece, the pieces cut at the tokenizer's special tokens,
each piece's ids remembered (`TokenMemo`): the `tokenizers` library itself splits the text at
its added tokens and encodes what lies between them one split at a time, so the same pieces
give the same ids, and a conversation's earlier turns and a shared system prompt cost a
lookup rather than a pass. Some tokenizers treat the first split differently (a `Metaspace`
pre-tokenizer with `prepend_scheme: first`, as Llama 2 and Mistral's have); so at load the
pieces must give the ids of the whole on probe chats, else every chat is encoded whole.

The encoding runs on one worker thread per gateway process (kvgate/routing/precise.py), and
`tokenizers` would spread each batch over every core besides: on a gateway whose cores serve
its event loops, those threads take the CPU the loop needs (a 1 ms timer on the loop fired up
to 7.6 ms late with them, about 1 ms without; benchmarks/RESULTS.md). So loading a tokenizer
sets `TOKENIZERS_PARALLELISM=false` unless the environment already says otherwise.

Needs the `hf` extra (`pip install 'kvgate[hf]'`: `tokenizers` and `jinja2`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from kvgate.routing.hf_chat import ContentFormat, content_format, template_messages, template_tools
from kvgate.routing.token_memo import MEMO_TOKENS, TokenMemo
from kvgate.sim_chat_template import TemplateError, responses_messages

log = logging.getLogger("kvgate.routing")

# `tokenizers`' switch for encoding a batch on every core (module docstring).
PARALLELISM = "TOKENIZERS_PARALLELISM"
# What the probes that decide piecewise encoding put between special tokens: leading and
# trailing spaces, blank lines, digits, punctuation, accents and a word split across lines.
_PROBE_TEXTS = (
    "You are a terse assistant.",
    " Hello  world\n\nHow are you today?",
    "Fine, thanks: 1 2 3, 4.5%!",
    "  ünïcödé\ttabs\n  and trailing spaces  ",
)


# Template arguments a request's `chat_template_kwargs` may not set: vLLM refuses the first two,
# and the messages are the request's own.
_RESERVED_ARGUMENTS = frozenset({"chat_template", "tokenize", "messages", "conversation"})


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' `tojson` filter for chat templates."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _token_text(value: Any) -> str:
    """A special token in tokenizer_config.json: a string or `{"content": ...}`."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


class HfTokenizer:
    """The ids a vLLM engine serving the model at `path` computes for a request."""

    off_loop = True  # `tokenizers` encodes without the GIL

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: str | None,
        special: dict[str, str],
        memo_tokens: int = MEMO_TOKENS,
    ):
        self._tokenizer = tokenizer
        self._special = special
        # Shared with a worker thread: precise routing encodes there (kvgate/routing/precise.py).
        self._memo = TokenMemo(memo_tokens)
        self._special_ids: dict[str, int] = {}
        self._pieces: re.Pattern[str] | None = None
        self._template: jinja2.Template | None = None
        self._content_format: ContentFormat = "string"
        if template is not None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(template)
            self._content_format = content_format(env.parse(template))
        specials = {
            token.content: token_id
            for token_id, token in tokenizer.get_added_tokens_decoder().items()
            if token.special
            and not (token.normalized or token.lstrip or token.rstrip or token.single_word)
        }
        if specials:
            longest_first = sorted(specials, key=len, reverse=True)
            self._special_ids = specials
            self._pieces = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")
            if not all(self._piecewise_matches(text) for text in self._probes()):
                self._pieces = None

    @property
    def piecewise(self) -> bool:
        """Whether chats are encoded piece by piece (the probes at load agreed)."""
        return self._pieces is not None

    def _probes(self) -> list[str]:
        """Texts the pieces must encode as the whole does: the probe texts around every
        special token, and probe chats rendered by the template (when it renders them)."""
        specials = list(self._special_ids)
        texts = ["".join(f"{special}{text}" for special in specials) for text in _PROBE_TEXTS]
        texts.append("".join(f"{text}{special}" for text in _PROBE_TEXTS for special in specials))
        roles = ("system", "user", "assistant", "user")
        messages = [
            {"role": role, "content": text} for role, text in zip(roles, _PROBE_TEXTS, strict=True)
        ]
        for chat in (messages, messages[1:]):
            rendered = self.render_chat({"messages": chat})
            if rendered is not None:
                texts.append(rendered)
        return texts

    def _piecewise_matches(self, text: str) -> bool:
        whole = self._encode([text])[0]
        return self._piecewise_ids(text, TokenMemo(0)) == whole

    def _piecewise_ids(self, text: str, memo: TokenMemo) -> list[int]:
        assert self._pieces is not None
        split = self._pieces.split(text)  # text, special, text, ..., text
        texts = [piece for piece in split[::2] if piece]
        encoded = iter(memo.ids_of(texts, self._encode))
        ids: list[int] = []
        special_ids = self._special_ids
        for index, piece in enumerate(split):
            if index % 2:
                ids.append(special_ids[piece])
            elif piece:
                ids += next(encoded)
        return ids

    def _encode(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Each text's ids. `encode_batch`, not `encode`: it lets go of the GIL while it
        works, so the event loop runs on while a worker thread encodes."""
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    @classmethod
    def load(cls, path: Path) -> HfTokenizer:
        """Load the directory; ValueError naming what is missing or broken."""
        os.environ.setdefault(PARALLELISM, "false")
        try:
            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as error:  # the library raises plain Exception subclasses
            raise ValueError(f"cannot load {path / 'tokenizer.json'}: {error}") from None
        config: dict[str, Any] = {}
        config_file = path / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except (OSError, ValueError) as error:
                raise ValueError(f"cannot read {config_file}: {error}") from None
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if not isinstance(template, str):
            log.warning(
                "tokenizer %s has no chat template (tokenizer_config.json's chat_template or "
                "chat_template.jinja): chat and Responses requests are routed approximately, "
                "completions precisely",
                path,
            )
        try:
            return cls(
                tokenizer,
                template if isinstance(template, str) else None,
                {
                    "bos_token": _token_text(config.get("bos_token")),
                    "eos_token": _token_text(config.get("eos_token")),
                },
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"the chat template of {path} does not compile: {error}") from None

    def prompt_ids(self, route: str, payload: dict[str, Any]) -> list[int] | None:
        if route in ("chat", "responses"):
            text = self.render_chat(payload) if route == "chat" else self._render_responses(payload)
            if text is None:
                return None
            if self._pieces is not None:
                return self._piecewise_ids(text, self._memo)
            return self._encode([text])[0]
        if route == "completions":
            prompt = payload.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, str):
                return self._encode([prompt], add_special_tokens=True)[0]
            if isinstance(prompt, list) and all(type(t) is int for t in prompt):
                return prompt  # token ids given directly reach the engine as they are
        return None

    def _render_responses(self, payload: dict[str, Any]) -> str | None:
        """A Responses API request rendered from the messages vLLM builds of it. With `tools`
        it is not reproduced: vLLM versions convert that request's tools differently."""
        if payload.get("tools"):
            return None
        try:
            messages = responses_messages(payload)
        except TemplateError:
            return None
        return self.render_chat({"messages": messages})

    def render_chat(self, payload: dict[str, Any]) -> str | None:
        """The chat template applied to the payload's messages and tools as vLLM applies it
        (kvgate/routing/hf_chat.py), with the request's `documents` and
        `chat_template_kwargs` (None: no template, a request the engine refuses, or one this
        gateway cannot reproduce)."""
        if self._template is None:
            return None
        messages = template_messages(payload.get("messages"), self._content_format)
        if not messages:
            return None
        continued = bool(payload.get("continue_final_message", False))
        arguments: dict[str, Any] = {
            "add_generation_prompt": not continued
            and bool(payload.get("add_generation_prompt", True)),
            "continue_final_message": continued,
            "tools": template_tools(payload.get("tools")),
            "documents": payload.get("documents"),
            **self._special,
        }
        extra = payload.get("chat_template_kwargs")
        if isinstance(extra, dict):
            if _RESERVED_ARGUMENTS.intersection(extra):
                return None
            arguments.update(extra)
        try:
            text = self._template.render(messages=messages, **arguments)
        except (jinja2.TemplateError, TypeError, ValueError):
            return None
        if continued:
            # As transformers does: cut after the final message's content, leaving it open.
            final = messages[-1]["content"]
            if isinstance(final, list):
                final = final[-1]["text"] if final else ""
            final = final.strip()
            if not final or final not in text:
                return None
            text = text[: text.rindex(final) + len(final)]
        return text
