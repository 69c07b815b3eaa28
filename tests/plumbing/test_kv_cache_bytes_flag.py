"""A worker's KV pool sized as memory (``--kv-cache-bytes 2GiB``, or ``SPLITSERVE_KV_CACHE_BYTES``),
as vLLM-CPU's ``VLLM_CPU_KVCACHE_SPACE``; ``--num-kv-blocks`` still wins (EngineConfig)."""

from __future__ import annotations

import argparse

import pytest

from engine.config import DEFAULT_KV_CACHE_BYTES
from plumbing.config import add_worker_flags, worker_config
from plumbing.flags import byte_size


@pytest.mark.parametrize(("text", "size"), [
    ("1", 1), ("4096", 4096), ("2GiB", 2 << 30), ("512MiB", 512 << 20), ("512mib", 512 << 20),
    ("1.5GiB", 3 << 29), ("64KiB", 64 << 10), ("1TiB", 1 << 40), ("3GB", 3 * 10**9), ("10kB", 10_000),
    (" 2 GiB ", 2 << 30), ("1_000", 1000), ("7b", 7),
])
def test_sizes_parse_to_bytes(text: str, size: int) -> None:
    assert byte_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "2XB", "two", "-1GiB", "0", "0.1", "1..5GiB", "2 G iB"])
def test_what_is_not_a_size_is_refused_with_its_text(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as err:
        byte_size(text)
    assert repr(text) in str(err.value)


def _engine(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_worker_flags(parser, "tiny")
    return worker_config(parser.parse_args(argv)).engine


def test_the_flag_sizes_the_pool_and_blocks_still_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPLITSERVE_KV_CACHE_BYTES", raising=False)
    monkeypatch.delenv("SPLITSERVE_NUM_KV_BLOCKS", raising=False)
    layers, heads, dim = 30, 3, 64
    block = _engine([]).kv_block_bytes(layers, heads, dim)
    assert _engine([]).resolve_num_kv_blocks(layers, heads, dim) == DEFAULT_KV_CACHE_BYTES // block
    assert _engine(["--kv-cache-bytes", "2GiB"]).resolve_num_kv_blocks(layers, heads, dim) == (2 << 30) // block
    both = _engine(["--kv-cache-bytes", "2GiB", "--num-kv-blocks", "7"])
    assert both.resolve_num_kv_blocks(layers, heads, dim) == 7


def test_the_env_var_sets_it_and_the_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPLITSERVE_NUM_KV_BLOCKS", raising=False)
    monkeypatch.setenv("SPLITSERVE_KV_CACHE_BYTES", "1GiB")
    assert _engine([]).kv_cache_bytes == 1 << 30
    assert _engine(["--kv-cache-bytes", "3MiB"]).kv_cache_bytes == 3 << 20


def test_a_bad_size_is_a_usage_error_naming_the_flag(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SPLITSERVE_KV_CACHE_BYTES", raising=False)
    with pytest.raises(SystemExit) as exit_:
        _engine(["--kv-cache-bytes", "lots"])
    assert exit_.value.code == 2
    assert "--kv-cache-bytes" in capsys.readouterr().err
