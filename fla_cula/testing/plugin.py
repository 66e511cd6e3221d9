"""pytest plugin: patch FLA with fla_cula before collection, so FLA's own tests run against fla_cula.

    pytest -p fla_cula.testing.plugin path/to/flash-linear-attention/tests/ops/test_kda.py

Test modules import `from fla.ops.kda import chunk_kda` at collection time; patching first makes
them bind fla_cula's functions. At the end, a summary of routes (kernel vs fallback reasons) is
printed, so a run that never reached a kernel is visible.
"""

from __future__ import annotations


def pytest_configure(config):
    import fla_cula
    fla_cula.patch()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    import fla_cula
    st = fla_cula.status()
    terminalreporter.section("fla_cula routes")
    if not st:
        terminalreporter.write_line("no fla_cula op was called")
    for op, s in st.items():
        terminalreporter.write_line(f"{op}: kernel={s['kernel']} fallbacks={s['fallback']}")


def pytest_unconfigure(config):
    import fla_cula
    fla_cula.unpatch()
