"""Typed gateway configuration, loaded from YAML in stages.

Stages: parse YAML → substitute `${ENV}` in strings → validate types (pydantic, unknown keys are
errors) → cross-check references. Every problem is reported as `file: key.path: reason`, all of
them at once, so `kvgate check-config` can print the full list. The running code never
re-validates: a `Config` object is correct by construction.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

EngineKind = Literal["vllm", "sglang", "openai"]
POLICY_NAMES = frozenset({"round_robin"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerConfig(_Strict):
    host: str = "0.0.0.0"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(10 * 1024 * 1024, gt=0)
    access_log: bool = True


class TimeoutsConfig(_Strict):
    """Seconds. `first_token` applies to streams only: a non-stream answer is one response."""

    connect: float = Field(5.0, gt=0)
    first_token: float = Field(60.0, gt=0)
    stall: float = Field(60.0, gt=0)
    total: float = Field(600.0, gt=0)


class UpstreamConfig(_Strict):
    max_connections: int = Field(1024, gt=0)
    max_keepalive_connections: int = Field(256, ge=0)
    keepalive_expiry: float = Field(30.0, gt=0)
    max_error_body_bytes: int = Field(64 * 1024, gt=0)


class HealthConfig(_Strict):
    interval: float = Field(5.0, gt=0)
    timeout: float = Field(2.0, gt=0)
    discovery_interval: float = Field(30.0, gt=0)


class EndpointConfig(_Strict):
    url: str
    api_key: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    max_inflight: int | None = Field(None, gt=0)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not re.fullmatch(r"https?://[^/\s]+(/[^\s]*)?", value):
            raise ValueError("must be an http:// or https:// URL")
        return value.rstrip("/")


class PoolConfig(_Strict):
    name: str = Field(min_length=1)
    engine: EngineKind = "vllm"
    models: list[str] = Field(default_factory=list)
    policy: str = "round_robin"
    endpoints: list[EndpointConfig] = Field(min_length=1)


class StateConfig(_Strict):
    backend: Literal["memory"] = "memory"


class Config(_Strict):
    server: ServerConfig = ServerConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    health: HealthConfig = HealthConfig()
    pools: list[PoolConfig] = Field(min_length=1)
    state: StateConfig = StateConfig()


class ConfigError(Exception):
    """One or more problems in a config file; `problems` lists `key.path: reason` lines."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__("\n".join(f"{source}: {p}" for p in problems))


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _key_path(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _substitute_env(node: Any, loc: tuple[str | int, ...], problems: list[str]) -> Any:
    if isinstance(node, dict):
        return {k: _substitute_env(v, (*loc, str(k)), problems) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute_env(v, (*loc, i), problems) for i, v in enumerate(node)]
    if isinstance(node, str) and "${" in node:
        def replace(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            value = os.environ.get(name, default)
            if value is None:
                problems.append(f"{_key_path(loc)}: environment variable {name} is not set")
                return ""
            return value

        return _ENV_REF.sub(replace, node)
    return node


def _model_at(loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The pydantic model that holds the key at `loc`, to suggest its real field names."""
    model: Any = Config
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            return None
        annotation = field.annotation
        args = getattr(annotation, "__args__", ())
        candidates = [annotation, *args]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)),
                     None)
        if model is None:
            return None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _describe(error: Any) -> str:
    loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    if error["type"] == "extra_forbidden":
        hint = ""
        holder = _model_at(loc)
        if holder is not None:
            close = difflib.get_close_matches(str(loc[-1]), list(holder.model_fields), n=1)
            if close:
                hint = f" (did you mean '{close[0]}'?)"
        return f"{_key_path(loc)}: unknown key{hint}"
    message = error["msg"].removeprefix("Value error, ")
    return f"{_key_path(loc)}: {message}"


def _cross_check(config: Config) -> list[str]:
    problems: list[str] = []
    seen_pools: set[str] = set()
    seen_urls: dict[str, str] = {}
    for i, pool in enumerate(config.pools):
        if pool.name in seen_pools:
            problems.append(f"pools[{i}].name: duplicate pool name '{pool.name}'")
        seen_pools.add(pool.name)
        if pool.policy not in POLICY_NAMES:
            problems.append(
                f"pools[{i}].policy: unknown policy '{pool.policy}' "
                f"(one of: {', '.join(sorted(POLICY_NAMES))})"
            )
        for j, endpoint in enumerate(pool.endpoints):
            where = f"pools[{i}].endpoints[{j}].url"
            if endpoint.url in seen_urls:
                first = seen_urls[endpoint.url]
                problems.append(f"{where}: duplicate endpoint, already in {first}")
            seen_urls[endpoint.url] = where
    return problems


def parse_config(data: Any, source: str = "<config>") -> Config:
    """Validate an already-parsed YAML/JSON tree. Raises ConfigError listing every problem."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, ["(top level): must be a mapping of keys to values"])
    problems: list[str] = []
    data = _substitute_env(data, (), problems)
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        problems.extend(_describe(e) for e in exc.errors())
        raise ConfigError(source, problems) from None
    problems.extend(_cross_check(config))
    if problems:
        raise ConfigError(source, problems)
    return config


def load_config(path: str | Path) -> Config:
    """Read, substitute, validate and cross-check a YAML config file."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(source, [f"(file): cannot read: {exc.strerror}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
        reason = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(source, [f"{where}: invalid YAML: {reason}"]) from None
    return parse_config(data, source)
