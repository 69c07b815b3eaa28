"""A figure that could not be measured: ``{"skipped": reason}`` in place of the number.

Its own module so that the report, its Markdown and its plots all read the same marker
without importing each other (``bench/report.py`` writes the folder through the other two).
"""

from __future__ import annotations


def skipped(reason: str) -> dict:
    """The marker for a figure not measured, and why."""
    return {"skipped": reason}


def is_skipped(value: object) -> bool:
    """Whether ``value`` is the marker :func:`skipped` makes."""
    return isinstance(value, dict) and set(value) == {"skipped"} and isinstance(value["skipped"], str)
