"""A blocking connect that ends at its deadline even when the peer accepts the TCP connection
and then never answers.

``torch.distributed.TCPStore``'s client pings the store after connecting and waits for the
answer with no timeout of its own (torch 2.x): a listener that accepts and stays silent would
hold the calling thread forever, whatever timeout the store was given. ``cut_after`` watches
such a call: once the deadline passes it shuts down (``shutdown(2)``, on a duplicate of the
descriptor) this process's TCP connections to the peer's address and port, as often as the
store reconnects, until the call returns; the blocked read then fails and the call raises.
Only connections to that one (address, port) are touched: the port is the rendezvous the
handshake named. Linux (``/proc``); elsewhere it only waits.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

CUT_EVERY_S = 0.2


@contextmanager
def cut_after(host: str, port: int, timeout_s: float) -> Iterator[None]:
    """Run the body; past ``timeout_s`` keep cutting connections to ``host``:``port``."""
    done = threading.Event()

    def watch() -> None:
        if done.wait(timeout_s):
            return
        while not done.is_set():
            cut_connections(host, port)
            done.wait(CUT_EVERY_S)

    watcher = threading.Thread(target=watch, name="kv-join-deadline", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()


def cut_connections(host: str, port: int) -> int:
    """Shut down this process's TCP connections to ``host``:``port``; how many were cut."""
    inodes = _socket_inodes(_addresses(host), port)
    num_cut = 0
    for fd, inode in _socket_fds():
        if inode in inodes:
            num_cut += _shutdown(fd)
    return num_cut


def _addresses(host: str) -> set[str]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return set()
    return {str(info[4][0]).split("%", 1)[0] for info in infos}


def _socket_inodes(addresses: set[str], port: int) -> set[str]:
    """Inodes of the TCP sockets whose remote end is one of ``addresses`` at ``port``."""
    found: set[str] = set()
    for table, decode in (("/proc/net/tcp", _ipv4), ("/proc/net/tcp6", _ipv6)):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            remote_ip, _, remote_port = fields[2].partition(":")
            if int(remote_port, 16) == port and decode(remote_ip) in addresses:
                found.add(fields[9])
    return found


def _ipv4(hex_ip: str) -> str:
    return socket.inet_ntop(socket.AF_INET, bytes.fromhex(hex_ip)[::-1])


def _ipv6(hex_ip: str) -> str:
    raw = b"".join(bytes.fromhex(hex_ip[i:i + 8])[::-1] for i in range(0, 32, 8))
    if raw[:12] == b"\0" * 10 + b"\xff\xff":  # an IPv4-mapped address
        return socket.inet_ntop(socket.AF_INET, raw[12:])
    return socket.inet_ntop(socket.AF_INET6, raw)


def _socket_fds() -> Iterator[tuple[int, str]]:
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            yield int(name), link[8:-1]


def _shutdown(fd: int) -> int:
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
        return 1
    except OSError:
        return 0


