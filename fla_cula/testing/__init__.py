"""Test helpers (the pytest plugin lives in fla_cula.testing.plugin)."""
