"""Stop strings: incremental detokenization of a response and the first match of any stop string.

The response text grows a delta per token (decoded over a short window so
that tokenizers which merge across tokens, or split a character over several
tokens, give the same text as decoding the whole response; an unfinished
multi-byte character is held back). After each delta the new text is searched
for every stop string, including matches that straddle the previous text.
The first match ends the request: the text is cut before the stop string (or
after it, with ``include_stop_str_in_output``). ``safe_len`` is how much text
can be shown while the request runs: a possible partial match at the end is
held back, so a stream never shows text a stop string later removes.
"""

from __future__ import annotations

from typing import Any

INCOMPLETE = "\ufffd"  # what a tokenizer decodes an unfinished multi-byte character to


class StopStringMatcher:
    def __init__(self, tokenizer: Any, stops: tuple[str, ...], include_stop: bool, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stops = stops
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        self.text = ""
        self.matched: str | None = None
        self._prefix_offset = 0  # window start: tokens decoded only as context for the next delta
        self._read_offset = 0  # tokens whose text is already in ``self.text``
        self._longest = max(len(s) for s in stops)

    def add(self, token_ids: list[int], check: bool = True) -> str | None:
        """Take the response so far (one token longer than last time); returns the stop string it
        now ends at, or None (always None with ``check`` False: before ``min_new_tokens``)."""
        window = token_ids[self._prefix_offset :]
        before = self.tokenizer.decode(token_ids[self._prefix_offset : self._read_offset],
                                       skip_special_tokens=self.skip_special)
        now = self.tokenizer.decode(window, skip_special_tokens=self.skip_special)
        if len(now) <= len(before) or now.endswith(INCOMPLETE):
            return None  # nothing printable yet (a special token, or half a character)
        delta = now[len(before) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        start = max(0, len(self.text) - self._longest + 1)  # a match may begin in the old text
        self.text += delta
        return self._search(start) if check else None

    def _search(self, start: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = self.text.find(stop, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop)] if self.include_stop else self.text[:at]
        self.matched = stop
        return stop

    def safe_len(self, finished: bool) -> int:
        """Characters of ``text`` no later token can take back."""
        if finished or self.matched is not None:
            return len(self.text)
        hold = 0
        for stop in self.stops:  # the longest end of the text that could still grow into a stop string
            for k in range(min(len(stop) - 1, len(self.text)), hold, -1):
                if self.text.endswith(stop[:k]):
                    hold = k
                    break
        return len(self.text) - hold
