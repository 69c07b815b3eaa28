"""KV transfer bandwidth benchmark (not a test): raw Gloo vs GlooChannel vs the full KV path.

    python -m bench.kv_transfer [--sizes-mib 1 8 64] [--trials 5] [--min-trial-mib 64] \
        [--out bench/results/kv_transfer.json]

Two processes (multiprocessing spawn) on 127.0.0.1, one torch thread each; rank 0 sends,
rank 1 receives and times. For each payload size the methods take turns, one trial each,
``--trials`` times after one warm-up round; the table shows medians:

* ``raw``: a bare ``ProcessGroupGloo`` (its own TCPStore, the same TCP device options as the
  channel) sending a uint8 tensor of that size; each side waits for each op before the next.
* ``raw_pre``: the same, but rank 1 posts all of a trial's receives before waiting on any, so
  no message reaches it before its receive is posted (Gloo's fast path; an upper bound).
* ``channel``: ``GlooChannel.send`` / ``recv`` of the same bytes (frame header, threads, futures).
* ``whole:<layout>``: the hand-off as it was before issue #13: rank 0 runs ``pack_kv`` on N
  random blocks of its cache and sends one message (at most two packed buffers in flight);
  rank 1 receives into one of two staging buffers and runs ``unpack_kv`` into N other random
  blocks, one after the other.
* ``full:<layout>``: the hand-off as the workers run it now (``plumbing.transport.pages``):
  each transfer in messages of ``--chunk-mib``, every receive posted up front, each chunk
  packed into a reused staging buffer while the previous ones are on the wire and unpacked
  as it lands (at most two transfers in flight). Layouts: ``model`` is the
  bundled model's (4 layers, 2 KV heads, head_dim 32, block 16, float32); ``llama1b`` is
  Llama-3.2-1B's (16 layers, 8 KV heads, head_dim 64, block 16, bfloat16).

A trial moves ``ceil(min_trial / size)`` messages (at least 2). Rank 1 starts its clock, sends
a one-element "go" to rank 0, and stops when the last message is received (and unpacked);
GB/s is payload bytes / seconds / 1e9. The unpacked pages are checked against a rebuilt copy
of the sender's cache once per size and layout. Local ``pack_kv`` / ``unpack_kv`` GB/s (one
thread) are reported too, to show where the full path's time goes.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import statistics
import sys
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from engine.kv_layout import KVLayout
from plumbing.transport.gloo import GlooChannel, GlooRendezvous, connect_gloo
from splitserve_kernels.ops import pack_kv, unpack_kv
from plumbing.transport.pages import DEFAULT_CHUNK_BYTES, StagingPool, chunk_blocks_for, chunk_ranges, recv_chunks, send_chunks

MIB = 1 << 20
HOST = "127.0.0.1"
TIMEOUT_S = 300.0
TAG_GO, TAG_DATA = 1, 2
LAYOUTS = {
    "model": KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32"),
    "llama1b": KVLayout(num_layers=16, num_kv_heads=8, head_dim=64, block_size=16,
                        dtype="bfloat16"),
}
CHUNK_BYTES = [DEFAULT_CHUNK_BYTES]  # the pipelined path's message size (--chunk-mib)
METHODS = ("raw", "raw_pre", "channel", *(f"whole:{name}" for name in LAYOUTS),
           *(f"full:{name}" for name in LAYOUTS))


# -- setup (both ranks) ----------------------------------------------------------------------


def raw_group(store: dist.Store, rank: int) -> dist.ProcessGroupGloo:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=TIMEOUT_S)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
    options._threads = 1
    return dist.ProcessGroupGloo(store, rank, 2, options)


def connect(rank: int, peer: Connection) -> tuple[dist.ProcessGroupGloo, GlooChannel, object]:
    """(raw group, channel, store to keep alive); rank 0 hosts both rendezvous."""
    if rank == 0:
        store = dist.TCPStore(HOST, 0, world_size=2, is_master=True,
                              timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
        rendezvous = GlooRendezvous(HOST, timeout_s=TIMEOUT_S)
        peer.send((store.port, rendezvous.port))
        return raw_group(store, 0), rendezvous.accept(), store
    raw_port, channel_port = peer.recv()
    store = dist.TCPStore(HOST, raw_port, world_size=2, is_master=False,
                          timeout=timedelta(seconds=TIMEOUT_S))
    return raw_group(store, 1), connect_gloo(HOST, channel_port, TIMEOUT_S), store


def make_cache(layout: KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = layout.packed_shape(num_blocks)  # a cache of num_blocks blocks has this shape too
    return torch.randn(shape, generator=generator).to(getattr(torch, layout.dtype))


class FullPath:
    """One layout's caches and block ids for one payload size (same seeds on both ranks)."""

    def __init__(self, layout: KVLayout, size: int, rank: int, seed: int) -> None:
        self.layout = layout
        self.num_pages = max(1, size // layout.bytes_per_block)
        self.nbytes = self.num_pages * layout.bytes_per_block
        self.num_blocks = 2 * self.num_pages + 1
        generator = torch.Generator().manual_seed(seed + 1)
        self.src_ids = torch.randperm(self.num_blocks, generator=generator)[: self.num_pages]
        self.dst_ids = torch.randperm(self.num_blocks, generator=generator)[: self.num_pages]
        self.seed = seed
        self.cache = make_cache(layout, self.num_blocks, seed if rank == 0 else seed + 2)
        self.staging = [torch.empty(layout.packed_shape(self.num_pages), dtype=getattr(torch, layout.dtype))
                        for _ in range(2 if rank == 1 else 0)]
        self.dtype = getattr(torch, layout.dtype)
        self.chunks = chunk_ranges(self.num_pages, chunk_blocks_for(layout.bytes_per_block, CHUNK_BYTES[0]))
        self.pool = StagingPool()

    def check(self) -> bool:
        """Rank 1: do the unpacked pages equal the sender's (rebuilt from its seed)?"""
        source = make_cache(self.layout, self.num_blocks, self.seed)
        return torch.equal(self.cache[:, :, self.dst_ids], source[:, :, self.src_ids])


# -- one trial (rank 0 sends, rank 1 receives and times) -------------------------------------


def send_trial(method: str, reps: int, raw: dist.ProcessGroupGloo, channel: GlooChannel,
               payload: torch.Tensor, full: dict[str, FullPath]) -> None:
    raw.recv([torch.empty(1)], 1, TAG_GO).wait()
    if method in ("raw", "raw_pre"):
        for _ in range(reps):
            raw.send([payload], 1, TAG_DATA).wait()
    elif method == "channel":
        for future in [channel.send(payload) for _ in range(reps)]:
            future.result()
    elif method.startswith("whole:"):
        path = full[method.split(":")[1]]
        in_flight = []
        for _ in range(reps):
            if len(in_flight) == 2:
                in_flight.pop(0).result()
            in_flight.append(channel.send(pack_kv(path.cache, path.src_ids)))
        for future in in_flight:
            future.result()
    else:
        path = full[method.split(":")[1]]
        in_flight = []
        for _ in range(reps):
            if len(in_flight) == 2:
                in_flight.pop(0).result()
            in_flight.append(send_chunks(channel, path.chunks, 0, path.pool, path.layout.packed_shape, path.dtype,
                                         lambda start, n, out: pack_kv(path.cache, path.src_ids[start:start + n], out)))
        for future in in_flight:
            future.result()


def recv_trial(method: str, reps: int, raw: dist.ProcessGroupGloo, channel: GlooChannel,
               payload: torch.Tensor, full: dict[str, FullPath]) -> float:
    start = time.perf_counter()
    raw.send([torch.zeros(1)], 0, TAG_GO).wait()
    if method == "raw":
        for _ in range(reps):
            raw.recv([payload], 0, TAG_DATA).wait()
    elif method == "raw_pre":
        for work in [raw.recv([payload], 0, TAG_DATA) for _ in range(reps)]:
            work.wait()
    elif method == "channel":
        for future in [channel.recv(payload) for _ in range(reps)]:
            future.result()
    elif method.startswith("whole:"):
        path = full[method.split(":")[1]]
        pending = [channel.recv(path.staging[i]) for i in range(min(2, reps))]
        for i in range(reps):
            pending[i].result()
            unpack_kv(path.cache, path.staging[i % 2], path.dst_ids)
            if i + 2 < reps:
                pending.append(channel.recv(path.staging[i % 2]))
    else:
        path = full[method.split(":")[1]]

        def post() -> object:
            return recv_chunks(channel, path.chunks, 0, path.pool, path.layout.packed_shape, path.dtype,
                               lambda start, buf: unpack_kv(path.cache, buf, path.dst_ids[start:start + buf.shape[2]]))

        pending = [post() for _ in range(min(2, reps))]
        for i in range(reps):
            pending[i].result()
            if i + 2 < reps:
                pending.append(post())
    return time.perf_counter() - start


def local_copy_rates(path: FullPath, repeats: int = 3) -> dict[str, float]:
    """Single-thread pack_kv / unpack_kv GB/s on this rank's cache."""
    pack_s, unpack_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        packed = pack_kv(path.cache, path.dst_ids)
        pack_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        unpack_kv(path.cache, packed, path.dst_ids)
        unpack_s.append(time.perf_counter() - start)
    return {"pack_gbps": path.nbytes / statistics.median(pack_s) / 1e9,
            "unpack_gbps": path.nbytes / statistics.median(unpack_s) / 1e9}


def rank_main(rank: int, peer: Connection, report: Connection | None, config: dict) -> None:
    torch.set_num_threads(1)
    CHUNK_BYTES[0] = int(config["chunk_mib"] * MIB)
    raw, channel, _store = connect(rank, peer)
    results: dict[str, dict] = {}
    for size_mib in config["sizes_mib"]:
        size = int(size_mib * MIB)
        reps = max(2, math.ceil(config["min_trial_mib"] * MIB / size))
        payload = torch.zeros(size, dtype=torch.uint8)
        full = {name: FullPath(layout, size, rank, seed=size_mib_seed(size_mib, i))
                for i, (name, layout) in enumerate(LAYOUTS.items())}
        seconds: dict[str, list[float]] = {method: [] for method in METHODS}
        for trial in range(config["trials"] + 1):  # round 0 is the warm-up
            for method in METHODS:
                if rank == 0:
                    send_trial(method, reps, raw, channel, payload, full)
                else:
                    elapsed = recv_trial(method, reps, raw, channel, payload, full)
                    if trial > 0:
                        seconds[method].append(elapsed)
        if rank == 1:
            results[str(size_mib)] = summarize(size, reps, seconds, full)
    channel.close()
    if report is not None:
        report.send(results)


def size_mib_seed(size_mib: float, layout_index: int) -> int:
    return int(size_mib * 1000) * 10 + layout_index


def summarize(size: int, reps: int, seconds: dict[str, list[float]],
              full: dict[str, FullPath]) -> dict:
    out: dict = {"reps_per_trial": reps, "methods": {}}
    for method, times in seconds.items():
        nbytes = full[method.split(":")[1]].nbytes if ":" in method else size
        rates = [nbytes * reps / s / 1e9 for s in times]
        out["methods"][method] = {"message_bytes": nbytes, "seconds": times,
                                  "gbps": rates, "median_gbps": statistics.median(rates)}
    for name, path in full.items():
        out["methods"][f"full:{name}"].update(
            num_pages=path.num_pages, pages_equal=path.check(), **local_copy_rates(path))
    return out


# -- driver ------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    """Medians; every ratio is to the better of the two raw Gloo figures."""
    names = list(LAYOUTS)
    head = ["payload", "raw Gloo GB/s", "raw, recvs pre-posted GB/s", "GlooChannel GB/s",
            "channel/raw"]
    for name in names:
        head += [f"one message {name} GB/s", "/raw", f"pipelined {name} GB/s", "/raw"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size, row in results.items():
        m = {k: v["median_gbps"] for k, v in row["methods"].items()}
        best = max(m["raw"], m["raw_pre"])
        cells = [f"{size} MiB", f"{m['raw']:.2f}", f"{m['raw_pre']:.2f}", f"{m['channel']:.2f}",
                 f"{m['channel'] / best:.2f}"]
        for name in names:
            for kind in ("whole", "full"):
                cells += [f"{m[f'{kind}:{name}']:.2f}", f"{m[f'{kind}:{name}'] / best:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| payload | layout | pages | pack_kv GB/s | unpack_kv GB/s | pages equal |",
              "|---|---|---|---|---|---|"]
    for size, row in results.items():
        for name in names:
            r = row["methods"][f"full:{name}"]
            lines.append(f"| {size} MiB | {name} | {r['num_pages']} | {r['pack_gbps']:.2f} | "
                         f"{r['unpack_gbps']:.2f} | {r['pages_equal']} |")
    return "\n".join(lines)


def run_ranks(config: dict) -> dict:
    """Both ranks in fresh processes; rank 1's results (exits when a rank failed)."""
    ctx = mp.get_context("spawn")
    peer0, peer1 = ctx.Pipe()
    report_recv, report_send = ctx.Pipe(duplex=False)
    procs = [
        ctx.Process(target=rank_main, args=(0, peer0, None, config), name="kv-bench-rank0"),
        ctx.Process(target=rank_main, args=(1, peer1, report_send, config), name="kv-bench-rank1"),
    ]
    for proc in procs:
        proc.start()
    report_send.close()  # so a dead rank 1 reads as EOF here instead of a hang
    try:
        results = report_recv.recv()
    except EOFError:
        results = None
    for proc in procs:
        proc.join()
    if results is None or any(proc.exitcode != 0 for proc in procs):
        sys.exit(f"a rank failed: exit codes {[proc.exitcode for proc in procs]}")
    return results


def main(argv: list[str] | None = None) -> dict:
    """Run, print the table, write the report; returns the per-size results."""
    from bench import report
    from bench.machine import load_window

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 8, 64])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--min-trial-mib", type=float, default=64)
    parser.add_argument("--chunk-mib", type=float, default=DEFAULT_CHUNK_BYTES / MIB,
                        help="pipelined path: bytes per message (the workers' --kv-chunk-bytes)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv_transfer.json"))
    args = parser.parse_args(argv)
    config = {"sizes_mib": args.sizes_mib, "trials": args.trials,
              "min_trial_mib": args.min_trial_mib, "chunk_mib": args.chunk_mib}
    full = report.header("kv_transfer", 1)  # one torch thread per rank
    start = time.perf_counter()
    with load_window() as load:
        results = run_ranks(config)
    table = markdown(results)
    print(table)
    report.write_json({
        **full, "config": config, "layouts": {name: vars(layout) for name, layout in LAYOUTS.items()},
        "load_average_1m": load, "wall_s": time.perf_counter() - start, "results": results,
        "table_markdown": table,
    }, args.out)
    print(f"\nwrote {args.out}")
    return results


if __name__ == "__main__":
    main()
