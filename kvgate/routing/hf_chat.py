"""What vLLM hands a Hugging Face chat template: the messages and tools of a request as its
chat parser rewrites them, so that the gateway renders the prompt the engine renders.

- **Content.** vLLM reads a message's content as parts (a string is one text part). A template
  that loops over `message['content']` (detected from its syntax tree, as vLLM detects it) gets
  `[{"type": "text", "text": ...}, ...]`; any other template gets the texts joined with a
  newline. `text`, `input_text`, `output_text`, `refusal` and `thinking` parts carry text;
  a media part makes the request irreproducible here (the model's processor expands it into
  placeholder tokens), so it is routed on the approximate index.
- **Messages.** Each keeps its role, its `name`, an assistant's `tool_calls` (their JSON
  `arguments` parsed into objects, as vLLM does before rendering) and reasoning, a tool
  message's `tool_call_id`.
- **Tools.** Each as vLLM's request model dumps it: `type`, then `function` with `name`,
  `description` and `parameters` (null when absent), then any other keys as sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import jinja2.nodes

from kvgate.sim_chat_template import TEXT_PART_TYPES

ContentFormat = Literal["string", "openai"]
# Part type → the key holding its text.
_TEXT_KEYS = {
    **dict.fromkeys(TEXT_PART_TYPES, "text"),
    "refusal": "refusal",
    "thinking": "thinking",
}
_ASSISTANT_KEYS = ("tool_calls", "reasoning", "reasoning_content")


def _reads(node: jinja2.nodes.Node, names: set[str], key: str | None = None) -> bool:
    """Whether `node` reads one of `names` (or its `key` item or attribute), through filters,
    tests and slices."""
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
        return node.node is not None and _reads(node.node, names, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, names, key)
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.name in names
    if isinstance(node, jinja2.nodes.Getitem):
        item = node.arg
        is_key = isinstance(item, jinja2.nodes.Const) and item.value == key
        return is_key and _reads(node.node, names)
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == key and _reads(node.node, names)
    return False


def _names_for(tree: jinja2.nodes.Template, name: str) -> set[str]:
    """`name` and every variable assigned from it (or from one of those)."""
    names = {name}
    grew = True
    while grew:
        grew = False
        for assign in tree.find_all(jinja2.nodes.Assign):
            target = assign.target
            if not isinstance(target, jinja2.nodes.Name) or target.name in names:
                continue
            if _reads(assign.node, names):
                names.add(target.name)
                grew = True
    return names


def _loop_targets(tree: jinja2.nodes.Template, names: set[str], key: str | None) -> Iterator[str]:
    for loop in tree.find_all(jinja2.nodes.For):
        if isinstance(loop.target, jinja2.nodes.Name) and _reads(loop.iter, names, key):
            yield loop.target.name


def content_format(tree: jinja2.nodes.Template) -> ContentFormat:
    """`openai` when the template loops over a message's content, else `string`."""
    messages = set(_loop_targets(tree, _names_for(tree, "messages"), None))
    return "openai" if any(_loop_targets(tree, messages, "content")) else "string"


def _texts(content: Any) -> list[str] | None:
    """A message content's texts (None: a media part or an unknown one)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        key = _TEXT_KEYS.get(str(part.get("type"))) if isinstance(part, dict) else None
        if key is None:
            return None
        text = part.get(key)
        if isinstance(text, str):
            texts.append(text)
        elif text is not None:
            return None
    return texts


def _tool_calls(calls: Any) -> list[Any] | None:
    """The calls with their JSON `arguments` as objects (an empty one as `{}`)."""
    if not isinstance(calls, list):
        return None
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            return None
        arguments = function.get("arguments")
        if not arguments:
            arguments = {}
        elif isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return parsed


def template_messages(messages: Any, form: ContentFormat) -> list[dict[str, Any]] | None:
    """`messages` as vLLM passes them to the template (None: not reproducible here)."""
    if not isinstance(messages, list):
        return None
    rendered = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        texts = _texts(message.get("content")) if isinstance(role, str) else None
        if texts is None:
            return None
        content: Any = (
            "\n".join(texts) if form == "string" else [{"type": "text", "text": t} for t in texts]
        )
        out: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            for key in _ASSISTANT_KEYS:
                value = message.get(key)
                if value is None:
                    continue
                if key == "tool_calls":
                    value = _tool_calls(value)
                    if value is None:
                        return None
                out[key] = value
        elif role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        rendered.append(out)
    return rendered


def template_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Chat completions `tools` as vLLM's request model dumps them (None when absent, and
    when malformed: the engine refuses those requests, wherever they are routed)."""
    if not isinstance(tools, list):
        return None
    dumped = []
    for tool in tools:
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            return None
        function = tool["function"]
        dumped.append(
            {
                "type": tool.get("type", "function"),
                "function": {
                    "name": function.get("name"),
                    "description": function.get("description"),
                    "parameters": function.get("parameters"),
                    **function,
                },
                **{key: value for key, value in tool.items() if key not in ("type", "function")},
            }
        )
    return dumped
