"""N-gram prompt lookup: propose the tokens that followed the last earlier occurrence of
the sequence's own suffix. No model, no KV; good on code, retrieval and editing work where
outputs copy spans of their context."""

from __future__ import annotations


def propose_ngram(
    token_ids: list[int], k: int, min_n: int, max_n: int, *, repeat: bool = False
) -> list[int]:
    """Up to ``k`` tokens continuing the longest suffix (``max_n`` down to ``min_n`` tokens)
    that also occurs earlier in ``token_ids``; the most recent earlier match wins. Empty
    when no suffix of at least ``min_n`` tokens recurs.

    The continuation is cut short where the sequence ends, unless ``repeat``: then the
    copy runs on over the tokens it has just proposed (an LZ77-style overlapping copy), so
    a match d tokens back proposes the last d tokens again and again: a loop predicted to
    go on looping. Greedy decoding, of small models especially, falls into such loops,
    and code repeats short patterns; the most recent match of a looping suffix is exactly
    one period back, where the plain copy has fewer than k tokens to offer.

    ``list.index`` scans (in C) for the earlier positions holding the last token, each the
    end of a match of length >= 1; each is extended backwards, most recent first, up to
    ``max_n``. Plain lists on purpose: the lookup runs right after a target forward has
    flushed the caches, where numpy's per-call overhead made it several times slower
    (~80 us against ~45 us for a 500-token sequence).
    """
    num_tokens = len(token_ids)
    if k < 1 or num_tokens < min_n + 1:
        return []
    last, ends, end = token_ids[-1], [], -1
    try:
        while True:  # every earlier position of the last token, ascending
            end = token_ids.index(last, end + 1, num_tokens - 1)
            ends.append(end)
    except ValueError:
        pass
    best_n, best_end = 0, -1
    for end in reversed(ends):  # most recent first, so ties keep the most recent
        n, limit = 1, min(max_n, end + 1)
        while n < limit and token_ids[end - n] == token_ids[num_tokens - 1 - n]:
            n += 1
        if n > best_n:
            best_n, best_end = n, end
            if n == max_n:
                break
    if best_n < min_n:
        return []
    start = best_end + 1
    drafts = token_ids[start : start + k]
    while repeat and len(drafts) < k:  # past the end: copy what was just proposed
        drafts.append(drafts[len(drafts) - (num_tokens - start)])
    return drafts
