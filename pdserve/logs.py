"""Structured, quiet-by-default logging: one line per event, ``key=value`` extras."""

from __future__ import annotations

import logging
import sys
import time

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class KeyValueFormatter(logging.Formatter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        extras = " ".join(
            f"{k}={_fmt(v)}" for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")
        )
        line = (
            f"{ts}.{int(record.msecs):03d} {record.levelname:<7} {self.component} {record.name}: {record.getMessage()}"
        )
        if extras:
            line += " " + extras
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _fmt(value: object) -> str:
    text = str(value)
    return f'"{text}"' if " " in text or not text else text


def setup_logging(level: str = "INFO", component: str = "pdserve") -> None:
    """Our loggers at ``level``; chatty third-party loggers only at WARNING."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter(component))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("pdserve").setLevel(level.upper())  # every module logs under pdserve.*
    logging.getLogger("nats").setLevel(logging.ERROR)
