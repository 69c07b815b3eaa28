"""Chaos campaign against a local 2-prefill + 2-decode cluster (real processes on 127.0.0.1).

    python -m tests.chaos --profile large --seed 0 --log-dir .cache/chaos-logs

A no-fault phase, then the same seeded workload under faults: SIGSTOP/SIGCONT of each role,
kill -9 of each role at each phase (before/during prefill, mid-transfer, mid-decode), each
killed process restarted on its address. Every OK reply is compared with its golden
(in-process) reply; statuses are counted by code; hangs, leaked blocks (GetStats after the
drain), crashes and the time until each restarted process is back in routing are measured.

Modules: ``profile`` (small for CI, large for the harness), ``workload`` (requests by seed,
golden replies), ``procs`` (the cluster with pause/kill/restart), ``faults`` (phases and the
injector), ``load`` (closed-loop clients), ``run``, ``report``.
"""
