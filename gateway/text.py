"""Incremental text for a stream, with stop strings applied.

Tokens arrive in chunks; text is detokenized incrementally. When stop strings are set, the
last ``max_len - 1`` characters are held back (they might be the start of a stop string)
until more text or the end of the stream decides. A match truncates the text before the
stop string and ends the request with FINISH_REASON_STOP.

Tokens are fed to the detokenizer and matched against the stop strings one at a time, however
they arrived, so the text handed out after n tokens depends on those n tokens alone, not on
how they were chunked. A resumed request (``GenerateRequest.resume``) relies on it: the
gateway replays the tokens the client already has (``add`` with the text discarded) and is in
the state the broken stream was in, held-back text included.
"""

from __future__ import annotations

from typing import Any

from engine.detokenizer import IncrementalDetokenizer


class TextStream:
    def __init__(self, tokenizer: Any | None, prompt_token_ids: list[int], stop_strings: tuple[str, ...]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids) if tokenizer is not None else None
        self._stops = stop_strings
        self._holdback = max((len(s) for s in stop_strings), default=1) - 1
        self.text = ""  # everything decoded so far (stop string cut once matched)
        self._emitted = 0  # characters of ``text`` already handed out
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Feed tokens; return the text now safe to send. Sets ``stopped`` on a stop string
        (the tokens after it add no text)."""
        if self._detok is None:
            return ""
        out = []
        for token_id in token_ids:
            if self.stopped:
                break
            out.append(self._add_one(token_id))
        return "".join(out)

    def _add_one(self, token_id: int) -> str:
        self.text += self._detok.add([token_id])  # type: ignore[union-attr]
        if self._stops:
            search_from = max(0, self._emitted - self._holdback)
            hits = [i for i in (self.text.find(s, search_from) for s in self._stops) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                return self._take(len(self.text))
            return self._take(max(self._emitted, len(self.text) - self._holdback))
        return self._take(len(self.text))

    def flush(self) -> str:
        """End of stream: release the held-back text."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        out = self.text[self._emitted:upto]
        self._emitted = max(self._emitted, upto)
        return out
