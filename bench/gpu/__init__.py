"""The GPU check (issue #26): ``python -m bench.gpu`` (``make gpu-check``).

One prepared run on one GPU that writes one JSON and one Markdown report: the build (none is
needed on CUDA), the Triton kernels against their torch references, greedy parity with
``transformers``, copy / attention bandwidth, the 8B-shaped throughput and a disaggregated
1 + 1 cluster's KV hand-off. Without a CUDA device (or with ``--dry-run``) the same code runs
on the CPU with tiny shapes and the Triton interpreter, so CI keeps it working.

Modules: ``options`` (flags, the device and dry profiles), ``runner`` (each step in its own
process under a time budget; the report), ``step`` (the child process), ``kernel_checks``,
``models`` (random checkpoints, weights made on the device), ``parity``, ``bandwidth``,
``throughput``, ``handoff`` (the cluster), ``markdown``. bench/README.md has the device command.
"""
