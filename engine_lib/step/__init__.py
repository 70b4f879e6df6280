"""Chapters 04, 05, 07 and 12: the forwards that make tokens: the naive loop, the decode step over fixed buffers
(compiled, graph-captured) and the forward of rows of new tokens, over either cache."""
