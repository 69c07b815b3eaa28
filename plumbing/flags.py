"""Flags with environment defaults: every ``--some-flag`` can also be set through
``SPLITSERVE_SOME_FLAG`` (flags win), read when the parser is built, never at import time."""

from __future__ import annotations

import argparse
import os
from typing import Any


def env_name(flag: str) -> str:
    return "SPLITSERVE_" + flag.lstrip("-").replace("-", "_").upper()


def add_flag(parser: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
    """``parser.add_argument`` whose default comes from ``SPLITSERVE_*`` when set."""
    value = os.environ.get(env_name(flag))
    if value is not None:
        if kwargs.get("action") == "store_true":
            kwargs["default"] = value.lower() in ("1", "true", "yes", "on")
        else:
            kwargs["default"] = kwargs.get("type", str)(value)
    if "help" in kwargs:
        kwargs["help"] += f" [env {env_name(flag)}]"
    parser.add_argument(flag, **kwargs)
