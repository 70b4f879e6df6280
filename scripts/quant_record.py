"""The perplexity record of the quantized rungs on the trained preset (chapter 10).

Writes ``book/results/<preset>.quant.json`` and ``.md``: perplexity of the held-out text at the
half rung, int8, int4 round-to-nearest and int4 GPTQ (calibrated on the training split), and the
share of round-to-nearest's gap that GPTQ closes.

    python scripts/quant_record.py                 # the committed record
    python scripts/quant_record.py --max-tokens 2000 --out /tmp   # a quick look

The whole held-out text (about 47,000 tokens) takes about 2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_lib.bench.measure import git_commit  # noqa: E402
from engine_lib.bench.quant_check import HELDOUT_TOKENS, heldout_perplexity, quant_perplexity_lines  # noqa: E402
from engine_lib.model.checkpoints import ensure_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2-stdlib-small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--context", type=int, default=128, help="the preset was trained on 128-token windows")
    p.add_argument("--stride", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=0, help="score only the held-out text's first T tokens "
                   f"(default 0: all of it; the bench scores the first {HELDOUT_TOKENS})")
    p.add_argument("--calibration-tokens", type=int, default=8192)
    p.add_argument("--act-order", action="store_true")
    p.add_argument("--out", default=str(ROOT / "book" / "results"))
    args = p.parse_args(argv)
    model_dir = ensure_checkpoint(args.preset)
    t0 = time.perf_counter()
    record = heldout_perplexity(model_dir, args.device, args.context, args.stride, args.max_tokens or None,
                                args.calibration_tokens, {"act_order": args.act_order}, progress=True)
    if record is None:
        raise SystemExit(f"{args.preset} has no held-out text")
    record["meta"] = {"command": "python scripts/quant_record.py " + " ".join(argv or sys.argv[1:]),
                      "git_commit": git_commit(), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      "seconds": time.perf_counter() - t0}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.preset}.quant.json").write_text(json.dumps(record, indent=1) + "\n")
    md = [f"# {args.preset}: perplexity of the quantized rungs", "",
          f"Made by `{record['meta']['command'].strip()}` at commit `{record['meta']['git_commit']}`, "
          f"{record['meta']['timestamp']} ({record['meta']['seconds']:.0f} s)."] + quant_perplexity_lines(record)
    (out / f"{args.preset}.quant.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return record


if __name__ == "__main__":
    main()
