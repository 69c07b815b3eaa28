"""Sending the HTTP family's cases with a raw HTTP/1.1 client (asyncio streams: any bytes,
chunked or not, a connection closed mid-stream), and judging each answer.

The body is written while the answer is read, as a client that does not wait for
``100-continue`` would, so a server that answers a too-large body early is read, not
deadlocked. One connection per case (keep-alive unless the case says ``connection: close``).

A verdict per case: its status, and what is wrong with the answer, if anything:
``5xx`` (any status >= 500, or an error event of type ``server_error`` in a stream),
``not_openai`` (an error status whose body is not ``{"error": {"message", "type", "param",
"code"}}``, or a 200 that is not a completion), ``hang`` (no complete answer within the
case's deadline), ``no_answer`` (the connection closed before a status line), ``not_413``
(a body past the cap answered otherwise).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from tests.fuzz.http_cases import HttpCase

HTTP_DEADLINE_S = 60.0
_CHUNK = 256 << 10


@dataclass
class HttpResult:
    kind: str
    status: int  # 0: no status line
    problem: str  # "" when the answer is right
    detail: str
    started: float  # monotonic
    seconds: float


def _request_head(case: HttpCase, host: str, length: int) -> bytes:
    lines = [f"{case.method} {case.path} HTTP/1.1", f"host: {host}"]
    names = {k.lower() for k, _ in case.headers}
    if "content-type" not in names:
        lines.append("content-type: application/json")
    lines += [f"{k}: {v}" for k, v in case.headers]
    if case.method in ("POST", "PUT"):
        lines.append("transfer-encoding: chunked" if case.chunked else f"content-length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _write(writer: asyncio.StreamWriter, case: HttpCase, host: str) -> None:
    body = case.make()
    writer.write(_request_head(case, host, len(body)))
    if case.method not in ("POST", "PUT"):
        return
    for start in range(0, len(body), _CHUNK):
        piece = body[start:start + _CHUNK]
        writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if case.chunked else piece)
        await writer.drain()
    if case.chunked:
        writer.write(b"0\r\n\r\n")
    await writer.drain()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    if not status_line:
        return 0, {}
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str], cut_after: int) -> bytes:
    """The response body (de-chunked); with ``cut_after``, only until that many SSE events."""
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    body = b""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()
            return body
        body += (await reader.readexactly(size + 2))[:-2]
        if cut_after and body.count(b"\n\n") >= cut_after:
            return body


async def send(address: str, case: HttpCase, deadline_s: float = HTTP_DEADLINE_S) -> HttpResult:
    """One case on its own connection; the verdict on its answer."""
    start = time.monotonic()
    host, port = address.rsplit(":", 1)
    status, body, headers, problem = 0, b"", {}, ""
    writer, sending = None, None
    try:
        async with asyncio.timeout(deadline_s):
            reader, writer = await asyncio.open_connection(host, int(port))
            sending = asyncio.ensure_future(_write(writer, case, address))
            status, headers = await _read_head(reader)
            if status:
                body = await _read_body(reader, headers, case.cut_after if status == 200 else 0)
    except TimeoutError:
        problem = "hang"
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        problem, body = "no_answer", repr(exc).encode()
    finally:
        if sending is not None:  # the rest of a refused body is not sent; its errors are moot
            sending.cancel()
            sending.add_done_callback(lambda t: t.cancelled() or t.exception())
        if writer is not None:
            writer.transport.abort()  # a cut stream: the server sees the client leave
    problem = problem or judge(case, status, headers, body)
    return HttpResult(case.kind, status, problem, body[:160].decode("utf-8", "replace"), start,
                      time.monotonic() - start)


def _is_openai_error(value: object) -> bool:
    error = value.get("error") if isinstance(value, dict) else None
    return (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
            and isinstance(error["message"], str) and isinstance(error["type"], str))


def judge(case: HttpCase, status: int, headers: dict[str, str], body: bytes) -> str:
    """What is wrong with an answer ("" if nothing)."""
    if status == 0:
        return "no_answer"
    if status >= 500:
        return "5xx"
    if case.huge and status != 413:
        return "not_413"
    if 300 <= status < 400:  # a redirect (a path with a trailing slash)
        return ""
    if status >= 400:
        try:
            return "" if _is_openai_error(json.loads(body)) else "not_openai"
        except ValueError:
            return "not_openai"
    if headers.get("content-type", "").startswith("text/event-stream"):
        return _judge_stream(body)
    if case.path.startswith("/v1/") and case.method == "POST":
        try:
            return "" if isinstance(json.loads(body).get("choices"), list) else "not_openai"
        except (ValueError, AttributeError):
            return "not_openai"
    return ""


def _judge_stream(body: bytes) -> str:
    for event in body.split(b"\n\n"):
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            continue
        try:
            data = json.loads(event[6:])
        except ValueError:
            return "not_openai"
        if "error" in data:
            return "5xx" if data["error"].get("type") == "server_error" else ("" if _is_openai_error(data) else "not_openai")
        if not isinstance(data.get("choices"), list):
            return "not_openai"
    return ""


async def send_all(address: str, cases: list[HttpCase], concurrency: int) -> list[HttpResult]:
    semaphore = asyncio.Semaphore(concurrency)

    async def one(case: HttpCase) -> HttpResult:
        async with semaphore:
            return await send(address, case)

    return list(await asyncio.gather(*(one(c) for c in cases)))


PROBLEMS = ("5xx", "not_openai", "hang", "no_answer", "not_413")


def summarize_http(results: list[HttpResult]) -> dict:
    """Statuses by kind, problems by name (each must be 0), a few examples of each problem."""
    by_kind: dict[str, dict[str, int]] = {}
    for r in results:
        counts = by_kind.setdefault(r.kind, {})
        counts[str(r.status)] = counts.get(str(r.status), 0) + 1
    problems = {p: sum(1 for r in results if r.problem == p) for p in PROBLEMS}
    examples = [f"{r.kind} {r.status} {r.problem}: {r.detail[:120]}" for r in results if r.problem][:15]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    return {"cases": len(results), "statuses": statuses, "by_kind": by_kind, "problems": problems,
            "examples": examples, "huge_bodies": sum(1 for r in results if r.kind == "huge"),
            "slowest_s": round(max((r.seconds for r in results), default=0.0), 2),
            "seconds": round(max((r.started + r.seconds for r in results), default=0.0)
                             - min((r.started for r in results), default=0.0), 1)}
