"""The measuring tools: the benchmark (``run``, ``report``), timers and kernel names (``measure``),
the fresh-process memory probe (``footprint``), the transformers reference (``reference``), the
quantization and speculative-decoding checks, and the serving load test (``loadtest``).

They import the engine; no engine file imports them.
"""
