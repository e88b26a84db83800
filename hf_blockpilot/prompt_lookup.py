"""Prompt lookup: drafts copied from the context, for rounds where the text repeats itself.

When the last few committed tokens already occurred earlier (in the prompt or the answer so far), the tokens
that followed them there are often what comes next: code restating a signature, an answer quoting the
question. `NgramLookup` finds the most recent earlier occurrence of the longest such n-gram and proposes its
continuation. The drafts are a deterministic function of the committed tokens, so verifying them against the
target keeps greedy output identical and sampled output exact (their draft distribution is one-hot).
"""

from __future__ import annotations

import torch

#: Longest and shortest n-gram matched (longest first); why 2 (docs/design-measurements.md).
MAX_NGRAM = 4
MIN_NGRAM = 2


class NgramLookup:
    """Incremental n-gram index over one growing token sequence (one request, batch size 1).

    Each call passes the committed ids so far (they only grow within a request); only the new tokens are
    copied to the host and indexed, so a round costs O(new tokens), not O(context).
    """

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.matched = 0  # the length of the n-gram the last continuation followed (0: none matched)
        self._tokens: list[int] = []
        # n-gram -> index just after its most recent occurrence that has a successor token.
        self._next_index: dict[tuple[int, ...], int] = {}

    def _extend(self, input_ids: torch.LongTensor) -> None:
        seen = len(self._tokens)
        self._tokens.extend(input_ids[0, seen:].tolist())
        # An n-gram ending at `end - 1` is indexed once token `end` exists, so the sequence's own tail is
        # never matched with itself.
        for end in range(max(seen, 1), len(self._tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._next_index[tuple(self._tokens[end - n : end])] = end

    def continuation(self, input_ids: torch.LongTensor, max_tokens: int) -> list[int]:
        """Up to `max_tokens` ids that followed the latest earlier occurrence of the longest matching tail
        n-gram of `input_ids` (1, n); empty if none matches. Its length is `matched`."""
        self._extend(input_ids)
        tokens = self._tokens
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            start = self._next_index.get(tuple(tokens[-n:]))
            if start is not None:
                self.matched = n
                return tokens[start : start + max_tokens]
        self.matched = 0
        return []
