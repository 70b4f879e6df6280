"""Chapters 01 to 04: the tokenizer, the config and the weights, the layers and the Qwen2 decoder."""
