"""structlog configuration: one call per process, key-value events, console or JSON lines."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(level: str = "info", fmt: str = "console", service: str = "epd") -> None:
    numeric = getattr(logging, level.upper(), logging.INFO)
    # FORCE_COLOR / NO_COLOR (the common conventions): `epd up` forwards its children's lines to a terminal
    colors = not os.environ.get("NO_COLOR") and (sys.stderr.isatty() or bool(os.environ.get("FORCE_COLOR")))
    renderer = (structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=colors))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # One write per line: print() writes the text and its newline apart when stderr is unbuffered
        # (PYTHONUNBUFFERED=1, as in deploy/Dockerfile), and the lines of processes sharing one stderr
        # (`epd up` and its children) then run into each other.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    # Libraries that log through the standard library (nats, uvicorn) go to the same stream.
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")


def get_logger(name: str | None = None):
    return structlog.get_logger(name)
