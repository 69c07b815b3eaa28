"""The engine owns its intra-op threads: EngineConfig.num_threads, else every CPU it may use."""

from __future__ import annotations

import os
import threading
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


def _step_in_a_thread(engine: Engine) -> dict:
    """One generate on a fresh thread (as a service's engine thread), reporting its pinning."""
    from engine import SamplingParams
    from splitserve_kernels.native import thread_cpus

    seen: dict = {}

    def run() -> None:
        engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2))
        seen["team"] = thread_cpus()
        seen["own"] = sorted(os.sched_getaffinity(0))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return seen


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_stepping_thread_pins_its_team_one_thread_per_cpu(ckpt_dir: Callable[..., Path],
                                                               restore_threads) -> None:
    from splitserve_kernels.native import native_kernels

    if not native_kernels().available:
        pytest.skip("binding needs the native kernels")
    main_before = sorted(os.sched_getaffinity(0))
    engine = Engine(EngineConfig(model=str(ckpt_dir("llama")), num_kv_blocks=8, num_threads=2))
    seen = _step_in_a_thread(engine)
    cpus = main_before[:2]
    assert engine.runner.thread_cpus == cpus and seen["team"] == cpus and seen["own"] == cpus[:1]
    assert sorted(os.sched_getaffinity(0)) == main_before  # the constructing thread is untouched


def test_one_thread_or_bind_off_pins_nothing(ckpt_dir: Callable[..., Path], restore_threads) -> None:
    for config in (dict(num_threads=1), dict(num_threads=2, bind_threads=False)):
        engine = Engine(EngineConfig(model=str(ckpt_dir("llama")), num_kv_blocks=8, **config))
        seen = _step_in_a_thread(engine)
        assert engine.runner.thread_cpus is None
        assert seen["own"] == sorted(os.sched_getaffinity(0))


def _os_threads() -> set[str]:
    """The process's threads by id. Ids, not a count: other tests' threads in this worker
    process (gRPC's, a closed server's) may end while a test runs."""
    return set(os.listdir("/proc/self/task"))


def _alive_after_settling(threads: set[str]) -> set[str]:
    """Those of ``threads`` still in /proc after they had a bounded time to leave it (an
    exiting thread takes a moment)."""
    for _ in range(200):
        if not threads & _os_threads():
            break
        threading.Event().wait(0.01)
    return threads & _os_threads()


def test_a_passing_thread_returns_raises_and_its_team_ends_with_it(restore_threads) -> None:
    big = torch.ones(1 << 22)
    before = _os_threads()
    seen: dict = {}

    def load() -> float:
        torch.set_num_threads(2)
        total = float((big * 2).sum())  # a parallel op: this thread starts a 2-thread team
        seen["new"] = _os_threads() - before
        seen["self"] = str(threading.get_native_id())
        seen["thread"] = threading.current_thread().name
        return total

    assert cpu_tuning.on_passing_thread(load, name="loader") == 2.0 * (1 << 22)
    assert seen["thread"] == "loader"
    assert seen["self"] in seen["new"] and len(seen["new"]) >= 2, seen  # itself and its team's other thread
    assert _alive_after_settling(seen["new"]) == set()
    with pytest.raises(ValueError, match="bad model"):
        cpu_tuning.on_passing_thread(lambda: (_ for _ in ()).throw(ValueError("bad model")))


def _native() -> None:
    from splitserve_kernels.native import native_kernels

    if not native_kernels().available:
        pytest.skip("needs the native kernels")


def test_a_thread_alone_starts_no_team_and_leaves_the_others(restore_threads) -> None:
    _native()
    torch.set_num_threads(2)
    big = torch.ones(1 << 22)
    seen: dict = {}

    def alone() -> None:
        before = _os_threads()
        assert cpu_tuning.single_intra_op_thread()
        float((big * 2).sum())
        seen.update(threads=torch.get_num_threads(), started=len(_os_threads() - before))

    worker = threading.Thread(target=alone)
    worker.start()
    worker.join()
    assert seen == {"threads": 1, "started": 0}
    assert torch.get_num_threads() == 2  # this thread, and the process's count, are untouched


def test_kv_pages_copied_off_the_stepping_thread_run_on_that_thread_alone(
        ckpt_dir: Callable[..., Path], restore_threads) -> None:
    _native()
    from engine import SamplingParams

    engine = Engine(EngineConfig(model=str(ckpt_dir("llama")), num_kv_blocks=8, num_threads=2))
    stepped, copied = threading.Event(), threading.Event()

    def engine_thread() -> None:  # steps (so it owns the engine's team), then lives on as a service's
        engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2))
        stepped.set()
        copied.wait(timeout=120)

    # Alive while the transport thread runs: an ended thread's id is soon another thread's.
    stepper = threading.Thread(target=engine_thread)
    stepper.start()
    assert stepped.wait(timeout=120)
    runner = engine.runner
    seen: dict = {}

    def transport() -> None:  # a KV channel's sender or receiver thread
        packed = runner.pack_kv([1, 2])
        runner.unpack_kv([3, 4], packed)
        seen["threads"] = torch.get_num_threads()

    worker = threading.Thread(target=transport)
    worker.start()
    worker.join()
    copied.set()
    stepper.join()
    assert seen == {"threads": 1}
    assert torch.equal(runner.pack_kv([3, 4]), runner.pack_kv([1, 2]))
