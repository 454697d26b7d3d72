"""Reading YAML files that people edit (gateway configs, routing policies): one loader that keeps
where every key was written, so an error can name the file, the line and column, the key path,
the reason and the offending value (secrets masked)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import yaml
from pydantic import BaseModel
from pydantic_core import ErrorDetails

Loc = tuple[str | int, ...]
# A key names a secret when its last word (split at `_`) is one of these: `api_key`,
# `sha256`, `cache_salt_secret`, `hf_token`, but not `tokens_per_minute` or `max_tokens`.
_SECRET_WORDS = frozenset(
    {"key", "secret", "password", "passwd", "token", "sha256", "credential", "credentials"}
)
_MAX_SHOWN = 60
# What stands for a secret in what is shown.
_MASK = "***"


class YamlSourceError(Exception):
    """The file cannot be read or is not valid YAML; `problems` are `where: reason` lines."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass(frozen=True, slots=True)
class YamlDocument:
    """A parsed YAML document and the position (1-based line, column) of every key and list
    item in it, by key path."""

    data: Any
    marks: dict[Loc, tuple[int, int]] = field(default_factory=dict)
    # Keys written twice in one mapping (YAML keeps the last): problems the reader reports
    # with those it finds in the values.
    duplicates: list[str] = field(default_factory=list)

    def where(self, loc: Sequence[str | int]) -> str:
        """`line L, column C: key.path` for the deepest part of `loc` that was written in the
        file (a missing key is reported where its parent is)."""
        path = key_path(loc)
        for end in range(len(loc), 0, -1):
            mark = self.marks.get(tuple(loc[:end]))
            if mark is not None:
                return f"line {mark[0]}, column {mark[1]}: {path}"
        return path


def key_path(loc: Sequence[str | int]) -> str:
    """`pools[0].endpoints[1].url` for ("pools", 0, "endpoints", 1, "url")."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


# Parts of a validation error's location that name no key: pydantic's validator steps, and the
# tags of the unions that read a value by its kind (e.g. a plugin's name or its mapping).
_STEP_PREFIXES = ("function-", "one-of:")


def error_loc(error: ErrorDetails) -> Loc:
    """The key path of a validation error."""
    return tuple(
        p for p in error["loc"] if not (isinstance(p, str) and p.startswith(_STEP_PREFIXES))
    )


def schema_problem(error: ErrorDetails, root: type[BaseModel]) -> tuple[Loc, str]:
    """A validation error of a file validated as `root`, as (key path, reason): an unknown key
    with the closest real key of the model that holds it ("did you mean"), other reasons with
    the offending value (secrets masked)."""
    loc = error_loc(error)
    if error["type"] == "extra_forbidden":
        holder = _model_holding(root, loc)
        close = difflib.get_close_matches(str(loc[-1]), list(holder.model_fields), n=1)
        return loc, "unknown key" + (f" (did you mean '{close[0]}'?)" if close else "")
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] != "missing" and "input" in error:
        message += f" (got {shown_value(loc, error['input'])})"
    return loc, message


def _model_holding(root: type[BaseModel], loc: Loc) -> type[BaseModel]:
    """The model whose field the last key of `loc` would be (`root` when the path leaves the
    models, e.g. into a free-form mapping)."""
    models = [root]
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        inner = [
            model
            for holder in models
            if (found := holder.model_fields.get(part)) is not None
            for model in _models_in(found.annotation)
        ]
        if not inner:
            return root
        models = inner
    return models[0]


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models a field's type annotation holds (in lists, unions, optionals)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in get_args(annotation) for model in _models_in(arg)]


def is_secret_name(name: str) -> bool:
    """Whether a config key names a secret (its value is never shown or served)."""
    return name.lower().rsplit("_", 1)[-1] in _SECRET_WORDS


def shown_value(loc: Sequence[str | int], value: Any) -> str:
    """The offending value for an error message: short, masked under a key that names a
    secret unless it is a number or a boolean (never a credential; `first_token: -1` is a
    timeout), and a URL's password and secret query parameters masked."""
    names = [p for p in loc if isinstance(p, str)]
    if names and is_secret_name(names[-1]) and not isinstance(value, int | float):
        return repr(_MASK)
    text = repr(without_credentials(value) if isinstance(value, str) else value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def without_credentials(text: str) -> str:
    """`text` with the password and secret-like query parameters of a URL masked."""
    if "://" not in text:
        return text
    try:
        parts = urlsplit(text)
        password = parts.password
    except ValueError:
        return _MASK
    if password is None and not parts.query:
        return text
    netloc = parts.netloc
    if password is not None:
        userinfo, _, host = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:{_MASK}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [(k, _MASK if _SECRET_NAME_PART.search(k) else v) for k, v in pairs], safe="*"
        )
    return urlunsplit(parts._replace(netloc=netloc, query=query))


# A URL query parameter holds a secret when its name holds one of these (`apikey`, `api-key`,
# `access_token`, `X-Amz-Signature`, `auth`, `sig`), in a URL shown or in free text.
_SECRET_WORD = "|".join(sorted(_SECRET_WORDS | {"auth", "sig"}))
_SECRET_NAME_PART = re.compile(_SECRET_WORD, re.IGNORECASE)
# In free text (a library's log line): a URL's password, and the value of a query parameter
# whose name holds a secret word, with or without the scheme and host around it.
_URL_PASSWORD = re.compile(r"(\b[a-zA-Z][\w+.-]*://[^/\s:@]+:)[^@\s/]+@")
_SECRET_PARAMETER = re.compile(
    rf"([?&][^=&\s]*(?:{_SECRET_WORD})[^=&\s]*=)[^&\s'\"]+", re.IGNORECASE
)


def redacted_text(text: str) -> str:
    """`text` with every URL password and secret-like query parameter in it masked."""
    if "://" not in text and "=" not in text:
        return text
    text = _URL_PASSWORD.sub(rf"\g<1>{_MASK}@", text)
    return _SECRET_PARAMETER.sub(rf"\g<1>{_MASK}", text)


def parse_yaml(text: str) -> YamlDocument:
    """Parse `text`; raises YamlSourceError naming the line and column of a syntax error. A key
    written twice is in the document's `duplicates`."""
    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
        reason = getattr(exc, "problem", None) or str(exc)
        raise YamlSourceError([f"{where}: invalid YAML: {reason}"]) from None
    marks: dict[Loc, tuple[int, int]] = {}
    duplicates: list[str] = []
    if root is not None:
        _walk(root, (), marks, duplicates)
    return YamlDocument(data, marks, duplicates)


def read_yaml(path: str | Path) -> YamlDocument:
    """Read and parse a YAML file; raises YamlSourceError when it cannot be read or parsed."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise YamlSourceError([f"(file): cannot read: {exc.strerror}"]) from None
    return parse_yaml(text)


def _walk(
    node: yaml.Node, loc: Loc, marks: dict[Loc, tuple[int, int]], duplicates: list[str]
) -> None:
    """Record where every key and item was written; a key written twice in one mapping (YAML
    keeps the last silently, so the first would be ignored without a word) is a problem."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value
            here = (*loc, key)
            mark = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            first = marks.get(here)
            if first is not None and key != "<<":
                duplicates.append(
                    f"line {mark[0]}, column {mark[1]}: {key_path(here)}: duplicate key (first"
                    f" written at line {first[0]}); YAML would keep only this one"
                )
            marks[here] = mark
            _walk(value_node, here, marks, duplicates)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            here = (*loc, i)
            marks[here] = (item.start_mark.line + 1, item.start_mark.column + 1)
            _walk(item, here, marks, duplicates)
