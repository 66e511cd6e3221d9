"""Benchmarks: FLA 0.6.0 vs fla_cula side by side (``python -m benchmarks``; see __main__.py)."""
