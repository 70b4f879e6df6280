"""The committed benchmark records (``python -m engine_lib bench``, ``scripts/gpu_check.sh``).

This folder ships inside the package as ``engine_lib.results`` (see pyproject.toml), so a
chapter opened in Colab reads the same records as the published book.
"""
