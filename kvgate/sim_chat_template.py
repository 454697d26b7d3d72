"""Render chat messages to one prompt string, the way a ChatML-style template does.

Each message becomes `<|im_start|>{role}\\n{content}<|im_end|>\\n`. The generation prompt
is `<|im_start|>assistant\\n`. Rendering with `continue_final_message=True` leaves the last
(assistant) message open, so

    render(messages + [{"role": "assistant", "content": partial}], continue_final_message=True)
    == render(messages, add_generation_prompt=True) + partial

which is what makes a continued answer reproduce the uninterrupted one exactly. A message's
text parts (`text`, and the Responses API's `input_text` and `output_text`) are joined with a
newline, as vLLM joins them for a template that takes string content. A Responses API request
becomes chat messages as vLLM builds them (`responses_messages`). Shared by the simulator and
the gateway's `kind: sim` tokenizer.
"""

from typing import Any

MESSAGE_START = "<|im_start|>"
MESSAGE_END = "<|im_end|>\n"
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})


class TemplateError(ValueError):
    """The messages cannot be rendered; the message is fit for a 400 answer about `param`."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


def message_text(content: Any) -> str:
    """Return the text of an OpenAI message `content` (a string, null, or a list of parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES:
                raise TemplateError("only text content parts are supported by the simulator")
            texts.append(str(part.get("text", "")))
        return "\n".join(texts)
    raise TemplateError("message content must be a string or a list of content parts")


def render_chat(
    messages: list[Any], *, add_generation_prompt: bool, continue_final_message: bool
) -> str:
    """Render `messages` to a prompt; raise TemplateError on malformed input.

    With `continue_final_message`, the last message must be from the assistant and is left
    open (no end marker) so generation continues it; `add_generation_prompt` must then be
    false, as vLLM requires.
    """
    return "".join(
        render_chat_parts(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
    )


def render_chat_parts(
    messages: list[Any], *, add_generation_prompt: bool, continue_final_message: bool
) -> list[str]:
    """`render_chat` as one string per message (and one for the generation prompt), joined
    to the prompt. Each starts with a special token after a newline, so the tokenizer never
    joins two parts into one token: tokenizing them one by one gives the prompt's tokens."""
    if not isinstance(messages, list) or not messages:
        raise TemplateError("messages must be a non-empty list")
    if continue_final_message and add_generation_prompt:
        raise TemplateError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    parts = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise TemplateError("each message must be an object with a string 'role'")
        text = message_text(message.get("content"))
        parts.append(f"{MESSAGE_START}{message['role']}\n{text}{MESSAGE_END}")
    if continue_final_message:
        if messages[-1]["role"] != "assistant":
            raise TemplateError("continue_final_message needs a final assistant message")
        parts[-1] = parts[-1].removesuffix(MESSAGE_END)
    elif add_generation_prompt:
        parts.append(f"{MESSAGE_START}assistant\n")
    return parts


def responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages a Responses API request's prompt is rendered from, as vLLM builds
    them (a stored conversation it continues aside): its `instructions`, when not empty, as the
    system message, then its `input`: a string as one user message, or each message item as
    `{"role", "content"}`, the content as given. Raises TemplateError naming the field for any
    other input. Tool calls and their outputs are refused too: each vLLM version turns those
    items into messages its own way."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise TemplateError("input must be a string or a non-empty array of messages", "input")
    for i, item in enumerate(given):
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("role"), str)
            or item.get("type", "message") != "message"
        ):
            raise TemplateError(f"input[{i}] must be a message with a role", "input")
        messages.append({"role": item["role"], "content": item.get("content")})
    return messages
