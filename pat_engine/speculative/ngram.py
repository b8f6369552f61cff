"""``NgramIndex``: where each short n-gram of a growing token list last occurred.

Prompt-lookup decoding: if the last n tokens of a request occurred before (in its own
text, a sibling response or an earlier response to the same prompt), what followed them
then is a good guess of what follows now. The index maps every n-gram (n in
[min_n, max_n]) that has at least one token after it to the end of its latest occurrence;
it is extended in place as the list grows, so each token is indexed once.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self._upto = 0  # n-grams ending before this index are in

    def __len__(self) -> int:
        return self._upto

    def update(self, tokens: Sequence[int]) -> None:
        """Index the n-grams of ``tokens`` (which extends the list indexed so far) that a token follows."""
        if len(tokens) < self._upto:  # not an extension (a caller's mistake): start again
            self._ends.clear()
            self._upto = 0
        for end in range(max(self._upto, self.min_n), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[tuple(tokens[end - n : end])] = end
        self._upto = max(self._upto, len(tokens))

    def end_of(self, gram: tuple[int, ...]) -> int | None:
        """The end of the latest indexed occurrence of ``gram`` (a token follows it there), if any."""
        return self._ends.get(gram)
