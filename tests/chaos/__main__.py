"""``python -m tests.chaos [--profile small|large|replicas] [--seed N] [--num-gateways N] [--out FILE] [--log-dir DIR]``

Runs the chaos campaign (``tests/chaos/__init__.py``), prints its figures, writes them as JSON,
and exits 1 when a zero check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from tests.chaos.profile import PROFILES
from tests.chaos.run import DEFAULT_MODEL, run_chaos
from plumbing.logs import configure_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="small")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--out", default=None, help="JSON report (default bench/results/chaos-<profile>-<seed>.json)")
    parser.add_argument("--log-dir", default=None, help="each process's log (default: discarded)")
    parser.add_argument("--num-gateways", type=int, default=None,
                        help="gateway replicas (the profile's by default); more than one: resuming clients")
    args = parser.parse_args(argv)
    configure_logging("chaos", "warning")
    profile = PROFILES[args.profile]
    if args.num_gateways is not None:
        profile = replace(profile, num_gateways=args.num_gateways, resume=profile.resume or args.num_gateways > 1)
    report = run_chaos(profile, args.seed, args.model, args.log_dir)
    out = Path(args.out or f"bench/results/chaos-{args.profile}-{args.seed}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    summary = {k: report[k] for k in ("requests", "statuses", "hangs", "leaked_blocks", "mismatches", "crashes",
                                      "migration", "cost", "checks", "load_average", "seconds")}
    summary["faults"] = {k: report["faults"][k] for k in ("fired", "phase_caught", "back_in_routing_max_s",
                                                           "back_in_routing_p50_s", "not_back_in_2s", "errors")}
    sys.stdout.write(json.dumps(summary, indent=2, default=str) + f"\nreport: {out}\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
