"""Waiting for a condition in async tests: poll, never sleep a fixed time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Return once ``check()`` is true; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {timeout_s} s: {what}")
