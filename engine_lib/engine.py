"""The user-facing Engine: load a checkpoint at one rung of the ladder, then generate.

Defined in chapter 04; every later chapter adds a rung (see ``stages.py``). Every cached generation,
greedy or sampled, one prompt or a batch, streamed or whole, speculative or not, is made by the token
loop (``loop.local.LocalLoop``: its scheduler, runner and output processor, over chapter 05's contiguous
cache). The naive rung keeps its short loop (``step.naive``), the baseline the book measures against,
and hands its tokens to the same output processor.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .cache.quantized import bytes_per_token, check_kv_cache_dtype
from .errors import ContextLengthError, UnsupportedOptionError
from .loop.local import LocalLoop
from .loop.metrics import Metrics
from .loop.output import OutputProcessor
from .loop.result import GenerationResult, result_of
from .loop.sequence import Delta, Sequence, make_sequence
from .model.checkpoints import checkpoint_label, is_random_checkpoint
from .model.config import Qwen2Config, usable_context
from .model.loader import load_model, resolve_model_dir
from .model.tokenizer import chat_ids, load_tokenizer
from .sampling import SamplingParams
from .speculative import DRAFTERS, DraftModel, drafter_named
from .stages import Stage, get_stage, resolve_device, resolve_dtype, sync
from .step.naive import naive_tokens

SPECULATIVE_TOKENS = 8  # the most tokens an engine's row drafts per step (each row starts at 4 and adapts)


def kernels_or_fused(stage: Stage, device: torch.device, dtype: torch.dtype) -> Stage:
    """The ``triton`` rung where our kernels can run; elsewhere ``fused``, with one warning saying why."""
    from .kernels import unavailable_reason

    reason = unavailable_reason(device, dtype)
    if reason is None:
        return stage
    warnings.warn(f"stage {stage.name!r} runs as 'fused': {reason}", RuntimeWarning, stacklevel=3)
    return get_stage("fused")


def check_fits(needed: int, max_model_len: int, what: str) -> None:
    """The engine's one context check: prompt + new tokens (``needed``) must fit ``max_model_len`` positions."""
    if needed > max_model_len:
        raise ContextLengthError(f"prompt + max_new_tokens = {needed} tokens exceeds {what} "
                                 f"({max_model_len}); shorten the prompt or ask for fewer tokens")


class Engine:
    """Qwen2 inference engine. Build with :meth:`from_pretrained`."""

    def __init__(self, model, tokenizer, model_dir: Path, stage: str | Stage, device: torch.device,
                 max_model_len: int | None = None, speculative=None, kv_cache_dtype: str | None = None):
        self.model, self.tokenizer, self.model_dir = model, tokenizer, model_dir
        self.config: Qwen2Config = model.config
        self.stage = stage if isinstance(stage, Stage) else get_stage(stage)
        self.device, self.dtype = device, model.dtype
        self.is_random = is_random_checkpoint(model_dir)
        self.fixed_len = max_model_len is not None  # a context the caller fixed, not the model's own
        self.max_model_len = usable_context(self.config, max_model_len)
        self.defaults = SamplingParams.from_generation_config(model_dir / "generation_config.json")
        if not self.defaults.stop_token_ids:
            self.defaults = self.defaults.merged(stop_token_ids=[self.config.eos_token_id])
        if self.dtype == torch.float16:
            # cuBLAS may otherwise sum split-K partial products in fp16, which overflows on
            # Qwen's activations; fp32 accumulation costs nothing measurable at decode sizes
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        # how decode steps run at this rung, for this engine's loop and for a server over it:
        # our Triton kernels run eagerly (inductor would treat them as opaque anyway) and are
        # captured in the CUDA graph with the rest of the step
        self.compile_step = self.stage.compiles_step
        self.cuda_graph = self.stage.use_cache and self.stage.fused and device.type == "cuda"
        if speculative is not None and not self.stage.use_cache:
            raise UnsupportedOptionError("speculative decoding needs a KV cache: use a stage other than 'naive'")
        self.drafter = self._drafter(speculative)
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)  # None: the model's dtype; or "int8"
        if self.kv_cache_dtype is not None and not self.stage.use_cache:
            raise UnsupportedOptionError(f"kv_cache_dtype={kv_cache_dtype!r} needs a KV cache: use a stage other "
                                         "than 'naive'")
        # the token loop (chapters 05 and 12), which makes every cached generation's tokens
        self.loop = LocalLoop(model, self.tokenizer, self.max_model_len, self.compile_step, self.cuda_graph,
                              self.drafter, SPECULATIVE_TOKENS, self.fixed_len, self.kv_cache_dtype
                              ) if self.stage.use_cache else None
        # int4: how the integers were chosen (chapter 10); quant.gptq.quantize_engine_gptq sets "gptq" and self.gptq
        self.quant_method = "rtn" if self.stage.quant == "int4" else None
        self.gptq = None

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | os.PathLike, device: str | torch.device | None = None,
                        dtype: str | torch.dtype | None = None, stage: str | None = None,
                        max_model_len: int | None = None, speculative=None, quant_method: str | None = None,
                        calibration=None, kv_cache_dtype: str | None = None) -> Engine:
        """Load a local checkpoint folder or a hub repo id.

        device: cuda if present, else cpu. stage: one of ``naive``, ``kv_cache``, ``half``,
        ``fused``, ``int8``, ``int4``, ``triton`` (default: ``fused`` on GPU, ``kv_cache`` on CPU, where
        compiling is slow). ``triton`` runs as ``fused``, with a warning, where our kernels cannot run.
        dtype: overrides the stage's default (fp32 for the first two rungs, half after).
        max_model_len: fix the context length; longer requests fail up front.
        kv_cache_dtype: ``"auto"`` (the model's dtype, the default) or ``"int8"``: keys and values stored as int8
        with an fp32 scale per token and KV head, 0.52 of a 16-bit cache's bytes (chapter 05, ``cache/quantized.py``).
        speculative: ``"prompt_lookup"``, ``"suffix"`` (drafts from this request and from the replies of the
        engine's earlier ones, ``speculative/suffix.py``), a draft model's folder / hub id, or a drafter object
        (chapter 11): each step verifies several drafted tokens in one forward; greedy output is unchanged.
        quant_method: at the int4 rung, ``"rtn"`` (round-to-nearest, the default) or ``"gptq"``
        (chapter 10, ``quant/gptq.py``), which needs ``calibration``: a list of token-id sequences, or a
        text whose first tokens are used (``gptq.calibration_ids``). The cost is in ``engine.gptq``.
        """
        dev = resolve_device(device)
        st = get_stage(stage or ("fused" if dev.type == "cuda" else "kv_cache"))
        dt = resolve_dtype(dtype, st, dev)
        if st.kernels:
            st = kernels_or_fused(st, dev, dt)
        check_kv_cache_dtype(kv_cache_dtype)  # before the weights load: a bad option costs no wait
        model_dir = resolve_model_dir(path_or_repo_id)
        if quant_method not in (None, "rtn", "gptq"):
            raise UnsupportedOptionError(f"unknown quant_method {quant_method!r}; choose 'rtn' or 'gptq'")
        if quant_method == "gptq" and (st.quant != "int4" or calibration is None):
            raise UnsupportedOptionError("quant_method='gptq' needs stage='int4' and calibration (token-id "
                                         "sequences or a text)")
        # the tokenizer (mostly Python: importing transformers) loads in a thread while the weights are read and
        # copied (torch releases the GIL there): on the 2-core EPYC of the CPU record, about a second sooner
        with ThreadPoolExecutor(1) as pool:
            tokenizer = pool.submit(load_tokenizer, model_dir)
            model = load_model(model_dir, dt, dev, st.model_options(dt))
            engine = cls(model, tokenizer.result(), model_dir, st, dev, max_model_len, speculative, kv_cache_dtype)
        if quant_method == "gptq":
            from .quant.gptq import calibration_ids, quantize_engine_gptq

            if isinstance(calibration, str):
                calibration = calibration_ids(engine.tokenizer, calibration)
            quantize_engine_gptq(engine, calibration)
        return engine

    def _drafter(self, speculative):
        """``"prompt_lookup"``, a draft model's folder / hub id, or a drafter object (``speculative/``).
        A draft model is loaded like this engine's own model: the same loader, dtype and device, at
        the kv_cache rung (cached and unfused; an fp32 residual stream with fp16 weights)."""
        if speculative is None or hasattr(speculative, "propose"):
            return speculative
        if speculative in DRAFTERS:
            return drafter_named(speculative)
        options = get_stage("kv_cache").model_options(self.dtype)
        return DraftModel(load_model(resolve_model_dir(speculative), self.dtype, self.device, options))

    def unquantized(self, dtype: torch.dtype = torch.float32):
        """This engine's checkpoint loaded again without quantization, in ``dtype`` (the weights GPTQ rounds)."""
        import dataclasses

        return load_model(self.model_dir, dtype, self.device, dataclasses.replace(self.model.options, quant=None,
                                                                                  kernels=False))

    @property
    def label(self) -> str:
        kind = checkpoint_label(self.model_dir) or "real weights"
        name = self.device.type if self.device.type == "cpu" else torch.cuda.get_device_name(self.device)
        stage = self.stage.name + ("+gptq" if self.quant_method == "gptq" else "")
        return (f"{self.model_dir.name} [{kind}] | stage={stage} | "
                f"{str(self.dtype).removeprefix('torch.')} | {name}")

    # ------------------------------------------------------ how the steps ran
    @property
    def step_form(self) -> str:
        """How decode steps run now: 'cuda_graph', 'compiled' or 'eager' (the naive rung has no step: 'eager';
        before the first generation, the form they will start in)."""
        return self.loop.step_form if self.loop is not None else "eager"

    @property
    def runs_on(self) -> str:
        """Which cache and step make this engine's tokens, for a timing's caption."""
        if self.loop is None:
            return "no cache: the naive loop of chapter 04"
        return f"contiguous KV cache (chapter 05), decode_step run {self.step_form} (token loop, chapter 12)"

    @property
    def fallbacks(self) -> list[str]:
        """What made the compiled step fall back, in order (empty: it did not, or there is none)."""
        return self.loop.fallbacks if self.loop is not None else []

    @property
    def kv_cache_bytes_per_token(self) -> int:
        """One token's KV cache over every layer, keys and values, an int8 cache's scales included (chapter 05)."""
        return bytes_per_token(self.config, self.dtype, self.kv_cache_dtype)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of KV cache the engine holds now (0 before its first cached generation, and on the naive rung)."""
        return self.loop.kv_cache_bytes if self.loop is not None else 0

    # ----------------------------------------------------------------- inputs
    def encode(self, prompt) -> list[int]:
        """A string (one user message), a list of chat messages, or token ids -> token ids."""
        if isinstance(prompt, str):
            return chat_ids(self.tokenizer, [{"role": "user", "content": prompt}])
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.flatten().tolist()
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            return chat_ids(self.tokenizer, list(prompt))
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(i, int) for i in prompt):
            bad = [i for i in prompt if not 0 <= i < self.config.vocab_size]
            if bad:
                raise UnsupportedOptionError(f"token ids out of range [0, {self.config.vocab_size}): {bad[:5]}")
            return list(prompt)
        raise UnsupportedOptionError("prompt must be a non-empty string, list of chat messages "
                                     "({'role': ..., 'content': ...}) or list of token ids")

    def sampling(self, **options) -> SamplingParams:
        return self.defaults.merged(**options)

    # --------------------------------------------------------------- forward
    @torch.inference_mode()
    def logits(self, input_ids) -> torch.Tensor:
        """float32 logits for every position: (seq, vocab). One full forward, no cache."""
        ids = torch.as_tensor(self.encode(input_ids) if not isinstance(input_ids, torch.Tensor)
                              else input_ids.flatten(), device=self.device).view(1, -1)
        if ids.shape[1] > self.config.max_position_embeddings:
            raise ContextLengthError(f"{ids.shape[1]} tokens exceed max_position_embeddings "
                                     f"({self.config.max_position_embeddings})")
        return self.model(ids)[0].float()

    # ------------------------------------------------------------ generation
    def generate(self, prompt, max_new_tokens: int = 128, **options) -> GenerationResult | list[GenerationResult]:
        """Generate a reply. Options: every field of ``SamplingParams`` (do_sample, temperature, top_k, top_p,
        repetition_penalty, seed, stop_token_ids, stop, ...). Defaults come from generation_config.json;
        ``do_sample=False`` is plain greedy. A list of strings is run as one batch and returns a list of results."""
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            return self.generate_batch(list(prompt), max_new_tokens, **options)
        return self.generate_batch([prompt], max_new_tokens, **options)[0]

    def generate_batch(self, prompts: list, max_new_tokens: int = 128, **options) -> list[GenerationResult]:
        """Several prompts of different lengths in one batch (naive: one by one)."""
        params, prompts_ids = self._request(prompts, max_new_tokens, options)
        if self.loop is None:
            return [self._naive(ids, params) for ids in prompts_ids]
        sync(self.device)
        start = time.perf_counter()
        # (sequences, texts) after each step; the host reads the tokens every 16 steps where it may
        texts: list[list[str]] = [[] for _ in prompts_ids]
        steps, seqs = 0, []
        for step_seqs, made in self.loop.run(prompts_ids, params, reads_every=16):
            steps, seqs = steps + 1, step_seqs
            for row, pieces in enumerate(made):
                texts[row] += pieces
        extra = {"batch": len(prompts_ids), "loop_steps": steps, **self._drafter_name()}
        return [self._result(seq, "".join(t), start, extra) for seq, t in zip(seqs, texts)]

    def stream(self, prompt, max_new_tokens: int = 128, **options) -> Iterator[str]:
        """Yield the reply as text pieces as soon as they form whole UTF-8 characters."""
        params, (ids,) = self._request([prompt], max_new_tokens, options)
        if self.loop is None:
            pieces: list[str] = []
            for _ in self._naive_steps(ids, params, pieces):
                yield from pieces
                pieces.clear()
            return
        for _, texts in self.loop.run([ids], params):
            yield from texts[0]

    def _request(self, prompts: list, max_new_tokens: int, options: dict) -> tuple[SamplingParams, list[list[int]]]:
        """Every generation's checks before any work: the options, at least one new token, room for the longest row."""
        if "max_tokens" in options:
            raise UnsupportedOptionError("give the number of new tokens as max_new_tokens")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise UnsupportedOptionError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
        params = self.sampling(**options, max_tokens=max_new_tokens)
        prompts_ids = [self.encode(p) for p in prompts]
        needed = max(map(len, prompts_ids)) + max_new_tokens
        if self.loop is None:  # the naive loop has no cache: only the model's positions bound it
            check_fits(needed, self.config.max_position_embeddings, "the model's max_position_embeddings")
        else:
            check_fits(needed, self.max_model_len,
                       "max_model_len" if self.fixed_len else "the model's max_position_embeddings")
        return params, prompts_ids

    def _naive_steps(self, ids: list[int], params: SamplingParams, pieces: list[str]) -> Iterator[Sequence]:
        """The naive loop's tokens, each through the output processor (stops, text, times); yields the sequence
        after each token, its new text appended to ``pieces``."""
        output = OutputProcessor(Metrics(), self.config.max_position_embeddings, release=lambda seq: None)
        seq = make_sequence(self.tokenizer, ids, params,
                            sink=lambda ev: pieces.append(ev.text) if isinstance(ev, Delta) and ev.text else None)
        for token in naive_tokens(self.model, torch.tensor([ids], device=self.device), params, params.max_tokens):
            output.append(seq, token, time.perf_counter())
            yield seq
            if seq.done:
                return

    def _naive(self, ids: list[int], params: SamplingParams) -> GenerationResult:
        sync(self.device)
        start = time.perf_counter()
        pieces: list[str] = []
        *_, seq = self._naive_steps(ids, params, pieces)  # the sequence after its last token
        return self._result(seq, "".join(pieces), start, {"batch": 1})

    def _result(self, seq: Sequence, text: str, start: float, extra: dict) -> GenerationResult:
        return result_of(seq, text, start, self.stage.name, str(self.dtype).removeprefix("torch."), str(self.device),
                         extra, speculative=self.drafter is not None)

    def _drafter_name(self) -> dict:
        return {"drafter": self.drafter.name} if self.drafter is not None else {}
