"""The chaos load: requests drawn from a seed, and their golden (in-process) replies.

Request ``i`` is drawn from ``random.Random(f"{seed}:{i}")`` alone, so the workload does not
depend on timing: the same seed gives the same requests in the same order. Prompts are spans
of this repository's Python source (token ids, or text the gateway tokenizes), short ones
prefilled on the decode worker and long ones remotely. The mix: greedy, seeded sampling,
stop strings, logprobs, min_new_tokens without ignore_eos.

The golden reply of a request is what the in-process ``Engine`` generates for the prompt and
parameters the gateway's own validation derives from it, with the text and stop strings
applied by the gateway's own ``TextStream`` token by token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.client import make_request
from splitserve_api.v1 import common_pb2, gateway_pb2

REPO = Path(__file__).resolve().parents[2]
STOP_STRINGS = ("\n\n", "):", "self.", "return", " = ")
KINDS = (("greedy", 0.45), ("seeded", 0.2), ("stop", 0.12), ("logprobs", 0.08), ("text", 0.15))


@dataclass(frozen=True)
class RequestSpec:
    """One request of the load (reproducible from the seed and its index)."""

    index: int
    kind: str
    prompt: tuple[int, ...] | str
    max_new_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    top_k: int = 0
    stop: tuple[str, ...] = ()
    min_new_tokens: int = 0
    logprobs: int | None = None
    ignore_eos: bool = True

    def to_proto(self) -> gateway_pb2.GenerateRequest:
        prompt = self.prompt if isinstance(self.prompt, str) else list(self.prompt)
        request = make_request(prompt, self.max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                               seed=self.seed, stop=list(self.stop), ignore_eos=self.ignore_eos)
        request.stopping.min_new_tokens = self.min_new_tokens
        if self.logprobs is not None:
            request.sampling.logprobs = self.logprobs
        return request


def corpus_token_ids(tokenizer: Any) -> list[int]:
    text = "\n".join(p.read_text() for p in sorted((REPO / "engine").glob("*.py")))
    return list(tokenizer.encode(text, add_special_tokens=False))


def draw_spec(seed: int, index: int, corpus: list[int], tokenizer: Any, max_new_tokens: int,
              long_prompt_share: float = 0.6) -> RequestSpec:
    rng = random.Random(f"{seed}:{index}")
    kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
    length = rng.randint(32, 256) if rng.random() < long_prompt_share else rng.randint(2, 31)
    start = rng.randrange(0, len(corpus) - length)
    ids = tuple(corpus[start : start + length])
    new = rng.randint(max(2, max_new_tokens // 6), max_new_tokens)
    if kind == "seeded":
        return RequestSpec(index, kind, ids, new, temperature=rng.choice((0.7, 1.0)), seed=rng.getrandbits(32),
                           top_k=rng.choice((0, 40)))
    if kind == "stop":
        return RequestSpec(index, kind, ids, new, stop=tuple(rng.sample(STOP_STRINGS, rng.randint(1, 3))))
    if kind == "logprobs":
        return RequestSpec(index, kind, ids, new, logprobs=rng.choice((0, 2)))
    if kind == "text":
        text = tokenizer.decode(list(ids))
        return RequestSpec(index, kind, text or "def", new, min_new_tokens=rng.randint(0, new),
                           ignore_eos=False)
    return RequestSpec(index, kind, ids, new)


@dataclass(frozen=True)
class Golden:
    token_ids: tuple[int, ...]  # everything the engine generated
    text: str  # as the gateway sends it (stop string cut)
    finish_reason: int
    stop_at: int | None  # a stop string completed at this token: a reply holds at least these

    def matches(self, token_ids: list[int], text: str, finish_reason: int) -> bool:
        """A reply equals this one: the same tokens (with a stop string, a prefix at least
        ``stop_at`` long, since the gateway sends the whole chunk the match ended in)."""
        if text != self.text or finish_reason != self.finish_reason:
            return False
        if self.stop_at is None:
            return tuple(token_ids) == self.token_ids
        return len(token_ids) >= self.stop_at and tuple(token_ids) == self.token_ids[: len(token_ids)]


_REASONS = {"length": common_pb2.FINISH_REASON_LENGTH, "stop": common_pb2.FINISH_REASON_STOP}


def golden_replies(model: str, specs: list[RequestSpec], gateway_flags: dict[str, Any]) -> dict[int, Golden]:
    """In-process reference for every spec (one engine, all prompts at once)."""
    from engine import Engine, EngineConfig
    from engine.models.spec import load_tokenizer
    from gateway.server import model_limits
    from gateway.text import TextStream
    from gateway.validation import validate
    from plumbing.config import GatewayConfig, ServerConfig

    tokenizer = load_tokenizer(model)
    limits = model_limits(GatewayConfig(server=ServerConfig(), model=model, **gateway_flags), tokenizer)
    validated = [validate(s.to_proto(), tokenizer, limits) for s in specs]
    engine = Engine(EngineConfig(model=model, num_threads=1, max_num_seqs=64))
    outs = engine.generate([v.prompt_token_ids for v in validated], [v.params for v in validated])
    golden = {}
    for spec, v, out in zip(specs, validated, outs):
        stream = TextStream(tokenizer, v.prompt_token_ids, v.stop_strings)
        text, n = "", 0
        for n, token in enumerate(out.token_ids, 1):
            text += stream.add([token])
            if stream.stopped:
                break
        text += stream.flush()
        reason = common_pb2.FINISH_REASON_STOP if stream.stopped else _REASONS[out.finish_reason]
        golden[spec.index] = Golden(tuple(out.token_ids), text, reason, n if stream.stopped else None)
    return golden
