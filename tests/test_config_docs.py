"""Every config key is documented: each field of every config section appears, in backquotes,
in the docs (docs/*.md, kvgate/policies/README.md)."""

from __future__ import annotations

import typing
from pathlib import Path

from pydantic import BaseModel

from kvgate.config import Config

ROOT = Path(__file__).resolve().parents[1]


def _models(model: type[BaseModel], seen: set[type[BaseModel]]) -> None:
    if model in seen:
        return
    seen.add(model)
    for field in model.model_fields.values():
        for candidate in (field.annotation, *typing.get_args(field.annotation)):
            for inner in (candidate, *typing.get_args(candidate)):
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    _models(inner, seen)


def config_keys() -> set[str]:
    models: set[type[BaseModel]] = set()
    _models(Config, models)
    return {field.alias or name for model in models for name, field in model.model_fields.items()}


def test_every_config_key_is_documented():
    docs = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    docs += (ROOT / "kvgate" / "policies" / "README.md").read_text()
    keys = config_keys()
    assert {"port", "panic_threshold", "prefill_tokens_per_second", "op_timeout"} <= keys
    assert sorted(k for k in keys if f"`{k}`" not in docs and f"{k}:" not in docs) == []
