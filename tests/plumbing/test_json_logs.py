"""No tracebacks outside the JSON logs (issue #10, item 6): an exception nobody retrieved,
a thread that dies, a library's own log line and a warning all come out as JSON lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import asyncio, gc, logging, threading, warnings
from plumbing.logs import configure_logging, install_loop_exception_handler

configure_logging("test", "info", json=True)

async def main():
    install_loop_exception_handler()
    async def fails():
        raise RuntimeError("nobody awaited me")
    task = asyncio.ensure_future(fails())
    await asyncio.sleep(0.01)
    del task
    gc.collect()  # "Task exception was never retrieved"
    loop = asyncio.get_running_loop()
    loop.call_soon(lambda: 1 / 0)  # a failing callback
    await asyncio.sleep(0.01)

asyncio.run(main())
thread = threading.Thread(target=lambda: [][1], name="dies")
thread.start()
thread.join()
logging.getLogger("grpc._cython.cygrpc").error("a library's own line")
warnings.warn("a library's warning")
raise SystemExit(0)
"""


def test_unretrieved_exceptions_thread_deaths_and_library_lines_are_json() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stderr.splitlines() if line.strip()]  # each one JSON
    events = [line["event"] for line in lines]
    assert events.count("event_loop.unhandled") == 2, events
    unretrieved = next(line for line in lines if "never retrieved" in line.get("message", ""))
    assert "RuntimeError: nobody awaited me" in unretrieved["exception"]
    died = next(line for line in lines if line["event"] == "thread_exception")
    assert died["thread"] == "dies" and "IndexError" in died["exception"]
    assert any(line["event"] == "a library's own line" and line["level"] == "error" for line in lines)
    assert any("a library's warning" in line["event"] for line in lines)
