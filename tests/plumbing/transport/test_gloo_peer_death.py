"""A real peer process killed with SIGKILL mid-stream: the survivor fails fast, never hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import torch

from plumbing.transport import TransportError
from plumbing.transport.gloo import GlooRendezvous

REPO = Path(__file__).resolve().parents[3]
PEER = Path(__file__).with_name("gloo_peer.py")
TIMEOUT_S = 3.0
NUMEL = 64 * 1024  # 256 KiB per message
HANG_GUARD_S = 60.0  # far above TIMEOUT_S: only there so a bug fails instead of hanging


def spawn_peer(port: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, str(PEER), "127.0.0.1", str(port), str(TIMEOUT_S), str(NUMEL)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, text=True,
    )


def test_sigkilled_peer_fails_pending_recvs_and_breaks_channel() -> None:
    rendezvous = GlooRendezvous("127.0.0.1", timeout_s=TIMEOUT_S)
    peer = spawn_peer(rendezvous.port)
    try:
        assert peer.stdout is not None and peer.stdout.readline() == "imported\n"
        channel = rendezvous.accept()
        buffers = [torch.empty(NUMEL) for _ in range(400)]
        futures: list[Future[None]] = [channel.recv(buf) for buf in buffers]
        for i in range(3):  # the stream is flowing, in order
            futures[i].result(HANG_GUARD_S)
            assert torch.equal(buffers[i], torch.full((NUMEL,), float(i)))

        os.kill(peer.pid, signal.SIGKILL)
        peer.wait(HANG_GUARD_S)

        outcomes = [f.exception(HANG_GUARD_S) for f in futures]
        failed = [i for i, exc in enumerate(outcomes) if exc is not None]
        assert failed, "some recv must have been pending when the peer died"
        assert failed == list(range(failed[0], len(futures)))  # a prefix succeeded, the rest failed
        assert all(isinstance(outcomes[i], TransportError) for i in failed)
        for i in range(failed[0]):  # what arrived before the kill is intact
            assert torch.equal(buffers[i], torch.full((NUMEL,), float(i)))
        assert channel.broken
        late = channel.recv(torch.empty(NUMEL))
        assert isinstance(late.exception(HANG_GUARD_S), TransportError)
        channel.close()
    finally:
        peer.kill()
        peer.wait()
