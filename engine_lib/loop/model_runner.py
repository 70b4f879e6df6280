"""Where a token is made: the runner executes one scheduled batch and returns its tokens.

Defined in chapter 12 (serving many users); the engine's own generations run it over chapter 05's
contiguous cache. The scheduler decides (``ScheduledBatch``: which sequences, which new tokens, from
which position, through which blocks); the runner executes, through its cache's driver
(``step.drivers``: ``ContiguousSteps`` or ``PagedSteps``):

- a **prefill** chunk runs eagerly through the cache's forward (its shape changes with every prompt);
- a **decode** batch runs the engine's own ``decode_step`` on the cache's decode state, in the form
  the rung chose (compiled, captured as a CUDA graph on a GPU, or eager). Rows are picked inside the
  step, each with its own settings, logits adjustments and seeded generator; a row with a grammar is
  picked from the step's logits by its ``RowSampler``.
- a decode batch may run **several steps ahead** (``steps``): each step's picked token is the next
  one's input, on the device, and the host reads all of them in one copy at the end. On a GPU that is
  one sync (and one round of the host's scheduling) per ``steps`` tokens instead of per token.
- a **verify** batch (speculative decoding, chapter 11) scores each row's newest token and its
  drafted ones in one forward and keeps the longest prefix the model agrees with, plus the model's
  own next token (``speculative.verify_tokens``).

It returns every row's token ids, the logprobs asked for, and which rows met NaN or Inf.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..cache.paged import PagedKVCache
from ..cpu import kernels as cpu_kernels
from ..sampling import non_finite
from ..speculative.verify import verify_tokens
from ..step.decode import GREEDY
from ..step.drivers import ContiguousSteps, PagedSteps
from ..step.forward import Row
from .logprobs import TokenLogprob, token_logprobs
from .sampler import pick_rows


@dataclass(frozen=True)
class ScheduledBatch:
    """One forward the scheduler asks for: a prefill chunk per sequence, or a decode token per sequence."""

    seqs: tuple  # the Sequences, one per row
    rows: tuple[Row, ...]
    prefill: bool
    all_positions: bool = False  # a prefill that scores its prompt (``echo``) needs every position's logits
    pick: tuple[bool, ...] = ()  # per row: pick a token now (a prefill that ends the prompt; every decode row)
    steps: int = 1  # decode only: tokens per row before the host reads them (the scheduler's ``steps_ahead``)
    drafts: tuple[tuple[int, ...], ...] = ()  # a verify batch: each row's drafted tokens, after its newest token


@dataclass
class StepResult:
    tokens: list[int | None]  # per row: the picked token, None where nothing was picked
    bad: list[int] = field(default_factory=list)  # rows whose logits held NaN or Inf (nothing picked)
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # row -> the picked token's, when asked
    prompt_logits: torch.Tensor | None = None  # (tokens, vocab) for an ``all_positions`` prefill
    ahead: list[list[int]] = field(default_factory=list)  # per row: the tokens after it, when run ahead


class ModelRunner:
    def __init__(self, model, cache, max_model_len: int, compile_step: bool = False, cuda_graph: bool = False,
                 min_rows: int = 1, fixed_read_span: int | None = None, pad_to_bucket: bool | None = None):
        self.model, self.cache = model, cache
        self.device = cache.device
        self.vocab_size = model.config.vocab_size
        self.batch_invariant = bool(fixed_read_span)
        if isinstance(cache, PagedKVCache):
            self.steps = PagedSteps(model, cache, max_model_len, compile_step, cuda_graph, min_rows, fixed_read_span,
                                    pad_to_bucket)
        else:
            self.steps = ContiguousSteps(model, cache, compile_step, cuda_graph)

    @property
    def step_form(self) -> str:
        """How decode batches run now: 'cuda_graph', 'compiled' or 'eager'."""
        return self.steps.step_form

    @property
    def fallbacks(self) -> list[str]:
        """What made the compiled step fall back, in order (empty: it did not)."""
        return self.steps.fallbacks

    @property
    def states(self) -> dict:
        """The decode states made so far, by (batch, read span)."""
        return self.steps.states

    def execute(self, batch: ScheduledBatch) -> StepResult:
        if batch.prefill:
            return self._prefill(batch)
        if batch.drafts:
            return self._verify(batch)
        return self._decode(batch)

    def _rows(self):
        """Batch invariance: on a CPU every row goes through our kernels, whose sums are per row (not a
        matmul library's, whose blocking follows the rows), so a row's numbers do not depend on its batch."""
        return cpu_kernels.rows_alone() if self.batch_invariant else contextlib.nullcontext()

    # ----------------------------------------------------------------- prefill
    def _prefill(self, batch: ScheduledBatch) -> StepResult:
        with self._rows():
            logits = self.steps.forward(list(batch.rows), all_positions=batch.all_positions)
        prompt_logits = None
        if batch.all_positions:  # (batch, tokens, vocab): the last position picks the next token
            prompt_logits, logits = logits[0], logits[:, -1]
        return self._finish_rows(batch, logits, [None] * len(batch.rows), prompt_logits)

    # ------------------------------------------------------------------ verify
    def _verify(self, batch: ScheduledBatch) -> StepResult:
        """Speculative decoding: each row's newest token and its draft in one forward (every position's logits),
        then ``verify_tokens`` with the row's own sampler: the longest prefix of the draft the model agrees
        with, and the model's token after it. All rows reach the host in one copy."""
        # on a CPU our kernels take every verified position, as they take a compiled decode step's rows: the int8
        # and int4 kernels round activations per row as the step does (a dequantized GEMM would not, and in fp32 a
        # near-tie could then go the other way); bf16 rows still share one read of the weights (our GEMM)
        rows = self._rows() if self.batch_invariant or self.device.type != "cpu" else cpu_kernels.every_row()
        with rows:
            logits = self.steps.forward(list(batch.rows), all_positions=True)  # (rows, tokens, vocab)
        found = []
        for i, (seq, draft) in enumerate(zip(batch.seqs, batch.drafts)):
            scores = logits[i, logits.shape[1] - len(draft) - 1:].float()[None]  # (1, k + 1, vocab): rows end together
            drafted = torch.tensor([draft], device=self.device)
            accepted, following = verify_tokens(scores, drafted, seq.sampler.state, seq.sampler.mode)
            found.append(torch.stack([accepted[0], following[0], torch.isfinite(scores).all().long()]))
        tokens, ahead, bad = [], [], []
        for i, ((kept, following, finite), draft) in enumerate(zip(torch.stack(found).tolist(), batch.drafts)):
            made = [*draft[:kept], following] if finite else [None]
            tokens.append(made[0])
            ahead.append(made[1:])
            if not finite:
                bad.append(i)
        good = [i for i in range(len(tokens)) if i not in bad]
        self._seen([batch.seqs[i].sampler for i in good], [[tokens[i], *ahead[i]] for i in good])
        return StepResult(tokens, bad, ahead=ahead)

    # ------------------------------------------------------------------ decode
    def _decode(self, batch: ScheduledBatch) -> StepResult:
        steps = batch.steps if self.steps.runs_ahead(len(batch.rows)) else 1
        st = self.steps.state_for(batch.rows, steps)
        samplers = [s.sampler for s in batch.seqs]
        in_step = [s.in_step for s in samplers]
        mode = st.load_sampling([s for s, k in zip(samplers, in_step) if k]) if all(in_step) else GREEDY
        if mode is GREEDY:  # a batch with host-picked rows: the argmax in the step, the rest on the host
            in_step = [s.plain_greedy for s in samplers]
        with self._rows():  # batch invariance: a row's sums must not depend on the batch's size either
            self.steps.run(st, mode)
        if steps > 1:
            return self._run_ahead(batch, st, mode, samplers, steps)
        rows = st.rows  # where the batch's rows sit in the decode state
        picked = st.token[rows, 0].tolist()  # the one host sync of a decode step
        if mode.penalize:
            self._seen(samplers, [[t] for t in picked])
        tokens = [t if k else None for t, k in zip(picked, in_step)]
        return self._finish_rows(batch, st.logits[rows], tokens, None, st.bad[rows])

    def _run_ahead(self, batch: ScheduledBatch, st, mode, samplers, steps: int) -> StepResult:
        """Steps 2..``steps`` of a batch whose rows are all picked inside the step, with nothing asked of
        the host between tokens (the scheduler's ``steps_ahead`` decides). The tokens wait in a device
        buffer and come over in one copy; a row whose logits went non-finite at any step is flagged."""
        for _ in range(1, steps):  # the state moves its rows on and keeps their picks itself (``advance``)
            if not mode.greedy:
                st.draw_noise(samplers, mode.candidates)
            with self._rows():
                self.steps.run(st, mode)
        rows = st.rows
        picked = st.picked[rows, :steps].tolist()  # the one host sync for ``steps`` tokens of every row
        bad = st.bad[rows]  # any step's non-finite logits (``load`` cleared the flags)
        if mode.penalize:
            self._seen(samplers, picked)
        bad_rows = torch.nonzero(bad).flatten().tolist()
        # no row here has a logits adjustment (``steps_ahead``), so no sampler counts its tokens (``took``)
        return StepResult([None if i in bad_rows else p[0] for i, p in enumerate(picked)], bad_rows,
                          ahead=[[] if i in bad_rows else p[1:] for i, p in enumerate(picked)])

    @staticmethod
    def _seen(samplers, picked: list[list[int]]) -> None:
        """Each row with a repetition penalty keeps the tokens it has seen (the step marked its picks in the
        batch's copy only)."""
        for s, toks in zip(samplers, picked):
            if s.mode.penalize:
                s.state.seen[0, toks] = True

    # --------------------------------------------------------------- the picks
    def _finish_rows(self, batch: ScheduledBatch, logits: torch.Tensor, tokens: list[int | None],
                     prompt_logits: torch.Tensor | None, bad: torch.Tensor | None = None) -> StepResult:
        """Flag non-finite rows, pick the tokens not picked yet, compute the logprobs asked for."""
        if bad is None:
            bad = non_finite(logits)
        bad_rows = torch.nonzero(bad).flatten().tolist()
        out = StepResult([None] * len(batch.rows), bad_rows, prompt_logits=prompt_logits)
        todo = [i for i in range(len(batch.rows)) if (batch.pick[i] if batch.pick else True) and i not in bad_rows]
        host = [i for i in todo if tokens[i] is None]
        if host:  # each by its own sampler (plain greedy rows share one argmax), one host copy for the lot
            picked = pick_rows(logits[host], [batch.seqs[i].sampler for i in host])
            tokens = list(tokens)
            for i, t in zip(host, picked):
                tokens[i] = t
        for i in todo:
            out.tokens[i] = tokens[i]
            batch.seqs[i].sampler.took(tokens[i])
        wants = [i for i in todo if batch.seqs[i].params.logprobs is not None]
        if wants:  # of the raw logits, as vLLM reports by default (see logprobs)
            for i, lp in zip(wants, token_logprobs(logits[wants], [out.tokens[i] for i in wants],
                                                   [batch.seqs[i].params.logprobs for i in wants])):
                out.logprobs[i] = lp
        return out
