"""The pytest plugin's route summary (CPU): counted in-process, and added up over pytest-xdist workers from each
test's report, also when a worker crashes or the run is interrupted.

Each case runs pytest in a subprocess (pytester) on a tiny test file that records routes through
fla_cula.routing, as an op does: record_kernel for a kernel call, record_fallback for a fallback.
"""

import re

import pytest

pytest_plugins = ["pytester"]

_TESTS = """
import os
from fla_cula import routing

def _one():
    routing.record_kernel("fused_recurrent_kda_fwd")
    routing.record_fallback("chunk_kda", "from " + os.environ.get("PYTEST_XDIST_WORKER", "main"))

def test_a():
    _one()

def test_b():
    _one()

def test_c():
    _one()
"""


def _summary(result) -> list[str]:
    out = result.stdout.lines
    start = next(i for i, line in enumerate(out) if "fla_cula routes" in line)
    return [line for line in out[start + 1:] if line.strip() and not line.startswith("=")]


def _run(pytester, *args):
    pytester.makepyfile(test_tiny=_TESTS)
    # the inner run's own xdist workers set PYTEST_XDIST_WORKER; an outer one's (this file under -n) must not leak
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PYTEST_XDIST_WORKER", raising=False)
        return pytester.runpytest_subprocess("-p", "fla_cula.testing.plugin", "-p", "no:cacheprovider", *args)


def test_summary_in_process(pytester):
    result = _run(pytester)
    result.assert_outcomes(passed=3)
    lines = _summary(result)
    assert "fused_recurrent_kda_fwd: kernel=3 fallbacks={}" in lines
    assert "chunk_kda: kernel=0 fallbacks={'from main': 3}" in lines
    assert not any("xdist" in line for line in lines)


def test_summary_adds_up_xdist_workers(pytester):
    pytest.importorskip("xdist")
    result = _run(pytester, "-n", "2")
    result.assert_outcomes(passed=3)
    lines = _summary(result)
    assert "routes added up over the test reports of 2 xdist workers and the controller" in lines
    assert not any(line.startswith(("no fla_cula op", "NOT FINISHED", "run interrupted")) for line in lines), lines
    assert "fused_recurrent_kda_fwd: kernel=3 fallbacks={}" in lines
    (chunk,) = [line for line in lines if line.startswith("chunk_kda:")]
    counts = {w: int(n) for w, n in re.findall(r"'from (gw\d)': (\d+)", chunk)}
    assert sum(counts.values()) == 3 and set(counts) <= {"gw0", "gw1"}, chunk   # the workers' calls, each once


def test_summary_names_a_crashed_worker_and_keeps_its_finished_tests(pytester):
    """A worker that dies mid-test: the tests it finished are counted, the worker is named."""
    pytest.importorskip("xdist")
    pytester.makepyfile(test_crash="""
import os
from fla_cula import routing

def test_finishes():
    routing.record_kernel("fused_recurrent_kda_fwd")

def test_dies():
    routing.record_kernel("fused_recurrent_kda_fwd")
    os._exit(1)
""")
    result = pytester.runpytest_subprocess("-p", "fla_cula.testing.plugin", "-p", "no:cacheprovider", "-n", "1",
                                           "--max-worker-restart", "0")
    lines = _summary(result)
    assert any(line.startswith("NOT FINISHED: workers gw0 (crashed or interrupted)") for line in lines), lines
    assert "fused_recurrent_kda_fwd: kernel=1 fallbacks={}" in lines, lines


def test_summary_of_an_interrupted_xdist_run(pytester):
    """SIGINT to the controller (as `timeout -s INT` sends): the finished tests' routes, and what was cut."""
    pytest.importorskip("xdist")
    # the controller marks when it has taken in test_finishes' reports; the worker cuts the run only then
    pytester.makeconftest("""
import os, pathlib

def pytest_runtest_logreport(report):
    if (not os.environ.get("PYTEST_XDIST_WORKER") and report.nodeid.endswith("test_finishes")
            and report.when == "teardown"):
        pathlib.Path("finished_seen").touch()
""")
    pytester.makepyfile(test_cut="""
import os, pathlib, signal, time
from fla_cula import routing

def test_finishes():
    routing.record_fallback("chunk_kda", "why")

def test_is_cut():
    routing.record_fallback("chunk_kda", "why")
    for _ in range(600):
        if pathlib.Path("finished_seen").exists():
            break
        time.sleep(0.1)
    os.kill(os.getppid(), signal.SIGINT)   # the worker's parent: the xdist controller
    time.sleep(60)
""")
    result = pytester.runpytest_subprocess("-p", "fla_cula.testing.plugin", "-p", "no:cacheprovider", "-n", "1",
                                           timeout=300)
    lines = _summary(result)
    assert "run interrupted: the counts below are those of the tests that finished" in lines, lines
    assert "chunk_kda: kernel=0 fallbacks={'why': 1}" in lines, lines
    assert not any(line.startswith("no fla_cula op") for line in lines), lines
