"""Chapters 05 and 12: the KV caches, contiguous (one row per sequence), paged (blocks of 16) and prefix-shared."""
