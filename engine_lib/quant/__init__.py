"""Chapter 10: weight-only quantization: the int8 and int4 formats, the quantized layer, round-to-nearest and GPTQ."""
