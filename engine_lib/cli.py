"""Every chapter's commands: ``python -m engine_lib {generate, make-checkpoint, reference, serve, perplexity, bench}``."""

from __future__ import annotations

import argparse
import sys
import time

from .model.checkpoints import PRESETS, resolve_auto_model
from .stages import STAGES

AUTO = "auto"


CHAT_PROMPT = "Explain what a transformer is in simple words."  # for an instruct model (the real one)
CODE_PROMPT = 'class Queue:\n    """A first-in, first-out queue."""\n\n    def __init__(self'  # for the trained preset
RULE = "-" * 60


def generate_model(args) -> str:
    """The checkpoint ``generate`` runs: ``--preset`` (offline), ``--model``, or ``auto``: the real
    model when the hub answers, else the small model trained here."""
    from .errors import UnsupportedOptionError
    from .model.checkpoints import STDLIB_SMALL, ensure_checkpoint

    if args.preset:
        if args.model != AUTO:
            raise UnsupportedOptionError("give --model or --preset, not both")
        return str(ensure_checkpoint(args.preset))
    return resolve_auto_model(args.model, fallback=STDLIB_SMALL)


def cmd_generate(args) -> int:
    from .engine import Engine
    from .model.checkpoints import is_trained_checkpoint

    model = generate_model(args)
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(model, device=args.device, dtype=args.dtype, stage=args.stage,
                                    speculative=args.speculative, kv_cache_dtype=args.kv_cache_dtype)
    print(f"model: {engine.label} (loaded in {time.perf_counter() - t0:.1f} s)")
    trained = is_trained_checkpoint(engine.model_dir)
    if trained:  # said in plain words before any text: a reader must not take this for Qwen2.5
        print(f"NOTE: this is {engine.model_dir.name}, a small model trained here on the Python standard library, "
              "not Qwen2.5. It learned to continue Python source and knows no chat: the prompt is continued as raw text.")
    raw = args.raw or trained  # a base model of code: no chat template
    prompt_text = args.prompt if args.prompt is not None else (CODE_PROMPT if trained else CHAT_PROMPT)
    prompt = engine.tokenizer(prompt_text, add_special_tokens=False)["input_ids"] if raw else prompt_text
    options = dict(do_sample=False) if args.greedy else {}
    for name in ("temperature", "top_k", "top_p", "repetition_penalty", "seed"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if raw:
        print("the prompt, then the model's continuation:")
    if args.stream:
        start = time.perf_counter()
        print(RULE)
        print(prompt_text if raw else "", end="", flush=True)
        for piece in engine.stream(prompt, max_new_tokens=args.max_new_tokens, **options):
            print(piece, end="", flush=True)
        print(f"\n{RULE}\n[{time.perf_counter() - start:.2f} s]")
        return 0
    result = engine.generate(prompt, max_new_tokens=args.max_new_tokens, **options)
    print(RULE)
    print((prompt_text if raw else "") + result.text)
    print(RULE)
    print(result.summary())
    if "acceptance_rate" in result.extra:
        x = result.extra
        print(f"speculative ({x['drafter']}): {100 * x['acceptance_rate']:.0f}% of drafts accepted, "
              f"{x['tokens_per_target_forward']:.2f} tokens per target forward")
    return 0


def cmd_make_checkpoint(args) -> int:
    from .model.checkpoints import preset_config, preset_name, write_checkpoint

    cfg = preset_config(args.preset, args.layers)
    t0 = time.perf_counter()
    out = write_checkpoint(args.out, cfg, seed=args.seed, label=preset_name(args.preset, args.layers), device=args.device)
    print(f"wrote {out} ({cfg.num_parameters():,} parameters, {cfg.num_hidden_layers} layers, random weights, "
          f"seed {args.seed}, drawn on {args.device}) in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_reference(args) -> int:
    """Record transformers' fp32 reference with the weights' identity (``reference_outputs``); by default
    into the package's ``assets/reference/outputs/``, which the chapters read instead of recording."""
    from .bench.reference import record_reference
    from .bench.reference_outputs import shipped_records

    if args.list:
        records = shipped_records()
        for folder, meta in records:
            how = meta.get("recorded", {})
            print(f"{folder.name}: {len(meta['prompts'])} prompts x {meta['max_new_tokens']} tokens, "
                  f"{meta['dtype']}, transformers {how.get('transformers', '?')} on {how.get('device', '?')}")
        print(f"{len(records)} shipped reference record(s)")
        return 0
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = resolve_auto_model(args.model, fallback=None)  # never ship a stand-in's record by accident
    t0 = time.perf_counter()
    path = record_reference(model, args.out, max_new_tokens=args.max_new_tokens, device=device)
    print(f"wrote the reference outputs of {model} (float32, {device}) to {path} in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_serve(args) -> int:
    from .serve.server import main as serve_main

    return serve_main(args)


def cmd_perplexity(args) -> int:
    import json
    from pathlib import Path

    from .bench.perplexity import perplexity_of_file
    from .engine import Engine

    calibration = Path(args.calibration).read_text(encoding="utf-8") if args.calibration else None
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(resolve_auto_model(args.model), device=args.device, dtype=args.dtype,
                                    stage=args.stage, quant_method=args.quant_method, calibration=calibration)
    print(f"model: {engine.label} (loaded in {time.perf_counter() - t0:.1f} s)")
    if engine.gptq is not None:
        print(engine.gptq.summary())
    result = perplexity_of_file(engine, args.text, args.context, args.stride, args.max_tokens)
    print(result.summary())
    if args.json:
        out = {**result.as_dict(), "gptq": engine.gptq.as_dict() if engine.gptq else None}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def cmd_bench(args) -> int:
    from .bench.run import main as bench_main

    return bench_main(args)


def add_generate_arguments(g: argparse.ArgumentParser) -> None:
    """The ``generate`` command's options."""
    g.add_argument("--model", default=AUTO, help="checkpoint folder or hub repo id; 'auto' = the real "
                   "Qwen2.5-1.5B-Instruct if the hub answers, else qwen2-stdlib-small, the small model trained here")
    g.add_argument("--preset", choices=list(PRESETS), default=None, help="an offline checkpoint instead: "
                   "qwen2-stdlib-small (trained here on Python source), or tiny / qwen2.5-1.5b-random (RANDOM "
                   "weights: meaningless text; qwen2.5-1.5b-random has the real shape, for timings)")
    g.add_argument("--prompt", default=None, help=f"default: {CHAT_PROMPT!r} (chat), or the start of a Python "
                   "class for the trained preset")
    g.add_argument("--raw", action="store_true", help="continue the prompt as plain text, without the chat "
                   "template (always so for the trained preset, a model of Python code)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--stage", choices=list(STAGES), default=None, help="rung of the ladder "
                   "(default: fused on GPU, kv_cache on CPU)")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if present)")
    g.add_argument("--dtype", default=None, help="float32, float16 or bfloat16 (default: the stage's)")
    g.add_argument("--greedy", action="store_true", help="plain greedy decoding instead of the "
                   "checkpoint's sampling defaults")
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--repetition-penalty", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--speculative", default=None, help="speculative decoding: 'prompt_lookup', 'suffix' (also "
                   "from the replies before: chapter 11) or a draft model's folder / hub id (same vocabulary)")
    g.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto", help="'int8': keys and values "
                   "stored as int8 with a scale per token and KV head, half the cache's bytes (chapter 05)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine_lib", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a reply to one prompt")
    add_generate_arguments(g)
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("make-checkpoint", help="write a random-weight Qwen2 checkpoint (HF layout)")
    m.add_argument("--preset", choices=["tiny", "qwen2.5-1.5b-random"], required=True)
    m.add_argument("--out", required=True, help="output folder")
    m.add_argument("--layers", type=int, default=None, help="override the number of layers")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--device", default="cpu", help="draw the weights here; cuda is much faster at the full shape "
                   "but gives other values than the CPU for the same seed")
    m.set_defaults(func=cmd_make_checkpoint)

    r = sub.add_parser("reference", help="record transformers' fp32 greedy ids and first-token logits, to ship "
                       "with the package (engine_lib/assets/reference/outputs/, read by the chapters)")
    r.add_argument("--model", default=AUTO, help="checkpoint folder or hub repo id; 'auto' = the real "
                   "Qwen2.5-1.5B-Instruct (an error if the hub cannot be reached)")
    r.add_argument("--out", default=None, help="output folder (default: the package's "
                   "assets/reference/outputs/<name>-<sha256 prefix>)")
    r.add_argument("--max-new-tokens", type=int, default=100)
    r.add_argument("--device", default=None, help="where transformers runs, in float32 (default: cuda if present)")
    r.add_argument("--list", action="store_true", help="list the records shipped with the package and exit")
    r.set_defaults(func=cmd_reference)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching "
                       "(needs the 'serve' extra)")
    from .serve.server import add_arguments as add_serve_arguments

    add_serve_arguments(s)
    s.set_defaults(func=cmd_serve)

    p = sub.add_parser("perplexity", help="perplexity of a text file, with a sliding window (llama.cpp's tool)")
    p.add_argument("--model", default=AUTO)
    p.add_argument("--text", required=True, help="a UTF-8 text file, tokenized as is (no chat template, no BOS)")
    p.add_argument("--stage", choices=list(STAGES), default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--context", type=int, default=512, help="tokens per window")
    p.add_argument("--stride", type=int, default=None, help="tokens each window moves by (default: context / 2); "
                   "each window scores only the tokens no earlier window scored")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the text's first T tokens")
    p.add_argument("--quant-method", choices=["rtn", "gptq"], default=None, help="int4: round-to-nearest or GPTQ")
    p.add_argument("--calibration", default=None, help="GPTQ: a text file whose first tokens calibrate (never the "
                   "evaluated text)")
    p.add_argument("--json", default=None, help="also write the result here")
    p.set_defaults(func=cmd_perplexity)

    b = sub.add_parser("bench", help="benchmark every rung beside the transformers baselines")
    from .bench.run import add_arguments

    add_arguments(b)
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .errors import EngineError

    try:
        return args.func(args)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
