"""OpenTelemetry tracing of one app: built from `observability.tracing` and the standard OTEL_*
variables (docs/config.md, docs/observability.md).

Off (`exporter: none`, the default) `build_tracing` returns None: the chain then makes no trace
and nothing on the request path calls OpenTelemetry. On, each app (each worker process, each
reload) has its own TracerProvider, batching spans to the exporter in a background thread, and
flushes it when the app shuts down. The spans themselves: kvgate/observability/request_trace.py.

Settings: a key of `observability.tracing` in the config wins; a key left out falls back to
the standard OTEL_* variables, read when the app is built (see `build_tracing`).
"""

from __future__ import annotations

import os

from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from kvgate import __version__
from kvgate.config import ConfigError, TracingConfig
from kvgate.observability.request_trace import GatewayTracing

_EXPORTERS = ("otlp", "console", "none")
_PROTOCOLS = ("http/protobuf", "grpc")


def build_tracing(
    config: TracingConfig, exporter: SpanExporter | None = None
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

    `exporter`, when given, receives every span as it ends in place of the configured
    exporters (tests read spans in memory); it is unused when tracing is off. Raises
    ConfigError for an exporter or protocol kvgate does not support."""
    names = _exporter_names(config)
    if not names:
        return None
    ratio = _sample_ratio(config)
    processors: list[SpanProcessor]
    if exporter is not None:
        processors = [SimpleSpanProcessor(exporter)]
    else:
        # Every exporter first: a refused one must not leave a processor's thread running.
        exporters = [_exporter(name, config) for name in names]
        processors = [BatchSpanProcessor(e) for e in exporters]
    resource = Resource.create({SERVICE_VERSION: __version__})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "kvgate"}))
    # Sampled before any span is made (GatewayTracing.start): every span made is recorded.
    # Shut down by the app (a reload makes a new provider), not kept alive until exit.
    provider = TracerProvider(sampler=ALWAYS_ON, resource=resource, shutdown_on_exit=False)
    for processor in processors:
        provider.add_span_processor(processor)
    return GatewayTracing(provider, ratio)


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


def _exporter(name: str, config: TracingConfig) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
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
    if protocol == "grpc":
        # Imported only when chosen: grpc is a heavy import the default path never needs.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=config.endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=config.endpoint)
