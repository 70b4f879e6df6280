"""Train the small Qwen2 checkpoint of the ``qwen2-stdlib-small`` preset on the Python standard library.

The engine's architecture at a small width (``engine_lib.model.checkpoints.STDLIB_SMALL``): the real
Qwen2.5 tokenizer and vocabulary, GQA (4 query heads, 2 KV heads), q/k/v biases, tied
embeddings. Trained here as ``transformers.Qwen2ForCausalLM`` with a plain AdamW loop, on two
CPU threads, within a time budget (default 14 minutes for the whole run, evaluation included).

Corpus: the ``.py`` files (code and docstrings) of the standard library shipped with the
interpreter that runs this (PSF License), without test suites, IDLE, tkinter, lib2to3, codec
tables and build configuration. A file is held out when a hash of its path says so
(``is_heldout``): the rule depends on the path only, so no Python version trains on a held-out
path. The held-out text itself is vendored (``engine_lib/assets/heldout/``) and evaluation always
reads that copy, so every machine evaluates on the same text. ``--write-heldout`` rewrites it
(done once, on purpose).

Training vocabulary: the corpus uses about 29,000 of the 151,936 tokens. Training runs on those
rows only (``TrainingVocab``), which makes a step about five times cheaper, because the LM head and
its softmax dominate a model this narrow. The exported checkpoint has the full vocabulary with
zero rows for the unused tokens, so their logits are exactly 0. During training the loss adds
the same mass: one extra logit of log(number of unused tokens). So the loss minimised is
exactly the full-vocabulary model's cross-entropy.

Deterministic: a fixed seed, deterministic algorithms, two threads. The number of steps is
estimated from the budget after a few timed steps and recorded; ``--steps N`` repeats a run
exactly (same data order, same schedule). The learning rate follows a linear warm-up and a
cosine decay over those steps.

    python scripts/train_small_model.py                      # the committed checkpoint and record
    python scripts/train_small_model.py --max-seconds 10 --out /tmp/small --record /tmp/small.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_lib.model.checkpoints import (  # noqa: E402
    HELDOUT_MANIFEST,
    HELDOUT_TEXT,
    REAL_GENERATION_CONFIG,
    STDLIB_SMALL,
    STDLIB_SMALL_DIR,
    preset_config,
)
from engine_lib.model.tokenizer import load_tokenizer  # noqa: E402

EOS = 151643  # <|endoftext|>: separates the files in the token stream
SEPARATOR = "<|endoftext|>"  # the same, in the vendored held-out text (the tokenizer reads it as one special token)
EXCLUDED_DIRS = {"test", "tests", "idle_test", "idlelib", "tkinter", "lib2to3", "turtledemo", "ensurepip",
                 "encodings", "site-packages", "lib-dynload", "__pycache__", "__phello__"}
HELDOUT_MODULUS = 40  # about 1 file in 40 is held out


def is_heldout(rel: str) -> bool:
    """Whether the stdlib file at relative path ``rel`` (posix form) belongs to the held-out split."""
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % HELDOUT_MODULUS == 0


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative posix path, path) of every corpus file of this interpreter's stdlib, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if set(rel.parts[:-1]) & EXCLUDED_DIRS or rel.parts[0].startswith("config-"):
            continue
        if rel.name.startswith("_sysconfigdata") or rel.name.startswith("test_"):
            continue  # the build's own settings; stray tests outside test folders
        out.append((rel.as_posix(), path))
    return out


def read_corpus(max_bytes: int | None) -> tuple[list[dict], list[str], list[dict], list[str]]:
    """(training manifest, training texts, held-out manifest, held-out texts). ``max_bytes`` keeps
    only the first files of the training split (quick runs)."""
    train_meta, train_text, held_meta, held_text = [], [], [], []
    total = 0
    for rel, path in stdlib_files():
        raw = path.read_bytes()
        text = raw.decode("utf-8", errors="replace")
        meta = {"path": rel, "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()[:16]}
        if is_heldout(rel):
            held_meta.append(meta)
            held_text.append(text)
        elif max_bytes is None or total < max_bytes:
            total += len(raw)
            train_meta.append(meta)
            train_text.append(text)
    return train_meta, train_text, held_meta, held_text


def write_heldout(meta: list[dict], texts: list[str]) -> None:
    HELDOUT_TEXT.parent.mkdir(parents=True, exist_ok=True)
    HELDOUT_TEXT.write_text(SEPARATOR.join(texts), encoding="utf-8")
    HELDOUT_MANIFEST.write_text(json.dumps({
        "source": f"Python {platform.python_version()} standard library (PSF License), .py files",
        "rule": f"int(sha256(relative path)[:8 hex], 16) % {HELDOUT_MODULUS} == 0, after the exclusions "
                f"in scripts/train_small_model.py",
        "separator": SEPARATOR, "files": meta}, indent=1) + "\n")


def tokenize(tokenizer, texts: list[str]) -> torch.Tensor:
    """The files' token ids, each followed by <|endoftext|>, as one stream."""
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(EOS)
    return torch.tensor(ids, dtype=torch.long)


def heldout_ids(tokenizer, max_tokens: int | None = None) -> torch.Tensor:
    """The vendored held-out text as token ids (the separators become <|endoftext|>)."""
    ids = tokenizer(HELDOUT_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[:max_tokens] if max_tokens else ids, dtype=torch.long)


@torch.no_grad()
def heldout_nll(model, ids: torch.Tensor, seq_len: int, batch: int = 4) -> tuple[float, int]:
    """Mean cross-entropy (nats) of ``ids`` in consecutive windows of ``seq_len`` tokens, each
    window predicting its tokens 2..n from the ones before them; and how many tokens were scored."""
    windows = [ids[a:a + seq_len + 1] for a in range(0, len(ids) - 1, seq_len)]
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        group = windows[i:i + batch]
        width = max(len(w) for w in group)
        x = torch.full((len(group), width), EOS)
        mask = torch.zeros(len(group), width, dtype=torch.bool)
        for j, w in enumerate(group):
            x[j, :len(w)], mask[j, :len(w)] = w, True
        logits = model(x[:, :-1], attention_mask=mask[:, :-1].long()).logits.float()
        keep = mask[:, 1:]
        nll = F.cross_entropy(logits[keep], x[:, 1:][keep], reduction="sum")
        total, count = total + nll.item(), count + int(keep.sum())
    return total / count, count


class TrainingVocab:
    """The tokens the training split uses, and the maps between full and compact ids."""

    def __init__(self, train_ids: torch.Tensor, vocab_size: int):
        self.ids = torch.unique(torch.cat([train_ids, torch.tensor([EOS])]))  # sorted full ids in use
        self.vocab_size = vocab_size
        self.to_compact = torch.full((vocab_size,), -1, dtype=torch.long)
        self.to_compact[self.ids] = torch.arange(len(self.ids))
        # the unused tokens' logits are 0 in the exported model: together, one logit of log(count)
        self.unused_logit = math.log(vocab_size - len(self.ids))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary cross-entropy from compact logits (n, used) and compact targets (n,)."""
        extra = logits.new_full((logits.shape[0], 1), self.unused_logit)
        return F.cross_entropy(torch.cat([logits, extra], dim=-1), targets)

    @torch.no_grad()
    def expand(self, compact, full):
        """Copy a compact model into a full-vocabulary one: used rows in place, unused rows zero."""
        state = compact.state_dict()
        emb = state.pop("model.embed_tokens.weight")
        state.pop("lm_head.weight", None)  # tied
        full_emb = emb.new_zeros(self.vocab_size, emb.shape[1])
        full_emb[self.ids] = emb
        missing, unexpected = full.load_state_dict({**state, "model.embed_tokens.weight": full_emb}, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        full.tie_weights()
        return full


def unigram_nll(train_ids: torch.Tensor, ids: torch.Tensor, vocab: int) -> float:
    """Mean cross-entropy of ``ids`` under token frequencies of the training split, add-one smoothed
    over the whole vocabulary (the same tokens as the model scores: all but the first)."""
    counts = torch.bincount(train_ids, minlength=vocab).double() + 1
    logp = counts.log() - counts.sum().log()
    return -logp[ids[1:]].mean().item()


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def save_checkpoint(model, out: Path, cfg, record_meta: dict) -> None:
    """config.json, generation_config.json and model.safetensors (bf16, tied: no lm_head.weight).
    The tokenizer files are not copied: the engine falls back to its vendored tokenizer, and
    ``ensure_checkpoint`` adds them where a complete folder is wanted."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = cfg.to_hf_dict()
    hf_cfg["torch_dtype"] = "bfloat16"
    hf_cfg["engine_lib_trained_checkpoint"] = record_meta
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    shutil.copy(REAL_GENERATION_CONFIG, out / "generation_config.json")
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})


def plot(curve: list[dict], evals: list[dict], final: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([c["tokens"] / 1e3 for c in curve], [c["loss"] for c in curve], label="training loss")
    ax.plot([e["tokens"] / 1e3 for e in evals], [e["heldout_loss"] for e in evals], "o-",
            label=f"held-out loss (first {evals[-1]['heldout_tokens']:,} tokens)")
    # Each baseline is drawn on the tokens its losses were scored on: the dots on a slice, the star on all.
    ax.axhline(evals[-1]["unigram_loss"], color="gray", ls="--",
               label=f"unigram on the same {evals[-1]['heldout_tokens']:,} tokens (training-split frequencies)")
    ax.plot([final["tokens"] / 1e3], [final["heldout_loss"]], "*", color="C3", ms=12,
            label=f"held-out loss (all {final['heldout_tokens']:,} tokens)")
    ax.axhline(final["unigram_loss"], color="C3", ls=":", label=f"unigram on all {final['heldout_tokens']:,} tokens")
    ax.set_xlabel("training tokens seen (thousands)")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _shown(path: Path) -> str:
    """A path as the record shows it: relative to the repository when inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=STDLIB_SMALL_DIR, help="checkpoint folder")
    p.add_argument("--record", type=Path, default=ROOT / "book" / "results" / "small-model.train.json",
                   help="training record (JSON); the loss plot goes beside it (.png)")
    p.add_argument("--max-seconds", type=float, default=14 * 60, help="budget for the whole run, evaluation included")
    p.add_argument("--steps", type=int, default=None, help="exact number of steps (default: as many as the budget allows)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--curve-evals", type=int, default=5, help="held-out evaluations on a slice during training (the plot)")
    p.add_argument("--curve-eval-tokens", type=int, default=2048)
    p.add_argument("--eval-tokens", type=int, default=None, help="score only the first N held-out tokens")
    p.add_argument("--max-corpus-bytes", type=int, default=None, help="train on the first files only (quick runs)")
    p.add_argument("--write-heldout", action="store_true", help="rewrite the vendored held-out text from this stdlib")
    return p.parse_args(argv)


def build_models(cfg, vocab: TrainingVocab, seed: int):
    """-> (the exported shape, on which evaluation runs; the model trained on the training vocabulary), each
    initialised from ``seed`` (normal, std 0.02), in that order."""
    from transformers import Qwen2Config as HFConfig
    from transformers import Qwen2ForCausalLM

    hf_kwargs = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")}
    full_model = Qwen2ForCausalLM(HFConfig(**hf_kwargs))
    full_model.config._attn_implementation = "sdpa"
    n_params = sum(p.numel() for p in full_model.parameters())
    assert n_params == cfg.num_parameters(), (n_params, cfg.num_parameters())
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(HFConfig(**{**hf_kwargs, "vocab_size": len(vocab.ids), "bos_token_id": None,
                                         "eos_token_id": None}))
    model.config._attn_implementation = "sdpa"
    return full_model, model


class Training:
    """The run's state: the models, the data, the optimizer, the schedule and what it logged."""

    def __init__(self, args, cfg, vocab: TrainingVocab, train_ids: torch.Tensor, t0: float):
        self.args, self.cfg, self.vocab, self.train_ids, self.t0 = args, cfg, vocab, train_ids, t0
        self.full_model, self.model = build_models(cfg, vocab, args.seed)
        self.compact_ids = vocab.to_compact[train_ids]
        decay = [p for n, p in self.model.named_parameters() if p.ndim == 2]
        other = [p for n, p in self.model.named_parameters() if p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                      {"params": other, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
        self.data_gen = torch.Generator().manual_seed(args.seed)
        self.tokens_per_step = args.batch * args.seq_len
        self.curve, self.slice_evals, self.step_times, self.losses = [], [], [], []
        self.step, self.stopped = 0, "steps"

    def batch(self) -> torch.Tensor:
        a = self.args
        starts = torch.randint(0, len(self.train_ids) - a.seq_len - 1, (a.batch,), generator=self.data_gen)
        return torch.stack([self.compact_ids[s:s + a.seq_len + 1] for s in starts.tolist()])

    def evaluate(self, ids: torch.Tensor) -> dict:
        full = self.vocab.expand(self.model, self.full_model).eval()
        loss, count = heldout_nll(full, ids, self.args.seq_len)
        unigram = unigram_nll(self.train_ids, ids, self.cfg.vocab_size)
        return {"step": self.step, "tokens": self.step * self.tokens_per_step, "heldout_loss": round(loss, 4),
                "heldout_ppl": round(math.exp(loss), 2), "heldout_tokens": count,
                "unigram_loss": round(unigram, 4), "unigram_ppl": round(math.exp(unigram), 2)}

    def eval_budget(self, held: torch.Tensor, slice_ids: torch.Tensor) -> float:
        """Seconds reserved for the evaluations and saving, from the measured speed of one."""
        seq = self.args.seq_len
        self.full_model.eval()
        heldout_nll(self.full_model, held[: seq + 1], seq)  # warm-up
        start = time.perf_counter()
        heldout_nll(self.full_model, held[: 4 * seq], seq)
        per_token = (time.perf_counter() - start) / (4 * seq)
        print(f"evaluation: {1 / per_token:.0f} tokens/s", flush=True)
        return per_token * (len(held) + (self.args.curve_evals + 2) * len(slice_ids)) * 1.3 + 10

    def one_step(self, steps: int | None) -> float:
        ts = time.perf_counter()
        x = self.batch()
        lr = lr_at(self.step, steps or 10**9, self.args.lr, self.args.warmup)
        for group in self.opt.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self.model(x[:, :-1]).logits
        loss = self.vocab.loss(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        self.step_times.append(time.perf_counter() - ts)
        self.losses.append(loss.item())
        return lr

    def run(self, slice_ids: torch.Tensor, eval_seconds: float) -> None:
        """Train until ``--steps`` or the time budget; the schedule is fixed from the measured step time."""
        a, steps = self.args, self.args.steps
        while steps is None or self.step < steps:
            lr = self.one_step(steps)
            loss = self.losses[-1]
            if self.step % a.log_every == 0 or self.step == 1:
                self.curve.append({"step": self.step, "tokens": self.step * self.tokens_per_step, "loss": round(loss, 4),
                                   "lr": round(lr, 6), "seconds": round(time.perf_counter() - self.t0, 1)})
                print(f"step {self.step:5d}/{steps or '?'}  loss {loss:.3f}  lr {lr:.2e}  "
                      f"{time.perf_counter() - self.t0:.0f} s", flush=True)
            left = a.max_seconds - (time.perf_counter() - self.t0) - eval_seconds
            if steps is None and self.step == 10:
                per_step = sorted(self.step_times[1:])[len(self.step_times[1:]) // 2]
                steps = max(self.step + 1, self.step + int(left / (per_step * 1.05)))
                print(f"{per_step:.2f} s per step: {steps} steps in the budget", flush=True)
            if steps and a.curve_evals and self.step < steps and self.step % max(1, steps // (a.curve_evals + 1)) == 0 \
                    and len(self.slice_evals) < a.curve_evals:
                self.slice_evals.append(self.evaluate(slice_ids))
                print(f"  held-out slice: perplexity {self.slice_evals[-1]['heldout_ppl']}", flush=True)
            if left <= 0 and (steps is None or self.step < steps):
                self.stopped = "budget"
                break


def main(argv: list[str] | None = None) -> dict:
    args = arguments(argv)
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    train_meta, train_text, held_meta, held_text = read_corpus(args.max_corpus_bytes)
    if args.write_heldout:
        write_heldout(held_meta, held_text)
    tokenizer = load_tokenizer()
    train_ids = tokenize(tokenizer, train_text)
    held = heldout_ids(tokenizer, args.eval_tokens)
    t_data = time.perf_counter() - t0
    print(f"corpus: {len(train_meta)} training files, {sum(m['bytes'] for m in train_meta):,} bytes, "
          f"{len(train_ids):,} tokens; held-out {len(held):,} tokens ({t_data:.0f} s)", flush=True)
    cfg = preset_config(STDLIB_SMALL)
    vocab = TrainingVocab(train_ids, cfg.vocab_size)
    run = Training(args, cfg, vocab, train_ids, t0)
    print(f"training vocabulary: {len(vocab.ids):,} of {cfg.vocab_size:,} tokens in use", flush=True)
    slice_ids = held[: args.curve_eval_tokens]
    eval_seconds = run.eval_budget(held, slice_ids)
    print(f"{eval_seconds:.0f} s reserved for the evaluations", flush=True)
    run.run(slice_ids, eval_seconds)
    train_seconds = time.perf_counter() - t0 - t_data
    fp32_slice = run.evaluate(slice_ids)
    with torch.no_grad():  # evaluate the weights as saved: rounded to bf16
        for param in run.model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    bf16_slice = run.evaluate(slice_ids)
    final = run.evaluate(held)
    total_seconds = time.perf_counter() - t0
    print(f"held-out: {final['heldout_tokens']:,} tokens, perplexity {final['heldout_ppl']} "
          f"(unigram {final['unigram_ppl']}); {run.step} steps, {run.step * run.tokens_per_step:,} tokens, "
          f"{total_seconds:.0f} s", flush=True)
    summary = run_summary(run, final, total_seconds)
    save_checkpoint(vocab.expand(run.model, run.full_model), args.out, cfg, dict(summary, dtype="bfloat16",
                                                                              record="book/results/small-model.train.json"))
    record = make_record(run, summary, final, (train_meta, held_meta), slice_ids, (fp32_slice, bf16_slice),
                         (t_data, train_seconds))
    args.record.parent.mkdir(parents=True, exist_ok=True)
    args.record.write_text(json.dumps(record, indent=1) + "\n")
    n_params = summary["parameters"]
    plot(run.curve, run.slice_evals + [bf16_slice], final, args.record.with_suffix(".png"),
         f"{STDLIB_SMALL}: {n_params / 1e6:.2f}M parameters, {run.step * run.tokens_per_step / 1e3:.0f}k tokens, "
         f"{total_seconds / 60:.1f} min on {torch.get_num_threads()} CPU threads\n"
         f"held-out perplexity {final['heldout_ppl']} vs unigram {final['unigram_ppl']}")
    return record


def run_summary(run: Training, final: dict, total_seconds: float) -> dict:
    return {
        "preset": STDLIB_SMALL, "parameters": sum(p.numel() for p in run.full_model.parameters()), "steps": run.step,
        "stopped_by": run.stopped, "tokens_seen": run.step * run.tokens_per_step,
        "final_train_loss": round(sum(run.losses[-20:]) / len(run.losses[-20:]), 4),
        "final_train_loss_note": "mean over the last 20 steps",
        "heldout_tokens": final["heldout_tokens"], "heldout_ppl": final["heldout_ppl"],
        "unigram_ppl": final["unigram_ppl"], "wall_seconds": round(total_seconds, 1),
        "note": "trained on the Python standard library; not the real Qwen2.5 model",
    }


def make_record(run: Training, summary: dict, final: dict, metas: tuple, slice_ids, slices: tuple,
                seconds: tuple) -> dict:
    """The training record committed beside the checkpoint: what was trained, on what, how, with what result."""
    args, cfg, (train_meta, held_meta), (fp32_slice, bf16_slice), (t_data, train_seconds) = \
        run.args, run.cfg, metas, slices, seconds
    return {
        "summary": summary,
        "config": {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                                "num_attention_heads", "num_key_value_heads")},
        "training": {**{k: (_shown(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     "steps": run.step, "tokens_per_step": run.tokens_per_step,
                     "optimizer": "AdamW(betas=(0.9, 0.95))",
                     "schedule": "linear warm-up, cosine decay to 0.1 x peak", "grad_clip": 1.0,
                     "autocast": "bfloat16 forward, fp32 loss and weights", "threads": torch.get_num_threads(),
                     "training_vocab": {"tokens_in_use": len(run.vocab.ids), "of": cfg.vocab_size,
                                        "rule": "tokens of the training split and <|endoftext|>; the others are "
                                                "zero rows in the checkpoint (logit exactly 0), counted in the loss "
                                                "as one logit of log(unused count)"},
                     "data_seconds": round(t_data, 1), "train_seconds": round(train_seconds, 1)},
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "corpus": {"source": f"Python {platform.python_version()} standard library ({sysconfig.get_paths()['stdlib']}), "
                             ".py files, PSF License",
                   "excluded_dirs": sorted(EXCLUDED_DIRS), "heldout_rule": f"sha256(path) % {HELDOUT_MODULUS} == 0",
                   "train_files": len(train_meta), "train_bytes": sum(m["bytes"] for m in train_meta),
                   "train_tokens": len(run.train_ids), "heldout_files": [m["path"] for m in held_meta],
                   "heldout_text": str(HELDOUT_TEXT.relative_to(ROOT)), "train": train_meta},
        "loss_curve": run.curve, "final_eval": final,
        "bf16_rounding": {"note": "held-out slice before and after rounding the weights to bf16 (the saved dtype)",
                          "fp32_ppl": fp32_slice["heldout_ppl"], "bf16_ppl": bf16_slice["heldout_ppl"]},
        "heldout_slice_evals": {"tokens": len(slice_ids), "evals": run.slice_evals},
    }


if __name__ == "__main__":
    main()
