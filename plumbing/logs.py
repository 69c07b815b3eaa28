"""structlog setup for the services: JSON lines (pretty console on a TTY), contextvars merged.

Each gRPC handler binds ``request_id`` with ``structlog.contextvars.bind_contextvars``; asyncio
gives every handler task its own context, so the id appears on every line that handler (and
anything it awaits) logs. Threads log with explicit ``request_id=`` keys.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(service: str, level: str = "info", json: bool | None = None) -> None:
    """Configure structlog once per process. ``json=None``: JSON unless stderr is a TTY."""
    if json is None:
        json = not sys.stderr.isatty()
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level must be one of debug/info/warning/error, got {level!r}")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service)
