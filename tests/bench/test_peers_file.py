"""``splitserve bench --peers-json``: the peers section comes from a file that ``python -m
benchmarks.peers`` writes; it is read whole or refused with the reason, and the report says
where it came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.markdown import peers_md
from bench.peers_file import SCHEMA, peers_document, read_peers

ROW = {"system": "engine", "label": "splitserve Engine (in-process)", "status": "ok", "reason": None,
       "figures": {"output_tokens_per_s": 100.0, "seconds": 0.5}, "counts": {"num_requests": 2, "num_output_tokens": 50},
       "greedy_match_vs_engine": None, "details": {}}
WORKLOAD = {"name": "tiny", "num_requests": 2, "min_prompt_len": 8, "max_prompt_len": 48, "output_len": 25,
            "decoding": "greedy, ignore_eos"}
HEADER = {"benchmark": "splitserve-peers", "command": ["python", "-m", "benchmarks.peers"],
          "timestamp": "2026-12-02T04:00:00+0000", "git_commit": "abc123", "splitserve_version": "0.1.0",
          "machine": {"cpu_count": 2}}


def write(path: Path, doc: object) -> Path:
    path.write_text(json.dumps(doc))
    return path


def test_a_written_section_reads_back_with_its_source(tmp_path: Path) -> None:
    section = {"workload": WORKLOAD, "systems": [ROW]}
    path = write(tmp_path / "peers.json", peers_document(HEADER, section))
    read = read_peers(path)
    assert read == {**section, "source": {"path": str(path), **{k: HEADER[k] for k in
                                                                  ("command", "timestamp", "git_commit",
                                                                   "splitserve_version", "machine")}}}
    text = peers_md(read)
    assert "Measured by `python -m benchmarks.peers` at 2026-12-02T04:00:00+0000 (commit abc123)" in text
    assert f"read from `{path}`" in text


@pytest.mark.parametrize("doc, message", [
    ("not json {", "not JSON"),
    ({"schema": "splitserve-bench/1", "peers": {}}, "schema 'splitserve-bench/1', expected 'splitserve-peers/1'"),
    ([1, 2], "schema None"),
    ({"schema": SCHEMA, "peers": {"systems": []}}, "'peers' must hold a 'workload' object and a 'systems' list"),
    ({"schema": SCHEMA, "peers": {"workload": WORKLOAD, "systems": [{"system": "engine"}]}},
     "peers.systems[0] lacks label, status, reason, figures, counts, greedy_match_vs_engine, details"),
    ({"schema": SCHEMA, "peers": {"workload": WORKLOAD, "systems": ["engine"]}}, "peers.systems[0] lacks system"),
])
def test_a_bad_file_is_refused_with_the_reason(tmp_path: Path, doc: object, message: str) -> None:
    path = tmp_path / "peers.json"
    path.write_text(doc) if isinstance(doc, str) else write(path, doc)
    with pytest.raises(ValueError) as caught:
        read_peers(path)
    assert str(caught.value).startswith(f"--peers-json {path}: ")
    assert message in str(caught.value)


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--peers-json .*missing\.json: No such file or directory"):
        read_peers(tmp_path / "missing.json")
