"""Every fuzz case of a profile, drawn from the seed: (method, request bytes, family)."""

from __future__ import annotations

import random
import zlib

from google.protobuf.message import Message

from tests.fuzz.methods import GATEWAY, REGISTRY, UNKNOWN_METHOD, WORKERS, Method
from tests.fuzz.profile import FuzzProfile
from tests.fuzz.strategies import draw, generate_request, message_of
from tests.fuzz.wire import MUTATIONS, garbage, mutate
from splitserve_api.v1 import decode_pb2, prefill_pb2

Case = tuple[Method, bytes, str]


def _seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode())


def ground(msg: Message, rng: random.Random, vocab_size: int, decode_address: str) -> Message:
    """Make a worker request plausible enough to get past parsing into the worker's logic:
    a short in-vocabulary prompt, a few tokens, the real decode worker as the target."""
    if isinstance(msg, (decode_pb2.DecodeRequest, prefill_pb2.PrefillRequest)):
        del msg.prompt_token_ids[:]
        msg.prompt_token_ids.extend(rng.randrange(vocab_size) for _ in range(rng.randint(1, 60)))
        msg.stopping.max_new_tokens = rng.randint(1, 6)
        msg.stopping.min_new_tokens = 0
        msg.num_prior_output_tokens = rng.choice((0, 0, 1, len(msg.prompt_token_ids)))
    if isinstance(msg, decode_pb2.DecodeRequest):
        msg.prefill_mode = rng.choice((decode_pb2.PREFILL_MODE_LOCAL, decode_pb2.PREFILL_MODE_REMOTE))
        msg.lease_ms = rng.randint(1, 2000)
        msg.reservation_wait_ms = rng.randint(1, 2000)
    if isinstance(msg, prefill_pb2.PrefillRequest):
        msg.target.address = decode_address
    return msg


def structured(profile: FuzzProfile, seed: int, vocab_size: int, decode_address: str) -> list[Case]:
    rng = random.Random(f"{seed}:ground")
    generate = [m for m in GATEWAY if m.request_type.__name__ == "GenerateRequest"]
    cases = [(generate[i % 2], r.SerializeToString(), "structured:generate")
             for i, r in enumerate(draw(generate_request(vocab_size), profile.generate, _seed(seed, "generate")))]
    for method in [*GATEWAY, *WORKERS, UNKNOWN_METHOD]:
        for i, msg in enumerate(draw(message_of(method.request_type), profile.structured, _seed(seed, method.path))):
            if method in WORKERS and i % 3 == 0:
                msg = ground(msg, rng, vocab_size, decode_address)
            cases.append((method, msg.SerializeToString(), "structured:message"))
    return cases


def wire(profile: FuzzProfile, seed: int, bases: dict[str, list[bytes]]) -> list[Case]:
    """Mutations of the structured cases' serializations, and raw bytes, for every RPC."""
    rng = random.Random(f"{seed}:wire")
    cases = []
    for method in [*GATEWAY, *WORKERS, UNKNOWN_METHOD]:
        own = bases.get(method.path) or [b""]
        for i in range(profile.wire):
            kind = MUTATIONS[i % len(MUTATIONS)]
            cases.append((method, mutate(rng.choice(own), rng, kind), f"wire:{kind}"))
        cases += [(method, garbage(rng), "raw") for _ in range(profile.raw)]
    return cases


def registry(profile: FuzzProfile, seed: int) -> list[Case]:
    cases = []
    for method in REGISTRY:
        for msg in draw(message_of(method.request_type), profile.registry, _seed(seed, method.path)):
            cases.append((method, msg.SerializeToString(), "structured:registry"))
    return cases
