"""``python -m bench.gpu [--dry-run] [--out DIR] [--budget-s S] [--steps ...]``: see ``bench.gpu``
and bench/README.md. Exits 1 when a selected step failed or did not run for want of time
(the report has every other step's figures)."""

from __future__ import annotations

import sys

import structlog

from bench.gpu.options import options_from_args, parser

log = structlog.get_logger()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    import torch  # does not import triton: the steps' processes set TRITON_INTERPRET first

    dry_run = args.dry_run or not torch.cuda.is_available()
    if dry_run and not args.dry_run:
        log.info("gpu_check.no_cuda_device", mode="dry run: CPU, tiny shapes, Triton interpreted")
    from bench.gpu import runner

    options = options_from_args(args, dry_run)
    doc = runner.run_all(options)
    paths = runner.write(doc, options.out_dir)
    log.info("gpu_check.done", failures=doc["failures"], elapsed_s=doc["elapsed_s"],
             reports=[str(p) for p in paths], goals={g["id"]: g["met"] for g in doc["goals"]})
    return 1 if doc["incomplete"] else 0


if __name__ == "__main__":
    sys.exit(main())
