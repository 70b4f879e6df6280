"""One scoreboard for the whole book: every rung, speculative decoding and the server, side by side.

Defined in chapter 15 (putting it together). A board is built from records of the shapes the
bench writes: a ladder record (``python -m engine_lib bench``: ``systems``, and ``speculative``
when it ran), serving records (``python -m engine_lib.bench.loadtest``: ``levels``, and
``prefix_cache`` when it ran), or a full-depth CPU record (``python -m engine_lib.bench.cpu_depth``).
``committed_boards`` reads the records committed under ``book/results`` (one board per device and
model, GPU boards first, newest first); ``live_records`` makes the same records on this machine (the
rungs timed as the bench times them, the load test through the bench's ``run_load``), small enough for
a chapter.
Every number on a board is read from a record: nothing here is typed in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

HEADER = ["part", "system", "dtype", "tokens/s", "measured as", "TTFT (ms)", "vs", "vs what"]


@dataclass(frozen=True)
class Entry:
    """One line of a board. ``tok_s`` is one stream's decode rate for a rung or a speculative run,
    and the total over all users for the server; ``ratio`` is ``tok_s`` (or, for the prefix
    cache, TTFT) relative to ``ratio_to``."""
    part: str  # "rung", "speculative" or "server"
    system: str
    dtype: str
    tok_s: float | None
    measured_as: str
    ttft_ms: float | None
    ratio: float | None
    ratio_to: str


@dataclass
class Board:
    source: str  # "live" or the record files it was read from
    device: str  # "cpu", "cuda", ...
    device_name: str
    model: str
    real_weights: bool
    timestamp: str
    entries: list[Entry] = field(default_factory=list)

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def rows(self) -> list[list[str]]:
        """The entries as table rows (``HEADER``), numbers formatted, ``n/a`` where a record has none."""
        from ..bench.report import fmt

        return [[e.part, e.system, e.dtype, fmt(e.tok_s), e.measured_as, fmt(e.ttft_ms, ".0f"),
                 fmt(e.ratio, ".2f", "x"), e.ratio_to] for e in self.entries]

    def caption(self) -> str:
        weights = "real weights" if self.real_weights else "RANDOM weights (timings only; the text means nothing)"
        where = "measured live in this run" if self.source == "live" else f"committed records: {self.source}"
        return f"{self.model}, {weights}, {self.device_name}; {where}, {self.timestamp[:10]}"


# ------------------------------------------------------------------------------ records -> entries
def rung_entries(record: dict, workload: str = "seed") -> list[Entry]:
    """One entry per engine rung of a ladder record, its decode rate relative to the first rung measured."""
    rungs = [(name, s) for name, s in record["systems"].items() if s.get("kind") == "engine"]
    ok = [(n, s["workloads"][workload]) for n, s in rungs
          if workload in s.get("workloads", {}) and "error" not in s["workloads"][workload]]
    base_name, base = ok[0] if ok else (None, None)
    meta_w = record["meta"].get("workloads", {}).get(workload, {})
    out = []
    for name, s in rungs:
        w = s.get("workloads", {}).get(workload)
        if not w or "error" in w:
            out.append(Entry("rung", name, s["dtype"], None, (w or {}).get("error", "not measured")[:60], None, None, ""))
            continue
        tokens = "/".join(map(str, w.get("prompt_tokens", meta_w.get("prompt_tokens", []))))
        out.append(Entry("rung", name, s["dtype"], w["decode_tok_s"],
                         f"decode, 1 stream, {tokens}-token prompt(s), {w['new_tokens']} new tokens", w["ttft_ms"],
                         w["decode_tok_s"] / base["decode_tok_s"], f"{base_name} rung"))
    return out


def speculative_entries(record: dict) -> list[Entry]:
    """Plain decoding and prompt lookup on each prompt of a record's ``speculative`` section."""
    spec = record.get("speculative")
    if not spec:
        return []
    out = []
    for prompt, p in spec["prompts"].items():
        for run in ("plain", "prompt lookup"):
            r = p["runs"].get(run)
            if r is None:
                continue
            accepted = f", {100 * r['acceptance_rate']:.0f}% of drafts accepted" if "acceptance_rate" in r else ""
            out.append(Entry("speculative", f"{run} · {prompt}", spec["dtype"], r["decode_tok_s"],
                             f"decode, 1 stream, {spec['stage']} rung, {p['prompt_tokens']}-token prompt, "
                             f"{spec['max_new_tokens']} new tokens{accepted}", None, r["speedup"],
                             "plain decoding, same prompt"))
    return out


def server_entries(record: dict) -> list[Entry]:
    """Each load-test level of a serving record (total throughput), then its prefix-cache TTFT if any."""
    m = record["meta"]
    out = []
    for lv in record["levels"]:
        if lv.get("skipped"):
            continue
        c = lv["concurrency"]
        out.append(Entry("server", f"{m['stage']} rung, {c} user{'s' if c > 1 else ''}", m["dtype"],
                         lv["throughput_tok_s"], f"total over {c} streams, {lv['requests']} requests of up to "
                         f"{m['max_tokens']} tokens, through HTTP", 1e3 * lv["ttft_p50_s"],
                         lv.get("speedup_vs_sequential"), "the same requests one at a time"))
    pc = record.get("prefix_cache")
    if pc:
        out.append(Entry("server", f"{pc['stage']} rung, system prompt cached", pc["dtype"], None,
                         f"TTFT p50, {pc['system_prompt_tokens']:,}-token system prompt", 1e3 * pc["warm_ttft_p50_s"],
                         pc["cold_ttft_p50_s"] / pc["warm_ttft_p50_s"], "TTFT with nothing cached"))
    return out


def depth_entries(record: dict) -> list[Entry]:
    """One entry per engine rung of a full-depth CPU record (``bench/cpu_depth.py``): its best later start's decode
    rate and TTFT, relative to the first rung measured."""
    import torch

    from ..bench.cpu_depth import best
    from ..stages import get_stage, resolve_dtype

    m = record["meta"]
    rungs = [(n.split(":", 1)[1], s) for n, s in record["systems"].items() if n.startswith("engine:")]
    ok = [(n, best(s, "decode_tok_s")[0]) for n, s in rungs if best(s, "decode_tok_s")]
    base_name, base = ok[0] if ok else (None, None)
    how = (f"decode, 1 stream, a fresh process, best of {m['rounds']} starts, {m['prompts']} seed prompts, "
           f"{m['new_tokens']} new tokens")
    out = []
    for name, s in rungs:
        dtype = str(resolve_dtype(None, get_stage(name), torch.device("cpu"))).removeprefix("torch.")
        rate = best(s, "decode_tok_s")
        if rate is None:
            out.append(Entry("rung", name, dtype, None, "failed", None, None, ""))
            continue
        out.append(Entry("rung", name, dtype, rate[0], how, best(s, "ttft_ms")[0], rate[0] / base, f"{base_name} rung"))
    return out


def depth_board(record: dict) -> Board:
    m = record["meta"]
    return Board(record["file"], "cpu", m["device_name"], m["model"], not m.get("checkpoint"), m["timestamp"],
                 depth_entries(record))


def board_from_records(bench: dict | None, serves: list[dict], source: str) -> Board:
    """A board from one ladder record (or none) and the serving records of the same device and model."""
    meta = (bench or serves[0])["meta"]
    entries = (rung_entries(bench) + speculative_entries(bench)) if bench else []
    for s in serves:
        entries += server_entries(s)
    stamps = [r["meta"]["timestamp"] for r in ([bench] if bench else []) + serves]
    return Board(source, meta["device"], meta["device_name"], meta["model"], bool(meta.get("real_weights")),
                 max(stamps), entries)


def committed_boards() -> list[Board]:
    """Every committed ladder and serving record, grouped by (device name, model): GPU boards
    first, then newest first. A serving record with no ladder record beside it gets its own board."""
    from . import committed_records

    benches, serves = committed_records("bench"), committed_records("serve")
    key = lambda r: (r["meta"]["device_name"], r["meta"]["model"])  # noqa: E731
    boards, used = [], set()
    for b in benches:
        mine = [s for s in serves if key(s) == key(b)]
        used.update(s["file"] for s in mine)
        boards.append(board_from_records(b, mine, ", ".join([b["file"]] + [s["file"] for s in mine])))
    for k in dict.fromkeys(key(s) for s in serves if s["file"] not in used):
        mine = [s for s in serves if key(s) == k and s["file"] not in used]
        boards.append(board_from_records(None, mine, ", ".join(s["file"] for s in mine)))
    boards += [depth_board(r) for r in committed_records("depth")]
    return sorted(boards, key=lambda b: (not b.on_gpu, _neg(b.timestamp)))


def _neg(stamp: str) -> tuple:
    return tuple(-ord(c) for c in stamp)  # newest first inside a stable ascending sort


def gpu_sentence(boards: list[Board]) -> str:
    """What the committed boards hold, GPU or not, counted from the folder."""
    gpu = [b for b in boards if b.on_gpu]
    if gpu:
        return (f"{len(gpu)} of the {len(boards)} committed board(s) were measured on a GPU ("
                + "; ".join(f"{b.device_name}, {b.model}" for b in gpu) + "); they come first.")
    names = sorted({b.device_name for b in boards})
    return (f"None of the {len(boards)} committed board(s) was measured on a GPU (devices: "
            f"{', '.join(names) or 'none'}), so this chapter shows no GPU numbers: scripts/gpu_check.sh makes "
            "a GPU record.")


# ------------------------------------------------------------------------------ a live board
def time_rung(model_dir: Path, device, stage: str, prompt: list[int], new_tokens: int, repeats: int) -> dict:
    """One rung as the bench's ``measure_system`` records it (its seed workload only, without the
    diagnostics): a warm-up with the timed shapes (a compiled rung compiles here), then the medians
    of ``repeats`` greedy generations of exactly ``new_tokens`` tokens."""
    import statistics

    from ..engine import Engine

    t0 = time.perf_counter()
    engine = Engine.from_pretrained(model_dir, device=device, stage=stage)
    load_s = time.perf_counter() - t0
    opts = dict(max_new_tokens=new_tokens, do_sample=False, stop_token_ids=())  # fixed length: no early stop
    t0 = time.perf_counter()
    engine.generate(prompt, **opts)
    warmup_s = time.perf_counter() - t0
    runs = [engine.generate(prompt, **opts) for _ in range(repeats)]
    return {"kind": "engine", "dtype": str(engine.dtype).removeprefix("torch."), "stage": stage, "load_s": load_s,
            "step_form": engine.step_form,
            "workloads": {"seed": {"ttft_ms": 1e3 * statistics.median(r.ttft_s for r in runs),
                                   "decode_tok_s": statistics.median(r.decode_tokens_per_s for r in runs),
                                   "new_tokens": len(runs[-1].token_ids), "batch": 1, "runs": repeats,
                                   "prompt_tokens": [len(prompt)], "warmup_s": warmup_s}}}


def live_records(model_dir: str | Path, device: str = "cpu", stages: list[str] | None = None, new_tokens: int = 8,
                 repeats: int = 2, speculative: bool = True, spec_repeats: int = 1,
                 users: tuple[int, ...] = (1, 4), requests: int = 8, server_stage: str = "half",
                 log=print) -> tuple[dict, list[dict]]:
    """A small ladder record and one serving record, made here (``stages=None``: every rung that
    can run here; ``[]``: none; ``users=()``: no server).

    Each rung: the bench's first seed prompt, ``new_tokens`` greedy tokens, a warm-up and ``repeats``
    timed runs (``time_rung``). Speculative decoding: plain against prompt lookup on the kv_cache
    rung (``lookup_record``). The server: ``requests`` streaming requests at each
    number of ``users`` through HTTP (the bench's ``run_load``). ``log`` hears each part's seconds."""
    import gc

    import torch

    from ..bench.measure import device_name
    from ..bench.run import build_workloads, stage_blocker
    from ..model.checkpoints import is_random_checkpoint
    from ..model.tokenizer import load_tokenizer
    from ..stages import STAGES, resolve_device

    model_dir, dev = Path(model_dir), resolve_device(device)
    stages = [s for s in STAGES if stage_blocker(s, dev) is None] if stages is None else stages
    prompt = build_workloads(load_tokenizer(model_dir), 1, new_tokens, 16, 0)[0].prompts[0]
    meta = {"model": model_dir.name, "real_weights": not is_random_checkpoint(model_dir), "device": str(dev),
            "device_name": device_name(dev), "torch": torch.__version__,
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "workloads": {"seed": {"prompts": 1, "prompt_tokens": [len(prompt)], "max_new_tokens": new_tokens}}}
    bench: dict = {"meta": meta, "systems": {}, "seconds": {}}
    for s in stages:
        t0 = time.perf_counter()
        bench["systems"][s] = time_rung(model_dir, dev, s, prompt, new_tokens, repeats)
        gc.collect()
        bench["seconds"][s] = time.perf_counter() - t0
        log(f"{s}: {bench['seconds'][s]:.1f} s")
    if speculative:
        t0 = time.perf_counter()
        bench["speculative"] = lookup_record(model_dir, dev, new_tokens, spec_repeats)
        gc.collect()
        bench["seconds"]["speculative"] = time.perf_counter() - t0
        log(f"speculative: {bench['seconds']['speculative']:.1f} s")
    serves = [] if not users else [live_serve_record(model_dir, dev, server_stage, users, requests, new_tokens, meta)]
    if serves:
        bench["seconds"]["server"] = serves[0]["meta"]["run_s"]
        log(f"server: {serves[0]['meta']['run_s']:.1f} s")
    return bench, serves


def lookup_record(model_dir: Path, device, new_tokens: int, repeats: int) -> dict:
    """Plain decoding against prompt lookup on the bench's two speculative prompts (the kv_cache
    rung, fp32, greedy), in the shape of the bench's ``measure_speculative`` record: its plain and
    prompt-lookup runs only, without the forced-acceptance bounds and the verify costs."""
    import statistics

    from ..bench.speculative import EDIT_PROMPT, FREE_PROMPT
    from ..engine import Engine

    plain = Engine.from_pretrained(model_dir, device=device, stage="kv_cache")
    lookup = Engine(plain.model, plain.tokenizer, plain.model_dir, plain.stage, plain.device,
                    speculative="prompt_lookup")  # the same weights, drafting from the prompt
    opts = dict(max_new_tokens=new_tokens, do_sample=False, stop_token_ids=())
    out = {"stage": plain.stage.name, "dtype": str(plain.dtype).removeprefix("torch."), "max_new_tokens": new_tokens,
           "prompts": {}}
    for name, prompt in (("edit code (lookup should help)", EDIT_PROMPT), ("free text", FREE_PROMPT)):
        runs = {}
        for label, engine in (("plain", plain), ("prompt lookup", lookup)):
            engine.generate(prompt, **opts)  # warm up
            res = [engine.generate(prompt, **opts) for _ in range(repeats)]
            runs[label] = {"decode_tok_s": statistics.median(r.decode_tokens_per_s for r in res),
                           "tokens": res[-1].token_ids, **{k: v for k, v in res[-1].extra.items()
                                                           if k in ("acceptance_rate", "tokens_per_target_forward")}}
        want, base = runs["plain"]["tokens"], runs["plain"]["decode_tok_s"]
        for r in runs.values():
            r["matches_plain"] = r.pop("tokens") == want  # greedy in fp32: speculation must not change a token
            r["speedup"] = r["decode_tok_s"] / base
        out["prompts"][name] = {"prompt_tokens": len(plain.encode(prompt)), "runs": runs}
    return out


def live_serve_record(model_dir: Path, device, stage: str, users: tuple[int, ...], requests: int, max_tokens: int,
                      meta: dict) -> dict:
    """The load test of chapter 12 at a small scale: a server in this process, OpenAI's client, ``users`` levels."""
    from ..bench.loadtest import make_prompts, run_load
    from ..cache.contiguous import kv_bytes_per_token
    from ..model.config import Qwen2Config
    from ..serve.server import BackgroundServer, ServerOptions, build_state

    t0 = time.perf_counter()
    context = 256
    gib = max(users) * context * kv_bytes_per_token(Qwen2Config.from_json(model_dir), 2) / 2**30  # a row each
    state, engine = build_state(ServerOptions(model=str(model_dir), device=str(device), stage=stage, kv_cache_gib=gib,
                                              max_batch=max(users), max_model_len=context, batch_invariant=True,
                                              served_model_name="scoreboard"))
    server = BackgroundServer(state)
    prompts = make_prompts(requests, seed=0)
    try:
        load = run_load(server.url, prompts, max_tokens, list(users), time_limit=300, log=lambda s: None)  # warmed up
    finally:
        server.stop()
    m = {**meta, "stage": stage, "dtype": str(engine.dtype).removeprefix("torch."), "requests": requests,
         "max_tokens": max_tokens, "run_s": time.perf_counter() - t0}
    return {"meta": m, **load}


def live_board(model_dir: str | Path, device: str = "cpu", **options) -> Board:
    """``live_records`` as a board (options as there)."""
    bench, serves = live_records(model_dir, device, **options)
    return board_from_records(bench, serves, "live")


# ------------------------------------------------------------------------------ a picture
def rung_chart(boards: list[Board]):
    """The rung lines of each board as bars: one stream's decode rate (left) and TTFT (right), one row
    of panels per board, titled with its device and model. Rungs a board did not measure are left out."""
    import matplotlib.pyplot as plt

    boards = [b for b in boards if any(e.part == "rung" and e.tok_s for e in b.entries)]
    if not boards:
        raise ValueError("no board has a measured rung to draw")
    fig, axes = plt.subplots(len(boards), 2, figsize=(9.0, 0.6 + 2.4 * len(boards)), squeeze=False)
    for board, (left, right) in zip(boards, axes):
        rungs = [e for e in board.entries if e.part == "rung" and e.tok_s]
        names = [f"{e.system} ({e.dtype})" for e in rungs]
        weights = "real weights" if board.real_weights else "random weights"
        for ax, values, label, fmt in ((left, [e.tok_s for e in rungs], "decode tokens/s, 1 stream", "{:.1f}"),
                                       (right, [e.ttft_ms for e in rungs], "TTFT (ms)", "{:.0f}")):
            bars = ax.barh(range(len(rungs)), values, color="#4c72b0")
            ax.set_yticks(range(len(rungs)), names if ax is left else [""] * len(rungs), fontsize=9)
            ax.invert_yaxis()  # the ladder's order, top to bottom
            ax.bar_label(bars, [fmt.format(v) for v in values], fontsize=8, padding=2)
            ax.set_xlim(0, 1.25 * max(values))
            ax.set_xlabel(label, fontsize=9)
            ax.tick_params(labelsize=8)
        where = "live, this run" if board.source == "live" else "committed record"
        left.set_title(f"{board.device_name} · {board.model} · {weights} · {where}", fontsize=9, loc="left")
    fig.tight_layout()
    return fig
