"""The model and its loading: config, layers, the Qwen2 decoder, checkpoints, tokenizer (chapters 01 to 04)."""
