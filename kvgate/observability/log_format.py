"""How every kvgate process logs: one JSON object per line (default for `serve`) or plain text.

The same `logging.config.dictConfig` dictionary configures the process that parses the command
line and, through uvicorn's `log_config`, every worker process it starts; a worker otherwise
keeps Python's last-resort handler (warnings only, no timestamp) and drops the access log.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import orjson

from kvgate.yaml_source import redacted_text

LOG_FORMATS = ("json", "text")
# The attribute a record's structured fields ride on (`log.info(..., extra={FIELDS: {...}})`).
FIELDS = "fields"
_TEXT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", ...}`: a record's structured fields at the top level when it
    has them (the access log), else its formatted `message`."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,  # which worker, under `--workers N`
        }
        fields = getattr(record, FIELDS, None)
        if isinstance(fields, dict):
            line.update(fields)
        else:
            line["message"] = record.getMessage()
        if record.exc_info:
            line["exception"] = record.exc_text or self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


class RedactingFilter(logging.Filter):
    """Masks URL passwords and secret-like query parameters in a record's message and
    exception (`redacted_text`): libraries log the URLs they call (the OTLP exporter's retry
    warning names its endpoint with its query string). Structured records (the access log)
    carry no URL and pass as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, FIELDS, None) is None:
            message = record.getMessage()
            masked = redacted_text(message)
            if masked != message:
                record.msg, record.args = masked, ()
            if record.exc_info and not record.exc_text:
                record.exc_text = redacted_text(_PLAIN.formatException(record.exc_info))
        return True


_PLAIN = logging.Formatter()


def current_logging() -> tuple[str, str]:
    """(level, format) of this process's logging as `logging_config` set it up, for a child
    process that logs alike: `json` when the root handler formats JSON, else `text`."""
    root = logging.getLogger()
    json_lines = any(isinstance(h.formatter, JsonFormatter) for h in root.handlers)
    return logging.getLevelName(root.level), "json" if json_lines else "text"


def logging_config(level: str, log_format: str) -> dict[str, Any]:
    """A dictConfig for stderr at `level` in `log_format` (one of LOG_FORMATS); uvicorn's own
    loggers propagate to it."""
    formatter: dict[str, Any] = (
        {"()": f"{__name__}.JsonFormatter"} if log_format == "json" else {"format": _TEXT}
    )
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"kvgate": formatter},
        "filters": {"redact": {"()": f"{__name__}.RedactingFilter"}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "kvgate",
                "filters": ["redact"],
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"handlers": ["stderr"], "level": level.upper()},
        "loggers": {
            "uvicorn": {"handlers": [], "propagate": True},
            "uvicorn.error": {"handlers": [], "propagate": True},
            "uvicorn.access": {"handlers": [], "propagate": True},
            # httpx logs every control-plane request at INFO: health and telemetry polls.
            "httpx": {"level": "WARNING"},
        },
    }
