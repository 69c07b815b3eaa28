"""A rank-1 Gloo peer run as a child process by test_gloo_peer_death.py.

    python tests/plumbing/transport/gloo_peer.py HOST PORT TIMEOUT_S NUMEL

Prints "imported" once torch is loaded (the parent then accepts), joins the rendezvous,
and sends ``torch.full((NUMEL,), i)`` for i = 0, 1, 2, ... until it is killed.
"""

from __future__ import annotations

import sys

import torch

from plumbing.transport.gloo import connect_gloo


def main() -> None:
    host, port, timeout_s, numel = sys.argv[1:5]
    torch.set_num_threads(1)
    sys.stdout.write("imported\n")
    sys.stdout.flush()
    channel = connect_gloo(host, int(port), float(timeout_s))
    i = 0
    while True:
        channel.send(torch.full((int(numel),), float(i))).result()
        i += 1


if __name__ == "__main__":
    main()
