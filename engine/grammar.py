"""Compiling constraints into grammar matchers (llguidance), once per schema; no torch.

``GrammarCompiler`` owns the llguidance tokenizer (built on first use: ~0.5 s) and a bounded
LRU cache of compiled matchers keyed by ``Constraint.key`` (a hash of the schema). A cache hit
costs a copy of the compiled matcher (~10 µs). ``submit`` compiles on the compiler's own
thread, so the engine thread never waits on a compile; ``compile`` runs in the caller's
thread (the gateway validates this way). Both raise / fail with ``ConstraintError`` naming the
field and giving the library's reason.

``GrammarState`` is one request's matcher: the tokens the request has produced so far, the
mask of the next token, speculative look-ahead with rollback.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from engine.constraints import Constraint, ConstraintError, grammar_of

DEFAULT_CACHE_SIZE = 256


@dataclass
class GrammarStats:
    """Counters since start (monotonic); read by the services' metrics."""

    num_constrained_requests: int = 0
    num_compiles: int = 0
    num_cache_hits: int = 0
    compile_seconds: float = 0.0
    num_mask_rows: int = 0  # constrained rows masked (one per row per step)
    mask_seconds: float = 0.0  # filling and applying those masks


class GrammarCompiler:
    """Compiles constraints for one tokenizer. Thread-safe (the cache sits under a lock)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        if tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer")
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self.stats = GrammarStats()

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_token_ids or None)
            return self._ll_tokenizer

    def compile(self, constraint: Constraint) -> GrammarState:
        """A fresh matcher for ``constraint`` (from the cache when compiled before)."""
        key = constraint.key
        with self._lock:
            self.stats.num_constrained_requests += 1
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.stats.num_cache_hits += 1
                return GrammarState(template.deep_copy())
        template = self._compile_new(constraint)
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return GrammarState(template.deep_copy())

    def _compile_new(self, constraint: Constraint) -> Any:
        from llguidance import LLMatcher

        tokenizer = self._tokenizer()
        start = time.perf_counter()
        matcher = LLMatcher(tokenizer, grammar_of(constraint), log_level=0)
        elapsed = time.perf_counter() - start
        with self._lock:
            self.stats.num_compiles += 1
            self.stats.compile_seconds += elapsed
        if matcher.is_error():
            raise ConstraintError(f"{_field(constraint)} does not compile: {_first_line(matcher.get_error())}")
        return matcher

    def submit(self, constraint: Constraint) -> Future[GrammarState]:
        """Compile on the compiler's thread; the future fails with ``ConstraintError``."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        return self._executor.submit(self.compile, constraint)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def _field(constraint: Constraint) -> str:
    if constraint.kind.value == "json_schema":
        return f"{constraint.field_name}.json_schema.schema"
    return f"{constraint.field_name}.{constraint.kind.value}"


def _first_line(message: str, limit: int = 300) -> str:
    """The library's reason, trimmed (its messages may quote the whole grammar)."""
    text = " ".join(line.strip() for line in message.strip().splitlines()[:4])
    return text[:limit]


class GrammarState:
    """One request's matcher. Owned by the engine thread once the request is admitted."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_ids: Sequence[int]) -> bool:
        """Advance over tokens the request produced; False if the grammar refuses one."""
        return bool(self._matcher.consume_tokens(list(token_ids)))

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many leading ``token_ids`` the grammar allows from here (state unchanged)."""
        return int(self._matcher.validate_tokens(list(token_ids)))

    def fill_mask(self, address: int, num_bytes: int) -> None:
        """Write the next token's allowed-set bitmask (1 bit per token id, int32 words) at
        ``address`` (a row of an int32 tensor)."""
        self._matcher.unsafe_compute_mask_ptr(address, num_bytes)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {self._matcher.get_error()}")

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete: nothing but EOS may follow."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())
