"""Suffix speculation: drafts from the longest suffix of the context seen before, here or in earlier replies.

Defined in chapter 11 (more tokens per read), after SuffixDecoding (Oliaro et al., 2024, arXiv 2411.04975;
written here from the paper). Prompt lookup (``drafters.PromptLookup``) drafts from the current request's own
context only, and forgets it when the request ends. Agents and tools send the same kind of request again and
again, and their replies repeat earlier replies: a code edit returns most of the file, a SQL generator the same
joins. ``SuffixDrafter`` keeps two indexes:

- one per request, over its prompt and its output so far, extended as tokens are accepted;
- one global, over the outputs of the requests that finished, shared by every request the loop sees, bounded in
  tokens (``global_tokens``): the oldest replies are forgotten first.

The paper indexes each with a suffix tree. Here each is a *suffix automaton* (``SuffixAutomaton``), the suffix
tree's compact cousin: one state for every set of substrings that end at the same places, so it takes at most
twice as many states as tokens, and a token is added in constant time on average (a suffix tree of the last
``d`` tokens' windows takes ``d`` updates a token, which at 64 rows cost milliseconds a step in Python). Each state
knows how often its substrings occur (``occurrences``) and where one occurrence ends.

To draft for a row:
- its own automaton gives, at once, the longest suffix of the context that occurred before, and the tokens that
  followed its first occurrence;
- the global one follows the context token by token (its *match*, kept from step to step) and then the most
  frequent next token, again and again, while the path's probability (each step: how often the longer string
  occurs over how often the shorter one does) stays above ``min_prob``.

The draft may be ``alpha`` times as long as the match (a long match is good evidence, a short one is not), at
most the row's ``k``; with a match shorter than ``min_match`` tokens no draft is made, since a verify that keeps
nothing costs more than a plain step. Of the two drafts the one from the longer match wins.

Greedy output is unchanged: the verify keeps a drafted token only where it is the model's own argmax
(``verify.verify_tokens``), whatever proposed it.
"""

from __future__ import annotations

import weakref
from collections import deque

SEPARATOR = -1  # between two replies in the global automaton: no context holds it, so no match crosses it
REMATCH = 64  # context tokens the global match is rebuilt from after the automaton changed


class SuffixAutomaton:
    """The suffix automaton of a token sequence (several, separated by ``SEPARATOR``), built a token at a time.

    State s stands for the substrings that end at the same set of positions; ``length[s]`` is the longest,
    ``link[s]`` the state of its longest suffix that ends at more places. ``next[s]`` maps a token to the state
    of the longer substring. ``first[s]`` is where the first occurrence ends. Plain ints in flat lists, not an object
    per state: Python's garbage collector walks every container object, and a dict of ints is not one it tracks."""

    def __init__(self):
        self.next: list[dict[int, int]] = [{}]
        self.link, self.length, self.first = [-1], [0], [-1]
        self.tokens: list[int] = []
        self.last = 0
        self.occ: list[int] = [0]  # occurrences (the size of the end set), once ``count`` ran
        self.counted = 0  # tokens ``occ`` covers

    def _state(self, length: int, link: int, first: int, nxt: dict) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.first.append(first)
        self.occ.append(0)
        return len(self.length) - 1

    def append(self, tok: int) -> None:
        """The standard online construction (Blumer et al. 1985): a new state for the whole text, and a clone
        where a state would otherwise stand for substrings that end at different sets of places."""
        nxt, link, length = self.next, self.link, self.length
        pos = len(self.tokens)
        self.tokens.append(tok)
        cur = self._state(length[self.last] + 1, -1, pos, {})
        p = self.last
        while p != -1 and tok not in nxt[p]:
            nxt[p][tok] = cur
            p = link[p]
        if p == -1:
            link[cur] = 0
        else:
            q = nxt[p][tok]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = self._state(length[p] + 1, link[q], self.first[q], dict(nxt[q]))
                while p != -1 and nxt[p].get(tok) == q:
                    nxt[p][tok] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur

    def extend(self, tokens) -> None:
        for tok in tokens:
            self.append(tok)

    def count(self) -> None:
        """Occurrences of every state: 1 for each position's own state, summed up the suffix links, longest
        first (a counting sort by length). Linear in the states."""
        n = len(self.length)
        occ = [0] * n
        for s in range(1, n):
            if self.first[s] >= 0 and self.length[s] == self.first[s] + 1:  # the state made for a position
                occ[s] = 1
        by_length = [[] for _ in range(max(self.length) + 1)]
        for s in range(1, n):
            by_length[self.length[s]].append(s)
        for group in reversed(by_length):
            for s in group:
                if self.link[s] > 0:
                    occ[self.link[s]] += occ[s]
        self.occ, self.counted = occ, len(self.tokens)

    def step(self, state: int, matched: int, tok: int) -> tuple[int, int]:
        """The match of a text extended by ``tok``: (state, length) of its longest suffix that occurs here."""
        nxt, link, length = self.next, self.link, self.length
        while state and tok not in nxt[state]:
            state = link[state]
            matched = length[state]
        if tok in nxt[state]:
            return nxt[state][tok], matched + 1
        return 0, 0

    def match(self, context: list[int]) -> tuple[int, int]:
        """The state and length of the longest suffix of ``context`` that occurs here."""
        state = matched = 0
        for tok in context:
            state, matched = self.step(state, matched, tok)
        return state, matched

    def repeat(self) -> tuple[int, int]:
        """The longest suffix of the whole text that also occurred earlier -> (its length, where its first
        occurrence ends); (0, -1) when even the last token is new."""
        s = self.link[self.last]
        return (self.length[s], self.first[s]) if s > 0 else (0, -1)

    def frequent(self, state: int, k: int, min_prob: float) -> list[int]:
        """Follow the most frequent next token from ``state`` for at most ``k`` tokens, while the path's
        probability stays at least ``min_prob``. Where the counts do not cover a state yet (added since the last
        ``count``), the tokens that followed its first occurrence, up to the end of that reply."""
        nxt, occ = self.next, self.occ
        out, prob = [], 1.0
        while len(out) < k:
            if not occ[state]:  # not counted yet: what followed it the first time
                at = self.first[state] + 1
                for tok in self.tokens[at:at + k - len(out)]:
                    if tok == SEPARATOR:
                        break
                    out.append(tok)
                break
            options = [(occ[s], t) for t, s in nxt[state].items() if t != SEPARATOR]
            if not options:
                break
            n, tok = max(options)
            prob *= n / occ[state]
            if prob < min_prob:
                break
            out.append(tok)
            state = nxt[state][tok]
        return out


class SuffixDrafter:
    """The drafter the token loop calls (``propose``, ``finished``): an automaton per request and one global."""

    name = "suffix"

    def __init__(self, alpha: float = 2.0, min_match: int = 2, min_prob: float = 0.1, global_tokens: int = 262_144):
        if min_match < 1 or alpha <= 0 or not 0.0 <= min_prob <= 1.0 or global_tokens < 0:
            from ..errors import UnsupportedOptionError

            raise UnsupportedOptionError(f"SuffixDrafter(alpha={alpha}, min_match={min_match}, min_prob={min_prob}, "
                                         f"global_tokens={global_tokens}): need alpha > 0, min_match >= 1, "
                                         "0 <= min_prob <= 1, global_tokens >= 0")
        self.alpha, self.min_match, self.min_prob, self.global_tokens = alpha, min_match, min_prob, global_tokens
        self.forget()
        # per request: its automaton, and its match in the global one (state, length, tokens fed, version)
        self.own: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.done: weakref.WeakSet = weakref.WeakSet()  # sequences whose reply is in the global automaton

    def start(self, cache) -> None:
        pass

    def forget(self) -> None:
        """Empty the global automaton (the replies it learned from)."""
        self.shared = SuffixAutomaton()
        self.replies: deque[list[int]] = deque()  # its replies, oldest first
        self.held = 0  # their tokens
        self.version = 0  # changes whenever the global automaton does: a row's match there is rebuilt

    def _state(self, seq, tokens: list[int]) -> list:
        state = self.own.get(seq)
        if state is None:
            state = self.own[seq] = [SuffixAutomaton(), 0, 0, 0, -1]
        own = state[0]
        if len(tokens) > len(own.tokens):  # what was accepted since the last draft
            own.extend(tokens[len(own.tokens):])
        if state[4] != self.version:  # the global automaton changed: match the context's tail again
            state[1], state[2] = self.shared.match(tokens[-REMATCH:])
            state[3], state[4] = len(tokens), self.version
        for tok in tokens[state[3]:]:
            state[1], state[2] = self.shared.step(state[1], state[2], tok)
        state[3] = len(tokens)
        return state

    def draft(self, seq, k: int) -> list[int]:
        """Up to ``k`` tokens for ``seq`` (maybe none): from its own automaton or the global one, whichever matched
        the longer suffix of its context."""
        tokens = seq.tokens
        own, g_state, g_len, _, _ = self._state(seq, tokens)
        m, end = own.repeat()
        if max(m, g_len) < self.min_match:
            return []
        if m >= g_len:  # what followed the first occurrence (it may run into the suffix itself: a repetition)
            return own.tokens[end + 1:end + 1 + min(k, int(self.alpha * m))]
        return self.shared.frequent(g_state, min(k, int(self.alpha * g_len)), self.min_prob)

    def propose(self, requests: list[tuple[object, int]]) -> list[list[int]]:
        """(sequence, at most k tokens) per row -> each row's draft, its length its own."""
        return [self.draft(seq, k) for seq, k in requests]

    def finished(self, seq) -> None:
        """A request is done: its reply joins the global automaton. Past ``global_tokens`` the oldest replies
        leave and it is built again from the rest (down to three quarters of the bound, so that happens once in
        many replies); occurrences are counted again once it grew by a tenth."""
        if seq in self.done or not seq.output_ids or self.global_tokens == 0:
            return
        self.done.add(seq)
        self.own.pop(seq, None)
        reply = list(seq.output_ids)[-self.global_tokens:]
        self.replies.append(reply)
        self.held += len(reply)
        if self.held > self.global_tokens:
            while self.held > 0.75 * self.global_tokens:
                self.held -= len(self.replies.popleft())
            kept = list(self.replies)
            self.shared = SuffixAutomaton()
            for r in kept:
                self.shared.extend([*r, SEPARATOR])
        else:
            self.shared.extend([*reply, SEPARATOR])
        if len(self.shared.tokens) >= 1.1 * self.shared.counted or self.shared.counted < 4096:
            self.shared.count()
        self.version += 1
