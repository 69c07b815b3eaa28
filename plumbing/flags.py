"""Flags with environment defaults: every ``--some-flag`` can also be set through
``SPLITSERVE_SOME_FLAG`` (flags win), read when the parser is built, never at import time.

A renamed flag keeps its old name, and the old name's env var, as a deprecated alias for one
release (``add_flag(..., deprecated=("--old-name",))``): using either logs
``flag.deprecated`` once and sets the new flag."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

import structlog

log = structlog.get_logger()


def env_name(flag: str) -> str:
    return "SPLITSERVE_" + flag.lstrip("-").replace("-", "_").upper()


class _StoreWarningOnAlias(argparse._StoreAction):
    """Stores like ``store``; the option's deprecated spellings log a warning."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if option_string is not None and option_string != self.option_strings[0]:
            log.warning("flag.deprecated", flag=option_string, use=self.option_strings[0])
        super().__call__(parser, namespace, values, option_string)


def _env_value(flag: str, deprecated: Sequence[str]) -> str | None:
    """The flag's env var, else a deprecated name's (logged)."""
    value = os.environ.get(env_name(flag))
    for old in deprecated:
        old_value = os.environ.get(env_name(old))
        if old_value is not None:
            log.warning("flag.deprecated", env=env_name(old), use=env_name(flag))
            if value is None:
                value = old_value
    return value


_BYTE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def byte_size(text: str) -> int:
    """A flag's memory size: bytes, or a number with a unit (``2GiB``, ``512MiB``, ``1.5GB``;
    KiB/MiB/GiB/TiB are powers of 1024, kB/MB/GB/TB of 1000, any case). An argparse ``type``."""
    value = text.strip().replace("_", "")
    digits = len(value) - len(value.lstrip("0123456789."))
    number, unit = value[:digits], value[digits:].strip().lower()
    try:
        size = float(number) * _BYTE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: bytes, or a number with KiB, MiB, GiB, TiB, kB, MB, GB or TB"
        ) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least 1 byte")
    return int(size)


def add_flag(parser: argparse.ArgumentParser, flag: str, deprecated: Sequence[str] = (), **kwargs: Any) -> None:
    """``parser.add_argument`` whose default comes from ``SPLITSERVE_*`` when set;
    ``deprecated``: old names of the flag, still accepted (flag and env var) with a warning."""
    value = _env_value(flag, deprecated)
    if value is not None:
        if kwargs.get("action") == "store_true":
            kwargs["default"] = value.lower() in ("1", "true", "yes", "on")
        else:
            kwargs["default"] = kwargs.get("type", str)(value)
    if "help" in kwargs:
        kwargs["help"] += f" [env {env_name(flag)}]"
        if deprecated:
            kwargs["help"] += f" ({', '.join(deprecated)}: deprecated, removed in the next release)"
    if deprecated:
        if kwargs.get("action", "store") != "store":
            raise ValueError(f"{flag}: deprecated aliases need a storing flag")
        kwargs["action"] = _StoreWarningOnAlias
        kwargs.setdefault("dest", flag.lstrip("-").replace("-", "_"))
    parser.add_argument(flag, *deprecated, **kwargs)
