"""``python -m tests.fuzz [--profile small|large] [--seed N] [--out FILE] [--log-dir DIR]``

Runs the fuzz campaign (``tests/fuzz/__init__.py``), prints its figures, writes them as JSON,
and exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tests.fuzz.profile import PROFILES
from tests.fuzz.run import DEFAULT_MODEL, run_fuzz
from plumbing.logs import configure_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="small")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--out", default=None, help="JSON report (default bench/results/fuzz-<profile>-<seed>.json)")
    parser.add_argument("--log-dir", default=None, help="each process's log (default: discarded)")
    args = parser.parse_args(argv)
    configure_logging("fuzz", "warning")
    report = run_fuzz(PROFILES[args.profile], args.seed, args.model, args.log_dir)
    out = Path(args.out or f"bench/results/fuzz-{args.profile}-{args.seed}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    keys = ("cases", "statuses", "by_family", "undocumented", "undocumented_examples", "crashes", "leaked_blocks",
            "heartbeat", "http", "checks", "load_average", "seconds")
    sys.stdout.write(json.dumps({k: report[k] for k in keys}, indent=2, default=str) + f"\nreport: {out}\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
