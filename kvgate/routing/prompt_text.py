"""The canonical prompt text of a request: what the prefix index hashes.

It is not the engine's chat template (the gateway does not know it); it only has to be
deterministic and prefix-preserving: a conversation extended by more messages renders to text
that starts with the shorter conversation's text, so multi-turn sessions share their prefix.
Tools come first because templates put them in the system prompt.
"""

from __future__ import annotations

from typing import Any

import orjson

_MESSAGE_END = "\x1e"  # record separator: cannot be confused with message text boundaries


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, dict):
                continue
            if isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part.get("image_url"), dict):
                parts.append(str(part["image_url"].get("url", "")))
        return "".join(parts)
    return ""


def prompt_text(payload: dict[str, Any]) -> str:
    """Canonical text of a chat or completions payload ('' when it has no prompt)."""
    messages = payload.get("messages")
    if isinstance(messages, list):
        pieces: list[str] = []
        tools = payload.get("tools")
        if tools:
            pieces.append(orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode())
            pieces.append(_MESSAGE_END)
        for message in messages:
            if isinstance(message, dict):
                pieces.append(str(message.get("role", "")))
                pieces.append("\n")
                pieces.append(_content_text(message.get("content")))
                pieces.append(_MESSAGE_END)
        return "".join(pieces)
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first  # a batch of prompts: the first one decides the route
        if isinstance(first, int):
            return " ".join(map(str, prompt))  # token ids: same ids, same prefix
    return ""
