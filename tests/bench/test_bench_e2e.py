"""``splitserve bench --profile tiny`` end to end, from an installed wheel, outside the source
tree: real gateway and worker processes, a tiny workload on the seeded random model the
profile makes. The peers section comes from ``python -m benchmarks.peers --profile tiny`` (the
checkout's: benchmarks/ is not in the wheel) through ``--peers-json``: the fast peers, vLLM
pointed at a missing interpreter, so it must be skipped with a reason. Checks the report's
structure, not its speed.

The wheel is built from exactly what the Dockerfile copies into the image, so a folder the
image lacks fails here too. It goes into a venv of its own whose third-party dependencies
are this interpreter's (a ``.pth`` file; a fully fresh venv installs torch, triton and NCCL,
minutes and gigabytes: ``tools/wheel_check.sh`` does that). The project's own packages come
only from the wheel: the venv's site-packages comes first, this checkout is not on the path
and the editable install's import hook lives in a ``.pth`` file that is never processed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from bench.figures import is_skipped
from bench.report import figure_problems

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def dockerfile_sources() -> list[str]:
    """The paths the Dockerfile's ``COPY`` lines take from the build context (not those
    copying from the build stage)."""
    sources = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words and words[0] == "COPY" and not any(w.startswith("--from") for w in words):
            sources += [w for w in words[1:-1] if not w.startswith("--")]
    return sources


def build_wheel(tmp: Path) -> Path:
    """The wheel built from a copy of the Dockerfile's inputs (never in this checkout)."""
    src = tmp / "src"
    src.mkdir()
    for name in dockerfile_sources():
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*_pb2*.py*"))
        else:
            shutil.copy2(ROOT / name, src / name)
    # Without the native CPU kernels (compiling them takes minutes on two busy cores; they
    # are built and tested by ``make setup``): the wheel's engine runs the torch references.
    env = {**os.environ, "SPLITSERVE_SKIP_NATIVE": "1"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp / "dist"), str(src)], check=True, capture_output=True, timeout=300, env=env)
    (wheel,) = (tmp / "dist").glob("splitserve-*.whl")
    return wheel


def install_in_venv(wheel: Path, venv: Path) -> Path:
    """A venv holding the wheel, its dependencies borrowed from this interpreter; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    deps = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (Path(site) / "borrowed_dependencies.pth").write_text("\n".join(deps) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", "--force-reinstall", str(wheel)], check=True, capture_output=True, timeout=300)
    return python


def clean_env() -> dict[str, str]:
    """This environment without what would point the installed wheel elsewhere: the checkout's
    modules, another model, or a native variant forced from outside (the AVX2 test mode may
    set ``SPLITSERVE_CPU_ISA``; this wheel has no native library, and a forced variant it lacks
    is refused at start)."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "SPLITSERVE_MODEL", "SPLITSERVE_CPU_ISA")}


def run_peers(run_dir: Path) -> Path:
    """The peers file, by the checkout's ``benchmarks.peers`` in a folder of its own (its own
    copy of the seeded tiny model, the same weights as the harness makes)."""
    out, where = run_dir / "peers.json", run_dir / "peers"
    where.mkdir()
    cmd = [sys.executable, "-m", "benchmarks.peers", "--profile", "tiny", "--out", str(out), "--threads", "2",
           "--systems", "engine,hf_generate,vllm_cpu,disaggregated,colocated",
           "--vllm-python", str(run_dir / "no-such-venv" / "python")]
    env = {**clean_env(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def run_tiny(venv: Path, run_dir: Path, peers: Path) -> tuple[dict, subprocess.CompletedProcess]:
    out = run_dir / "report"
    cmd = [str(venv / "bin" / "splitserve"), "bench", "--profile", "tiny", "--out", str(out), "--no-progress",
           "--peers-json", str(peers), "--threads", "2"]
    proc = subprocess.run(cmd, cwd=run_dir, env=clean_env(), capture_output=True, text=True, timeout=600)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else {}
    return report, proc


def test_dockerfile_copies_every_packaged_folder() -> None:
    """What ``[tool.setuptools.packages.find]`` packages, the image must have to install."""
    import tomllib

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    copied = set(dockerfile_sources())
    folders = set()
    for pattern in find["include"]:  # each package's folder: top level, or under another `where`
        name = pattern.split(".")[0].rstrip("*")
        folders |= {where for where in find["where"] if where != "." and (ROOT / where / name).is_dir()} or {name}
    assert "kernels" in folders
    assert folders <= copied


@pytest.mark.slow
def test_tiny_profile_from_a_wheel(tmp_path: Path) -> None:
    """One test (one run of the profile, also under pytest-xdist), four groups of checks."""
    venv = tmp_path / "venv"
    python = install_in_venv(build_wheel(tmp_path), venv)
    check_installed(python, venv)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    report, proc = run_tiny(venv, run_dir, run_peers(run_dir))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (run_dir / ".cache" / "bench-tiny-llama" / "config.json").is_file()  # made by the harness
    assert report["git_commit"] is None and report["splitserve_version"]  # an install, not a checkout
    check_structure(report)
    check_sections(report)
    check_markdown_and_plots(run_dir / "report", report)


def check_installed(python: Path, venv: Path) -> None:
    """The project's packages load from the venv, and ``splitserve bench --help`` works."""
    where = subprocess.run([str(python), "-c", "import bench, engine, plumbing.rpc, splitserve_api.v1.gateway_pb2 as g; "
                            "print(bench.__file__, engine.__file__, plumbing.rpc.__file__, g.__file__)"],
                           cwd=venv, env=clean_env(), check=True, capture_output=True, text=True).stdout.split()
    assert all(Path(path).is_relative_to(venv) for path in where), where
    # the product only: neither the comparisons with other systems nor the tests are installed
    absent = subprocess.run([str(python), "-c", "import importlib.util as u; "
                             "print(u.find_spec('benchmarks'), u.find_spec('tests'))"],
                            cwd=venv, env=clean_env(), check=True, capture_output=True, text=True).stdout.split()
    assert absent == ["None", "None"], absent
    help_text = subprocess.run([str(venv / "bin" / "splitserve"), "bench", "--help"], cwd=venv, env=clean_env(),
                               check=True, capture_output=True, text=True).stdout
    assert "--profile" in help_text


def check_structure(report: dict) -> None:
    for key in ("schema", "machine", "config", "online", "cost", "peers", "interference", "goals", "plots"):
        assert key in report, key
    assert report["failures"] == []
    for section in ("online", "cost", "peers", "interference"):
        assert not is_skipped(report[section]), report[section]
    assert figure_problems(report) == []
    assert report["machine"]["cpu_count"] >= 1
    assert report["config"]["random_model"]["hidden_size"] == 128


def check_sections(report: dict) -> None:
    runs = report["online"]["runs"]
    assert [r["name"] for r in runs] == ["capacity", "sweep-0", "sweep-1", "long_mix"]
    for run in runs:
        figs = run["figures"]
        assert run["counts"]["num_failed"] == 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(figs[key]) == {"mean", "p50", "p90", "p99"}
        # every prompt goes to the prefill worker, so every request moved KV pages
        assert set(figs["kv_transfer_ms"]) == {"mean", "p50", "p90", "p99"}
        assert run["requests"] and run["kv_timeline"]
    assert set(report["cost"]["figures"]) >= {"usd_per_m_output_tokens", "usd_per_m_input_tokens",
                                               "break_even_output_tokens_per_month"}
    assert report["peers"]["source"]["command"][:3] == ["python", "-m", "benchmarks.peers"]
    systems = {row["system"]: row for row in report["peers"]["systems"]}
    assert set(systems) == {"engine", "hf_generate", "vllm_cpu", "disaggregated", "colocated"}
    assert systems["vllm_cpu"]["status"] == "skipped" and "not installed" in systems["vllm_cpu"]["reason"]
    for name in ("engine", "hf_generate", "disaggregated", "colocated"):
        assert systems[name]["status"] == "ok", systems[name]
    # greedy decoding: our deployments give the in-process engine's tokens
    assert systems["disaggregated"]["greedy_match_vs_engine"] == "6/6"
    assert systems["colocated"]["greedy_match_vs_engine"] == "6/6"
    modes = report["interference"]["modes"]
    assert set(modes) == {"disaggregated", "colocated"}
    assert "itl_p99_ratio_disaggregated_vs_colocated" in report["interference"]["figures"]
    goals = {row["goal"]: row for row in report["goals"]}
    assert goals["engine_vs_vllm_cpu"]["met"] is None   # skipped, with the reason
    assert is_skipped(goals["engine_vs_vllm_cpu"]["figures"]["measured"])


def check_markdown_and_plots(out: Path, report: dict) -> None:
    md = (out / "report.md").read_text()
    for heading in ("## Goals", "## Online load", "## Cost", "## Peers", "## Disaggregation vs colocation"):
        assert heading in md
    assert "Measured by `python -m benchmarks.peers`" in md
    assert set(report["plots"]) == {"latency_cdfs.png", "throughput_goodput_vs_rate.png", "peers.png",
                                    "interference_itl_cdf.png", "kv_utilisation.png"}
    for name in report["plots"]:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
        assert f"]({name})" in md
