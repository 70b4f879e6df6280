"""Chapters 06 and 10: our CPU kernels (``gemv.cpp``) and which one runs for each instruction set and row count."""
