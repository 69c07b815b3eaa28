"""NCCL binding on any machine (the library loads without a GPU), and NcclChannel's
refusal without CUDA. Skipped only when libnccl.so.2 cannot be found at all."""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import pytest
import torch

from plumbing.transport import TransportError, TransportKind, TransportUnavailable
from plumbing.transport.nccl import NcclChannel, NcclLibrary, find_nccl_library
from plumbing.transport.nccl_lib import (
    ENV_LIBRARY,
    NCCL_UINT8,
    CommConfig,
    _decode_version,
    nccl_datatype,
)


@pytest.fixture(scope="module")
def library() -> NcclLibrary:
    try:
        return NcclLibrary(find_nccl_library())
    except TransportUnavailable as exc:
        pytest.skip(f"libnccl.so.2 not installed: {exc}")


def test_version_is_plausible(library: NcclLibrary) -> None:
    major, minor, patch = library.version()
    assert major == 2 and 0 <= minor < 100 and 0 <= patch < 100


def test_unique_ids_are_128_fresh_bytes(library: NcclLibrary) -> None:
    first, second = library.get_unique_id(), library.get_unique_id()
    assert isinstance(first, bytes) and len(first) == len(second) == 128
    assert first != second


def test_error_strings(library: NcclLibrary) -> None:
    assert library.error_string(0) == "no error"
    assert library.error_string(7)  # ncclInProgress
    with pytest.raises(TransportError, match=r"ncclX failed: .*\[4\]"):
        library.check(4, "ncclX")  # ncclInvalidArgument


def test_library_is_recent_enough_for_non_blocking_communicators(library: NcclLibrary) -> None:
    library.require_non_blocking()


@pytest.mark.parametrize(
    ("code", "version"),
    [(22703, (2, 27, 3)), (21903, (2, 19, 3)), (23203, (2, 32, 3)),
     (2804, (2, 8, 4)), (2708, (2, 7, 8))],
)
def test_version_codes_old_and_new(code: int, version: tuple[int, int, int]) -> None:
    assert _decode_version(code) == version


def test_dtype_mapping() -> None:
    t = torch.empty(3, 4, dtype=torch.bfloat16)
    assert nccl_datatype(t.dtype, t.numel(), t.nbytes) == (9, 12)
    assert nccl_datatype(torch.float32, 5, 20) == (7, 5)
    assert nccl_datatype(torch.bool, 5, 5) == (NCCL_UINT8, 5)  # no NCCL type: bytes
    assert nccl_datatype(torch.complex64, 2, 16) == (NCCL_UINT8, 16)


def test_config_struct_is_the_2_14_layout() -> None:
    config = CommConfig.non_blocking()
    assert ctypes.sizeof(CommConfig) == config.size == 24
    assert (config.magic, config.version, config.blocking) == (0xCAFEBEEF, 21400, 0)


def test_env_var_overrides_and_must_exist(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "libnccl.so.2"
    fake.write_bytes(b"")
    monkeypatch.setenv(ENV_LIBRARY, str(fake))
    assert find_nccl_library() == str(fake)
    monkeypatch.setenv(ENV_LIBRARY, str(tmp_path / "missing.so"))
    with pytest.raises(TransportUnavailable, match=ENV_LIBRARY):
        find_nccl_library()


def test_unloadable_library_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(TransportUnavailable, match="cannot load"):
        NcclLibrary(str(tmp_path / "nope.so"))


def test_bad_unique_id_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="128 bytes"):
        NcclChannel(b"\0" * 127, rank=0)
    with pytest.raises(ValueError, match="128 bytes"):
        NcclChannel("x" * 128, rank=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank"):
        NcclChannel(b"\0" * 128, rank=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_channel_without_cuda_is_unavailable(library: NcclLibrary) -> None:
    with pytest.raises(TransportUnavailable, match="CUDA") as info:
        NcclChannel(library.get_unique_id(), rank=0, timeout_s=1.0)
    assert "nccl transport needs a CUDA device" in str(info.value)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_in_one_process(library: NcclLibrary) -> None:
    unique_id = library.get_unique_id()
    made: dict[int, NcclChannel] = {}
    def join(rank: int) -> None:
        made[rank] = NcclChannel(unique_id, rank, device=rank, timeout_s=60.0)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    sender, receiver = made[0], made[1]
    try:
        assert sender.kind is TransportKind.NCCL
        tensors = [torch.randn(n, device="cuda:0").to(dtype)
                   for n in (1, 1000, 1 << 20) for dtype in (torch.float32, torch.bfloat16)]
        outs = [torch.empty(t.shape, dtype=t.dtype, device="cuda:1") for t in tensors]
        recvs = [receiver.recv(out) for out in outs]
        for t in tensors:
            sender.send(t)
        for future in recvs:
            future.result(60)
        assert all(torch.equal(t.cpu(), o.cpu()) for t, o in zip(tensors, outs, strict=True))
        with pytest.raises(ValueError, match="rank 0 to rank 1"):
            receiver.send(outs[0])
    finally:
        sender.close()
        receiver.close()
