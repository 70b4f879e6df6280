"""Weight-only quantization: the int8 and int4 formats, round-to-nearest and GPTQ (chapter 10)."""
