"""``python -m engine_lib bench``: every rung of the ladder beside the transformers baselines, in one run.

Defined in chapter 08 (results). It measures TTFT and decode tokens/s (medians after a
warm-up) and peak memory on seed prompts, one long prompt and (optionally) one batch,
plus single decode-step latency at several context lengths, the attention kernel each
rung ends up on and the eager operators left per token. It writes a JSON record (after
every system, so a run cut short still leaves one), a markdown table and a chart, and
prints each rung's ratio to each baseline and every target it can check.

Presets: ``quick`` (CI, tiny checkpoint, seconds), ``check`` (the GPU check: 3 prompts, a
2,000-token prompt, contexts up to 4,096, one compile per compiled rung), ``focused``
(``check`` plus a static-cache + compile baseline, sampling diagnostics and speculative
decoding: the check's ``--full``), ``full`` (ten prompts, a batch, every baseline dtype).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UnsupportedOptionError
from ..sampling import SamplingParams
from ..stages import STAGES, half_dtype, resolve_device, sync
from .llamacpp import WIDTH_BITS
from .measure import (
    copy_bandwidth,
    device_name,
    git_commit,
    host_meta,
    peak_memory_bytes,
    reset_peak_memory,
    timed,
    weight_bytes,
)
from .systems import BaselineUnavailable, System, Workload  # noqa: F401 (imported from here too)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Preset:
    n_prompts: int
    max_new_tokens: int
    long_tokens: int
    batch: int  # 0: no batch workload
    repeats: int
    contexts: tuple[int, ...]  # step-latency contexts
    hf_naive: bool  # transformers without a cache
    hf_dtypes: str  # "fp32": transformers generate in fp32 only; "rungs": at every dtype a rung uses
    hf_static: bool = True  # on a GPU, transformers with a static cache + torch.compile (minutes to compile)
    speculative: bool = True  # prompt lookup and forced acceptance on the kv_cache rung (chapter 11)
    sampling_diagnostics: bool = True  # host ops per token when sampling: one more compiled variant per rung
    perplexity_tokens: int = 16384  # held-out tokens scored per rung in the quantization section (about 9 s each on CPU)


PRESETS = {
    "quick": Preset(2, 8, 128, 2, 1, (64, 256), True, "fp32", False, False, perplexity_tokens=2048),
    "focused": Preset(3, 32, 2000, 0, 2, (64, 2048, 4096), False, "rungs"),
    # the GPU check's default (issue 14): one compile each for fused and int8, no static-cache baseline
    "check": Preset(3, 32, 2000, 0, 2, (64, 2048, 4096), False, "rungs", hf_static=False, speculative=False,
                    sampling_diagnostics=False),
    "full": Preset(10, 64, 2000, 4, 3, (64, 512, 2048, 4096), True, "rungs"),
}
NAIVE_MAX_CONTEXT = 2048  # the no-cache rung recomputes the whole context per step: cap its step contexts


def stage_blocker(stage: str, device: torch.device) -> str | None:
    """Why a rung cannot be measured here (None: it can); only the ``triton`` rung needs more than torch."""
    if not STAGES[stage].kernels:
        return None
    from ..kernels import interpreting, unavailable_reason

    if torch.device(device).type == "cpu" and interpreting():
        return "Triton's interpreter runs the kernels in numpy: right answers, no speed to measure"
    return unavailable_reason(device, half_dtype(device))


def systems_for(device: torch.device, stages: list[str], dtype: torch.dtype | None, baselines: bool,
                preset: Preset) -> list[System]:
    half = half_dtype(device)
    out = [System(s, "engine", dtype or (half if STAGES[s].half else torch.float32), stage=s) for s in stages]
    if baselines:
        dtypes = [torch.float32] if preset.hf_dtypes == "fp32" else sorted({s.dtype for s in out}, key=str)
        if preset.hf_naive:
            out.append(System("hf_naive", "hf", torch.float32 if dtype is None else dtype, hf_mode="naive"))
        out += [System(f"hf_generate_{dtype_name(d)}", "hf", d, hf_mode="generate") for d in dtypes]
        if device.type == "cuda" and preset.hf_static:  # compiling transformers on a CPU takes minutes
            out.append(System(f"hf_static_compile_{dtype_name(half)}", "hf", half, hf_mode="static_compile"))
        if "int8" in stages:  # the same quantization, done by torchao on transformers' model
            out.append(System(f"torchao_int8_{dtype_name(dtype or half)}", "hf", dtype or half, hf_mode="torchao_int8"))
    return out


# ------------------------------------------------------------------------------------------ runners
def _engine_runner(system: System, model_dir: Path, device: torch.device):
    from ..engine import Engine

    engine = Engine.from_pretrained(model_dir, device=device, dtype=system.dtype, stage=system.stage)

    def run(prompts: list, n: int, batch: bool) -> tuple[float, float, int]:
        """-> (TTFT s, decode tokens/s summed over the batch, new tokens)."""
        opts = dict(max_new_tokens=n, do_sample=False, stop_token_ids=())  # fixed length: no early stop
        if batch:
            res = engine.generate_batch(prompts, **opts)
            return res[0].ttft_s, res[0].decode_tokens_per_s * len(prompts), len(res[0].token_ids)
        res = engine.generate(prompts[0], **opts)
        return res.ttft_s, res.decode_tokens_per_s, len(res.token_ids)

    return engine, run


class TokenClock:
    """A ``transformers`` streamer that only timestamps: ``put`` is called with the prompt, then
    once per generated token, right after it is on the host."""

    def __init__(self, device: torch.device):
        sync(device)
        self.start = time.perf_counter()
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_timer(model, device: torch.device, mode: str = "generate"):
    """Time ``transformers``' ``generate`` on a loaded model: -> run(prompts, n, batch) -> (TTFT s,
    decode tokens/s summed over the batch, n). mode: "generate" (its default cache), "naive"
    (use_cache=False) or "static_compile" (static cache + torch.compile, which this call sets up)."""
    kwargs = dict(do_sample=False, repetition_penalty=1.0, temperature=None, top_p=None, top_k=None)
    if mode == "naive":
        kwargs["use_cache"] = False
    if mode == "static_compile":
        kwargs["cache_implementation"] = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def generate(prompts: list, n: int, streamer=None):
        width = max(len(p) for p in prompts)  # left padding, as transformers expects for generation
        ids = torch.tensor([[model.config.bos_token_id] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           pad_token_id=model.config.bos_token_id, streamer=streamer, **kwargs)

    def run(prompts: list, n: int, batch: bool = False) -> tuple[float, float, int]:
        batch_prompts = prompts if batch else prompts[:1]
        clock = TokenClock(device)
        generate(batch_prompts, n, clock)
        first, end = clock.times[1], clock.times[-1]  # times[0]: generate hands over the prompt
        rate = (n - 1) * len(batch_prompts) / (end - first) if n > 1 else float("nan")
        return first - clock.start, rate, n

    return run


def torchao_int8(model):
    """``transformers``' model with torchao's int8 weight-only quantization of every ``nn.Linear``
    (the LM head included), in place. Raises ``BaselineUnavailable`` where torchao does not import."""
    try:
        import torchao
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except Exception as exc:  # not installed, or built for another torch
        raise BaselineUnavailable(f"torchao is not importable ({type(exc).__name__}: {str(exc)[:200]})") from exc
    quantize_(model, Int8WeightOnlyConfig())
    model.torchao_version = torchao.__version__
    return model


def _hf_runner(system: System, model_dir: Path, device: torch.device):
    from .reference import load_hf_model

    if system.hf_mode == "torchao_int8":
        try:
            import torchao  # noqa: F401  (before loading: a missing package skips the baseline at once)
        except Exception as exc:
            raise BaselineUnavailable(f"torchao is not importable ({type(exc).__name__}: {str(exc)[:200]})") from exc
    model = load_hf_model(model_dir, system.dtype, str(device))
    if system.hf_mode == "torchao_int8":
        torchao_int8(model)
    return model, hf_timer(model, device, system.hf_mode)


# ----------------------------------------------------------------------------------- measurements
def step_latency(engine, contexts: list[int], device: torch.device, repeats: int = 3, rounds: int = 3) -> dict[int, dict]:
    """One decode step's seconds at each context length (naive: a full forward over it), and on
    CUDA the peak memory of that request beside its weights and KV cache.

    The contexts are measured round-robin, ``rounds`` times, and each gets the median of all its
    timed steps: a machine that drifts (another tenant, a clock change) then shifts every context
    alike instead of whichever one it happened to be measuring.
    """
    times: dict[int, list[float]] = {c: [] for c in contexts}
    out: dict[int, dict] = {c: {} for c in contexts}
    for _ in range(rounds):
        for ctx in contexts:
            reset_peak_memory(device)
            with torch.inference_mode():
                if engine.loop is None:
                    ids = torch.arange(1000, 1000 + ctx, device=device)[None]
                    times[ctx].append(timed(lambda ids=ids: engine.model(ids, last_only=True), device, repeats))
                    continue
                # the loop stopped after the prefill; its next decode step, run again and again (the same slots)
                paused = engine.loop.paused([list(range(1000, 1000 + ctx))], SamplingParams(max_tokens=4))
                for i in range(repeats + 2):  # the first steps warm up (and compile, and capture)
                    sync(device)
                    start = time.perf_counter()
                    paused.decode()
                    sync(device)
                    if i >= 2:
                        times[ctx].append(time.perf_counter() - start)
                out[ctx]["kv_cache_bytes"] = paused.cache.nbytes
                if device.type == "cuda":
                    out[ctx]["peak_memory_bytes"] = peak_memory_bytes(device)
    for ctx in contexts:
        out[ctx]["s"] = statistics.median(times[ctx])
    return out


def engine_diagnostics(engine, prompt: list[int], sampling_too: bool = True) -> dict:
    """Where the time goes besides the weights: the attention kernel, the step's form and the
    eager operators the host still launches per token (greedy and the checkpoint's sampling)."""
    from .measure import attention_kernels, eager_ops_per_token, matmul_kernels, step_operators

    ops = step_operators(engine.model)  # one profiled prefill + decode step, read twice
    out = {"attention_kernels": attention_kernels(engine.model, ops), "matmul_kernels": matmul_kernels(engine.model, ops)}
    if engine.loop is not None:
        sampling = dict(do_sample=True, seed=0)  # the checkpoint's defaults: top-k, top-p, penalty
        out["eager_ops_per_token"] = {"greedy": eager_ops_per_token(engine, prompt, short=4, long=20)}
        if sampling_too:
            out["eager_ops_per_token"]["sampling"] = eager_ops_per_token(engine, prompt, short=4, long=20, **sampling)
        out["step_form"] = engine.step_form
        out["runs_on"] = engine.runs_on  # which cache and step made its tokens, for every caption
        out["fallbacks"] = engine.fallbacks
    return out


def measure_system(system: System, model_dir: Path, device: torch.device, workloads: list[Workload],
                   repeats: int, contexts: list[int], progress, sampling_diagnostics: bool = True) -> dict:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    reset_peak_memory(device)
    t0 = time.perf_counter()
    record = {"kind": system.kind, "dtype": system.peer or dtype_name(system.dtype), "stage": system.stage,
              "hf_mode": system.hf_mode, "workloads": {}, "load_average": list(os.getloadavg())}
    try:
        if system.kind == "peer":  # llama.cpp, in a process of its own
            from .llamacpp import peer_runner

            holder, run = peer_runner(system, model_dir, workloads)
        else:
            holder, run = (_engine_runner if system.kind == "engine" else _hf_runner)(system, model_dir, device)
    except BaselineUnavailable as exc:  # e.g. torchao not installed: say so in the record, measure the rest
        progress.update(len(workloads))
        return {**record, "skipped": str(exc)}
    record["load_s"] = time.perf_counter() - t0
    if system.kind == "peer":
        record.update(peer=system.peer, weight_bytes=holder.info["gguf"]["tensor_bytes"], **holder.info)
    if getattr(holder, "torchao_version", None):
        record["torchao"] = holder.torchao_version
        record["note"] = ("torchao's weight-only int8 computes mm(x, q.to(dtype)) * scale; timed eagerly, as the "
                          "other transformers baselines, that converts every weight on every call: the form "
                          "relies on torch.compile to fuse the conversion into the matmul")
    model = holder.model if system.kind == "engine" else None if system.kind == "peer" else holder
    if model is not None:
        record["weight_bytes"] = weight_bytes(model)
    for w in workloads:
        n = w.max_new_tokens
        if system.stage == "naive" or system.hf_mode == "naive":
            n = min(n, 16 if w.name == "seed" else 4)  # no cache: cost grows with every token
        progress.set_postfix_str(f"{system.name} / {w.name}")
        prompts = w.prompts[:1] if system.hf_mode == "static_compile" else w.prompts  # one shape to compile
        try:
            groups = [prompts] if w.batch else [[p] for p in prompts]
            t1 = time.perf_counter()
            run(groups[0], n, w.batch)  # warm-up, same shapes as timed (a compiled rung compiles here)
            warmup_s = time.perf_counter() - t1
            ttfts, rates, new = [], [], 0
            for _ in range(repeats):
                for g in groups:
                    ttft, rate, new = run(g, n, w.batch)
                    ttfts.append(ttft)
                    rates.append(rate)
            record["workloads"][w.name] = {
                "ttft_ms": 1e3 * statistics.median(ttfts), "decode_tok_s": statistics.median(rates),
                "decode_tok_s_runs": rates, "ttft_ms_runs": [1e3 * t for t in ttfts],  # the spread
                "new_tokens": new, "batch": len(prompts) if w.batch else 1, "runs": len(ttfts),
                "prompt_tokens": [len(p) for p in prompts], "warmup_s": warmup_s}
        except Exception as exc:  # one failing baseline must not sink the whole run
            record["workloads"][w.name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        progress.update(1)
    if system.kind == "peer":  # the worker's own peak RSS, over its whole life
        record["peak_memory_bytes"] = holder.memory()["peak_rss_bytes"]
        holder.close()
    else:
        record["peak_memory_bytes"] = peak_memory_bytes(device)
    if system.kind == "engine":
        progress.set_postfix_str(f"{system.name} / step latency, kernels")
        own = [c for c in contexts if system.stage != "naive" or c <= NAIVE_MAX_CONTEXT]
        record["step_latency"] = {str(k): v for k, v in step_latency(holder, own, device).items()}
        record["step_latency_s"] = {k: v["s"] for k, v in record["step_latency"].items()}
        try:
            record.update(engine_diagnostics(holder, workloads[0].prompts[0], sampling_diagnostics))
        except Exception as exc:  # diagnostics are extras: never lose the timings over them
            record["diagnostics_error"] = f"{type(exc).__name__}: {exc}"[:300]
    del holder, run, model
    return record


def paired_decode(model_dir: Path, device: torch.device, stages: tuple[str, ...], prompt: list[int],
                  new_tokens: int = 32, rounds: int = 7) -> dict:
    """Two (or more) rungs timed turn about, A B A B ..., on one prompt: the fairest comparison a
    noisy machine allows (drift hits all alike). -> each rung's median decode tok/s and TTFT, the
    second's decode ratio to the first (``ratio``) and every rung's (``ratios``), and every round's
    readings (``decode_rounds``, ``ttft_rounds_ms``) for ``timing.relation(..., paired=True)``."""
    from ..engine import Engine

    engines = {s: Engine.from_pretrained(model_dir, device=device, stage=s) for s in stages}
    opts = dict(max_new_tokens=new_tokens, do_sample=False, stop_token_ids=())
    for e in engines.values():
        e.generate(prompt, **opts)  # warm up (and compile)
    rates: dict[str, list[float]] = {s: [] for s in stages}
    ttfts: dict[str, list[float]] = {s: [] for s in stages}
    for _ in range(rounds):
        for s, e in engines.items():
            res = e.generate(prompt, **opts)
            rates[s].append(res.decode_tokens_per_s)
            ttfts[s].append(res.ttft_s)
    med = {s: statistics.median(r) for s, r in rates.items()}
    a, b = stages[:2]
    return {"stages": list(stages), "dtype": dtype_name(engines[a].dtype), "rounds": rounds,
            "new_tokens": new_tokens, "prompt_tokens": len(prompt), "decode_tok_s": med,
            "ttft_ms": {s: 1e3 * statistics.median(t) for s, t in ttfts.items()},
            "decode_rounds": rates, "ttft_rounds_ms": {s: [1e3 * x for x in t] for s, t in ttfts.items()},
            "step_forms": {s: e.step_form for s, e in engines.items()},
            "ratio": med[b] / med[a], "ratios": {s: med[s] / med[a] for s in stages}}


# ---------------------------------------------------------------------------------------- the run
def build_workloads(tokenizer, n_prompts: int, max_new: int, long_tokens: int, batch: int) -> list[Workload]:
    from ..model.tokenizer import chat_ids, seed_prompts

    seeds = [p["input_ids"] for p in seed_prompts()][:n_prompts]
    text = " ".join(p["prompt"] for p in seed_prompts())
    body = tokenizer(text)["input_ids"]
    head = chat_ids(tokenizer, [{"role": "user", "content": "Summarise this text."}])
    head, tail = head[:-5], head[-5:]  # tail: <|im_end|>\n<|im_start|>assistant\n
    filler = (body * (long_tokens // len(body) + 1))[: long_tokens - len(head) - len(tail)]
    out = [Workload("seed", seeds, max_new), Workload("long", [head + filler + tail], max(4, max_new // 4))]
    if batch > 1:
        out.append(Workload("batch", [p["input_ids"] for p in seed_prompts()][:batch], max_new, batch=True))
    return out


def values_model_dir(model_dir: Path) -> Path:
    """The model whose *values* the quantization section measures. Random weights show speed
    truly but quantization damage not at all (their top-1 is rarely decided), so a bench of a
    random checkpoint measures accuracy and perplexity on the trained preset instead; a real
    or trained checkpoint measures itself."""
    from ..model.checkpoints import STDLIB_SMALL, ensure_checkpoint, is_random_checkpoint

    return ensure_checkpoint(STDLIB_SMALL) if is_random_checkpoint(model_dir) else model_dir


def run_benchmark(model_dir: str | Path, device=None, stages: list[str] | None = None, dtype=None,
                  baselines: bool = True, preset: str | Preset = "full", on_update=None, progress: bool = True,
                  peer: str | None = None, peer_types: list[str] | None = None, **overrides) -> dict:
    """Measure every system in one process, one after the other. ``overrides`` replace preset
    fields (n_prompts, max_new_tokens, long_tokens, batch, repeats, contexts, hf_naive, hf_dtypes,
    hf_static); ``on_update(record)``
    is called after every system, so a caller can save partial results. ``progress=False`` hides the
    progress bar (a notebook page would keep a frozen one). ``peer="llama.cpp"`` times llama.cpp on
    the same weights beside the rungs (``peer_types``: its GGUF widths; default, the rungs' widths),
    or says in one line why it cannot."""
    import dataclasses

    from tqdm.auto import tqdm

    from ..model.tokenizer import load_tokenizer

    p = PRESETS[preset] if isinstance(preset, str) else preset
    p = dataclasses.replace(p, **{k: (tuple(v) if k == "contexts" else v) for k, v in overrides.items() if v is not None})
    model_dir, device = Path(model_dir), resolve_device(device)
    stages = runnable_stages(stages, device)
    systems = systems_for(device, stages, resolve_dtype_or_none(dtype, device), baselines, p)
    systems, peer_skipped = with_peer(systems, stages, device, peer, peer_types)
    workloads = build_workloads(load_tokenizer(model_dir), p.n_prompts, p.max_new_tokens, p.long_tokens, p.batch)
    record = {"meta": record_meta(model_dir, device, p, preset, workloads, peer, peer_skipped), "systems": {}}
    record["copy_bandwidth_bytes_s"] = copy_bandwidth(device)
    finish = lambda: finish_record(record, systems, on_update)  # noqa: E731 (after each part: save what is known)
    with tqdm(total=len(systems) * len(workloads), desc="bench", unit="run", disable=not progress) as bar:
        for s in systems:
            record["systems"][s.name] = measure_system(s, model_dir, device, workloads, p.repeats,
                                                       list(p.contexts) if s.kind == "engine" else [], bar,
                                                       p.sampling_diagnostics)
            finish()
    paired_parts(record, systems, stages, model_dir, device, workloads, p, finish)
    quantization_parts(record, stages, model_dir, device, p, finish)
    if p.speculative and "kv_cache" in stages:  # fp32, where greedy speculation is token-exact
        from ..engine import Engine
        from .speculative import measure_speculative

        gc.collect()
        engine = Engine.from_pretrained(model_dir, device=device, stage="kv_cache")
        record["speculative"] = measure_speculative(engine, max_new_tokens=p.max_new_tokens, repeats=p.repeats)
        del engine
        finish()
    record["meta"]["complete"] = True
    finish()
    return record


def runnable_stages(stages: list[str] | None, device: torch.device) -> list[str]:
    """The rungs to time: those asked for (each must run here: measured as something else, it would be
    labelled wrongly), or every rung that runs on this device."""
    why = {s: stage_blocker(s, device) for s in (stages or STAGES)}
    stages = stages or [s for s in STAGES if why[s] is None]
    blocked = {s: why[s] for s in stages if why[s]}
    if blocked:
        raise UnsupportedOptionError("; ".join(f"stage {s!r} cannot run on {device}: {why}" for s, why in blocked.items()))
    return stages


def resolve_dtype_or_none(dtype, device: torch.device):
    """Every rung at ``dtype`` where one is given; None: each rung's own."""
    from ..stages import resolve_dtype

    return resolve_dtype(dtype, STAGES["naive"], device) if dtype else None


def with_peer(systems: list, stages: list[str], device: torch.device, peer: str | None,
              peer_types: list[str] | None) -> tuple[list, str | None]:
    """The systems with llama.cpp's files beside the rungs, where ``peer`` asks for it and it can run here;
    -> (systems, why the peer was skipped or None)."""
    if not peer:
        return systems, None
    from .llamacpp import add_peer_systems, gguf_types_for, unavailable_reason

    skipped = "llama.cpp here runs on the CPU only" if device.type != "cpu" else unavailable_reason()
    if skipped:
        print(f"[bench] skipping the {peer} peer: {skipped}", file=sys.stderr, flush=True)
        return systems, skipped
    return add_peer_systems(systems, gguf_types_for(stages, peer_types)), None


def record_meta(model_dir: Path, device: torch.device, p: Preset, preset, workloads: list, peer: str | None,
                peer_skipped: str | None) -> dict:
    """Everything a record says about where and how it was measured."""
    import transformers

    from ..model.checkpoints import is_random_checkpoint
    from ..model.config import Qwen2Config

    cfg = Qwen2Config.from_json(model_dir)
    return {
        "model": model_dir.name, "real_weights": not is_random_checkpoint(model_dir),
        "num_parameters": cfg.num_parameters(), "num_layers": cfg.num_hidden_layers,
        "device": str(device), "device_name": device_name(device),
        **host_meta(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__, "git_commit": git_commit(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "repeats": p.repeats,
        "preset": preset if isinstance(preset, str) else "custom",
        "memory_note": ("torch.cuda.max_memory_allocated after a reset" if device.type == "cuda"
                        else "peak RSS of the whole process after a reset (VmHWM)"),
        "workloads": {w.name: {"prompts": len(w.prompts), "prompt_tokens": [len(q) for q in w.prompts][:10],
                               "max_new_tokens": w.max_new_tokens, "batch": w.batch} for w in workloads},
        "step_contexts": list(p.contexts), "complete": False,
        "load_average": {"start": list(os.getloadavg())}, "cpu_count": os.cpu_count(),
        **({"peer": peer, "peer_skipped": peer_skipped} if peer else {})}


def finish_record(record: dict, systems: list, on_update) -> None:
    """The record's derived parts, from what it holds now (ratios, roofline, targets), and ``on_update``."""
    from .report import ratios, roofline, targets

    record["meta"]["load_average"]["end"] = list(os.getloadavg())
    record["ratios"] = ratios(record)
    record["roofline"] = roofline(record)
    record["targets"] = targets(record)
    if any(s.kind == "peer" for s in systems):
        from .llamacpp import peer_ratios, peer_targets

        record["peer_ratios"] = peer_ratios(record)
        record["targets"] += peer_targets(record)
    if on_update:
        on_update(record)


def paired_parts(record: dict, systems: list, stages: list[str], model_dir: Path, device: torch.device,
                 workloads: list, p: Preset, finish) -> None:
    """Systems timed turn about, where runs apart would be too noisy to compare: each rung and its llama.cpp
    peers, fused and then int8 (chapter 10) against half."""
    if any(s.kind == "peer" for s in systems) and p.repeats > 1:
        from .llamacpp import paired_peers

        gc.collect()
        record["peer_paired"] = paired_peers(systems, record, model_dir, device, workloads, _engine_runner)
        finish()
    for key, pair in (("paired", ("half", "fused")), ("paired_int8", ("half", "int8"))):
        if set(pair) <= set(stages) and p.repeats > 1:
            gc.collect()
            record[key] = paired_decode(model_dir, device, pair, workloads[0].prompts[0], p.max_new_tokens)
            finish()


def quantization_parts(record: dict, stages: list[str], model_dir: Path, device: torch.device, p: Preset,
                       finish) -> None:
    """How far the integer weights move the model (chapter 10), on a model whose values mean something
    (``values_model_dir``), and the perplexity of the held-out text with int4 GPTQ beside RTN."""
    quant_modes = [s for s in stages if STAGES[s].quant]
    values_dir = values_model_dir(model_dir)
    if quant_modes and p.repeats > 1:
        from .quant_check import quant_accuracy

        gc.collect()
        record["quant_accuracy"] = {"model": values_dir.name, **quant_accuracy(values_dir, device, quant_modes)}
        finish()
    if "int4" in quant_modes:
        from .quant_check import heldout_perplexity

        gc.collect()
        qp = heldout_perplexity(values_dir, device, max_tokens=p.perplexity_tokens)
        if qp is not None:
            record["quant_perplexity"] = qp
            finish()


def write_outputs(record: dict, out_dir: str | Path, stem: str, chart_too: bool = True) -> list[Path]:
    from .report import chart, markdown

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md", out_dir / f"{stem}.png"]
    paths[0].write_text(json.dumps(record, indent=2))
    paths[1].write_text(markdown(record))
    if chart_too:
        chart(record, paths[2])
    return paths


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-").replace("--", "-")


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="checkpoint folder or repo id (default: the tiny random checkpoint "
                   "with --quick, else the real model if reachable, else the offline 1.5B-shape random one)")
    p.add_argument("--preset", choices=list(PRESETS), default=None,
                   help="quick (CI), check (the GPU check), focused (the check's --full) or full (default)")
    p.add_argument("--quick", action="store_true", help="same as --preset quick, on the tiny checkpoint")
    p.add_argument("--stage", "--stages", dest="stages", nargs="+", choices=list(STAGES), default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="run every rung at this dtype instead of its default")
    p.add_argument("--no-baselines", action="store_true", help="skip the transformers baselines")
    p.add_argument("--prompts", type=int, default=None, help="how many seed prompts")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--long-tokens", type=int, default=None, help="length of the long prompt")
    p.add_argument("--batch", type=int, default=None, help="batch size of the batch case (0: none)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--contexts", type=int, nargs="*", default=None, help="context lengths for step latency")
    p.add_argument("--out", default="book/results", help="folder for the JSON, markdown and chart")
    p.add_argument("--name", default=None, help="file stem (default: from device and model)")
    p.add_argument("--peer", choices=["llama.cpp"], default=None,
                   help="also time llama.cpp on the same weights (GGUF), beside the rung of each width")
    p.add_argument("--peer-types", nargs="+", choices=list(WIDTH_BITS), default=None,
                   help="the peer's GGUF widths (default: those of the rungs timed)")


def main(args) -> int:
    from ..model.checkpoints import ensure_checkpoint, resolve_auto_model

    preset = "quick" if args.quick else (args.preset or "full")
    model = args.model or (str(ensure_checkpoint("tiny")) if preset == "quick" else resolve_auto_model("auto-bench"))
    stem = [args.name]

    def save(record: dict) -> None:  # after every system: a run cut short still leaves its record
        if stem[0] is None:
            stem[0] = slug(f"{record['meta']['device_name']}_{record['meta']['model']}")
        write_outputs(record, args.out, stem[0], chart_too=record["meta"]["complete"])

    record = run_benchmark(
        model, device=args.device, stages=args.stages, dtype=args.dtype, baselines=not args.no_baselines,
        preset=preset, on_update=save, peer=args.peer, peer_types=args.peer_types, n_prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        long_tokens=args.long_tokens, batch=args.batch, repeats=args.repeats, contexts=args.contexts)
    paths = write_outputs(record, args.out, stem[0])
    print(paths[1].read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
