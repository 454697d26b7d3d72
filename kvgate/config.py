"""Typed gateway configuration, loaded from YAML in stages.

Stages: parse YAML → substitute `${ENV}` in strings → validate types (pydantic, unknown keys are
errors) → cross-check references. Every problem is reported as `file: line L, column C:
key.path: reason (got: value)`, all of them at once, so `kvgate check-config` can print the full
list. Routing policy files named by pools are loaded by the routing package
(`kvgate.routing.policy_catalog`) from the same Config, where the app is assembled and in
`check-config`. The running code never re-validates: a `Config` object is correct by
construction.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from kvgate.chain.settings import (
    AdmissionConfig,
    AuthConfig,
    ClassificationConfig,
    TierConfig,
    cross_check_chain,
)
from kvgate.routing.settings import (
    EndpointKvEventsConfig,
    PoolKvEventsConfig,
    RoutingConfig,
    TokenizerConfig,
)
from kvgate.upstream.settings import ResilienceConfig
from kvgate.yaml_source import (
    Loc,
    YamlDocument,
    YamlSourceError,
    error_loc,
    key_path,
    read_yaml,
    schema_problem,
)

EngineKind = Literal["vllm", "sglang", "openai"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# An idle keep-alive connection is closed after this long. It must outlast the idle expiry of
# clients' connection pools (httpx and so the OpenAI SDK: 5 s; aiohttp: 15 s), so that the
# client always retires an idle connection first: with the server closing at the same moment
# a client reuses it, that request meets a reset connection (measured: 2 of 30 requests sent
# 5 s apart through httpx at a 5 s server timeout). 75 s is nginx's default.
KEEPALIVE_SECONDS = 75.0


class CorsConfig(_Strict):
    """Browsers' cross-origin requests (docs/config.md): `allow_origins` lists the origins
    (`scheme://host[:port]`, or `*` for any) whose pages may call the gateway."""

    allow_origins: list[str] = Field(min_length=1)
    allow_headers: list[str] = Field(default_factory=lambda: ["*"])
    max_age: int = Field(600, ge=0)

    @field_validator("allow_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        for origin in value:
            if origin != "*" and not re.fullmatch(r"https?://[^/\s*]+", origin):
                raise ValueError(
                    f"{origin!r} is not an origin: write scheme://host[:port] as the browser "
                    "sends it (no path, no trailing slash), or * for any"
                )
        return value


class ServerConfig(_Strict):
    # Loopback by default: a gateway without `auth:` is open, so serving the network is a
    # choice (`--host 0.0.0.0`, KVGATE_HOST; the container image sets it).
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(10 * 1024 * 1024, gt=0)
    # Seconds for a request's headers to arrive (the connection is closed after) and its whole
    # body (408 after), and for an idle keep-alive connection to be closed: slow or idle
    # clients hold no memory or socket for longer.
    body_timeout: float = Field(30.0, gt=0)
    header_timeout: float = Field(10.0, gt=0)
    # Bytes of a request's line and headers (Envoy's default limit is 60 KiB): a client sending
    # more gets 431 and its connection closed, before the headers fill the process's memory.
    max_header_bytes: int = Field(64 * 1024, ge=4096)
    keepalive_timeout: float = Field(KEEPALIVE_SECONDS, gt=0)
    access_log: bool = True
    # A second listener for /metrics and /admin/* only (then unknown on `port`).
    admin_port: int | None = Field(None, ge=0, le=65535)
    # GET /v1/models[/{id}] need a valid key (and list only the models the key may use).
    models_require_key: bool = False
    # SIGTERM: seconds requests in flight (long streams) may take to finish before they are cut.
    drain_seconds: float = Field(30.0, ge=0)
    # Cross-origin requests from browsers: none answered unless configured.
    cors: CorsConfig | None = None

    @model_validator(mode="after")
    def _two_ports(self) -> ServerConfig:
        if self.admin_port is not None and self.admin_port == self.port != 0:
            raise ValueError(
                f"admin_port {self.admin_port} is the port requests are served on; the admin "
                "listener needs a port of its own"
            )
        return self


class TierTimeouts(_Strict):
    """Overrides of `timeouts` for one tenant tier; unset keys keep the global value."""

    connect: float | None = Field(None, gt=0)
    first_token: float | None = Field(None, gt=0)
    stall: float | None = Field(None, gt=0)
    total: float | None = Field(None, gt=0)


class TimeoutsConfig(_Strict):
    """Seconds. `first_token` applies to streams only: a non-stream answer is one response.
    `tiers` maps a tier name to overrides (see docs/resilience.md)."""

    connect: float = Field(5.0, gt=0)
    first_token: float = Field(60.0, gt=0)
    stall: float = Field(60.0, gt=0)
    total: float = Field(600.0, gt=0)
    tiers: dict[str, TierTimeouts] = Field(default_factory=dict)


class UpstreamConfig(_Strict):
    max_connections: int = Field(1024, gt=0)
    max_keepalive_connections: int = Field(256, ge=0)
    # Below the engines' own idle timeout (vLLM's and SGLang's uvicorn close idle connections
    # after 5 s), so the gateway never sends on a connection the engine is closing: that
    # request would meet a reset, be retried and count against a healthy endpoint's breaker.
    keepalive_expiry: float = Field(4.0, gt=0)
    max_error_body_bytes: int = Field(64 * 1024, gt=0)


class HealthConfig(_Strict):
    """Active health checks (docs/resilience.md). Envoy's names and defaults: unhealthy after
    `unhealthy_threshold` failed probes in a row, healthy again after `healthy_threshold`
    good ones; a pool with fewer than `panic_threshold` of its endpoints healthy routes
    across all of them (0: never)."""

    interval: float = Field(5.0, gt=0)
    timeout: float = Field(2.0, gt=0)
    discovery_interval: float = Field(30.0, gt=0)
    unhealthy_threshold: int = Field(3, ge=1)
    healthy_threshold: int = Field(2, ge=1)
    panic_threshold: float = Field(0.5, ge=0, le=1)


class EndpointConfig(_Strict):
    url: str
    # Unset: `{pool}-{index}`. A name of the operator's keeps the endpoint's metric series,
    # headers and admin name when endpoints are added or removed before it.
    name: str | None = None
    api_key: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    max_inflight: int | None = Field(None, gt=0)
    # Where the engine publishes its KV-cache events (precise routing; docs/routing.md).
    kv_events: EndpointKvEventsConfig | None = None

    @field_validator("name")
    @classmethod
    def _header_safe_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}", value):
            raise ValueError(
                "1 to 64 letters, digits, '.', '_', ':' or '-', starting with a letter or digit "
                "(it goes into a response header, a metric label and an admin URL path)"
            )
        return value

    @field_validator("labels")
    @classmethod
    def _cost_label(cls, value: dict[str, str]) -> dict[str, str]:
        """`cost` is read as a number by the `endpoint_cost` scorer: one it cannot read would
        silently count as the default."""
        cost = value.get("cost")
        if cost is not None:
            try:
                number = float(cost)
            except ValueError:
                number = float("nan")
            if not 0 < number < float("inf"):
                raise ValueError(
                    "'cost' must be a positive number (the endpoint_cost scorer divides by it; "
                    "for an engine that costs next to nothing use a small one, e.g. 0.001)"
                )
        return value

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not re.fullmatch(r"https?://[^/\s]+(/[^\s]*)?", value):
            raise ValueError("must be an http:// or https:// URL")
        root = value.rstrip("/")
        if root.endswith("/v1"):
            raise ValueError(
                "must be the engine's root URL, without /v1 (kvgate adds the /v1/... path)"
            )
        return root


class PriceConfig(_Strict):
    """What a pool's work costs, in dollars, in one of two forms: per million tokens
    (`input_per_mtok`, `output_per_mtok`, and `cached_input_per_mtok`, which defaults to the
    input price), or per GPU-hour (`gpu_hour` x `gpus`) spread over the tokens the pool's
    engines process (docs/observability.md, Cost)."""

    input_per_mtok: float | None = Field(None, ge=0)
    cached_input_per_mtok: float | None = Field(None, ge=0)
    output_per_mtok: float | None = Field(None, ge=0)
    gpu_hour: float | None = Field(None, gt=0)
    gpus: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_form(self) -> PriceConfig:
        per_token = (self.input_per_mtok, self.cached_input_per_mtok, self.output_per_mtok)
        if self.gpu_hour is None:
            if self.gpus is not None:
                raise ValueError("gpus is given without gpu_hour")
            if self.input_per_mtok is None or self.output_per_mtok is None:
                raise ValueError(
                    "give input_per_mtok and output_per_mtok (cached_input_per_mtok is "
                    "optional), or gpu_hour and gpus"
                )
        elif any(price is not None for price in per_token):
            raise ValueError("give per-token prices or gpu_hour, not both")
        return self


class PoolConfig(_Strict):
    name: str = Field(min_length=1)
    engine: EngineKind = "vllm"
    models: list[str] = Field(default_factory=list)
    # A built-in policy name or the path of a policy YAML file (relative: to the config file).
    policy: str = "kvgate"
    endpoints: list[EndpointConfig] = Field(min_length=1)
    # Opt-in: a stream broken mid-way continues on another endpoint (docs/resilience.md).
    resume: bool = False
    # Whether the engines serve POST /v1/responses; unset: vLLM pools do, others do not.
    responses: bool | None = None
    # Unset: the pool's requests are counted as successes but cost nothing.
    price: PriceConfig | None = None
    # Precise prefix routing (docs/routing.md): every endpoint's KV events at an offset from its
    # HTTP port (an endpoint's own `kv_events` wins), and how to compute the engines' token ids.
    kv_events: PoolKvEventsConfig | None = None
    tokenizer: TokenizerConfig = TokenizerConfig()

    def endpoint_name(self, index: int) -> str:
        """The name of the pool's endpoint at `index`: its own, or `{pool}-{index}`."""
        return self.endpoints[index].name or f"{self.name}-{index}"

    def kv_events_of(self, endpoint: EndpointConfig) -> EndpointKvEventsConfig | None:
        """Where `endpoint` publishes its KV events (None: nowhere, approximate routing)."""
        if endpoint.kv_events is not None:
            return endpoint.kv_events
        return None if self.kv_events is None else self.kv_events.for_endpoint(endpoint.url)


class StateConfig(_Strict):
    """Where replicas share state. `memory`: this process only (the embedded default).
    `redis`: prefix-index deltas, load heartbeats and quotas shared through Redis at `url`
    (redis://, rediss:// or unix://); see docs/redis.md."""

    backend: Literal["memory", "redis"] = "memory"
    url: str | None = None
    key_prefix: str = Field("kvgate", min_length=1)
    op_timeout: float = Field(0.1, gt=0)
    heartbeat_interval: float = Field(0.5, gt=0)
    snapshot_interval: float = Field(10.0, gt=0)
    stream_maxlen: int = Field(100_000, gt=0)
    # Connections to Redis per process (plus one for the stream reader). By Little's law the
    # connections busy at once are calls per second x seconds per call: 1,000 quota calls/s
    # (one per request at one process's measured ceiling) x 25 ms (a call's p99.9 as the
    # gateway saw it on the shared 2-core test host) = 25, so even if every call were that
    # slow a process at its ceiling would not wait; 32 also covers the background loops.
    # When all are busy a call waits for one within op_timeout, then falls back.
    max_connections: int = Field(32, ge=1)
    # Seconds a connection may sit idle before it is closed (two are always kept).
    idle_timeout: float = Field(10.0, gt=0)

    @field_validator("url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not re.match(r"(rediss?|unix)://", value):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        # Imported here: only a Redis state backend needs the client library at load.
        from redis.asyncio import ConnectionPool

        try:  # what the URL's query asks of a connection is checked now, without connecting
            ConnectionPool.from_url(value).make_connection()
        except (TypeError, ValueError) as error:
            raise ValueError(f"redis cannot use this URL: {error}") from None
        return value


class TracingConfig(_Strict):
    """OpenTelemetry traces of requests (docs/observability.md). A key left out falls back to
    the standard OTEL_* environment variables, then to its default (`exporter`: none)."""

    exporter: Literal["otlp", "console", "none"] | None = None
    # The OTLP traces URL, used as given (http/protobuf: http://collector:4318/v1/traces).
    endpoint: str | None = None
    sample_ratio: float | None = Field(None, ge=0, le=1)

    @field_validator("endpoint")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"https?://", value):
            raise ValueError("must be an http:// or https:// URL")
        return value


class ObservabilityConfig(_Strict):
    """Metrics and traces settings (docs/observability.md)."""

    # Distinct tenant and model label values each process reports; more become `other`. 100
    # keeps the families labelled by tenant, model and pool to a few thousand series per
    # process even with several pools, which one Prometheus scrape handles easily.
    max_label_values: int = Field(100, ge=1)
    tracing: TracingConfig = TracingConfig()


class Config(_Strict):
    server: ServerConfig = ServerConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    health: HealthConfig = HealthConfig()
    pools: list[PoolConfig] = Field(min_length=1)
    routing: RoutingConfig = RoutingConfig()
    state: StateConfig = StateConfig()
    resilience: ResilienceConfig = ResilienceConfig()
    # Absent: open gateway with a loud startup warning (the minimal config must keep working);
    # `auth: none` says so explicitly; a mapping turns on API keys and tenants.
    auth: AuthConfig | None = None
    tiers: dict[str, TierConfig] = Field(default_factory=dict)
    classification: ClassificationConfig = ClassificationConfig()
    admission: AdmissionConfig = AdmissionConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    # Where the config came from: a file's path, or a name in angle brackets; relative policy
    # paths are resolved against a file's folder.
    _source: str = PrivateAttr(default="<config>")

    @property
    def source(self) -> str:
        return self._source

    @property
    def folder(self) -> Path | None:
        """The folder of the config file (None when the config did not come from a file)."""
        return None if self._source.startswith("<") else Path(self._source).parent


# `server` keys read when the process starts (its listeners, their timeouts, the drain): a
# reload cannot change them.
START_ONLY_SERVER_KEYS = (
    "host",
    "port",
    "admin_port",
    "header_timeout",
    "max_header_bytes",
    "keepalive_timeout",
    "drain_seconds",
)


def server_in_effect(config: Config) -> dict[str, Any]:
    """The start-only `server` values of `config`."""
    return {key: getattr(config.server, key) for key in START_ONLY_SERVER_KEYS}


def with_server_in_effect(config: Config, in_effect: dict[str, Any]) -> Config:
    """`config` with the start-only `server` values the process runs with (the file's when it
    started, or the flags and environment variables that overrode them)."""
    differ = {
        key: value for key, value in in_effect.items() if getattr(config.server, key) != value
    }
    if not differ:
        return config
    return config.model_copy(update={"server": config.server.model_copy(update=differ)})


class ConfigError(Exception):
    """One or more problems in a config file; `problems` lists `key.path: reason` lines.
    `parsed`: the config as read when every key was valid and only checks across sections
    failed (so that what it names, its policy files, can still be checked and reported)."""

    def __init__(self, source: str, problems: list[str], parsed: Config | None = None) -> None:
        self.source = source
        self.problems = problems
        self.parsed = parsed
        super().__init__("\n".join(f"{source}: {p}" for p in problems))


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _substitute_env(node: Any, loc: Loc, unset: dict[Loc, list[str]]) -> Any:
    """`node` with `${NAME}` references replaced; each value that names unset variables
    without a default is added to `unset` (its key path → the variables)."""
    if isinstance(node, dict):
        return {k: _substitute_env(v, (*loc, str(k)), unset) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute_env(v, (*loc, i), unset) for i, v in enumerate(node)]
    if isinstance(node, str) and "${" in node:

        def replace(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            value = os.environ.get(name, default)
            if value is None:
                unset.setdefault(loc, []).append(name)
                return ""
            return value

        return _ENV_REF.sub(replace, node)
    return node


def _describe(error: ErrorDetails, document: YamlDocument | None) -> str:
    loc, reason = schema_problem(error, Config)
    return f"{document.where(loc) if document is not None else key_path(loc)}: {reason}"


def _event_keys(pool: PoolConfig, endpoint: EndpointConfig, i: int, j: int) -> tuple[str, str]:
    """The config keys that set `endpoint`'s KV-event PUB and replay sockets: its own
    `kv_events`, or its pool's offsets."""
    if endpoint.kv_events is not None:
        own = f"pools[{i}].endpoints[{j}].kv_events"
        return f"{own}.url", f"{own}.replay_url"
    return f"pools[{i}].kv_events.port_offset", f"pools[{i}].kv_events.replay_port_offset"


def _event_socket_problems(
    pool: PoolConfig, i: int, j: int, seen: dict[str, str], replays: list[tuple[str, str, str]]
) -> list[str]:
    """An endpoint's KV-event sockets must be ports, and no two engines share one (one
    engine's events would be taken for another's). Its replay socket, which may be another
    engine's PUB socket, is added to `replays` (key, endpoint, URL) to be checked once every
    PUB socket is `seen`."""
    endpoint = pool.endpoints[j]
    events = pool.kv_events_of(endpoint)
    if events is None:
        return []
    who = f"pools[{i}].endpoints[{j}]"
    pub_key, replay_key = _event_keys(pool, endpoint, i, j)
    problems = []
    for key, url in ((pub_key, events.url), (replay_key, events.replay_url)):
        if url is None:
            continue
        if int(url.rsplit(":", 1)[1]) > 65535:
            problems.append(f"{key}: {who}'s KV-event socket {url} is past port 65535")
        host = urlsplit(url).hostname or ""
        if host in ("*", "0.0.0.0", "::"):
            problems.append(
                f"{key}: {url} is an address to bind (as vLLM's --kv-events-config gives "
                "it), not one to connect to: name the engine's host"
            )
    if events.replay_url is not None:
        if events.replay_url == events.url:
            problems.append(
                f"{replay_key}: {who}'s KV-event replay socket is its PUB socket ({events.url})"
            )
        replays.append((replay_key, who, events.replay_url))
    if events.url in seen:
        problems.append(
            f"{pub_key}: {who}'s KV events at {events.url} are also {seen[events.url]}'s "
            "(one engine's events would be taken for another's)"
        )
    seen[events.url] = who
    return problems


def _cross_check(sections: dict[str, Any]) -> list[str]:
    """Problems between the `sections` given (validated; a section whose values are not valid
    is left out, and so are the checks that need it)."""
    problems: list[str] = []
    state: StateConfig | None = sections.get("state")
    if state is not None and state.backend == "redis" and not state.url:
        problems.append("state.url: required when state.backend is 'redis'")
    pools: list[PoolConfig] = sections.get("pools") or []
    seen_pools: set[str] = set()
    seen_urls: dict[str, str] = {}
    seen_names: dict[str, str] = {}
    seen_event_urls: dict[str, str] = {}
    replays: list[tuple[str, str, str]] = []
    for i, pool in enumerate(pools):
        duplicate_pool = pool.name in seen_pools
        if duplicate_pool:
            problems.append(f"pools[{i}].name: duplicate pool name '{pool.name}'")
        seen_pools.add(pool.name)
        if pool.engine == "openai" and pool.price is not None and pool.price.gpu_hour is not None:
            problems.append(
                f"pools[{i}].price.gpu_hour: needs the engines' token counters, which only "
                "vllm and sglang pools have; give per-token prices"
            )
        for j, endpoint in enumerate(pool.endpoints):
            where = f"pools[{i}].endpoints[{j}].url"
            if endpoint.url in seen_urls:
                first = seen_urls[endpoint.url]
                problems.append(f"{where}: duplicate endpoint, already in {first}")
            seen_urls[endpoint.url] = where
            name = pool.endpoint_name(j)
            if name in seen_names and not duplicate_pool:
                problems.append(
                    f"pools[{i}].endpoints[{j}].name: endpoint name '{name}' is also "
                    f"{seen_names[name]}'s (names label metrics and headers; give one of them "
                    "a `name:` of its own)"
                )
            seen_names.setdefault(name, f"pools[{i}].endpoints[{j}]")
            problems.extend(_event_socket_problems(pool, i, j, seen_event_urls, replays))
        events = any(pool.kv_events_of(e) is not None for e in pool.endpoints)
        if events and pool.tokenizer.kind == "none":
            problems.append(
                f"pools[{i}].tokenizer: KV events need the engines' token ids: set kind "
                "'hf' or 'sim'"
            )
    for key, who, replay in replays:
        publisher = seen_event_urls.get(replay)
        if publisher is not None and publisher != who:
            problems.append(
                f"{key}: {who}'s KV-event replay socket {replay} is {publisher}'s PUB socket "
                "(a replay offset one above the PUB offset lands on the next engine's port)"
            )
    resilience: ResilienceConfig | None = sections.get("resilience")
    if resilience is not None:
        retries, breaker = resilience.retries, resilience.breaker
        if retries.backoff_cap < retries.backoff_base:
            problems.append("resilience.retries.backoff_cap: must be at least backoff_base")
        if breaker.max_ejection < breaker.base_ejection:
            problems.append("resilience.breaker.max_ejection: must be at least base_ejection")
    if "auth" in sections and "tiers" in sections:
        problems.extend(cross_check_chain(sections["auth"], sections["tiers"]))
    if "pools" in sections:
        problems.extend(_unlabelled_residencies(sections))
    return problems


def _unlabelled_residencies(sections: dict[str, Any]) -> list[str]:
    """A residency (a tenant's, or a classification rule's) naming a place no endpoint's label
    has: a typo, or a region not configured yet, whose requests would all be refused (503
    `no_eligible_endpoint`). Any label counts, as the jurisdiction filter may read another."""
    places = {
        value for pool in sections["pools"] for e in pool.endpoints for value in e.labels.values()
    }
    named: list[tuple[str, list[str]]] = []
    auth: AuthConfig | None = sections.get("auth")
    if auth is not None:
        named += [
            (f"auth.tenants[{i}].residency", tenant.residency)
            for i, tenant in enumerate(auth.tenants)
            if tenant.residency is not None
        ]
    classification: ClassificationConfig | None = sections.get("classification")
    if classification is not None:
        named += [
            (f"classification.rules[{i}].then.residency", rule.then.residency)
            for i, rule in enumerate(classification.rules)
            if rule.then.residency is not None
        ]
    return [
        f"{where}: no endpoint has a label '{place}' (set it on the endpoints of that "
        "jurisdiction, e.g. labels: {jurisdiction: " + place + "}); every request kept there "
        "would be refused"
        for where, residency in named
        for place in residency
        if place not in places
    ]


# The sections the checks between sections read.
_CROSS_CHECKED = ("state", "pools", "resilience", "auth", "tiers", "classification")


def _valid_sections(data: dict[str, Any], invalid: set[Any]) -> dict[str, Any]:
    """The cross-checked sections of `data` whose values are valid (none of `invalid`, the
    top-level keys with problems), each validated alone (its default when absent)."""
    fields = Config.model_fields
    sections: dict[str, Any] = {}
    for name in _CROSS_CHECKED:
        if name in invalid:
            continue
        field = fields[name]
        value = data[name] if name in data else field.get_default(call_default_factory=True)
        assert field.annotation is not None
        try:
            sections[name] = TypeAdapter(field.annotation).validate_python(value)
        except ValidationError:
            continue
    return sections


def parse_config(
    data: Any, source: str = "<config>", document: YamlDocument | None = None
) -> Config:
    """Validate an already-parsed YAML/JSON tree (`document`, when given, places errors on
    lines and names keys written twice). Raises ConfigError listing every problem: the file's
    keys and values, and those between the sections whose values are valid (duplicate names,
    unknown tiers, ...)."""
    problems: list[str] = list(document.duplicates) if document is not None else []
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, [*problems, "(top level): must be a mapping of keys to values"])
    unset: dict[Loc, list[str]] = {}
    data = _substitute_env(data, (), unset)
    problems.extend(
        f"{document.where(loc) if document is not None else key_path(loc)}: environment "
        f"variable {name} is not set"
        for loc, names in unset.items()
        for name in names
    )
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        # A value whose variable is unset is reported as such, not as the empty string it became.
        problems.extend(_describe(e, document) for e in errors if error_loc(e) not in unset)
        invalid = {e["loc"][0] for e in errors if e["loc"]}
        problems.extend(_cross_check(_valid_sections(data, invalid)))
        raise ConfigError(source, problems) from None
    config._source = source
    problems.extend(_cross_check({name: getattr(config, name) for name in _CROSS_CHECKED}))
    if problems:
        raise ConfigError(source, problems, config)
    return config


def load_config(path: str | Path) -> Config:
    """Read, substitute, validate and cross-check a YAML config file."""
    source = str(path)
    try:
        document = read_yaml(path)
    except YamlSourceError as exc:
        raise ConfigError(source, exc.problems) from None
    return parse_config(document.data, source, document)
