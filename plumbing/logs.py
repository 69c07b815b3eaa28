"""structlog setup for the services: JSON lines (pretty console on a TTY), contextvars merged.

Each gRPC handler binds ``request_id`` with ``structlog.contextvars.bind_contextvars``; asyncio
gives every handler task its own context, so the id appears on every line that handler (and
anything it awaits) logs. Threads log with explicit ``request_id=`` keys.

Nothing reaches stderr outside these lines: the standard library's logging (gRPC, torch,
transformers once ``adopt_library_loggers`` ran, warnings) goes through the same renderer, and
so do uncaught exceptions of the main thread (``sys.excepthook``), of other threads
(``threading.excepthook``) and of the event loop ("Task exception was never retrieved" and
the like: ``install_loop_exception_handler``), tracebacks as a field of the line.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from types import TracebackType

import structlog

_LIBRARY_LOGGERS = ("transformers", "torch", "grpc", "asyncio")


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
    _route_stdlib_logging(renderer, numeric)
    _install_excepthooks()


def _route_stdlib_logging(renderer: structlog.types.Processor, level: int) -> None:
    formatter = structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        foreign_pre_chain=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(max(level, logging.WARNING))  # libraries' info lines are noise here
    logging.captureWarnings(True)
    adopt_library_loggers()


def adopt_library_loggers() -> None:
    """Libraries that attach a stderr handler of their own (transformers does, lazily, on
    import) log through the root handler instead. Call again after such an import."""
    for name in _LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = []
        logger.propagate = True


def _install_excepthooks() -> None:
    log = structlog.get_logger()

    def main_thread(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        log.critical("uncaught_exception", exc_info=(kind, exc, tb))

    def other_thread(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        log.error("thread_exception", thread=args.thread.name if args.thread else None,
                  exc_info=(args.exc_type, args.exc_value, args.exc_traceback))  # type: ignore[arg-type]

    def unraisable(args: sys.UnraisableHookArgs) -> None:  # a __del__ or a finalizer that raised
        log.error("unraisable_exception", message=args.err_msg or "Exception ignored in",
                  source=repr(args.object)[:300] if args.object is not None else None,
                  exc_info=(args.exc_type, args.exc_value, args.exc_traceback))  # type: ignore[arg-type]

    sys.excepthook = main_thread
    threading.excepthook = other_thread
    sys.unraisablehook = unraisable


def install_loop_exception_handler() -> None:
    """Errors the running event loop reports (an exception nobody retrieved, a failing
    callback) become one JSON line each instead of a traceback on stderr."""
    log = structlog.get_logger()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
        exc = context.get("exception")
        source = context.get("task") or context.get("future") or context.get("handle")
        log.error("event_loop.unhandled", message=str(context.get("message", "")),
                  source=repr(source)[:300] if source is not None else None,
                  exc_info=exc if isinstance(exc, BaseException) else None)

    asyncio.get_running_loop().set_exception_handler(handler)
