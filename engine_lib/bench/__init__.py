"""Chapter 08 and every chapter's measurements: the measuring tools.

The benchmark (``run``, ``report``), timers and kernel names (``measure``), the fresh-process memory probe
(``footprint``), the transformers reference (``reference``), the quantization and speculative-decoding
checks, llama.cpp beside the engine (``llamacpp``, ``gguf_export``) and the serving load test (``loadtest``).

They import the engine; no engine file imports them.
"""
