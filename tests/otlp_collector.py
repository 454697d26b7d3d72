"""A real OTLP/HTTP trace receiver for tests: a loopback HTTP server that decodes each
`ExportTraceServiceRequest` (protobuf) posted to /v1/traces and keeps its spans."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, Span


class OtlpCollector:
    """Use as a context manager; `endpoint` is the traces URL to give an OTLP exporter."""

    def __init__(self) -> None:
        self.resources: list[ResourceSpans] = []
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                request = ExportTraceServiceRequest.FromString(body)
                with collector._lock:
                    collector.resources.extend(request.resource_spans)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return [s for r in self.resources for ss in r.scope_spans for s in ss.spans]

    def __enter__(self) -> OtlpCollector:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
