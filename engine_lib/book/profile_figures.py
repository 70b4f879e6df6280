"""Pictures measured with the profiler and the allocator: what one decode step does on the host
(and the GPU), and what one generation holds in memory, step by step.

- ``step_trace`` / ``timeline_figure``: defined in chapter 07 (fusion and CUDA graphs): one decode
  step of the same model run eagerly, compiled, and (on a GPU) replayed as a CUDA graph, drawn as
  a timeline of the operators the host dispatched and the kernels the GPU ran.
- ``memory_timeline`` / ``memory_figure``: defined in chapter 09 (beyond greedy): the weights, the
  KV cache (allocated and filled) and the transient peak of each step of one generation. On a GPU
  from ``torch.cuda.memory_allocated`` and ``max_memory_allocated``; on a CPU from the
  allocations and frees that ``torch.profiler`` records (``profile_memory=True``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..bench.measure import DISPATCHED
from ..sampling import SamplingParams
from ..stages import sync

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..loop.local import LocalLoop, Paused

FONT = 10
LANES = ("host", "in graph", "GPU")
# what a span is, by the name the profiler gives it; the first match wins
CATEGORIES = (
    ("graph replay", "#C44E52", ("cudaGraphLaunch", "graph_replay", "CUDAGraph")),
    ("compiled region", "#55A868", ("Torch-Compiled", "CompiledFunction", "CompiledFxGraph", "triton_", "cpp_fused",
                                    "inductor")),
    ("matmul", "#4C72B0", ("mm", "linear", "matmul", "gemm", "gemv", "Gemm", "int4pack", "int8pack")),
    ("attention", "#8172B2", ("attention", "softmax", "fmha", "flash")),
    ("other op", "#CCB974", ()),
)


def category(name: str) -> str:
    """The colour group of a profiler event: graph replay, compiled region, matmul, attention or other."""
    for label, _, keys in CATEGORIES:
        if any(k in name for k in keys):
            return label
    return "other op"


@dataclass
class Span:
    lane: str  # "host": what the step dispatched from Python; "in graph": the library calls (matmuls,
    # attention) inside a compiled region, between its generated kernels; "GPU": kernels the device ran
    name: str
    start_us: float  # from the step's start
    dur_us: float


@dataclass
class StepTrace:
    """One profiled decode step."""

    form: str  # "eager", "compiled" or "cuda_graph"
    spans: list[Span] = field(default_factory=list)
    wall_us: float = 0.0  # the step as the host saw it, launch to sync

    @property
    def host_ops(self) -> int:
        return sum(s.lane == "host" for s in self.spans)

    @property
    def in_graph(self) -> int:
        return sum(s.lane == "in graph" for s in self.spans)

    @property
    def kernels(self) -> int:
        return sum(s.lane == "GPU" for s in self.spans)


def _quiet_profile(activities, **kw):
    """``torch.profiler.profile`` with its C++ side's stray lines on fd 2 sent to /dev/null."""
    import contextlib

    from torch.profiler import profile

    @contextlib.contextmanager
    def run():
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 2)
                with profile(activities=activities, **kw) as prof:
                    yield prof
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    return run()


def prefill_for_trace(loop: LocalLoop, prompt_len: int = 32, new_tokens: int = 16) -> Paused:
    """The loop stopped right after a ``prompt_len``-token prompt's prefill (greedy), its next decode step ready
    to run (``Paused.decode``, again and again: it writes the same slots)."""
    return loop.paused([list(range(1000, 1000 + prompt_len))], SamplingParams(max_tokens=new_tokens))


def step_trace(paused: Paused, form: str, warmup: int = 3) -> StepTrace:
    """Profile one ``paused.decode()`` after ``warmup`` of them (which compile and capture, where the
    loop's runner does). Host spans are the top-level events under the step; GPU spans the device kernels
    that ran during it."""
    from torch.profiler import ProfilerActivity, record_function

    device = paused.cache.device
    for _ in range(warmup):
        paused.decode()
    sync(device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with _quiet_profile(activities) as prof:
        with record_function("decode step"):
            paused.decode()
            sync(device)
    events = prof.events()
    step = next(e for e in events if e.name == "decode step")
    t0, t1 = step.time_range.start, step.time_range.end
    trace = StepTrace(form, wall_us=t1 - t0)
    regions = {e.id for e in events if e.cpu_parent is not None and e.cpu_parent.id == step.id
               and category(e.name) == "compiled region"}

    def in_region(e) -> bool:  # an aten op under a compiled region, outside any other aten op
        p = e.cpu_parent
        while p is not None:
            if p.id in regions:
                return True
            if p.name.startswith(DISPATCHED):
                return False
            p = p.cpu_parent
        return False

    for e in events:
        if e is step:
            continue
        span = (e.name, e.time_range.start - t0, e.time_range.elapsed_us())
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if t0 <= e.time_range.start <= t1:
                trace.spans.append(Span("GPU", *span))
        elif e.cpu_parent is not None and e.cpu_parent.id == step.id:
            if e.name != "cudaDeviceSynchronize":
                trace.spans.append(Span("host", *span))
        elif regions and e.name.startswith(DISPATCHED) and in_region(e):
            trace.spans.append(Span("in graph", *span))
    trace.spans.sort(key=lambda s: (s.lane, s.start_us))
    return trace


def show_trace_summary(traces: list[StepTrace]) -> None:
    """A table of the traced steps: calls from Python, library calls inside a compiled region, GPU
    kernels, and the step's time as the host saw it under the profiler."""
    from . import show_table

    show_table(["step runs as", "calls from Python", "library calls in the compiled region", "GPU kernels",
                "step under the profiler (ms)"],
               [[t.form, t.host_ops, t.in_graph or "", t.kernels or "", f"{t.wall_us / 1e3:.2f}"] for t in traces],
               caption="one decode step per form, profiled in this run (the profiler's own cost included)")


def timeline_figure(traces: list[StepTrace], title: str) -> Figure:
    """One lane per step form (and a second, GPU lane where kernels were recorded): every span as a
    bar from its start, coloured by ``category``, on a shared axis in milliseconds."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lanes = [(t, lane) for t in traces for lane in LANES if any(s.lane == lane for s in t.spans)]
    fig, ax = plt.subplots(figsize=(6.8, 0.75 * len(lanes) + 1.9))
    colors = {label: color for label, color, _ in CATEGORIES}
    ticks = []
    for row, (t, lane) in enumerate(reversed(lanes)):
        spans = [s for s in t.spans if s.lane == lane]
        for label in colors:
            bars = [(s.start_us / 1e3, max(s.dur_us / 1e3, 1e-4)) for s in spans if category(s.name) == label]
            if bars:
                ax.broken_barh(bars, (row - 0.35, 0.7), facecolors=colors[label], edgecolor="black", linewidth=0.2)
        what = {"host": "calls", "in graph": "library calls", "GPU": "kernels"}[lane]
        ticks.append(f"{t.form}, {lane}\n{len(spans)} {what}" + (f", {t.wall_us / 1e3:.2f} ms" if lane == "host" else ""))
    ax.set_yticks(range(len(lanes)), ticks, fontsize=FONT)
    ax.set_xlabel("time from the start of the step (ms)", fontsize=FONT)
    ax.set_xlim(0, max(t.wall_us for t in traces) / 1e3 * 1.02)
    used = {category(s.name) for t in traces for s in t.spans}
    ax.legend(handles=[Patch(color=colors[c], label=c) for c in colors if c in used], fontsize=FONT,
              loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=3, frameon=False)
    ax.set_title(title, fontsize=FONT)
    ax.tick_params(labelsize=FONT)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------- memory
@dataclass
class MemoryTimeline:
    """Bytes per step of one generation: step 0 is the prefill, then one entry per decode step."""

    source: str  # how it was measured
    weights: int  # the model's parameters and buffers
    kv_allocated: list[int] = field(default_factory=list)  # the cache buffers held after each step
    kv_filled: list[int] = field(default_factory=list)  # the part of them written so far
    steady: list[int] = field(default_factory=list)  # live bytes above the weights after the step
    peak: list[int] = field(default_factory=list)  # the highest live bytes above the weights during it
    slots: int = 0  # cache slots per row, allocated at the prefill

    @property
    def transient(self) -> list[int]:
        """Per step: how far the step's peak rose above what it left behind (activations, logits)."""
        return [p - s for p, s in zip(self.peak, self.steady)]


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers, each storage once (a tied matrix counts once)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _profiled_live(fn) -> tuple[int, int]:
    """Run ``fn`` under the CPU profiler with memory recording -> (net bytes allocated, peak of the
    running sum): every allocation and free the profiler recorded, in time order."""
    from torch.profiler import ProfilerActivity

    with _quiet_profile([ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    deltas = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    live = peak = 0
    for _, d in deltas:
        live += d
        peak = max(peak, live)
    return live, peak


@torch.inference_mode()
def memory_timeline(loop: LocalLoop, prompt_ids: list[int], new_tokens: int) -> MemoryTimeline:
    """Measure one greedy generation of ``new_tokens`` after ``prompt_ids``, batch 1, step by step through the
    engine's own loop (its old cache is dropped first). GPU: the allocator's counters; CPU: the profiler's
    record of allocations and frees, counted from just before the first step (the prefill)."""
    import gc

    device, model = loop.model.device, loop.model
    cuda = device.type == "cuda"
    loop.core = None  # the cache is made again, inside the first step
    gc.collect()
    steps = loop.run([list(prompt_ids)], SamplingParams(max_tokens=new_tokens))
    if cuda:
        torch.cuda.empty_cache()
        sync(device)
        base = torch.cuda.memory_allocated(device)
        tl = MemoryTimeline("torch.cuda.memory_allocated / max_memory_allocated", held_bytes(model))
    else:
        base = 0
        tl = MemoryTimeline("CPU: allocations and frees recorded by torch.profiler (profile_memory=True)",
                            held_bytes(model))
    live, seqs = 0, None
    for _ in range(new_tokens):  # the prefill, then a decode step per token
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            seqs, _ = next(steps)
            sync(device)
            now, top = torch.cuda.memory_allocated(device) - base, torch.cuda.max_memory_allocated(device) - base
        else:
            out: list = []
            net, high = _profiled_live(lambda out=out: out.append(next(steps)))
            seqs = out[0][0]
            now, top = live + net, live + high
            live = now
        cache = loop.cache
        per_slot, tl.slots = cache.nbytes // (cache.batch * cache.max_len), cache.max_len
        tl.kv_allocated.append(cache.nbytes)
        tl.kv_filled.append(per_slot * min(seqs[0].length, cache.max_len))  # the newest token's slot counts
        tl.steady.append(now)
        tl.peak.append(max(top, now))
    steps.close()
    return tl


def memory_figure(tl: MemoryTimeline, title: str) -> Figure:
    """Left: what the step with the highest peak held, from zero (the weights included). Right: per
    step, what sits above the weights: the KV cache (its filled part darker), the other step
    buffers, and the step's transient peak above what it left behind."""
    import matplotlib.pyplot as plt

    mib = 1 / 2**20
    x = list(range(len(tl.steady)))
    other = [max(0, s - a) for s, a in zip(tl.steady, tl.kv_allocated)]  # step buffers, logits, picks
    layers = [("KV cache, filled", "#4C72B0", tl.kv_filled),
              ("KV cache, allocated, empty", "#a9c1e6", [a - f for a, f in zip(tl.kv_allocated, tl.kv_filled)]),
              ("other step buffers", "#CCB974", other),
              ("transient peak in the step", "#C44E52", tl.transient)]
    fig, (ax0, ax) = plt.subplots(1, 2, figsize=(6.8, 4.0), width_ratios=(1, 4))
    top = max(x, key=lambda i: tl.peak[i])
    bottom = tl.weights * mib
    ax0.bar([0], [bottom], color="#bbbbbb", label="weights")
    for _, color, values in layers:
        ax0.bar([0], [values[top] * mib], bottom=[bottom], color=color)
        bottom += values[top] * mib
    ax0.set_xticks([0], ["prefill" if top == 0 else f"step {top}"], fontsize=FONT)
    ax0.set_ylabel("MiB", fontsize=FONT)
    ax0.set_title(f"at the peak\n(weights: {tl.weights * mib:,.0f} MiB)", fontsize=FONT)
    base = [0.0] * len(x)
    for label, color, values in layers:
        ax.bar(x, [v * mib for v in values], bottom=base, color=color, label=label)
        base = [b + v * mib for b, v in zip(base, values)]
    every = max(1, len(x) // 8)
    ax.set_xticks([i for i in x if i % every == 0], ["prefill" if i == 0 else str(i) for i in x if i % every == 0])
    ax.set_xlabel("step (prefill, then decode steps)", fontsize=FONT)
    ax.set_ylabel("MiB above the weights", fontsize=FONT)
    ax.set_title(title, fontsize=FONT)
    ax.legend(fontsize=FONT, loc="upper center", bbox_to_anchor=(0.4, -0.22), ncol=2, frameon=False)
    for a in (ax0, ax):
        a.tick_params(labelsize=FONT)
    fig.tight_layout()
    return fig
