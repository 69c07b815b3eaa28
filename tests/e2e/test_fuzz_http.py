"""The fuzz campaign's HTTP family without a cluster: cases follow the seed and hold what the
profiles promise (every kind, 8 MB bodies, the depths and overflows), the judge catches each
problem it counts, and a run against the front before a fake gateway finds none."""

from __future__ import annotations

import asyncio
import json

from tests.fuzz.http_cases import EIGHT_MB, KINDS, NEAR_CAP, HttpCase, Target, http_cases
from tests.fuzz.http_send import judge, send_all, summarize_http
from tests.fuzz.profile import LARGE, SMALL
from tests.helpers.http_front import running_front

TARGET = Target("target", 1000)


def test_cases_follow_the_seed_and_cover_every_kind() -> None:
    first, again = http_cases(60, 3, TARGET), http_cases(60, 3, TARGET)
    assert [(c.kind, c.path, c.make()[:2000]) for c in first] == [(c.kind, c.path, c.make()[:2000]) for c in again]
    assert {c.kind for c in first} == set(KINDS)
    huge = [c for c in first if c.kind == "huge"]
    assert huge and all(c.huge and len(c.make()) >= EIGHT_MB for c in huge)
    assert all(json.loads(c.make())["model"] == "target" for c in huge)  # past the cap, yet valid JSON
    [near] = http_cases(0, 3, TARGET, near_cap=1)
    assert len(near.make()) == NEAR_CAP and not near.huge
    assert LARGE.http >= 1000 and sum(1 for c in http_cases(LARGE.http, 0, TARGET) if c.kind == "huge") >= 50
    assert SMALL.http >= 60


def test_the_judge_counts_each_problem() -> None:
    post = HttpCase("valid", "POST", "/v1/completions", lambda: b"{}")
    huge = HttpCase("huge", "POST", "/v1/completions", lambda: b"{}", huge=True)
    error = json.dumps({"error": {"message": "m", "type": "invalid_request_error", "param": "x", "code": None}}).encode()
    json_type = {"content-type": "application/json"}
    assert judge(post, 400, json_type, error) == ""
    assert judge(post, 500, {}, b"Internal Server Error") == "5xx"
    assert judge(post, 400, {}, b"Bad Request") == "not_openai"
    assert judge(post, 400, json_type, b'{"detail": "x"}') == "not_openai"
    assert judge(huge, 429, json_type, error) == "not_413"
    assert judge(huge, 413, json_type, error) == ""
    assert judge(post, 0, {}, b"") == "no_answer"
    sse = {"content-type": "text/event-stream"}
    bug = b'data: {"error": {"message": "m", "type": "server_error", "param": null, "code": "internal"}}\n\n'
    assert judge(post, 200, sse, b'data: {"choices": []}\n\n' + bug) == "5xx"
    assert judge(post, 200, sse, b'data: {"choices": []}\n\ndata: [DONE]\n\n') == ""
    assert judge(post, 200, json_type, b'{"choices": [{"text": "a"}]}') == ""


def test_the_family_against_the_front_finds_no_problem() -> None:
    cases = [c for c in http_cases(45, 1, TARGET) if c.path != "/health"]  # the fake gateway has no health
    with running_front("target") as front:
        results = asyncio.run(send_all(front.address, cases, 4))
    summary = summarize_http(results)
    assert summary["problems"] == {"5xx": 0, "not_openai": 0, "hang": 0, "no_answer": 0, "not_413": 0}, summary
    assert summary["by_kind"]["huge"] == {"413": summary["huge_bodies"]}
    assert summary["by_kind"]["valid"].get("200", 0) >= 3 and summary["by_kind"]["stream_cut"] == {"200": 3}
