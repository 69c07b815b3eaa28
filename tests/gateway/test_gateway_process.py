"""The gateway process: started for real, it never loads torch (it needs a tokenizer and the
model's limits only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import asyncio, json, os, signal, sys
from pathlib import Path
from plumbing.config import GatewayConfig, ServerConfig
from gateway.server import serve_gateway
from plumbing.servers import read_ready_file

def rss_kib():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

async def main(ready):
    config = GatewayConfig(server=ServerConfig(port=0, ready_file=ready), model=sys.argv[2])
    task = asyncio.ensure_future(serve_gateway(config))
    while not Path(ready).exists():
        if task.done():
            task.result()
        await asyncio.sleep(0.05)
    print(json.dumps({"torch": "torch" in sys.modules, "triton": "triton" in sys.modules,
                      "rss_kib": rss_kib(), "address": read_ready_file(Path(ready).read_text())["public"]}), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # the real shutdown path: drain, then return
    await asyncio.wait_for(task, 30)

asyncio.run(main(sys.argv[1]))
"""


def test_a_started_gateway_has_not_imported_torch(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ready), str(ROOT / "models" / "target")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = next(json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"torch"'))
    assert report["address"].startswith("127.0.0.1:")
    assert report["torch"] is False and report["triton"] is False
