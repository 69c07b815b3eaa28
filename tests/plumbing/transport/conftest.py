"""Gloo channel pairs formed inside the test process (rank 1 joins from a thread)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from plumbing.transport.gloo import GlooChannel, GlooRendezvous, connect_gloo

Pair = tuple[GlooChannel, GlooChannel]


def form_pair(timeout_s: float = 10.0) -> Pair:
    """(rank-0 channel, rank-1 channel) over 127.0.0.1."""
    rendezvous = GlooRendezvous("127.0.0.1", timeout_s=timeout_s)
    joined: dict[str, object] = {}

    def join() -> None:
        try:
            joined["channel"] = connect_gloo(rendezvous.host, rendezvous.port, timeout_s)
        except BaseException as exc:  # surfaced below
            joined["error"] = exc

    thread = threading.Thread(target=join)
    thread.start()
    sender = rendezvous.accept()
    thread.join()
    if "error" in joined:
        raise joined["error"]  # type: ignore[misc]
    return sender, joined["channel"]  # type: ignore[return-value]


@pytest.fixture
def gloo_pair() -> Iterator[Callable[..., Pair]]:
    """Factory of channel pairs; every pair is closed after the test."""
    made: list[Pair] = []

    def make(timeout_s: float = 10.0) -> Pair:
        pair = form_pair(timeout_s)
        made.append(pair)
        return pair

    yield make
    for sender, receiver in made:
        sender.close()
        receiver.close()
