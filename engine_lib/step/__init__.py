"""The decode step: one function over fixed buffers, compiled and graph-captured (chapters 05, 07, 12)."""
