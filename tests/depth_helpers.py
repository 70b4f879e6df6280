"""A full-depth CPU record made up for the tests (the layout bench/cpu_depth.py writes): systems with their
readings per round, then the ratios and targets computed as the bench computes them."""

from engine_lib.bench.cpu_depth import finish

GIB = 2**30


def reading(decode: float, ttft_ms: float, rss_gib: float, first_token_s: float = 3.0, load_s: float = 2.0) -> dict:
    return {"load_s": load_s, "first_token_s": first_token_s, "ttft_ms": ttft_ms, "decode_tok_s": decode,
            "peak_rss_bytes": int(rss_gib * GIB), "threads": 2, "runs_on": "x", "load_average": [1.0, 1.0, 1.0]}


def depth_record(int4_rate: float = 40.0, q4_rate: float = 35.0) -> dict:
    """int8 against Q8_0 and int4 against Q4_0 and Q4_K_M; each system's three later starts are its rate and
    5% either side of it."""
    def system(rate, ttft, rss, first=3.0):
        return {"first_start": reading(rate, ttft, rss * 1.2, first * 4, load_s=12.0),
                "rounds": [reading(rate * f, ttft, rss, first) for f in (0.95, 1.0, 1.05)]}

    rec = {"file": "x.depth.json",
           "meta": {"model": "m", "layers": 28, "checkpoint": "RANDOM weights", "device_name": "CPU (x86_64, AVX2, 2 cores)",
                    "cpu_model": "Some CPU", "threads": 2, "held_to": {}, "rounds": 3, "prompts": 3, "new_tokens": 32,
                    "repeats": 1, "timestamp": "2026-12-07T03:00:00+0000", "commit": "abc", "torch": "2",
                    "huge_pages": "on", "cpu_count": 2, "load_average": {"start": [1.0, 1.0, 1.0]}},
           "systems": {"hf:bfloat16": system(5.0, 900.0, 3.5), "engine:int8": system(25.0, 380.0, 2.1),
                       "llama.cpp:Q8_0": system(21.0, 520.0, 1.8, first=2.2),
                       "engine:int4": system(int4_rate, 350.0, 1.4), "llama.cpp:Q4_0": system(q4_rate, 440.0, 1.9, 2.0),
                       "llama.cpp:Q4_K_M": system(30.0, 450.0, 1.8, first=2.1)}}
    return finish(rec)
