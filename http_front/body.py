"""A request body, read and decoded before anything looks at it.

* At most ``max_bytes`` (``--max-body-bytes``): a ``content-length`` past it is refused
  before a byte of the body is read, and a body without one (chunked) is counted while it
  arrives from the ASGI ``receive``, so the front never holds more than the cap; 413 either
  way. The rest of a refused body is dropped, not kept (``_drop_rest_before_close``), so a
  client still writing reads its 413 rather than a reset connection.
* Strict UTF-8 (RFC 8259): bytes that are not, encoded surrogates included, are a 400. A lone
  surrogate written as a JSON escape (``"\\ud800"``) decodes to a ``str`` that is not valid
  text; ``schema.Text`` refuses it, naming the field.
* JSON nested at most ``MAX_JSON_DEPTH`` levels (400 naming the top-level field that does),
  and no ``NaN``/``Infinity`` (not JSON). The parser recurses once per level, so a body
  nested thousands deep stops it with RecursionError near 1,000, also a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from itertools import chain, compress, repeat
from operator import is_

from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope

from http_front.errors import bad_field, too_large

MAX_JSON_DEPTH = 64  # an OpenAI body nests ~5 deep; a JSON schema inside one (response_format) a few dozen
_DROP_BYTES = 64 << 20  # of a refused body, read and dropped so a closing client reads its 413
_DROP_S = 30.0
_OFF_LOOP_BYTES = 256 << 10  # decode a body this large on a thread (json.loads: ~50 ms per MiB)
_CONTAINERS = frozenset({dict, list})  # what json.loads builds nested values of


async def read_body(scope: Scope, receive: Receive, max_bytes: int) -> bytes:
    """The whole body, or ApiError 413 once it is past ``max_bytes`` (ClientDisconnect if the
    client leaves first)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit() and int(value) > max_bytes:
            await _drop_rest_before_close(scope, receive)
            raise too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect
        chunk = message.get("body", b"")
        size += len(chunk)
        more = message.get("more_body", False)
        if size > max_bytes:
            if more:
                await _drop_rest_before_close(scope, receive)
            raise too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


async def _drop_rest_before_close(scope: Scope, receive: Receive) -> None:
    """Read and drop the rest of a refused body when the connection closes after the answer.

    uvicorn closes such a connection (``connection: close``, HTTP/1.0) as soon as the answer
    is sent, and bytes of the body still unread then make the kernel reset it: the client,
    still writing, never reads its 413. On a keep-alive connection uvicorn drops the rest
    itself, and a client that waits for ``100-continue`` sends nothing more. Bounded: past
    ``_DROP_BYTES`` or ``_DROP_S``, the reset it is."""
    headers = dict(scope.get("headers", ()))
    closing = headers.get(b"connection", b"").lower() == b"close" or scope.get("http_version") == "1.0"
    if not closing or b"100-continue" in headers.get(b"expect", b"").lower():
        return
    dropped = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(_DROP_S):
            while dropped <= _DROP_BYTES:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
                dropped += len(message.get("body", b""))


async def decode(raw: bytes) -> object:
    """``load_json``, on a thread for a large body (the loop keeps serving the others)."""
    if len(raw) > _OFF_LOOP_BYTES:
        return await asyncio.to_thread(load_json, raw)
    return load_json(raw)


def load_json(raw: bytes) -> object:
    """The body's JSON value; ApiError 400 when it is not strict UTF-8, not JSON (``param``
    ``body``), or nests deeper than ``MAX_JSON_DEPTH`` (``param`` the top-level field)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_field("body", f"is not valid UTF-8 (byte {exc.start}: {exc.reason})") from None
    try:
        value = json.loads(text, parse_constant=_not_json)
    except RecursionError:  # the parser recurses per level and stops near 1,000
        raise bad_field("body", f"nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:
        raise bad_field("body", f"is not valid JSON ({exc})") from None
    fields = value.items() if isinstance(value, dict) else [("body", value)]
    for name, item in fields:
        if _deeper_than(item, MAX_JSON_DEPTH - 1 if isinstance(value, dict) else MAX_JSON_DEPTH):
            raise bad_field(name, f"nests deeper than {MAX_JSON_DEPTH} levels (the body's limit)")
    return value


def _deeper_than(value: object, limit: int) -> bool:
    """Whether ``value``'s arrays and objects nest more than ``limit`` levels. Level by level,
    in C-level iterators (a 4 MB body of a million empty arrays takes milliseconds, where a
    Python loop per container took seconds)."""
    level = [value] if type(value) in _CONTAINERS else []
    for _ in range(limit):
        if not level:
            return False
        kinds = list(map(type, level))
        lists = compress(level, map(is_, kinds, repeat(list)))
        dicts = compress(level, map(is_, kinds, repeat(dict)))
        children = list(chain(chain.from_iterable(lists), chain.from_iterable(map(dict.values, dicts))))
        level = list(compress(children, map(_CONTAINERS.__contains__, map(type, children))))
    return bool(level)


def _not_json(constant: str) -> None:
    raise bad_field("body", f"is not valid JSON ({constant} is not a JSON number)")
