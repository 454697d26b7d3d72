"""The shape of chat `messages`, checked at ingress as OpenAI checks it, before any other work.

    role        a non-empty string: OpenAI's system | developer | user | assistant | tool |
                function, or any other role the model's chat template knows (vLLM passes
                custom roles such as `ipython` or `document` to the template as they are)
    content     a string, or a non-empty array of typed parts (objects with a string `type`;
                `text` parts carry a string `text`, `image_url` parts an object with a string
                `url`, `refusal` parts a string `refusal`); other part types pass through for
                the engine to judge (vLLM adds several), and so does a media part without a
                `type` that carries one of vLLM's media keys (`image_url`, `video_url`, …:
                vLLM takes the type from the key)
    null        of OpenAI's roles, content may be null or absent only on an assistant message
                with `tool_calls` or `function_call`, and on a `function` message; a custom
                role's message may go without (its template decides)
    tool        a `tool` message needs a string `tool_call_id`
    name        a string when present; `tool_calls` an array of objects when present

Every violation is a 400 whose `param` names the path (`messages[0].content`); fields not
listed here pass through untouched.
"""

from __future__ import annotations

from typing import Any

from kvgate.errors import InvalidRequest

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# Part types whose payload kvgate knows: type → (key, expected type of its value).
_PART_FIELDS: dict[str, tuple[str, type]] = {
    "text": ("text", str),
    "image_url": ("image_url", dict),
    "refusal": ("refusal", str),
    "input_audio": ("input_audio", dict),
    "file": ("file", dict),
}


# Keys from which vLLM infers the type of a content part sent without one.
_TYPELESS_MEDIA_KEYS = (
    "image_url",
    "image_embeds",
    "audio_embeds",
    "audio_url",
    "input_audio",
    "video_url",
)


def _invalid(path: str, message: str, code: str = "invalid_type") -> InvalidRequest:
    return InvalidRequest(f"{path}: {message}", param=path, code=code)


def _may_omit_content(message: dict[str, Any]) -> bool:
    role = message["role"]
    if role == "function" or role not in ROLES:
        return True
    return role == "assistant" and (
        message.get("tool_calls") is not None or message.get("function_call") is not None
    )


def _check_part(part: Any, path: str) -> None:
    if not isinstance(part, dict):
        raise _invalid(path, "a content part must be an object")
    kind = part.get("type")
    if kind is None and any(part.get(key) is not None for key in _TYPELESS_MEDIA_KEYS):
        return  # a media part whose type vLLM takes from its key
    if not isinstance(kind, str):
        raise _invalid(f"{path}.type", "a content part needs a string 'type'")
    known = _PART_FIELDS.get(kind)
    if known is None:
        return
    key, expected = known
    if not isinstance(part.get(key), expected):
        what = "a string" if expected is str else "an object"
        raise _invalid(f"{path}.{key}", f"a '{kind}' part needs '{key}' as {what}")
    if kind == "image_url" and not isinstance(part["image_url"].get("url"), str):
        raise _invalid(f"{path}.image_url.url", "an 'image_url' part needs a string 'url'")


def _check_content(message: dict[str, Any], path: str) -> None:
    content = message.get("content")
    if content is None:
        if not _may_omit_content(message):
            raise _invalid(
                path,
                f"a '{message['role']}' message needs content",
                code="missing_required_parameter",
            )
        return
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _invalid(path, "content must be a string or a non-empty array of content parts")
    if not content:
        if _may_omit_content(message):
            return  # no parts: as no content, which this message may have
        raise _invalid(
            path,
            "content must be a string or a non-empty array of content parts",
            code="invalid_value",
        )
    for i, part in enumerate(content):
        _check_part(part, f"{path}[{i}]")


def check_message(message: Any, path: str) -> None:
    """One chat message at `path` (`messages[3]`); raises InvalidRequest naming the field."""
    if not isinstance(message, dict):
        raise _invalid(path, "a message must be an object")
    role = message.get("role")
    if role is None:
        raise _invalid(f"{path}.role", "'role' is required", code="missing_required_parameter")
    if not isinstance(role, str):
        raise _invalid(f"{path}.role", "'role' must be a string")
    if not role:
        raise _invalid(f"{path}.role", "'role' must not be empty", code="invalid_value")
    _check_content(message, f"{path}.content")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise _invalid(f"{path}.name", "'name' must be a string")
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise _invalid(
            f"{path}.tool_call_id",
            "a 'tool' message needs a string 'tool_call_id'",
            code="missing_required_parameter",
        )
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and not (
        isinstance(tool_calls, list) and all(isinstance(c, dict) for c in tool_calls)
    ):
        raise _invalid(f"{path}.tool_calls", "'tool_calls' must be an array of objects")
