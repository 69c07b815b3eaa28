"""N-gram prompt lookup: propose the tokens that followed the last earlier occurrence of
the sequence's own suffix. No model, no KV; good on code, retrieval and editing work where
outputs copy spans of their context."""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens continuing the longest suffix (``max_n`` down to ``min_n`` tokens)
    that also occurs earlier in ``token_ids``; the most recent earlier match wins. Empty
    when no suffix of at least ``min_n`` tokens recurs."""
    num_tokens = len(token_ids)
    if k < 1 or num_tokens < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        suffix = tokens[num_tokens - n :]
        # Windows starting at 0 .. num_tokens - n - 1 (excluding the suffix itself).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: num_tokens - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
