"""pytest plugin: patch FLA with fla_cula before collection, so FLA's own tests run against fla_cula.

    pytest -p fla_cula.testing.plugin path/to/flash-linear-attention/tests/ops/test_kda.py [-n 8]

Test modules import `from fla.ops.kda import chunk_kda` at collection time; patching first makes
them bind fla_cula's functions. At the end, a summary of routes (kernel vs fallback reasons) is
printed, so a run that never reached a kernel is visible.

Under pytest-xdist the calls happen in the workers: each worker sends its `fla_cula.status()` to
the controller when it finishes (`workeroutput`), and the summary adds them up. A worker that
ended without sending them (a crash) is named in the summary: its calls are not counted.
"""

from __future__ import annotations

import pytest

_KEY = "fla_cula_status"
_WORKERS = pytest.StashKey[dict]()   # controller: worker id -> its status, or None if it sent none


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config):
    import fla_cula
    fla_cula.patch()
    config.stash[_WORKERS] = {}


def pytest_sessionfinish(session, exitstatus):
    """xdist worker: hand this process's routes to the controller."""
    if _is_worker(session.config):
        import fla_cula
        session.config.workeroutput[_KEY] = fla_cula.status()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodeup(node):
    node.config.stash[_WORKERS].setdefault(_worker_id(node), None)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    st = getattr(node, "workeroutput", {}).get(_KEY)
    node.config.stash[_WORKERS][_worker_id(node)] = st


def _worker_id(node) -> str:
    return getattr(node, "workerinput", {}).get("workerid") or getattr(node, "gateway", node).id


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
            if "grad" in s:
                m["grad"] = s["grad"]
    return dict(sorted(out.items()))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    import fla_cula
    if _is_worker(config):
        return
    workers = config.stash.get(_WORKERS, {})
    sent = [st for st in workers.values() if st is not None]
    st = merge_status([fla_cula.status(), *sent])
    tr = terminalreporter
    tr.section("fla_cula routes")
    if workers:
        tr.write_line(f"routes counted in {len(sent)} of {len(workers)} xdist workers and the controller")
        missing = sorted(w for w, s in workers.items() if s is None)
        if missing:
            tr.write_line(f"NOT COLLECTED: workers {', '.join(missing)} ended without sending their routes "
                          "(crashed?); their calls are missing from the counts below")
    if not st:
        tr.write_line("no fla_cula op was called")
    for op, s in st.items():
        extra = f" stand_in={s['stand_in']}" if s.get("stand_in") else ""
        tr.write_line(f"{op}: kernel={s['kernel']}{extra} fallbacks={s['fallback']}")


def pytest_unconfigure(config):
    import fla_cula
    fla_cula.unpatch()
