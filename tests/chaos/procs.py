"""A local cluster whose processes can be paused, killed and restarted on the same address.

``ChaosCluster`` is ``splitserve.cluster.Cluster`` (real processes on 127.0.0.1, kill and
restart on the same address) plus what a fault campaign needs: SIGSTOP/SIGCONT, a restart
that does not block the event loop, a count of processes that exited unbidden (crashes),
exact loads (GetStats), and the time until a (re)started process is back in routing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass

import grpc

from plumbing.rpc import channel_options
from plumbing.servers import read_ready_file
from splitserve.cluster import Cluster
from splitserve_api.v1 import common_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc, prefill_pb2_grpc

ROLES = ("gateway", "prefill", "decode")


@dataclass
class Crash:
    name: str
    exit_code: int | None
    at_s: float


class ChaosCluster(Cluster):
    """``Cluster`` plus pause/resume, crash accounting and an asynchronous restart."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.expected_exit: set[str] = set()  # killed by us, not yet restarted
        self.crashes: list[Crash] = []
        self.t0 = time.monotonic()
        self._channels: dict[str, grpc.aio.Channel] = {}  # by address (they reconnect after a restart)

    def names(self, role: str) -> list[str]:
        """The processes of a role: ["gateway", "gateway-1", ...], ["prefill-0", ...], ["decode-0", ...]."""
        return sorted(n for n in self.procs if self.role(n) == role)

    def role(self, name: str) -> str:
        return self._commands[name][0]

    # -- faults ------------------------------------------------------------------------
    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """kill -9 by default (the process gets no chance to clean up); not a crash."""
        self.expected_exit.add(name)
        return super().kill(name, sig)

    def pause(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGCONT)

    async def restart_async(self, name: str, timeout_s: float = 120.0) -> float:
        """``restart`` without blocking the event loop: ``name`` again on the address it had;
        returns when it is ready (monotonic)."""
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running")
        proc, ready = self._spawn(name, *self.restart_command(name))
        deadline = time.monotonic() + timeout_s
        while not (ready.exists() and ready.read_text()):
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} while restarting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not ready after {timeout_s} s")
            await asyncio.sleep(0.01)
        self.expected_exit.discard(name)
        address = read_ready_file(ready.read_text())["public"]
        if address != self.addresses[name]:
            raise RuntimeError(f"{name} came back on {address}, not {self.addresses[name]}")
        return time.monotonic()

    def check_crashes(self) -> list[str]:
        """Processes that exited without being killed by us (recorded once each)."""
        dead = []
        for name, proc in self.procs.items():
            if name not in self.expected_exit and proc.poll() is not None:
                self.crashes.append(Crash(name, proc.returncode, time.monotonic() - self.t0))
                self.expected_exit.add(name)
                dead.append(name)
        return dead

    # -- observation -------------------------------------------------------------------
    def channel(self, name: str) -> grpc.aio.Channel:
        """A cached channel to a process (reconnecting within 100-500 ms after a restart)."""
        address = self.addresses[name]
        if address not in self._channels:
            options = [*channel_options(), ("grpc.initial_reconnect_backoff_ms", 100),
                       ("grpc.min_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]
            self._channels[address] = grpc.aio.insecure_channel(address, options=options)
        return self._channels[address]

    async def close_channels(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    async def serving(self, gateway: str = "gateway") -> dict[str, float]:
        """Addresses ``gateway`` lists as SERVING, with the age of the freshest heartbeat it
        handled from each (empty when the gateway does not answer)."""
        try:
            info = await gateway_pb2_grpc.GatewayStub(self.channel(gateway)).GetInfo(
                gateway_pb2.GetInfoRequest(), timeout=1.0)
        except grpc.aio.AioRpcError:
            return {}
        ages: dict[str, float] = {}
        for w in info.workers:
            if w.state == common_pb2.WORKER_STATE_SERVING:
                ages[w.address] = min(ages.get(w.address, float("inf")), w.heartbeat_age_ms / 1000)
        return ages

    async def wait_in_routing(self, names: list[str], since: float, timeout_s: float = 10.0,
                              gateways: list[str] | None = None) -> float | None:
        """Seconds from ``since`` (ready, or SIGCONT) until each of ``gateways`` (default:
        every gateway replica up) lists every one of ``names`` as SERVING with a registration
        or heartbeat it handled after ``since`` (polled every 20 ms; an entry left from before
        a pause or a kill does not count); None if not within ``timeout_s``."""
        want = {self.addresses[n] for n in names}
        while time.monotonic() - since < timeout_s:
            asked = time.monotonic()
            up = gateways or [g for g in self.names("gateway") if g not in self.expected_exit]
            seen = await asyncio.gather(*(self.serving(g) for g in up))
            if all(want <= {a for a, age in ages.items() if age <= asked - since + 0.1} for ages in seen):
                return time.monotonic() - since
            await asyncio.sleep(0.02)
        return None

    async def stats(self, name: str, timeout_s: float = 2.0) -> common_pb2.WorkerLoad | None:
        """A worker's exact load (GetStats), or None when it does not answer."""
        stub_type = decode_pb2_grpc.DecodeWorkerStub if self.role(name) == "decode" else prefill_pb2_grpc.PrefillWorkerStub
        try:
            return await stub_type(self.channel(name)).GetStats(common_pb2.GetStatsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return None

    def workers(self) -> list[str]:
        """The prefill and decode workers (not the gateway, nor an HTTP front)."""
        return [n for n in self.procs if self.role(n) in ("prefill", "decode")]

