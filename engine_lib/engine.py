"""The user-facing Engine: load a checkpoint at one rung of the ladder, then generate.

Defined in chapter 04; every later chapter adds a rung (see ``stages.py``).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from .errors import ContextLengthError, UnsupportedOptionError
from .loop.local import LocalLoop
from .loop.naive import cached_tokens, left_pad, naive_tokens
from .loop.result import GenerationResult
from .model.checkpoints import checkpoint_label, is_random_checkpoint
from .model.config import Qwen2Config
from .model.loader import load_model, resolve_model_dir
from .model.tokenizer import chat_ids, load_tokenizer
from .sampling.pick import SamplingParams
from .sampling.streaming import IncrementalDecoder
from .speculative.drafters import DraftModel, PromptLookup, speculative_tokens
from .stages import Stage, get_stage, resolve_device, resolve_dtype, sync
from .step.runner import CachedRunner, check_fits


def kernels_or_fused(stage: Stage, device: torch.device, dtype: torch.dtype) -> Stage:
    """The ``triton`` rung where our kernels can run; elsewhere ``fused``, with one warning saying why."""
    from .kernels import unavailable_reason

    reason = unavailable_reason(device, dtype)
    if reason is None:
        return stage
    warnings.warn(f"stage {stage.name!r} runs as 'fused': {reason}", RuntimeWarning, stacklevel=3)
    return get_stage("fused")


class Engine:
    """Qwen2 inference engine. Build with :meth:`from_pretrained`."""

    def __init__(self, model, tokenizer, model_dir: Path, stage: str | Stage, device: torch.device,
                 max_model_len: int | None = None, speculative=None):
        self.model, self.tokenizer, self.model_dir = model, tokenizer, model_dir
        self.config: Qwen2Config = model.config
        self.stage = stage if isinstance(stage, Stage) else get_stage(stage)
        self.device, self.dtype = device, model.dtype
        self.is_random = is_random_checkpoint(model_dir)
        self.defaults = SamplingParams.from_generation_config(model_dir / "generation_config.json")
        if not self.defaults.stop_token_ids:
            self.defaults = self.defaults.merged(stop_token_ids=[self.config.eos_token_id])
        if self.dtype == torch.float16:
            # cuBLAS may otherwise sum split-K partial products in fp16, which overflows on
            # Qwen's activations; fp32 accumulation costs nothing measurable at decode sizes
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        # how decode steps run at this rung, for this engine's runner and for a server over it:
        # our Triton kernels run eagerly (inductor would treat them as opaque anyway) and are
        # captured in the CUDA graph with the rest of the step
        self.compile_step = self.stage.compiles_step
        self.cuda_graph = self.stage.use_cache and self.stage.fused and device.type == "cuda"
        self.runner = self.loop = None
        if self.stage.use_cache:
            # the contiguous cache of chapter 05, which speculative decoding verifies over (chapter 11)
            self.runner = CachedRunner(model, compile_step=self.compile_step, cuda_graph=self.cuda_graph,
                                       max_model_len=max_model_len)
            # the token loop (chapter 12), which makes every other cached generation's tokens, as it does the server's
            self.loop = LocalLoop(model, self.tokenizer, self.runner.max_model_len, self.compile_step, self.cuda_graph)
        if speculative is not None and self.runner is None:
            raise UnsupportedOptionError("speculative decoding needs a KV cache: use a stage other than 'naive'")
        self.drafter = self._drafter(speculative)
        self.spec_stats: dict = {}
        # int4: how the integers were chosen (chapter 10); gptq.quantize_gptq sets "gptq" and self.gptq
        self.quant_method = "rtn" if self.stage.quant == "int4" else None
        self.gptq = None

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | os.PathLike, device: str | torch.device | None = None,
                        dtype: str | torch.dtype | None = None, stage: str | None = None,
                        max_model_len: int | None = None, speculative=None, quant_method: str | None = None,
                        calibration=None) -> Engine:
        """Load a local checkpoint folder or a hub repo id.

        device: cuda if present, else cpu. stage: one of ``naive``, ``kv_cache``, ``half``,
        ``fused``, ``int8``, ``int4``, ``triton`` (default: ``fused`` on GPU, ``kv_cache`` on CPU, where
        compiling is slow). ``triton`` runs as ``fused``, with a warning, where our kernels cannot run.
        dtype: overrides the stage's default (fp32 for the first two rungs, half after).
        max_model_len: fix the KV cache length; longer requests fail up front.
        speculative: ``"prompt_lookup"`` or a draft model's folder / hub id (chapter 11): each step
        verifies several drafted tokens in one forward; greedy output is unchanged.
        quant_method: at the int4 rung, ``"rtn"`` (round-to-nearest, the default) or ``"gptq"``
        (chapter 10, ``gptq.py``), which needs ``calibration``: a list of token-id sequences, or a
        text whose first tokens are used (``gptq.calibration_ids``). The cost is in ``engine.gptq``.
        """
        dev = resolve_device(device)
        st = get_stage(stage or ("fused" if dev.type == "cuda" else "kv_cache"))
        dt = resolve_dtype(dtype, st, dev)
        if st.kernels:
            st = kernels_or_fused(st, dev, dt)
        model_dir = resolve_model_dir(path_or_repo_id)
        if quant_method not in (None, "rtn", "gptq"):
            raise UnsupportedOptionError(f"unknown quant_method {quant_method!r}; choose 'rtn' or 'gptq'")
        if quant_method == "gptq" and (st.quant != "int4" or calibration is None):
            raise UnsupportedOptionError("quant_method='gptq' needs stage='int4' and calibration (token-id "
                                         "sequences or a text)")
        model = load_model(model_dir, dt, dev, st.model_options(dt))
        engine = cls(model, load_tokenizer(model_dir), model_dir, st, dev, max_model_len, speculative)
        if quant_method == "gptq":
            from .quant.gptq import calibration_ids, quantize_gptq

            if isinstance(calibration, str):
                calibration = calibration_ids(engine.tokenizer, calibration)
            quantize_gptq(engine, calibration)
        return engine

    def _drafter(self, speculative):
        """``"prompt_lookup"``, a draft model's folder / hub id, or a drafter object (``speculative.py``).
        A draft model is loaded like this engine's own model: the same loader, dtype and device, at
        the kv_cache rung (cached and unfused; an fp32 residual stream with fp16 weights)."""
        if speculative is None or hasattr(speculative, "propose"):
            return speculative
        if speculative == "prompt_lookup":
            return PromptLookup()
        options = get_stage("kv_cache").model_options(self.dtype)
        return DraftModel(load_model(resolve_model_dir(speculative), self.dtype, self.device, options))

    @property
    def label(self) -> str:
        kind = checkpoint_label(self.model_dir) or "real weights"
        name = self.device.type if self.device.type == "cpu" else torch.cuda.get_device_name(self.device)
        stage = self.stage.name + ("+gptq" if self.quant_method == "gptq" else "")
        return (f"{self.model_dir.name} [{kind}] | stage={stage} | "
                f"{str(self.dtype).removeprefix('torch.')} | {name}")

    # ------------------------------------------------------ how the steps ran
    def _token_maker(self):
        """What runs the decode steps: the loop's runner, or the contiguous runner of a speculative engine."""
        if self.loop is not None and self.drafter is None:
            return self.loop.scheduler.runner if self.loop.scheduler is not None else None
        return self.runner

    @property
    def step_form(self) -> str:
        """How decode steps run now: 'cuda_graph', 'compiled' or 'eager' (the naive rung has no step: 'eager';
        before the first generation, the form they will start in)."""
        maker = self._token_maker()
        if maker is None:
            return "eager" if self.runner is None else self.runner.step_form
        return maker.step_form

    @property
    def fallbacks(self) -> list[str]:
        """What made the compiled step fall back, in order (empty: it did not, or there is none)."""
        maker = self._token_maker()
        return maker.fallbacks if maker is not None else []

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of KV cache the engine holds now (0 before its first cached generation, and on the naive rung)."""
        if self.loop is not None and self.drafter is None:
            return self.loop.kv_cache_bytes
        return self.runner.kv_cache_bytes if self.runner is not None else 0

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
    def _token_chunks(self, prompts_ids: list[list[int]], params: SamplingParams, max_new_tokens: int,
                      sync_every: int) -> Iterator[list[list[int]]]:
        """Each row's new tokens, a chunk at a time, as host lists (speculative rows differ in length)."""
        self._check_new_tokens(prompts_ids, max_new_tokens)
        b = len(prompts_ids)
        ids, valid = left_pad(prompts_ids, pad=params.stop_token_ids[-1] if params.stop_token_ids else 0)
        ids, valid = ids.to(self.device), valid.to(self.device)
        if self.runner is None:
            if b != 1:
                raise UnsupportedOptionError("the naive stage runs one prompt at a time")
            return (chunk.tolist() for chunk in naive_tokens(self.model, ids, params, max_new_tokens))
        if self.drafter is not None:
            return speculative_tokens(self.runner, self.drafter, ids, valid, [params] * b, max_new_tokens,
                                      self.spec_stats)
        return (chunk.tolist() for chunk in cached_tokens(self.runner, ids, valid, [params] * b, max_new_tokens,
                                                          sync_every))

    def generate(self, prompt, max_new_tokens: int = 128, **options) -> GenerationResult | list[GenerationResult]:
        """Generate a reply. Options: do_sample, temperature, top_k, top_p, repetition_penalty,
        seed, stop_token_ids. Defaults come from generation_config.json; ``do_sample=False`` is
        plain greedy. A list of strings is run as one batch and returns a list of results."""
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            return self.generate_batch(list(prompt), max_new_tokens, **options)
        return self.generate_batch([prompt], max_new_tokens, **options)[0]

    def generate_batch(self, prompts: list, max_new_tokens: int = 128, **options) -> list[GenerationResult]:
        """Several prompts of different lengths in one left-padded batch (naive: one by one)."""
        if self.runner is None and len(prompts) > 1:
            return [self.generate_batch([p], max_new_tokens, **options)[0] for p in prompts]
        params = self.sampling(**options)
        prompts_ids = [self.encode(p) for p in prompts]
        if self.loop is not None and self.drafter is None:
            return self._loop_results(prompts_ids, params, max_new_tokens)
        stops = set(params.stop_token_ids)
        outputs: list[list[int]] = [[] for _ in prompts_ids]
        finished = [False] * len(prompts_ids)
        self._sync()
        start = time.perf_counter()
        first = None
        steps = 0
        for chunk in self._token_chunks(prompts_ids, params, max_new_tokens, sync_every=16):
            if first is None:
                first = time.perf_counter()
            steps += max(len(r) for r in chunk)
            for row, tokens in enumerate(chunk):
                for tok in tokens:
                    if finished[row]:
                        break
                    if tok in stops:
                        finished[row] = True
                    else:
                        outputs[row].append(tok)
                finished[row] = finished[row] or len(outputs[row]) >= max_new_tokens
            if all(finished):
                break
        end = time.perf_counter()
        decode_rate = (steps - 1) / (end - first) if steps > 1 and end > first else float("nan")
        return [GenerationResult(
            token_ids=out, text=self.tokenizer.decode(out, skip_special_tokens=True),
            prompt_tokens=len(p), ttft_s=first - start, decode_tokens_per_s=decode_rate,
            finish_reason="length" if len(out) >= max_new_tokens else "stop",
            stage=self.stage.name, dtype=str(self.dtype).removeprefix("torch."), device=str(self.device),
            extra={"batch": len(prompts_ids), "decode_steps": steps, **self._spec_extra()})
            for p, out in zip(prompts_ids, outputs)]

    def _loop_results(self, prompts_ids: list[list[int]], params: SamplingParams,
                      max_new_tokens: int) -> list[GenerationResult]:
        """Every prompt through the token loop at once (chapter 12), in this thread; TTFT from the call's start."""
        self._check_new_tokens(prompts_ids, max_new_tokens)
        self._sync()
        start = time.perf_counter()
        # (sequences, texts) after each step; the host reads the tokens every 16 steps, as the contiguous loop did
        made = list(self.loop.run(prompts_ids, params, max_new_tokens, reads_every=16))
        seqs, steps = made[-1][0], len(made)
        results = []
        for seq in seqs:
            out, first, last = seq.output_ids, seq.first_token_at, seq.last_token_at
            rate = (len(out) - 1) / (last - first) if len(out) > 1 and last > first else float("nan")
            results.append(GenerationResult(
                token_ids=list(out), text=self.tokenizer.decode(out, skip_special_tokens=True),
                prompt_tokens=len(seq.prompt_ids), ttft_s=first - start, decode_tokens_per_s=rate,
                finish_reason="length" if len(out) >= max_new_tokens else "stop",
                stage=self.stage.name, dtype=str(self.dtype).removeprefix("torch."), device=str(self.device),
                extra={"batch": len(prompts_ids), "loop_steps": steps}))
        return results

    def _check_new_tokens(self, prompts_ids: list[list[int]], max_new_tokens: int) -> None:
        """Every generation's checks before any work: at least one new token, and room for the longest row."""
        if max_new_tokens < 1:
            raise UnsupportedOptionError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        needed = max(map(len, prompts_ids)) + max_new_tokens
        if self.runner is None:  # the naive loop has no cache: only the model's positions bound it
            check_fits(needed, self.config.max_position_embeddings, "the model's max_position_embeddings")
        else:
            self.runner.check_fits(needed)

    def _spec_extra(self) -> dict:
        s = self.spec_stats
        if self.drafter is None or not s.get("rounds"):
            return {}
        return {"drafter": self.drafter.name, "acceptance_rate": s["accepted"] / max(s["drafted"], 1),
                # per row: the prefill's token, then each round's kept drafts and its next token
                "tokens_per_target_forward": (s["accepted"] / s["rows"] + s["rounds"] + 1) / s["target_forwards"],
                "target_forwards": s["target_forwards"]}

    def stream(self, prompt, max_new_tokens: int = 128, **options) -> Iterator[str]:
        """Yield the reply as text pieces as soon as they form whole UTF-8 characters."""
        params = self.sampling(**options)
        if self.loop is not None and self.drafter is None:
            ids = [self.encode(prompt)]
            self._check_new_tokens(ids, max_new_tokens)
            for _, texts in self.loop.run(ids, params, max_new_tokens):
                yield from texts[0]
            return
        stops = set(params.stop_token_ids)
        decoder = IncrementalDecoder(self.tokenizer)
        for chunk in self._token_chunks([self.encode(prompt)], params, max_new_tokens, sync_every=1):
            for tok in chunk[0]:
                if tok in stops:
                    tail = decoder.flush()
                    if tail:
                        yield tail
                    return
                piece = decoder.push(tok)
                if piece:
                    yield piece
        tail = decoder.flush()
        if tail:
            yield tail

    def _sync(self) -> None:
        sync(self.device)
