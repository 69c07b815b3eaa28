"""``splitserve bench`` flags: which model a run uses, and the deployments' engine flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.deployment import engine_flags
from bench.options import add_bench_flags, build_config
from bench.profiles import TINY_MODEL
from bench.engine_run import EngineSettings
from bench.workload import CACHE_DIR, Workload

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "models" / "target"


def parse(*argv: str, default_model: Path = BUNDLED) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_flags(parser, str(default_model))
    return parser.parse_args(list(argv))


def test_tiny_profile_makes_its_own_model_unless_given_one(tmp_path: Path) -> None:
    config = build_config(parse("--profile", "tiny", default_model=tmp_path / "missing"))
    assert config.model == CACHE_DIR / "bench-tiny-llama" and config.random_model == TINY_MODEL
    given = build_config(parse("--profile", "tiny", "--model", str(BUNDLED)))
    assert given.model == BUNDLED and given.random_model is None


def test_full_profile_needs_an_existing_model(tmp_path: Path) -> None:
    config = build_config(parse())
    assert config.model == BUNDLED and config.random_model is None
    with pytest.raises(ValueError, match="--model .* has no config.json"):
        build_config(parse(default_model=tmp_path / "missing"))


def test_engine_flags_give_the_deployment_the_engines_limits() -> None:
    settings = EngineSettings.for_workload(Workload(num_requests=4, output_len=8, max_prompt_len=24))
    assert engine_flags(settings) == ("--num-kv-blocks", "8", "--max-num-seqs", "4", "--max-num-batched-tokens",
                                      "2048", "--max-model-len", "32", "--block-size", "16")


def test_peers_json_is_read_when_the_flags_are(tmp_path: Path) -> None:
    """Without --peers-json the run has no peers section to show; a bad file stops the run before
    anything starts, naming the flag."""
    assert build_config(parse("--profile", "tiny")).peers is None
    bad = tmp_path / "peers.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="--peers-json .*peers.json: schema None"):
        build_config(parse("--profile", "tiny", "--peers-json", str(bad)))
    with pytest.raises(ValueError, match=r"--sections takes a comma list of \('online', 'interference'\)"):
        build_config(parse("--profile", "tiny", "--sections", "online,peers"))
