"""Our CPU kernels and which one runs for each instruction set and shape (chapters 06 and 10)."""
