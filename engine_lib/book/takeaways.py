"""Takeaway sentences computed from the data they summarise, so no page states a direction that
its own numbers contradict. Each function is the logic of one chapter's takeaway; the tests
feed them adversarial data (the rung slower, equal, faster) and check that the words follow.

Used by chapters 05 (growth of the uncached step), 08 (the ladder, live against the record),
09 (what temperature did to sampled text), 10 (what the quantized bytes bought) and 12 (which
blocks the paged cache reused).
"""

from __future__ import annotations

from ..bench.timing import Samples, ratio_words, relation, verdict

NUMBER_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def number_word(n: int) -> str:
    """'three' for 3: number words on a page computed from the list they count."""
    return NUMBER_WORDS[n] if 0 <= n < len(NUMBER_WORDS) else str(n)


# ------------------------------------------------------------------------------------ chapter 05
def ratio_growth_sentence(rows: dict[str, dict[int, float]]) -> str:
    """rows: {model name: {n: uncached/cached FLOPs ratio}}. Says which ratio grows faster from
    the smallest n to the largest, with both factors."""
    growth = {}
    for name, ratios in rows.items():
        lo, hi = min(ratios), max(ratios)
        growth[name] = (ratios[hi] / ratios[lo], lo, hi)
    (a, (ga, lo, hi)), (b, (gb, _, _)) = list(growth.items())[:2]
    if abs(ga / gb - 1) < 0.05:
        how = "about as fast on both"
    else:
        faster, slower = (a, b) if ga > gb else (b, a)
        how = f"faster on {faster} than on {slower}"
    return (f"From n = {lo:,} to {hi:,} the ratio grows x{ga:.0f} on {a} and x{gb:.0f} on {b}: "
            f"{how}.")


# ------------------------------------------------------------------------------------ chapter 09
def trend(values: list[float], up: str, down: str) -> str:
    """How a series moves from first to last: '<up> at every step', '<down> or stays level at every
    step', '<up> overall, though not at every step', ..."""
    steps = list(zip(values, values[1:]))
    if all(b > a for a, b in steps):
        return f"{up} at every step"
    if all(b < a for a, b in steps):
        return f"{down} at every step"
    if all(b >= a for a, b in steps) and values[-1] > values[0]:
        return f"{up} or stays level at every step"
    if all(b <= a for a, b in steps) and values[-1] < values[0]:
        return f"{down} or stays level at every step"
    overall = up if values[-1] > values[0] else down
    return f"{overall} overall, though not at every step"


def temperature_takeaway(sweep: dict[str, list[dict]], defaults) -> list[str]:
    """Chapter 09's sampling sweep in words. ``sweep``: {setting: [{"rep": share of repeated
    4-grams, "nll": nats per token}, ...]} with "greedy", then "T=<t>" settings in rising order,
    then "defaults" (the checkpoint's ``SamplingParams`` at ``defaults.temperature``, which must
    be one of the swept T). -> the sentences, each with the numbers it rests on."""
    from statistics import fmean

    rep = {name: fmean(r["rep"] for r in runs) for name, runs in sweep.items()}
    nll = {name: fmean(r["nll"] for r in runs) for name, runs in sweep.items()}
    temps = [name for name in sweep if name.startswith("T=")]
    cool, warm = temps[0], temps[-1]
    order = ["greedy", *temps]
    out = [f"Repetition {trend([rep[n] for n in order], 'rises', 'falls')} from greedy to {warm}: "
           + ", ".join(f"{n} {rep[n]:.1%}" for n in order) + " of the 4-grams repeat an earlier one, on average.",
           f"The model's own NLL of the text {trend([nll[n] for n in order], 'rises', 'falls')} over the same "
           "settings: " + ", ".join(f"{n} {nll[n]:.2f}" for n in order) + " nats per token."]
    more_rep = ("more repetitive than" if rep[cool] > rep[warm] else "less repetitive than" if rep[cool] < rep[warm]
                else "just as repetitive as")
    likelier = "more likely" if nll[cool] < nll[warm] else "less likely" if nll[cool] > nll[warm] else "just as likely"
    out.append(f"So at {cool} the text is {more_rep} at {warm} ({rep[cool]:.1%} against {rep[warm]:.1%}) and "
               f"{likelier} under the model ({nll[cool]:.2f} against {nll[warm]:.2f} nats per token).")
    same_t = f"T={defaults.temperature}"

    def versus(key, table, lower, higher, equal, spec, unit):
        """The defaults against temperature alone at the same T, in words, with both means."""
        a_runs, b_runs = [r[key] for r in sweep["defaults"]], [r[key] for r in sweep[same_t]]
        a, b = table["defaults"], table[same_t]
        word = lower if a < b else higher if a > b else equal
        overlap = ", the ranges overlapping" if min(a_runs) <= max(b_runs) and min(b_runs) <= max(a_runs) else ""
        return f"{word} ({a:{spec}} against {b:{spec}}{unit}{overlap})"

    likelihood = versus("nll", nll, "likelier", "less likely", "just as likely", ".2f", " nats per token")
    repetition = versus("rep", rep, "less repetitive", "more repetitive", "just as repetitive", ".1%",
                        " of 4-grams repeated")
    out.append(f"At the same T={defaults.temperature}, the checkpoint's defaults (top-k {defaults.top_k}, top-p "
               f"{defaults.top_p}, penalty {defaults.repetition_penalty}) made the text, on average, {likelihood} "
               f"and {repetition}, compared with temperature alone.")
    return out


# ------------------------------------------------------------------------------------ chapter 10
def quant_takeaway(rates: dict[str, Samples], nbytes: dict[str, int], device: str,
                   paired: bool = True) -> str:
    """What the quantized rungs' fewer bytes bought in decode speed, rung by rung, against
    ``half``: a direction only where ``verdict`` decides it (paired rounds by default)."""
    base = rates["half"]
    parts, winners = [], []
    for q in ("int8", "int4"):
        if q not in rates:
            continue
        v = verdict(rates[q], base, paired=paired)
        share = nbytes[q] / nbytes["half"]
        parts.append(f"{q} read {share:.0%} of half's bytes per token and decoded "
                     f"{relation(rates[q], base, paired=paired)} half")
        if v > 0:
            winners.append(q)
    sentence = "; ".join(parts) + f" ({device})."
    if not winners:
        sentence += (" Neither quantized rung beat half beyond the noise here, so on this machine "
                     "the bytes saved did not become speed (its kernels, not its bytes, set the pace).")
    else:
        best = max(winners, key=lambda q: rates[q].median)
        rivals = [q for q in winners if q != best and verdict(rates[best], rates[q], paired=paired) <= 0]
        if rivals:
            sentence += (f" {best} and {', '.join(rivals)} both beat half beyond the noise; between them "
                         "the difference is within it.")
        else:
            sentence += f" The fastest beyond noise was {best}."
    return sentence + (" Whatever the speed, int8's logits moved less than int4's (checked above), so "
                       "int4 needs checking on the real task before it is used.")


# ------------------------------------------------------------------------------------ chapter 08
def fusion_takeaway(live: dict, record: dict | None) -> str:
    """The fused rung against half: the live run's verdict (unpaired, its own repeats) beside a
    committed record's paired ratio, and which to believe when they disagree."""
    def runs(rec: dict, name: str) -> Samples | None:
        w = rec["systems"].get(name, {}).get("workloads", {}).get("seed", {})
        vals = w.get("decode_tok_s_runs") or ([w["decode_tok_s"]] if "decode_tok_s" in w else None)
        return Samples.rates(vals) if vals else None

    f, h = runs(live, "fused"), runs(live, "half")
    out = []
    live_v = None
    if f and h:
        live_v = verdict(f, h)
        n = min(len(f.values), len(h.values))
        if n < 2:
            live_v = 0
            out.append(f"In the live run (one unpaired run each) fused decoded at {f.median:.1f} tok/s and "
                       f"half at {h.median:.1f}: one reading each cannot tell a difference from noise.")
        else:
            out.append(f"In the live run fused decoded {relation(f, h)} half "
                       f"({f.median:.1f} against {h.median:.1f} tok/s, {n} unpaired runs each).")
    paired = (record or {}).get("paired")
    if paired:
        m = record["meta"]
        r = paired["ratio"]
        rec_dir = "faster than" if r >= 1.02 else "slower than" if r <= 0.98 else "about as fast as"
        word = f"{ratio_words(r)} {rec_dir}" if rec_dir != "about as fast as" else rec_dir
        out.append(f"The committed record ({m['device_name']}, commit {m['git_commit']}) timed the two turn "
                   f"about for {paired['rounds']} rounds: fused was {word} half (median ratio {r:.2f}).")
        rec_v = 1 if r >= 1.02 else -1 if r <= 0.98 else 0
        if live_v == 0 and rec_v != 0:
            out.append("The live run could not separate the two from its noise; the record's paired "
                       "rounds, timed turn about so that the machine's drift hits both, give the direction.")
        elif live_v is not None and live_v != rec_v:
            out.append("The two disagree. Believe the paired record for the direction: rounds timed turn "
                       "about share the machine's drift, while the live run times each rung a few times, "
                       "one rung after the other, on whatever this machine is doing now.")
    if not out:
        return "No run here timed both fused and half."
    return " ".join(out)


# ------------------------------------------------------------------------------------ chapter 12
def block_reuse_caption(freed: list[int], new_blocks: list[int], free_now: list[int],
                        old: str = "B", new: str = "D") -> str:
    """The paged-cache figure's words, read from the allocator's state: which of the blocks
    ``old`` freed did ``new`` get, and which are free again."""
    reused = [b for b in new_blocks if b in set(freed)]
    idle = [b for b in freed if b in set(free_now)]
    if reused and not idle:
        return f"{new} took the blocks {old} freed ({', '.join(map(str, reused))})."
    if reused:
        return (f"{new} took {len(reused)} of the {len(freed)} blocks {old} freed "
                f"({', '.join(map(str, reused))}); the rest are free.")
    return (f"{new} got blocks that had never been used ({', '.join(map(str, new_blocks))}): the "
            f"free list is first in, first out, so the blocks {old} freed "
            f"({', '.join(map(str, idle))}) wait behind them, free.")
