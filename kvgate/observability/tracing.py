"""OpenTelemetry tracing of one app: built from `observability.tracing` and the standard OTEL_*
variables (docs/config.md, docs/observability.md).

Off (`exporter: none`, the default) `build_tracing` returns None: the chain then makes no trace
and nothing on the request path calls OpenTelemetry. On, requests are recorded as plain data
(kvgate/observability/request_trace.py) and each app (each worker process, each reload) starts
one exporter process (kvgate/observability/exporter_process.py) that builds the SDK spans and
runs the official exporters outside the gateway's GIL; stopping the app flushes it.

Settings: a key of `observability.tracing` in the config wins; a key left out falls back to
the standard OTEL_* variables, read when the app is built (see `build_tracing`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter

from kvgate import __version__
from kvgate.config import ConfigError, TracingConfig
from kvgate.observability.exporter_process import ExporterProcess
from kvgate.observability.request_trace import GatewayTracing
from kvgate.observability.span_records import TraceRecord, readable_spans, scope

_EXPORTERS = ("otlp", "console", "none")
_PROTOCOLS = ("http/protobuf", "grpc")


def build_tracing(
    config: TracingConfig,
    exporter: SpanExporter | None = None,
    on_dropped: Callable[[int], None] = lambda spans: None,
    on_restarted: Callable[[], None] = lambda: None,
) -> GatewayTracing | None:
    """The tracing of one app, or None when tracing is off.

    Exporters: `config.exporter`, else $OTEL_TRACES_EXPORTER (`otlp`, `console`, `none`, or a
    comma-separated list), else none; $OTEL_SDK_DISABLED=true turns tracing off regardless.
    OTLP: the protocol from $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / $OTEL_EXPORTER_OTLP_PROTOCOL
    (`http/protobuf`, the default, or `grpc`); the URL `config.endpoint`, else the exporter
    reads $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / $OTEL_EXPORTER_OTLP_ENDPOINT (and the other
    OTEL_EXPORTER_OTLP_* variables: headers, timeout, certificates). Sampling: always
    parent-based (a client's sampled flag is followed); of new traces the ratio
    `config.sample_ratio`, else $OTEL_TRACES_SAMPLER_ARG, else 1. Resource:
    $OTEL_RESOURCE_ATTRIBUTES and $OTEL_SERVICE_NAME, service name `kvgate` when neither
    names one.

    The configured exporters run in an exporter process (started by `GatewayTracing.open`,
    started again when it dies); `on_dropped` is told of spans dropped because it fell behind
    or died, `on_restarted` of each restart. `exporter`, when given,
    receives every request's spans in this process, in place of the configured exporters,
    as soon as the request ends (tests read spans in memory); it is unused when tracing is
    off. Raises ConfigError for an exporter or protocol kvgate does not support."""
    names = _exporter_names(config)
    if not names:
        return None
    ratio = _sample_ratio(config)
    resource = Resource.create({SERVICE_VERSION: __version__})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "kvgate"}))
    if exporter is not None:
        return GatewayTracing(InProcessExport(exporter, resource), ratio, resource)
    if "otlp" in names:
        _otlp_protocol()
    settings: dict[str, object] = {
        "exporters": names,
        "endpoint": config.endpoint,
        "resource": dict(resource.attributes),
        "schema_url": resource.schema_url,
        "version": __version__,
    }
    export = ExporterProcess(settings, on_dropped, on_restarted)
    return GatewayTracing(export, ratio, resource)


class InProcessExport:
    """Builds a request's spans and hands them to `exporter` at once, in this process (for
    tests and tools that read spans in memory; the gateway serves with ExporterProcess)."""

    def __init__(self, exporter: SpanExporter, resource: Resource) -> None:
        self.exporter = exporter
        self.resource = resource
        self._scope = scope(__version__)

    def send(self, record: TraceRecord) -> None:
        self.exporter.export(readable_spans(record, self.resource, self._scope))

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        self.exporter.shutdown()


def span_exporter(name: str, endpoint: str | None) -> SpanExporter:
    """The official exporter `name` (`otlp` or `console`); OTLP to `endpoint`, else to where
    the OTEL_EXPORTER_OTLP_* variables say."""
    if name == "console":
        return ConsoleSpanExporter()
    if _otlp_protocol() == "grpc":
        # Imported only when chosen: grpc is a heavy import the default path never needs.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint)


def _otlp_protocol() -> str:
    environ = os.environ
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol not in _PROTOCOLS:
        raise ConfigError(
            "$OTEL_EXPORTER_OTLP_PROTOCOL",
            [f"unsupported OTLP protocol {protocol!r}: kvgate sends http/protobuf or grpc"],
        )
    return protocol


def check_tracing_settings(config: TracingConfig) -> None:
    """Raise ConfigError for the settings `build_tracing` would refuse (an exporter, protocol
    or sampling ratio kvgate cannot use), before any app is built: `kvgate check-config`
    reports them, and `kvgate serve` refuses to start on them."""
    names = _exporter_names(config)
    if names:
        _sample_ratio(config)
        if "otlp" in names:
            _otlp_protocol()


def _exporter_names(config: TracingConfig) -> list[str]:
    environ = os.environ
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names: list[str]
    if config.exporter is not None:
        names = [config.exporter]
    else:
        wanted = environ.get("OTEL_TRACES_EXPORTER", "none")
        names = [n.strip().lower() for n in wanted.split(",") if n.strip()]
        unknown = [n for n in names if n not in _EXPORTERS]
        if unknown:
            raise ConfigError(
                "$OTEL_TRACES_EXPORTER",
                [f"unsupported trace exporter {unknown[0]!r}: kvgate exports otlp, console, none"],
            )
    return [n for n in dict.fromkeys(names) if n != "none"]


def _sample_ratio(config: TracingConfig) -> float:
    if config.sample_ratio is not None:
        return config.sample_ratio
    given = os.environ.get("OTEL_TRACES_SAMPLER_ARG")
    if given is None:
        return 1.0
    try:
        ratio = float(given)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(
            "$OTEL_TRACES_SAMPLER_ARG", [f"must be a number from 0 to 1 (got: {given!r})"]
        )
    return ratio
