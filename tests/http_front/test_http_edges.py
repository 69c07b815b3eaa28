"""Hostile input at the HTTP front (issue #22, items 1-3), each failure reproduced as the
campaign found it, through a real HTTP connection to the front in front of a fake gateway
(``tests/helpers/http_front.py``): every refusal a 4xx with an OpenAI error body naming
``param``, decided before the gateway sees the request; a 500 only for a bug, logged."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import structlog

from http_front.app import Front
from http_front.body import MAX_JSON_DEPTH, load_json, read_body
from http_front.config import DEFAULT_MAX_BODY_BYTES, HttpConfig
from http_front.errors import ApiError, from_rpc
from plumbing.rpc import MAX_MESSAGE_BYTES
from tests.helpers.http_front import MODEL, RunningFront, running_front

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
EIGHT_MB = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def front() -> RunningFront:
    with running_front() as f:
        yield f


def refused(front: RunningFront, path: str, body: bytes | dict, status: int = 400) -> dict:
    """POST ``body``; assert it was refused with ``status`` before reaching the gateway, and
    return the OpenAI error object."""
    before = len(front.gateway.requests)
    reply = front.post(path, body) if isinstance(body, bytes) else front.post_json(path, body)
    assert reply.status == status, reply.body[:300]
    assert len(front.gateway.requests) == before  # validated before anything else
    return reply.error()


def test_a_valid_request_reaches_the_gateway(front: RunningFront) -> None:
    reply = front.post_json(COMPLETIONS, {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4294967295,
                                          "top_k": 4294967295, "seed": 2**64 - 1, "min_tokens": 4294967295})
    assert reply.status == 200 and reply.json()["choices"][0]["text"] == "ab"
    request = front.gateway.requests[-1]
    assert list(request.token_ids.ids) == [1, 2, 3] and request.stopping.max_new_tokens == 4294967295
    assert request.sampling.seed == 2**64 - 1 and request.sampling.top_k == 4294967295


# -- item 1: integers past the proto's types, deep nesting, a lone surrogate ------------------
@pytest.mark.parametrize(("extra", "param"), [
    ({"max_tokens": 4294967296}, "max_tokens"),  # the curl
    ({"min_tokens": 4294967296}, "min_tokens"),
    ({"top_k": 4294967296}, "top_k"),
    ({"prompt": [1, 4294967296]}, "prompt[1]"),
    ({"seed": 2**64}, "seed"),
    ({"max_tokens": 10**400}, "max_tokens"),
    ({"temperature": 10**400}, "temperature"),
])
def test_integers_past_the_proto_types_are_400_naming_the_field(front: RunningFront, extra: dict, param: str) -> None:
    error = refused(front, COMPLETIONS, {"model": MODEL, "prompt": "x", **extra})
    assert (error["param"], error["type"]) == (param, "invalid_request_error")


def test_json_nested_100000_deep_is_400(front: RunningFront) -> None:
    deep = b'{"model": "m", "prompt": "x", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    error = refused(front, COMPLETIONS, deep)
    assert error["param"] == "body" and f"deeper than {MAX_JSON_DEPTH}" in error["message"]
    just_past = b'{"model": "m", "prompt": "x", "metadata": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}"
    assert refused(front, COMPLETIONS, just_past)["param"] == "metadata"  # named when it can be
    at_cap = {"model": MODEL, "prompt": "x", "metadata": json.loads("[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1))}
    assert front.post_json(COMPLETIONS, at_cap).status == 200


@pytest.mark.parametrize(("path", "raw", "param"), [
    (COMPLETIONS, rb'{"model": "m", "prompt": "\ud800"}', "prompt"),  # the case
    (COMPLETIONS, rb'{"model": "m", "prompt": "x", "stop": ["a", "b\udfff"]}', "stop[1]"),
    (CHAT, rb'{"model": "m", "messages": [{"role": "user", "content": "hi \ud83d"}]}', "messages[0].content"),
    (COMPLETIONS, rb'{"model": "\ud800", "prompt": "x"}', "model"),
    (COMPLETIONS, b'{"model": "m", "prompt": "\xed\xa0\x80"}', "body"),  # an encoded surrogate: not UTF-8
    (COMPLETIONS, b'{"model": "m", "prompt": "\xff"}', "body"),
    (COMPLETIONS, b'{"model": "m", "prompt": "x", "temperature": NaN}', "body"),
])
def test_text_that_is_not_utf8_is_400_naming_the_field(front: RunningFront, path: str, raw: bytes, param: str) -> None:
    error = refused(front, path, raw)
    assert error["param"] == param, error
    assert error["message"].isascii()  # the refusal itself is valid JSON in valid UTF-8


def test_a_valid_surrogate_pair_is_text(front: RunningFront) -> None:
    reply = front.post(COMPLETIONS, rb'{"model": "m", "prompt": "\ud83d\ude00"}')
    assert reply.status == 200 and front.gateway.requests[-1].text == "\U0001f600"


# -- item 2: a body past --max-body-bytes is 413, never 429 ---------------------------------
def test_an_8_mb_body_is_413_not_429(front: RunningFront) -> None:
    body = json.dumps({"model": MODEL, "prompt": "word " * (EIGHT_MB // 5)}).encode()
    error = refused(front, COMPLETIONS, body, status=413)  # content-length: refused unread
    assert (error["param"], error["code"]) == ("body", "request_too_large")
    assert str(DEFAULT_MAX_BODY_BYTES) in error["message"]
    chunks = (body[i:i + 65536] for i in range(0, len(body), 65536))  # chunked: counted while read
    before = len(front.gateway.requests)
    reply = front.post(COMPLETIONS, chunks)
    assert reply.status == 413 and reply.error()["code"] == "request_too_large"
    assert len(front.gateway.requests) == before
    assert front.post_json(COMPLETIONS, {"model": MODEL, "prompt": "x"}).status == 200  # still serving


def test_a_client_that_closes_the_connection_reads_its_413_too(front: RunningFront) -> None:
    # uvicorn closes a `connection: close` connection right after the answer; with the body's
    # rest unread the kernel reset it and the client never saw the 413 (urllib sends close).
    body = json.dumps({"model": MODEL, "prompt": "w" * EIGHT_MB}).encode()
    assert front.post(COMPLETIONS, body, {"connection": "close"}).status == 413
    chunks = (body[i:i + 65536] for i in range(0, len(body), 65536))
    assert front.post(COMPLETIONS, chunks, {"connection": "close"}).status == 413


def test_what_is_dropped_of_a_refused_body_is_bounded() -> None:
    pulled: list[int] = []

    async def endless() -> dict:
        pulled.append(1)
        return {"type": "http.request", "body": b"x" * (1 << 20), "more_body": True}

    closing = {"headers": [(b"content-length", str(1 << 40).encode()), (b"connection", b"close")]}
    with pytest.raises(ApiError):
        asyncio.run(read_body(closing, endless, 3 << 20))
    assert len(pulled) == 65  # 64 MiB dropped, then the connection may reset


def test_a_body_at_the_cap_reaches_the_gateway(front: RunningFront) -> None:
    head, tail = b'{"model": "m", "prompt": "', b'"}'
    body = head + b"w" * (DEFAULT_MAX_BODY_BYTES - len(head) - len(tail)) + tail
    assert len(body) == DEFAULT_MAX_BODY_BYTES
    reply = front.post(COMPLETIONS, body)  # the channel's send limit and the gateway's receive fit it
    assert reply.status == 200, reply.body[:300]
    assert len(front.gateway.requests[-1].text) == DEFAULT_MAX_BODY_BYTES - len(head) - len(tail)


def test_a_request_the_gateway_refuses_as_too_large_is_413() -> None:
    # --max-body-bytes above the gateway's 4 MiB: the front sends, the gateway's server refuses.
    with running_front(max_body_bytes=16 << 20) as big:
        error = refused(big, COMPLETIONS, json.dumps({"model": MODEL, "prompt": "w" * EIGHT_MB}).encode(), 413)
        assert error["code"] == "request_too_large" and "larger than max" in error["message"]
    for details in ("Sent message larger than max (8388700 vs. 4194304)",
                    "Received message larger than max (8388700 vs. 4194304)"):
        assert from_rpc(grpc.StatusCode.RESOURCE_EXHAUSTED, details).status == 413
    assert from_rpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "max_in_flight=64 reached").status == 429


def test_the_body_is_read_no_further_than_the_cap() -> None:
    pulled: list[int] = []

    async def endless() -> dict:  # a client that never stops sending 1 MiB chunks
        pulled.append(1)
        return {"type": "http.request", "body": b"x" * (1 << 20), "more_body": True}

    with pytest.raises(ApiError) as caught:
        asyncio.run(read_body({"headers": []}, endless, 3 << 20))
    assert caught.value.status == 413 and len(pulled) == 4  # 4 MiB read: one chunk past 3 MiB
    declared = {"headers": [(b"content-length", str(EIGHT_MB).encode())]}
    with pytest.raises(ApiError):
        asyncio.run(read_body(declared, endless, 3 << 20))
    assert len(pulled) == 4  # refused on its content-length, nothing read


def test_the_channel_send_limit_follows_max_body_bytes() -> None:
    assert HttpConfig().max_send_bytes == MAX_MESSAGE_BYTES  # by default: what the gateway receives
    assert HttpConfig(max_body_bytes=16 << 20).max_send_bytes == (16 << 20) + (64 << 10)
    with pytest.raises(ValueError, match="max_body_bytes"):
        HttpConfig(max_body_bytes=100)


# -- item 3: wrong types are refused, naming the field ---------------------------------------
@pytest.mark.parametrize(("extra", "param"), [
    ({"stream": True, "stream_options": {"include_usage": "y"}}, "stream_options.include_usage"),  # the issue's
    ({"stream_options": "y"}, "stream_options"),
    ({"stream": "true"}, "stream"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 5.0}, "max_tokens"),
    ({"n": True}, "n"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"temperature": "0.5"}, "temperature"),
    ({"stop": {"a": 1}}, "stop"),
])
def test_wrong_types_are_400_naming_the_field(front: RunningFront, extra: dict, param: str) -> None:
    assert refused(front, COMPLETIONS, {"model": MODEL, "prompt": "x", **extra})["param"] == param


def test_chat_wrong_types_are_named(front: RunningFront) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    assert refused(front, CHAT, body)["param"] == "messages[0].content[0].text"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}
    assert refused(front, CHAT, body)["param"] == "logprobs"


@pytest.mark.parametrize("authorization", ["Bearer \u00e9t\u00e9", "Bearer a\tb", "Bearer a\x7fb", "x" * 20_000])
def test_an_authorization_grpc_cannot_carry_is_400(front: RunningFront, authorization: str) -> None:
    # Found by the fuzz family: gRPC refused such metadata (a 500 from an exception; a 20,000
    # character key: RESOURCE_EXHAUSTED, a 429).
    before = len(front.gateway.requests)
    reply = front.post(COMPLETIONS, json.dumps({"model": MODEL, "prompt": "x"}).encode(),
                       {"authorization": authorization})
    assert reply.status == 400 and reply.error()["param"] == "authorization"
    assert len(front.gateway.requests) == before


# -- every other answer is OpenAI-shaped too; a bug is a logged 500 --------------------------
def test_unknown_routes_and_methods_get_openai_bodies(front: RunningFront) -> None:
    missing = front.get("/v1/nope")
    assert missing.status == 404 and missing.error()["type"] == "not_found_error"
    wrong = front.get(COMPLETIONS)
    assert wrong.status == 405 and wrong.error()["code"] == "method_not_allowed"
    empty = front.post(COMPLETIONS, b"")
    assert empty.status == 400 and empty.error()["param"] == "body"


def test_a_bug_is_a_logged_500_with_an_openai_body(monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(self: Front, *args: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(Front, "_run", broken)
    with structlog.testing.capture_logs() as logs, running_front() as f:
        reply = f.post_json(COMPLETIONS, {"model": MODEL, "prompt": "x"})
    assert reply.status == 500 and reply.error()["type"] == "server_error"
    [bug] = [e for e in logs if e["event"] == "http.bug"]
    assert bug["log_level"] == "error" and bug["exc_info"] is True and bug["path"] == COMPLETIONS


def test_load_json_refuses_what_is_not_json() -> None:
    for raw in (b"", b"{", b'{"a": Infinity}', b"[1,]", b'{"a": 1}\xef\xbb\xbf', b"\xef\xbb\xbf{}"):
        with pytest.raises(ApiError) as caught:
            load_json(raw)
        assert (caught.value.status, caught.value.param) == (400, "body")
    assert load_json(b'{"a": [1, {"b": "\\u00e9"}]}') == {"a": [1, {"b": "\u00e9"}]}
