"""The HTTP family: hostile requests to the OpenAI-compatible front (``splitserve http``).

Each case starts from a valid completions or chat body (a few new tokens, a prompt of words or
in-vocabulary token ids) and breaks one thing, by kind (``KINDS``, round-robin, so every kind
is in every profile):

* ``valid``: unchanged (stream or not, n 1-2, logprobs, stop strings, seeds);
* ``overflow``: an integer field past its proto type (uint32, uint64), negative, or 10^400;
* ``wrong_type``: a field (nested ones too: ``stream_options.include_usage``,
  ``messages[0].role``) given a string, boolean, float, list, object or null;
* ``bad_text``: a lone surrogate escape in a string, or bytes that are not UTF-8 (invalid,
  overlong, truncated, encoded surrogates) spliced into the body;
* ``deep``: a field, or the whole body, nested 65 to 100,000 levels;
* ``huge``: a body of 8-12 MB (a prompt, token ids or messages), with a content-length or
  chunked, on a keep-alive connection or one the client closes; in ``large`` also bodies just under the default cap, which reach the gateway;
* ``not_json``: empty, truncated, random bytes, JSON that is not an object, NaN;
* ``unserved``: fields the server refuses (echo, tools, logit_bias, n > 8, penalties);
* ``route``: unknown paths, wrong methods, GETs of /v1/models and /health, a bad
  x-request-id, an Authorization gRPC metadata cannot carry (latin-1, a tab, 20,000
  characters), a garbled traceparent;
* ``stream_cut``: a valid stream of 20-60 tokens whose connection is closed after 1-2 events.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KINDS = ("valid", "overflow", "wrong_type", "bad_text", "deep", "huge", "not_json", "unserved", "route",
         "stream_cut", "valid", "overflow", "wrong_type", "bad_text", "deep")
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
WORDS = ["def", "class", "return", "import", "the", "a", "loop", "x", "=", "(", ")", "\n", "é", "🙂"]
INT_FIELDS = ("max_tokens", "min_tokens", "top_k", "seed", "n", "logprobs", "max_completion_tokens", "top_logprobs")
OVERFLOWS = (2**32, 2**32 - 1, 2**32 + 7, 2**63, 2**64, 2**64 - 1, -1, -(2**63), 10**30, 10**400, 4294967296)
WRONG = ("y", "", True, False, 1.5, -0.0, [], [1], {}, {"a": 1}, None, "1", 10**20)
TYPED_FIELDS = ("model", "prompt", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                "stream", "n", "logprobs", "ignore_eos", "repetition_penalty", "stream_options",
                "stream_options.include_usage", "messages", "messages.0.role", "messages.0.content",
                "messages.0.content.0.text", "top_logprobs", "max_completion_tokens")
BAD_BYTES = (b"\xff", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf8\x88\x80\x80\x80", b"\x80")
SURROGATES = ("\ud800", "\udfff", "x\udbff", "\ud83d", "a\udc00b")
DEPTHS = (65, 66, 100, 1000, 5000, 100_000)
EIGHT_MB = 8 * 1024 * 1024
NEAR_CAP = 4 * 1024 * 1024 - 64 * 1024 - 1  # just under the front's default --max-body-bytes


@dataclass(frozen=True)
class Target:
    """What the cases are drawn for: the served model's name and vocabulary size."""

    model: str
    vocab_size: int


@dataclass(frozen=True)
class HttpCase:
    """One request: ``make`` builds its body when it is sent (the 8 MB ones are not kept)."""

    kind: str
    method: str
    path: str
    make: Callable[[], bytes]
    chunked: bool = False  # send the body chunked (no content-length)
    headers: tuple[tuple[str, str], ...] = ()
    cut_after: int = 0  # a stream: close the connection after this many events (0: read to the end)
    huge: bool = False  # a body past the cap: must be answered 413


def _valid(rng: random.Random, target: Target, chat: bool | None = None, stream: bool | None = None) -> dict[str, Any]:
    chat = rng.random() < 0.3 if chat is None else chat
    body: dict[str, Any] = {"model": target.model, "max_tokens": rng.randint(1, 6), "temperature": rng.choice([0, 0, 0.7])}
    if chat:
        body["messages"] = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 20)))}]
    elif rng.random() < 0.5:
        body["prompt"] = [rng.randrange(target.vocab_size) for _ in range(rng.randint(1, 40))]
    else:
        body["prompt"] = " ".join(rng.choices(WORDS, k=rng.randint(1, 30)))
    body["stream"] = rng.random() < 0.4 if stream is None else stream
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    for name, value in (("n", 2), ("seed", rng.randrange(2**64)), ("stop", ["\n"]), ("top_k", 5)):
        if rng.random() < 0.15:
            body[name] = value
    if rng.random() < 0.15:
        body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    return body


def _path(body: dict[str, Any]) -> str:
    return CHAT if "messages" in body else COMPLETIONS


def _post(kind: str, body: dict[str, Any], **kw: Any) -> HttpCase:
    raw = json.dumps(body).encode()  # ensure_ascii: a lone surrogate becomes its \\u escape
    return HttpCase(kind, "POST", _path(body), lambda: raw, **kw)


def _set(body: dict[str, Any], dotted: str, value: object) -> None:
    """``body[a][b]... = value`` along ``a.b.0.c`` (objects made where missing); where the
    body has no such path (``content`` is a string, not parts), the top-level field instead."""
    parts = dotted.split(".")
    node: Any = body
    for part in parts[:-1]:
        if isinstance(node, list) and node and part.isdigit():
            node = node[min(int(part), len(node) - 1)]
        elif isinstance(node, dict) and not part.isdigit():
            node = node.setdefault(part, {})
        else:
            node = None
            break
    last = parts[-1]
    if isinstance(node, list) and node and last.isdigit():
        node[min(int(last), len(node) - 1)] = value
    elif isinstance(node, dict) and not last.isdigit():
        node[last] = value
    else:
        body[parts[0]] = value


def overflow(rng: random.Random, target: Target) -> HttpCase:
    body = _valid(rng, target)
    value = rng.choice(OVERFLOWS)
    if "prompt" in body and isinstance(body["prompt"], list) and rng.random() < 0.3:
        body["prompt"][rng.randrange(len(body["prompt"]))] = value
    else:
        body[rng.choice(INT_FIELDS)] = value
    return _post("overflow", body)


def wrong_type(rng: random.Random, target: Target) -> HttpCase:
    body = _valid(rng, target, chat=rng.random() < 0.5)
    if "messages" in body and rng.random() < 0.3:
        body["messages"][0]["content"] = [{"type": "text", "text": "hi"}]
    _set(body, rng.choice(TYPED_FIELDS), rng.choice(WRONG))
    return _post("wrong_type", body)


def bad_text(rng: random.Random, target: Target) -> HttpCase:
    body = _valid(rng, target, chat=rng.random() < 0.4)
    field = rng.choice(["model", "stop", "text"])
    if rng.random() < 0.5:  # a lone surrogate, as a JSON escape
        bad = rng.choice(SURROGATES)
        if field == "stop":
            body["stop"] = ["ok", bad]
        elif field == "model":
            body["model"] = bad
        elif "messages" in body:
            body["messages"][0]["content"] += bad
        else:
            body["prompt"] = f"say {bad} twice"
        return _post("bad_text", body)
    raw = json.dumps({**body, "model": target.model + "\x00MARK"}).encode()  # raw bytes spliced in a string
    garbage = rng.choice(BAD_BYTES)
    return HttpCase("bad_text", "POST", _path(body), lambda: raw.replace(b"\\u0000MARK", garbage))


def deep(rng: random.Random, target: Target) -> HttpCase:
    body = _valid(rng, target)
    depth = rng.choice(DEPTHS)
    where = rng.choice(["metadata", "prompt", "stop", "stream_options", "messages", "whole"])
    opening, closing = rng.choice([("[", "]"), ('{"a":', "}")])
    nested = (opening * depth + "1" + closing * depth).encode()
    if where == "whole":
        raw = ("[" * depth).encode() + json.dumps(body).encode() + ("]" * depth).encode()
    else:
        raw = json.dumps({**body, where: "NESTED"}).encode().replace(b'"NESTED"', nested)
    return HttpCase("deep", "POST", _path(body), lambda: raw)


def huge(rng: random.Random, target: Target, size: int = 0) -> HttpCase:
    """A body of ``size`` bytes (default: 8-12 MB, past any cap)."""
    size = size or rng.randint(EIGHT_MB, 12 * 1024 * 1024)
    form = rng.choice(["text", "ids", "messages"])
    seed = rng.randrange(2**32)

    def make() -> bytes:
        r = random.Random(seed)
        head = b'{"model": ' + json.dumps(target.model).encode() + b', "max_tokens": 2, '
        if form == "ids":
            head, unit, tail = head + b'"prompt": [', f"{r.randrange(target.vocab_size)},".encode(), b"0]}"
        elif form == "text":
            head, unit, tail = head + b'"prompt": "', b"word ", b'"}'
        else:
            head, unit, tail = head + b'"messages": [{"role": "user", "content": "', b"word ", b'"}]}'
        room = size - len(head) - len(tail)
        return head + unit * (room // len(unit)) + b" " * (room % len(unit)) + tail  # exactly size bytes

    path = CHAT if form == "messages" else COMPLETIONS
    close = (("connection", "close"),) if rng.random() < 0.25 else ()  # the server must drop the rest first
    return HttpCase("huge", "POST", path, make, chunked=rng.random() < 0.5, headers=close, huge=size > NEAR_CAP + 1)


def not_json(rng: random.Random, target: Target) -> HttpCase:
    valid = json.dumps(_valid(rng, target)).encode()
    raw = rng.choice([b"", b"{", valid[: rng.randrange(1, len(valid))], rng.randbytes(rng.randint(1, 2000)), b"[]",
                      b'"text"', b"null", b"12", b"\xef\xbb\xbf" + valid, valid.replace(b"0", b"NaN", 1),
                      valid[:-1] + b', "temperature": Infinity}', valid + b"{}", b'{"model": "x", "model": 3}'])
    return HttpCase("not_json", "POST", rng.choice([COMPLETIONS, CHAT]), lambda: raw)


def unserved(rng: random.Random, target: Target) -> HttpCase:
    body = _valid(rng, target)
    name, value = rng.choice([("echo", True), ("tools", [{"type": "function"}]), ("logit_bias", {"5": 1}),
                              ("n", 9), ("presence_penalty", 0.5), ("frequency_penalty", -1), ("best_of", 3),
                              ("suffix", "x"), ("model", "another-model"), ("temperature", 2.5)])
    body[name] = value
    return _post("unserved", body)


def route(rng: random.Random, target: Target) -> HttpCase:
    raw = json.dumps(_valid(rng, target, chat=False, stream=False)).encode()
    method, path, headers = rng.choice([
        ("POST", "/v1/nope", ()), ("GET", COMPLETIONS, ()), ("PUT", CHAT, ()), ("DELETE", "/v1/models", ()),
        ("POST", "/", ()), ("GET", "/v1/models", ()), ("GET", "/health", ()), ("POST", "/v1/completions/", ()),
        ("POST", COMPLETIONS, (("x-request-id", "has space"),)), ("POST", COMPLETIONS, (("x-request-id", "a" * 200),)),
        ("POST", COMPLETIONS, (("content-type", "text/plain"),)), ("GET", "/metrics", ()),
        ("POST", COMPLETIONS, (("authorization", "Bearer \u00e9t\u00e9"),)), ("GET", "/v1/models", (("authorization", "a\tb"),)),
        ("POST", CHAT, (("authorization", "Bearer " + "k" * 20_000),)), ("POST", COMPLETIONS, (("traceparent", "00-zz"),))])
    return HttpCase("route", method, path, lambda: raw if method in ("POST", "PUT") else b"", headers=headers)


def stream_cut(rng: random.Random, target: Target) -> HttpCase:
    body = _valid(rng, target, chat=False, stream=True)
    body.update(max_tokens=rng.randint(20, 60), ignore_eos=True)
    return _post("stream_cut", body, cut_after=rng.randint(1, 2))


def valid(rng: random.Random, target: Target) -> HttpCase:
    return _post("valid", _valid(rng, target))


BUILDERS: dict[str, Callable[[random.Random, Target], HttpCase]] = {
    "valid": valid, "overflow": overflow, "wrong_type": wrong_type, "bad_text": bad_text, "deep": deep,
    "huge": huge, "not_json": not_json, "unserved": unserved, "route": route, "stream_cut": stream_cut}


def http_cases(num: int, seed: int, target: Target, near_cap: int = 0) -> list[HttpCase]:
    """``num`` cases, kinds in turn, drawn from ``seed``; plus ``near_cap`` bodies just under
    the cap (they reach the gateway, which tokenizes 4 MB before refusing the prompt's length)."""
    rng = random.Random(f"{seed}:http")
    cases = [BUILDERS[KINDS[i % len(KINDS)]](rng, target) for i in range(num)]
    cases += [huge(rng, target, size=NEAR_CAP) for _ in range(near_cap)]
    return cases
