"""llama.cpp as a benchmark peer: the same weights, prompt ids, threads, token counts and greedy
choice as the engine's rungs, timed in the same run (``python -m engine_lib bench --peer llama.cpp``).

Defined for chapter 08 (results). On a CPU, llama.cpp is what a reader would run instead of
this engine, so each rung is set beside it at the same weight width:

    half, fused (bf16)  <->  F16 and BF16      int8 (per channel)  <->  Q8_0
    int4  <->  Q4_0 and Q4_K_M (the 4-bit file most llama.cpp users download: mostly Q4_K, some Q6_K)

The checkpoint is converted to GGUF by ``engine_lib.bench.gguf_export`` (cached beside it). llama.cpp
runs in a process of its own (``llamacpp_worker.mjs``), so its peak memory is its own, fed token
ids (its tokenizer never runs), with flash attention on, as llama.cpp's own default does on a CPU.

The binding is the npm package ``node-llama-cpp``, pinned at 3.21.1:
``npm install --prefix ~/.cache/engine_lib/node-llama-cpp -E node-llama-cpp@3.21.1`` (or set
``ENGINE_LIB_NODE_LLAMA_CPP`` to the folder that holds its ``node_modules``). Why it and not
``llama-cpp-python``: it ships llama.cpp prebuilt (CPU variants chosen at run time: on an AVX2
host, its AVX2 build), so it installs from the npm registry in about two minutes with nothing to
compile; ``llama-cpp-python`` builds llama.cpp from its source distribution, and on this project's
shared 2-core machine that build (``nice -n 19``, one compile job) had done 27 of 140 steps after
20 minutes. The price: a generic prebuilt build rather than one tuned with ``-march=native`` (on an
AVX-512 host it may leave AVX-512 unused), and no raw logits: its API gives the next-token
probabilities, so the agreement check compares log-probabilities (logits less their log-sum-exp).
It is not in the project's lock: the peer is optional, and the bench says in one line when it
skips it.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = Path(__file__).with_name("llamacpp_worker.mjs")
PACKAGE_ENV = "ENGINE_LIB_NODE_LLAMA_CPP"
VERSION = "3.21.1"
PEERS = ("llama.cpp",)
GGUF_FOR_RUNG = {"half": ("F16", "BF16"), "fused": ("F16", "BF16"), "int8": ("Q8_0",),
                 "int4": ("Q4_0", "Q4_K_M")}
WIDTH_BITS = {"F16": 16, "BF16": 16, "Q8_0": 8, "Q4_0": 4, "Q4_K_M": 4}
RUNG_BITS = {"half": 16, "fused": 16, "int8": 8, "int4": 4}
DECODE_GOAL, TTFT_GOAL = 1.1, 1.0  # issue 28: each rung >= 1.1x llama.cpp's decode, TTFT no worse


def package_dir() -> Path:
    """The folder whose ``node_modules`` holds node-llama-cpp."""
    from ..model.paths import default_cache_dir

    return Path(os.environ.get(PACKAGE_ENV) or default_cache_dir() / "node-llama-cpp")


def install_command() -> str:
    return f"npm install --prefix {package_dir()} -E node-llama-cpp@{VERSION}"


def worker_env() -> dict:
    return {**os.environ, PACKAGE_ENV: str(package_dir())}


def unavailable_reason() -> str | None:
    """Why the peer cannot run here (None: it can): the ``gguf`` writer missing in this process,
    no Node.js, or no node-llama-cpp in ``package_dir()``."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        return "the gguf package is not installed (pip install gguf==0.19.0)"
    node = shutil.which("node")
    if node is None:
        return f"Node.js is not installed (node-llama-cpp runs on it: apt-get install nodejs, then {install_command()})"
    try:
        out = subprocess.run([node, str(WORKER), "--check"], capture_output=True, text=True, timeout=120,
                             env=worker_env())
        said = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as exc:
        return f"the llama.cpp worker could not be run ({type(exc).__name__}: {exc})"
    if "error" in said:
        return f"node-llama-cpp is not installed in {package_dir()} (install it: {install_command()})"
    return None


def context_size(tokens: int) -> int:
    """llama.cpp's context for a request of ``tokens`` (prompt and new): a margin of 16, in whole 256s."""
    return -(-(tokens + 16) // 256) * 256


class LlamaCppProcess:
    """The worker process with one GGUF model loaded: ``generate``, ``logits``, ``memory``, ``close``."""

    def __init__(self, gguf_path: str | os.PathLike, threads: int, n_ctx: int, lookup: bool = False):
        self.stderr = tempfile.TemporaryFile(mode="w+")  # llama.cpp's log: shown when something fails
        argv = ["node", str(WORKER), str(gguf_path), str(threads), str(n_ctx)] + (["lookup"] if lookup else [])
        self.proc = subprocess.Popen(argv,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     env=worker_env())
        self.hello = self._read()
        if "error" in self.hello:
            self.close()
            raise RuntimeError(f"llama.cpp could not load {gguf_path}: {self.hello['error']}")
        self.threads, self.n_ctx = threads, n_ctx

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.stderr.seek(0)
            raise RuntimeError(f"the llama.cpp worker exited ({self.proc.poll()}): {self.stderr.read()[-1000:]}")
        return json.loads(line)

    def request(self, op: str, **fields) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        if "error" in out:
            raise RuntimeError(f"llama.cpp {op}: {out['error']}")
        return out

    def generate(self, prompt: list[int], n: int) -> dict:
        """-> {"ttft_s", "decode_tok_s", "tokens", "predictions"}: greedy, exactly ``n`` new tokens; predictions:
        the drafts validated and refuted (0 and 0 unless the process was started with ``lookup``)."""
        return self.request("generate", prompt=list(prompt), n=n)

    def logprobs(self, prompt: list[int], n_vocab: int, steps: bool = True):
        """float32 next-token log-probabilities: at every position, one token per evaluation (``steps``:
        llama.cpp's decode path), (len(prompt), n_vocab); or after the prompt in one batch (its
        prefill path), the last position's, (1, n_vocab)."""
        import numpy as np

        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "logprobs.f32")
            self.request("logprobs", prompt=list(prompt), n_vocab=n_vocab, out=out, steps=steps)
            return np.fromfile(out, dtype=np.float32).reshape(-1, n_vocab)

    def memory(self) -> dict:
        return self.request("memory")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------- the bench system
def gguf_types_for(stages: list[str], asked: list[str] | None = None) -> list[str]:
    """The GGUF widths to time: those asked for, else those of the rungs in this run (every width
    when no rung has one)."""
    if asked:
        return list(dict.fromkeys(asked))
    types = [t for s in stages for t in GGUF_FOR_RUNG.get(s, ())]
    return list(dict.fromkeys(types)) or list(WIDTH_BITS)


def add_peer_systems(systems: list, gguf_types: list[str]) -> list:
    """``systems`` with one llama.cpp system per GGUF type, each right after the last rung of its
    width (so the two are timed minutes apart, not at the two ends of a run), the rest after the rungs."""
    import torch

    from .systems import System

    out = list(systems)
    for t in gguf_types:
        peer = System(f"llama.cpp_{t}", "peer", torch.float32, peer=t)  # llama.cpp computes in float32
        same = [i for i, s in enumerate(out) if s.kind == "engine" and RUNG_BITS.get(s.stage) == WIDTH_BITS[t]]
        last_engine = max((i for i, s in enumerate(out) if s.kind in ("engine", "peer")), default=-1)
        at = (max(same) if same else last_engine) + 1
        while at < len(out) and out[at].kind == "peer":  # after the width's other peers
            at += 1
        out.insert(at, peer)
    return out


def peer_runner(system, model_dir: Path, workloads: list):
    """Convert (or reuse) the GGUF file, start llama.cpp on it. -> (process, run) for
    ``run.measure_system``; run(prompts, n, batch) -> (TTFT s, decode tokens/s, new tokens)."""
    import torch

    from .gguf_export import ensure_gguf
    from .systems import BaselineUnavailable

    reason = unavailable_reason()
    if reason:
        raise BaselineUnavailable(reason)
    longest = max(len(p) for w in workloads for p in w.prompts) + max(w.max_new_tokens for w in workloads)
    n_ctx = context_size(longest)
    info = ensure_gguf(model_dir, system.peer)
    proc = LlamaCppProcess(info["path"], torch.get_num_threads(), n_ctx)
    proc.info = {"gguf": info, "threads": proc.threads, "n_ctx": n_ctx, "flash_attn": True,
                 "node_llama_cpp": proc.hello["node_llama_cpp"], "node": proc.hello["node"], "build": proc.hello["build"],
                 "model_load_s": proc.hello["load_s"], "base_rss_bytes": proc.hello["base_rss_bytes"],
                 "system_info": proc.hello["system_info"]}

    def run(prompts: list, n: int, batch: bool) -> tuple[float, float, int]:
        if batch:
            raise RuntimeError("not measured: the llama.cpp peer runs one sequence at a time")
        r = proc.generate(prompts[0], n)
        return r["ttft_s"], r["decode_tok_s"], len(r["tokens"])

    return proc, run


PAIRED_ROUNDS, PAIRED_NEW_TOKENS = 2, 32  # turn-about rounds over the seed prompts, and new tokens per reply


def pair_key(rung: str, peer: str) -> str:
    """A rung and a llama.cpp file's key in the record's ``peer_paired``."""
    return f"{rung} vs {peer}"


def turn_about(run_rung, run_peer, prompts: list, new_tokens: int, rounds: int) -> dict:
    """A rung and its peer timed turn about on every prompt, the one first on one prompt and second on the
    next (and the other way in the next round), so a drift of the machine (a neighbour's load, its memory
    bandwidth) hits both alike: -> each side's readings, in pairs. ``run_*(prompts, n, batch)`` as
    ``run.measure_system`` calls them."""
    for run in (run_rung, run_peer):
        run(prompts[:1], new_tokens, False)  # warm-up
    out = {"rung_ttft_ms": [], "peer_ttft_ms": [], "rung_decode_tok_s": [], "peer_decode_tok_s": []}
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            sides = [("rung", run_rung), ("peer", run_peer)]
            for side, run in sides if (r + i) % 2 == 0 else sides[::-1]:
                ttft, rate, _ = run([prompt], new_tokens, False)
                out[f"{side}_ttft_ms"].append(1e3 * ttft)
                out[f"{side}_decode_tok_s"].append(rate)
    return out


def paired_peers(systems: list, record: dict, model_dir: Path, device, workloads: list, engine_runner,
                 rounds: int = PAIRED_ROUNDS, new_tokens: int = PAIRED_NEW_TOKENS) -> dict:
    """Every rung beside each llama.cpp peer of its width, turn about on the seed prompts (``turn_about``),
    after each was timed alone: -> {"<rung> vs <peer>": the paired readings}. The seed-prompt ratios and
    targets come from these (``peer_ratios``): timed minutes apart, a busy neighbour could decide them.
    ``engine_runner(system, model_dir, device) -> (engine, run)``: how the bench loads and runs a rung."""
    import gc

    from .systems import BaselineUnavailable

    seed = next((w for w in workloads if w.name == "seed"), None)
    measured = {n for n, s in record["systems"].items() if "skipped" not in s}
    out = {}
    for rung in [s for s in systems if s.kind == "engine" and s.stage in RUNG_BITS and s.name in measured]:
        peers = [s for s in systems if s.kind == "peer" and s.name in measured
                 and WIDTH_BITS[s.peer] == RUNG_BITS[rung.stage]]
        if seed is None or not peers:
            continue
        engine, run_rung = engine_runner(rung, model_dir, device)
        n = min(new_tokens, seed.max_new_tokens)
        for peer in peers:
            try:
                proc, run_peer = peer_runner(peer, model_dir, workloads)
            except BaselineUnavailable:
                continue
            print(f"[bench] {rung.name} and {peer.name} turn about: {rounds} rounds of {len(seed.prompts)} prompts",
                  file=sys.stderr, flush=True)
            try:
                pairs = turn_about(run_rung, run_peer, seed.prompts, n, rounds)
            finally:
                proc.close()
            out[pair_key(rung.name, peer.name)] = {"rung": rung.name, "peer": peer.name, "rounds": rounds,
                                                   "prompts": len(seed.prompts), "new_tokens": n, **pairs}
        del engine, run_rung
        gc.collect()
    return out


# ------------------------------------------------------------------------------------ reporting
def _samples(w: dict, key: str):
    from .timing import Samples

    runs = w.get(f"{key}_runs") or [w[key]]
    return Samples.rates(runs) if key == "decode_tok_s" else Samples(tuple(runs))


def peer_ratios(record: dict) -> dict:
    """Every rung against llama.cpp at its width, per workload: decode x and TTFT x (> 1: the
    rung is faster), each with the spread of its runs and the words ``timing.relation`` gives."""
    from .timing import relation

    systems = record["systems"]
    peers = {n: s for n, s in systems.items() if s["kind"] == "peer" and "skipped" not in s}
    out = {}
    for r, rs in systems.items():
        if rs["kind"] != "engine" or rs["stage"] not in RUNG_BITS:
            continue
        for p, ps in peers.items():
            if WIDTH_BITS.get(ps["peer"]) != RUNG_BITS[rs["stage"]]:
                continue
            for w, rw in rs["workloads"].items():
                pw = ps["workloads"].get(w, {})
                if "error" in rw or "error" in pw or not pw:
                    continue
                rd, pd, rt, pt = _samples(rw, "decode_tok_s"), _samples(pw, "decode_tok_s"), \
                    _samples(rw, "ttft_ms"), _samples(pw, "ttft_ms")
                rm, pm = rs.get("peak_memory_bytes"), ps.get("peak_memory_bytes")
                row = {"rung": r, "peer": p, "workload": w, "bits": RUNG_BITS[rs["stage"]],
                       "decode_x": rd.median / pd.median, "decode_x_range": [rd.low / pd.high, rd.high / pd.low],
                       "ttft_x": pt.median / rt.median, "ttft_x_range": [pt.low / rt.high, pt.high / rt.low],
                       "decode_words": relation(rd, pd), "ttft_words": relation(rt, pt),
                       "memory_x": rm / pm if rm and pm else None, "paired": False}
                turns = record.get("peer_paired", {}).get(pair_key(r, p))
                if w == "seed" and turns:  # the turn-about rounds decide: each ratio from one pair of replies
                    row.update(paired_ratios(turns), paired=True)
                out[f"{r} vs {p} [{w}]"] = row
    return out


def readings(record: dict, v: dict) -> tuple[float, float, float, float]:
    """(the rung's decode tok/s, llama.cpp's, the rung's TTFT ms, llama.cpp's) behind one ``peer_ratios``
    row: the turn-about rounds' medians where its ratios came from them, else each system's own run."""
    if v.get("paired"):
        turns = record["peer_paired"][pair_key(v["rung"], v["peer"])]
        return tuple(statistics.median(turns[f"{side}_{key}"]) for key in ("decode_tok_s", "ttft_ms")
                     for side in ("rung", "peer"))
    return tuple(record["systems"][v[side]]["workloads"][v["workload"]][key] for key in ("decode_tok_s", "ttft_ms")
                 for side in ("rung", "peer"))


def paired_ratios(turns: dict) -> dict:
    """The ratios of ``turn_about``'s readings, pair by pair: their median and quartiles, and in words."""
    from .timing import Samples, relation

    # each pair's ratio, > 1 where the rung did better: its decode rate over llama.cpp's, llama.cpp's TTFT over its
    decode = Samples.rates([a / b for a, b in zip(turns["rung_decode_tok_s"], turns["peer_decode_tok_s"])])
    ttft = Samples.rates([b / a for a, b in zip(turns["rung_ttft_ms"], turns["peer_ttft_ms"])])
    ones = Samples.rates([1.0] * len(decode.values))  # the words say the pairs' median ratio, as the figure does
    return {"decode_x": decode.median, "decode_x_range": [decode.low, decode.high],
            "ttft_x": ttft.median, "ttft_x_range": [ttft.low, ttft.high],
            "decode_words": relation(decode, ones, paired=True), "ttft_words": relation(ttft, ones, paired=True)}


def peer_targets(record: dict) -> list[dict]:
    """Issue 28's goals, decided from this run: each rung's seed-prompt decode >= 1.1x llama.cpp's
    at its width, and its time to first token no worse."""
    out = []
    for v in record.get("peer_ratios", {}).values():
        if v["workload"] != "seed":
            continue
        how = "seed prompts, turn about" if v.get("paired") else "seed prompts"
        out.append({"target": f"{v['rung']} decode / {v['peer']} decode ({how})", "value": v["decode_x"],
                    "goal": f">= {DECODE_GOAL}x", "met": v["decode_x"] >= DECODE_GOAL})
        out.append({"target": f"{v['peer']} TTFT / {v['rung']} TTFT ({how})", "value": v["ttft_x"],
                    "goal": f">= {TTFT_GOAL}", "met": v["ttft_x"] >= TTFT_GOAL})
    return out


def peer_lines(record: dict) -> list[str]:
    """Markdown: the rungs beside llama.cpp at each width, then how llama.cpp was run."""
    ratios = record.get("peer_ratios") or {}
    peers = {n: s for n, s in record["systems"].items() if s["kind"] == "peer" and "skipped" not in s}
    if not peers:
        return []
    lines = ["", "## llama.cpp at the same weight width (same prompt ids, threads, token counts, greedy)", "",
             "Ratios > 1: the rung is faster. Spread: from the slowest to the fastest pairing of the two systems' "
             "runs (quartiles from 4 runs up).", "",
             "| bits | rung | llama.cpp | workload | decode (tok/s) rung / llama.cpp | decode x (spread) | "
             "TTFT (ms) rung / llama.cpp | TTFT x (spread) | peak memory x (llama.cpp / rung) |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|"]
    turns = None
    for v in ratios.values():
        rd, pd, rt, pt = readings(record, v)
        workload = v["workload"]
        if v.get("paired"):
            turns = record["peer_paired"][pair_key(v["rung"], v["peer"])]
            workload += " (turn about)"
        mem = f"{1 / v['memory_x']:.2f}" if v["memory_x"] else "n/a"
        lines.append(f"| {v['bits']} | {v['rung']} | {v['peer']} | {workload} | {rd:.1f} / {pd:.1f} | "
                     f"{v['decode_x']:.2f}x ({v['decode_x_range'][0]:.2f}-{v['decode_x_range'][1]:.2f}) | "
                     f"{rt:.0f} / {pt:.0f} | {v['ttft_x']:.2f}x "
                     f"({v['ttft_x_range'][0]:.2f}-{v['ttft_x_range'][1]:.2f}) | {mem} |")
    if turns:
        lines += ["", f"Turn about: after each system was timed alone, each rung and its llama.cpp peer answered "
                      f"the {turns['prompts']} seed prompts in turn, {turns['rounds']} rounds, {turns['new_tokens']} "
                      "new tokens each, the one first on one prompt and second on the next, so a drift of the "
                      "machine hits both alike; each ratio is the median of the pairs' ratios, its spread their "
                      "quartiles. The seed-prompt targets are decided from these pairs."]
    first = next(iter(peers.values()))
    if "threads" in first:
        files = "; ".join(f"{s['gguf']['type']} {s['gguf']['bytes'] / 2**20:.0f} MiB (converted in "
                          f"{s['gguf']['made_s']:.1f} s)" for s in peers.values() if "gguf" in s)
        lines += ["", f"llama.cpp through node-llama-cpp {first['node_llama_cpp']} ({first['build']} build), "
                      f"{first['threads']} threads "
                      f"(the engine's torch threads), context {first['n_ctx']}, flash attention on, fed the prompt's "
                      f"token ids; its peak memory is its own process's peak RSS (Node.js, the library and "
                      f"the memory-mapped GGUF file pages it touched). GGUF files: {files}.",
                  f"llama.cpp's build: {first['system_info'].strip()}"]
    return lines


def load_line(meta: dict) -> str:
    """'- machine load (1/5/15-minute load average): ...' from the record's meta ('' without it)."""
    la = meta.get("load_average")
    if not la:
        return ""
    parts = [f"{' / '.join(f'{x:.2f}' for x in la[k])} at the {k}" for k in ("start", "end") if k in la]
    return f"- machine load (1 / 5 / 15-minute load average, {meta.get('cpu_count', '?')} cores): " + "; ".join(parts)
