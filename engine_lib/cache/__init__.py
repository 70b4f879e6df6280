"""The KV caches: contiguous (chapter 05), paged and prefix-shared (chapter 12)."""
