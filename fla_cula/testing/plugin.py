"""pytest plugin: patch FLA with fla_cula before collection, so FLA's own tests run against fla_cula.

    pytest -p fla_cula.testing.plugin path/to/flash-linear-attention/tests/ops/test_kda.py [-n 8]

Test modules import `from fla.ops.kda import chunk_kda` at collection time; patching first makes
them bind fla_cula's functions. At the end, a summary of routes (kernel vs fallback reasons) is
printed, so a run that never reached a kernel is visible.

Every test report (setup, call, teardown) carries the routes its process counted since the
previous report, as a user property. Under pytest-xdist the reports reach the controller as
tests finish, so the summary adds up every finished test of every worker even when the run is
cut short (Ctrl-C, a timeout's SIGINT) or a worker crashes; it names the workers that did not
finish and says when the run was interrupted.
"""

from __future__ import annotations

import os

import pytest

_PROP = "fla_cula_routes"


def pytest_configure(config):
    import fla_cula
    fla_cula.patch()
    config.pluginmanager.register(_Routes(config), "fla_cula_routes")


def diff_status(now: dict, before: dict) -> dict:
    """`now - before` for two `fla_cula.status()` dicts (counts only; ops and reasons with no new calls dropped)."""
    out: dict[str, dict] = {}
    for op, s in now.items():
        b = before.get(op, {})
        fb = {why: n - b.get("fallback", {}).get(why, 0) for why, n in s.get("fallback", {}).items()}
        fb = {why: n for why, n in fb.items() if n}
        d = {"kernel": s.get("kernel", 0) - b.get("kernel", 0), "calls": s.get("calls", 0) - b.get("calls", 0),
             "fallback": fb}
        if s.get("stand_in", 0) - b.get("stand_in", 0):
            d["stand_in"] = s["stand_in"] - b.get("stand_in", 0)
        if d["calls"]:
            out[op] = d
    return out


def merge_status(statuses) -> dict:
    """Sum `fla_cula.status()` dicts (per op: kernel, calls, stand_in counts and fallback reasons)."""
    out: dict[str, dict] = {}
    for st in statuses:
        for op, s in st.items():
            m = out.setdefault(op, {"kernel": 0, "fallback": {}, "calls": 0})
            m["kernel"] += s.get("kernel", 0)
            m["calls"] += s.get("calls", 0)
            if s.get("stand_in"):
                m["stand_in"] = m.get("stand_in", 0) + s["stand_in"]
            for why, n in s.get("fallback", {}).items():
                m["fallback"][why] = m["fallback"].get(why, 0) + n
    return dict(sorted(out.items()))


class _Routes:
    """Route counts per test report; on the controller, the sum over every process and the summary."""

    def __init__(self, config):
        self.config = config
        self.seen: dict = {}          # this process: the status at its previous report
        self.received: list = []      # controller: route deltas from other processes' reports
        self.workers: dict = {}       # controller: xdist worker id -> finished cleanly

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        """Attach this process's routes since its previous report to the report (xdist sends it on)."""
        report = (yield).get_result()
        import fla_cula
        now = fla_cula.status()
        delta = diff_status(now, self.seen)
        self.seen = now
        if delta:
            report.user_properties.append((_PROP, {"pid": os.getpid(), "routes": delta}))

    def pytest_runtest_logreport(self, report):
        """Controller: keep the routes of reports made in another process; its own are in status()."""
        for name, value in report.user_properties:
            if name == _PROP and value["pid"] != os.getpid():
                self.received.append(value["routes"])

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodeready(self, node):
        self.workers[_worker_id(node)] = False

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        self.workers[_worker_id(node)] = error is None

    def pytest_terminal_summary(self, terminalreporter, exitstatus):
        import fla_cula
        if hasattr(self.config, "workerinput"):
            return
        st = merge_status([fla_cula.status(), *self.received])
        tr = terminalreporter
        tr.section("fla_cula routes")
        if exitstatus == pytest.ExitCode.INTERRUPTED:
            tr.write_line("run interrupted: the counts below are those of the tests that finished")
        if self.workers:
            tr.write_line(f"routes added up over the test reports of {len(self.workers)} xdist workers "
                          "and the controller")
            unfinished = sorted(w for w, done in self.workers.items() if not done)
            if unfinished:
                tr.write_line(f"NOT FINISHED: workers {', '.join(unfinished)} (crashed or interrupted): the calls "
                              "of a test they were running are missing from the counts below")
        if not st:
            tr.write_line("no fla_cula op was called in a finished test")
        for op, s in st.items():
            extra = f" stand_in={s['stand_in']}" if s.get("stand_in") else ""
            tr.write_line(f"{op}: kernel={s['kernel']}{extra} fallbacks={s['fallback']}")


def _worker_id(node) -> str:
    return getattr(node, "workerinput", {}).get("workerid") or getattr(node, "gateway", node).id


def pytest_unconfigure(config):
    import fla_cula
    fla_cula.unpatch()
