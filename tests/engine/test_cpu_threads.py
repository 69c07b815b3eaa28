"""The engine owns its intra-op threads: EngineConfig.num_threads, else every CPU it may use."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, cpu_tuning


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_available_cpus_is_the_affinity_mask() -> None:
    assert cpu_tuning.available_cpus() == len(os.sched_getaffinity(0))


def test_unset_num_threads_takes_the_default(ckpt_dir: Callable[..., Path], monkeypatch,
                                             restore_threads) -> None:
    # tests/conftest.py makes the default 1 for the suite; here it is 3, as on a 3-CPU mask.
    monkeypatch.setattr(cpu_tuning, "default_num_threads", lambda: 3)
    engine = Engine(EngineConfig(model=str(ckpt_dir("llama")), num_kv_blocks=8))
    assert engine.runner.num_threads == 3 and torch.get_num_threads() == 3


def test_explicit_num_threads_wins(ckpt_dir: Callable[..., Path], monkeypatch,
                                   restore_threads) -> None:
    monkeypatch.setattr(cpu_tuning, "default_num_threads", lambda: 3)
    engine = Engine(EngineConfig(model=str(ckpt_dir("llama")), num_kv_blocks=8, num_threads=2))
    assert engine.runner.num_threads == 2 and torch.get_num_threads() == 2


def test_num_threads_is_validated() -> None:
    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(model="m", num_threads=0)
