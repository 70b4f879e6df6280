"""Suffix speculation: drafts from the longest suffix of the context seen before, here or in earlier replies.

Defined in chapter 11 (more tokens per read), after SuffixDecoding (Oliaro et al., 2024, arXiv 2411.04975;
written here from the paper). Prompt lookup (``drafters.PromptLookup``) drafts from the current request's own
context only, and forgets it when the request ends. Agents and tools send the same kind of request again and
again, and their replies repeat earlier replies: a code edit returns most of the file, a SQL generator the same
joins. ``SuffixDrafter`` keeps two indexes of token windows:

- one per request, over its prompt and its output so far, extended as tokens are accepted;
- one global, over the outputs of the requests that finished, shared by every request the loop sees, bounded in
  tokens (``global_tokens``): the oldest reply is forgotten first.

Each index is a *suffix trie* cut at ``depth`` tokens: every window of up to ``depth`` consecutive tokens is a
path from the root, and every node counts the windows that pass through it. To draft for a row, each index
finds the longest suffix of the row's context that is a path (the *match*), then follows the most frequent next
token from there, while the path's probability (each step: the child's count over its parent's) stays above
``min_prob``. The draft may be ``alpha`` times as long as the match (a long match is good evidence, a short one
is not), at most the row's ``k``; with a match shorter than ``min_match`` tokens no draft is made, since a verify
that keeps nothing costs more than a plain step. Of the two indexes' drafts the one with more expected
accepted tokens (the sum of its path probabilities) wins.

Greedy output is unchanged: the verify keeps a drafted token only where it is the model's own argmax
(``verify.verify_tokens``), whatever proposed it.
"""

from __future__ import annotations

import weakref
from collections import deque

# a node: [windows through it, {token: child}, the child token with the most windows (or None)]
COUNT, CHILDREN, BEST = 0, 1, 2


def _node() -> list:
    return [0, {}, None]


class SuffixTrie:
    """Every window of up to ``depth`` consecutive tokens of the sequences added, with counts."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _node()

    def extend(self, active: list, tokens) -> list:
        """Add ``tokens`` to a sequence whose open windows are ``active`` (the nodes of its last depth - 1 windows,
        shortest first; [] for a new sequence) -> the open windows after them. Each token deepens every open
        window by one node and opens a new one at the root: ``depth`` updates a token."""
        root, depth = self.root, self.depth
        for tok in tokens:
            grown = []
            for node in (root, *active):
                kids = node[CHILDREN]
                child = kids.get(tok)
                if child is None:
                    child = kids[tok] = _node()
                child[COUNT] += 1
                best = node[BEST]
                if best is None or (best != tok and child[COUNT] > kids[best][COUNT]):
                    node[BEST] = tok
                grown.append(child)
            active = grown[:depth - 1]  # a window of ``depth`` tokens is complete: it grows no further
        return active

    def remove(self, tokens: list[int]) -> None:
        """Take every window of ``tokens`` out again (what ``extend`` added for them, from an empty start)."""
        for start in range(len(tokens)):
            node = self.root
            for tok in tokens[start:start + self.depth]:
                child = node[CHILDREN][tok]
                child[COUNT] -= 1
                if child[COUNT] == 0:
                    del node[CHILDREN][tok]
                if node[BEST] == tok or child[COUNT] == 0:  # the best may have changed: find it again
                    kids = node[CHILDREN]
                    node[BEST] = max(kids, key=lambda t: kids[t][COUNT]) if kids else None
                if child[COUNT] == 0:
                    break
                node = child

    def match(self, context: list[int]) -> tuple[list | None, int]:
        """The longest suffix of ``context`` (at most ``depth`` - 1 tokens, so something may follow) that is a
        path from the root -> (its node, its length); (None, 0) when not even the last token is."""
        for m in range(min(self.depth - 1, len(context)), 0, -1):
            node = self.root
            for tok in context[len(context) - m:]:
                node = node[CHILDREN].get(tok)
                if node is None:
                    break
            else:
                return node, m
        return None, 0

    @staticmethod
    def continuation(node: list, k: int, min_prob: float) -> tuple[list[int], float]:
        """Follow the most frequent next token from ``node`` for at most ``k`` tokens, while the path's probability
        stays at least ``min_prob`` -> (the tokens, the sum of their path probabilities: the expected number
        accepted, were the index the model)."""
        out, prob, score = [], 1.0, 0.0
        while len(out) < k and node[BEST] is not None:
            child = node[CHILDREN][node[BEST]]
            prob *= child[COUNT] / node[COUNT] if node[COUNT] else 1.0
            if prob < min_prob:
                break
            out.append(node[BEST])
            score += prob
            node = child
        return out, score


class SuffixDrafter:
    """The drafter the token loop calls (``propose``, ``finished``): a suffix trie per request and one global.

    The root of a trie counts no windows, so the first token of a draft is weighed by its share of the windows
    that continue the match, as every later one is."""

    name = "suffix"

    def __init__(self, depth: int = 24, alpha: float = 2.0, min_match: int = 2, min_prob: float = 0.1,
                 global_tokens: int = 262_144):
        if depth < 2 or min_match < 1 or alpha <= 0 or not 0.0 <= min_prob <= 1.0 or global_tokens < 0:
            from ..errors import UnsupportedOptionError

            raise UnsupportedOptionError(f"SuffixDrafter(depth={depth}, alpha={alpha}, min_match={min_match}, "
                                         f"min_prob={min_prob}, global_tokens={global_tokens}): need depth >= 2, "
                                         "min_match >= 1, alpha > 0, 0 <= min_prob <= 1, global_tokens >= 0")
        self.depth, self.alpha, self.min_match, self.min_prob = depth, alpha, min_match, min_prob
        self.global_tokens = global_tokens
        self.shared = SuffixTrie(depth)
        self.replies: deque[list[int]] = deque()  # the global trie's replies, oldest first
        self.held = 0  # their tokens
        # per request: [its trie, its open windows, tokens indexed]; gone with the sequence
        self.own: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.done: weakref.WeakSet = weakref.WeakSet()  # sequences whose reply is in the global trie

    def start(self, cache) -> None:
        pass

    def _own(self, seq, tokens: list[int]) -> SuffixTrie:
        state = self.own.get(seq)
        if state is None:
            state = self.own[seq] = [SuffixTrie(self.depth), [], 0]
        trie, active, n = state
        if len(tokens) > n:  # what was accepted since the last draft
            state[1] = trie.extend(active, tokens[n:])
            state[2] = len(tokens)
        return trie

    def draft(self, seq, k: int) -> list[int]:
        """Up to ``k`` tokens for ``seq`` (maybe none): the better of its own trie's and the global trie's."""
        context, best, best_score = seq.tokens, [], 0.0
        for trie in (self._own(seq, context), self.shared):
            node, m = trie.match(context)
            if m < self.min_match:
                continue
            tokens, score = trie.continuation(node, min(k, int(self.alpha * m)), self.min_prob)
            if score > best_score:
                best, best_score = tokens, score
        return best

    def propose(self, requests: list[tuple[object, int]]) -> list[list[int]]:
        """(sequence, at most k tokens) per row -> each row's draft, its length its own."""
        return [self.draft(seq, k) for seq, k in requests]

    def finished(self, seq) -> None:
        """A request is done: its reply joins the global trie (the oldest replies leave past ``global_tokens``)."""
        if seq in self.done or not seq.output_ids or self.global_tokens == 0:
            return
        self.done.add(seq)
        self.own.pop(seq, None)
        reply = list(seq.output_ids)[-self.global_tokens:]
        self.shared.extend([], reply)
        self.replies.append(reply)
        self.held += len(reply)
        while self.held > self.global_tokens:
            old = self.replies.popleft()
            self.shared.remove(old)
            self.held -= len(old)
