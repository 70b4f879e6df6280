"""``python -m engine_lib bench``: every rung of the ladder beside the transformers baselines, in one run.

Defined in chapter 08 (results). It measures TTFT and decode tokens/s (medians after a
warm-up) and peak memory on the ten seed prompts, one long prompt and one batch, plus
single decode-step latency at several context lengths. It writes a JSON record, a
markdown table and a chart, and prints each rung's ratio to each baseline.
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .measure import copy_bandwidth, peak_memory_bytes, reset_peak_memory, sync, timed, weight_bytes
from .stages import STAGES, half_dtype, resolve_device


@dataclass(frozen=True)
class System:
    name: str
    kind: str  # "engine" or "hf"
    dtype: torch.dtype
    stage: str = ""  # engine rung
    hf_mode: str = ""  # "naive" (use_cache=False), "generate" (default cache), "static_compile"


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list  # token-id lists
    max_new_tokens: int
    batch: bool = False


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def systems_for(device: torch.device, stages: list[str], dtype: torch.dtype | None, baselines: bool,
                quick: bool = False) -> list[System]:
    half = half_dtype(device)
    out = [System(s, "engine", dtype or (half if STAGES[s].half else torch.float32), stage=s) for s in stages]
    if baselines:
        # transformers at every dtype a rung uses (quick: fp32 only)
        dtypes = [torch.float32] if quick else sorted({s.dtype for s in out}, key=str)
        out.append(System("hf_naive", "hf", torch.float32 if dtype is None else dtype, hf_mode="naive"))
        out += [System(f"hf_generate_{dtype_name(d)}", "hf", d, hf_mode="generate") for d in dtypes]
        if device.type == "cuda":
            out.append(System(f"hf_static_compile_{dtype_name(half)}", "hf", half, hf_mode="static_compile"))
    return out


# ------------------------------------------------------------------------------------------ runners
def _engine_runner(system: System, model_dir: Path, device: torch.device):
    from .engine import Engine

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


def _hf_runner(system: System, model_dir: Path, device: torch.device):
    from .reference import load_hf_model

    model = load_hf_model(model_dir, system.dtype, str(device))
    kwargs = dict(do_sample=False, repetition_penalty=1.0, temperature=None, top_p=None, top_k=None)
    if system.hf_mode == "naive":
        kwargs["use_cache"] = False
    if system.hf_mode == "static_compile":
        kwargs["cache_implementation"] = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def generate(prompts: list, n: int, streamer=None):
        width = max(len(p) for p in prompts)  # left padding, as transformers expects for generation
        ids = torch.tensor([[model.config.bos_token_id] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           pad_token_id=model.config.bos_token_id, streamer=streamer, **kwargs)

    def run(prompts: list, n: int, batch: bool) -> tuple[float, float, int]:
        batch_prompts = prompts if batch else prompts[:1]
        clock = TokenClock(device)
        generate(batch_prompts, n, clock)
        first, end = clock.times[1], clock.times[-1]  # times[0]: generate hands over the prompt
        rate = (n - 1) * len(batch_prompts) / (end - first) if n > 1 else float("nan")
        return first - clock.start, rate, n

    return model, run


# ----------------------------------------------------------------------------------- measurements
def step_latency(engine, contexts: list[int], device: torch.device, repeats: int = 3) -> dict[int, float]:
    """Seconds for one decode step at each context length (naive: a full forward over it)."""
    out = {}
    for ctx in contexts:
        ids = torch.arange(1000, 1000 + ctx, device=device)[None]
        with torch.inference_mode():
            if engine.runner is None:
                out[ctx] = timed(lambda ids=ids: engine.model(ids, last_only=True), device, repeats)  # as naive_tokens
                continue
            runner = engine.runner
            runner.prefill(ids[:, :-1], None, max_new_tokens=2 * repeats + 4)
            token = ids[0, -1:]
            times = []
            for i in range(2 * repeats + 2):  # the first steps warm up (and compile once)
                sync(device)
                start = time.perf_counter()
                runner.decode(token)
                sync(device)
                if i >= 2:
                    times.append(time.perf_counter() - start)
            out[ctx] = statistics.median(times)
    return out


def measure_system(system: System, model_dir: Path, device: torch.device, workloads: list[Workload],
                   repeats: int, contexts: list[int], progress) -> dict:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    reset_peak_memory(device)
    t0 = time.perf_counter()
    holder, run = (_engine_runner if system.kind == "engine" else _hf_runner)(system, model_dir, device)
    record = {"kind": system.kind, "dtype": dtype_name(system.dtype), "stage": system.stage,
              "hf_mode": system.hf_mode, "load_s": time.perf_counter() - t0, "workloads": {}}
    model = holder.model if system.kind == "engine" else holder
    record["weight_bytes"] = weight_bytes(model)
    for w in workloads:
        n = w.max_new_tokens
        if system.stage == "naive" or system.hf_mode == "naive":
            n = min(n, 16 if w.name == "seed" else 4)  # no cache: cost grows with every token
        progress.set_postfix_str(f"{system.name} / {w.name}")
        try:
            groups = [w.prompts] if w.batch else [[p] for p in w.prompts]
            run(groups[0], n, w.batch)  # warm-up, same shapes as timed (a compiled rung compiles here)
            ttfts, rates, new = [], [], 0
            for _ in range(repeats):
                for g in groups:
                    ttft, rate, new = run(g, n, w.batch)
                    ttfts.append(ttft)
                    rates.append(rate)
            record["workloads"][w.name] = {
                "ttft_ms": 1e3 * statistics.median(ttfts), "decode_tok_s": statistics.median(rates),
                "new_tokens": new, "batch": len(w.prompts) if w.batch else 1, "runs": len(ttfts),
                "prompt_tokens": [len(p) for p in w.prompts]}
        except Exception as exc:  # one failing baseline must not sink the whole run
            record["workloads"][w.name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        progress.update(1)
    if system.kind == "engine" and contexts:
        progress.set_postfix_str(f"{system.name} / step latency")
        record["step_latency_s"] = {str(k): v for k, v in step_latency(holder, contexts, device).items()}
    record["peak_memory_bytes"] = peak_memory_bytes(device)
    del holder, run, model
    return record


# ---------------------------------------------------------------------------------------- the run
def build_workloads(tokenizer, n_prompts: int, max_new: int, long_tokens: int, batch: int) -> list[Workload]:
    from .tokenizer import chat_ids, seed_prompts

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


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_benchmark(model_dir: str | Path, device=None, stages: list[str] | None = None, dtype=None,
                  baselines: bool = True, n_prompts: int = 10, max_new_tokens: int = 64, long_tokens: int = 2000,
                  batch: int = 4, repeats: int = 3, contexts: list[int] | None = None, quick: bool = False) -> dict:
    import transformers
    from tqdm.auto import tqdm

    from .book import device_name
    from .checkpoints import is_random_checkpoint
    from .config import Qwen2Config
    from .stages import resolve_dtype
    from .tokenizer import load_tokenizer

    model_dir = Path(model_dir)
    device = resolve_device(device)
    stages = stages or list(STAGES)
    fixed = resolve_dtype(dtype, STAGES["naive"], device) if dtype else None
    systems = systems_for(device, stages, fixed, baselines, quick)
    workloads = build_workloads(load_tokenizer(model_dir), n_prompts, max_new_tokens, long_tokens, batch)
    contexts = [64, 512, 2048] if contexts is None else contexts
    cfg = Qwen2Config.from_json(model_dir)
    record = {"meta": {
        "model": model_dir.name, "real_weights": not is_random_checkpoint(model_dir),
        "num_parameters": cfg.num_parameters(), "num_layers": cfg.num_hidden_layers,
        "device": str(device), "device_name": device_name(device), "torch": torch.__version__,
        "transformers": transformers.__version__, "git_commit": git_commit(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "repeats": repeats,
        "memory_note": ("torch.cuda.max_memory_allocated after a reset" if device.type == "cuda"
                        else "peak RSS of the whole process after a reset (VmHWM)"),
        "workloads": {w.name: {"prompts": len(w.prompts), "prompt_tokens": [len(p) for p in w.prompts][:10],
                               "max_new_tokens": w.max_new_tokens, "batch": w.batch} for w in workloads},
        "step_contexts": contexts}, "systems": {}}
    record["copy_bandwidth_bytes_s"] = copy_bandwidth(device)
    total = len(systems) * len(workloads)
    with tqdm(total=total, desc="bench", unit="run") as progress:
        for s in systems:
            record["systems"][s.name] = measure_system(s, model_dir, device, workloads, repeats,
                                                       contexts if s.kind == "engine" else [], progress)
    from .bench_report import ratios, roofline

    record["ratios"] = ratios(record)
    record["roofline"] = roofline(record)
    return record


def write_outputs(record: dict, out_dir: str | Path, stem: str) -> list[Path]:
    from .bench_report import chart, markdown

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md", out_dir / f"{stem}.png"]
    paths[0].write_text(json.dumps(record, indent=2))
    paths[1].write_text(markdown(record))
    chart(record, paths[2])
    return paths


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-").replace("--", "-")


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="checkpoint folder or repo id (default: the tiny random checkpoint "
                   "with --quick, else the real model if reachable, else the offline 1.5B-shape random one)")
    p.add_argument("--quick", action="store_true", help="a short run on the tiny checkpoint, for CI")
    p.add_argument("--stage", "--stages", dest="stages", nargs="+", choices=list(STAGES), default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="run every rung at this dtype instead of its default")
    p.add_argument("--no-baselines", action="store_true", help="skip the transformers baselines")
    p.add_argument("--prompts", type=int, default=None, help="how many seed prompts (default 10)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--long-tokens", type=int, default=None, help="length of the long prompt (default 2000)")
    p.add_argument("--batch", type=int, default=None, help="batch size of the batch case (default 4)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--contexts", type=int, nargs="*", default=None, help="context lengths for step latency")
    p.add_argument("--out", default="book/results", help="folder for the JSON, markdown and chart")
    p.add_argument("--name", default=None, help="file stem (default: from device and model)")


def main(args) -> int:
    from .checkpoints import ensure_checkpoint
    from .cli import _resolve_auto_model

    quick = args.quick
    model = args.model or (str(ensure_checkpoint("tiny")) if quick else _resolve_auto_model("auto-bench"))

    def pick(value, quick_value, full_value):
        return value if value is not None else (quick_value if quick else full_value)

    record = run_benchmark(
        model, device=args.device, stages=args.stages, dtype=args.dtype, baselines=not args.no_baselines,
        n_prompts=pick(args.prompts, 2, 10), max_new_tokens=pick(args.max_new_tokens, 8, 64),
        long_tokens=pick(args.long_tokens, 128, 2000), batch=pick(args.batch, 2, 4),
        repeats=pick(args.repeats, 1, 3), contexts=pick(args.contexts, [64, 256], [64, 512, 2048]), quick=quick)
    stem = args.name or slug(f"{record['meta']['device_name']}_{record['meta']['model']}")
    paths = write_outputs(record, args.out, stem)
    print(paths[1].read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
