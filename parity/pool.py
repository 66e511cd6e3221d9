"""Parity cases spread over worker processes sharing the one GPU (``python -m parity --jobs N``).

FLA's Triton kernels compile and autotune for minutes on a fresh machine, one kernel at a time per
process; N processes compile N at once (the CPU has the cores), as long as they compile different
kernels: the cases are grouped by what FLA compiles for them, and one pilot per group runs before
the rest of its group (see _schedule). Each worker holds its own CUDA context, takes the next case
and returns its record. A worker whose CUDA context is broken (a sticky error) runs no more cases;
a worker that dies ends the run (the parent reports the cases that did not run). Autotuning under
contention may pick slower FLA configurations: that changes FLA's speed, never a result, so
gpu_check gives parity its own Triton cache.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import time
from collections import deque
from collections.abc import Iterator

from parity.cases import Case

_W: dict = {}


def _init(seed: int, deadline: float | None) -> None:
    import torch

    from parity.runner import cula_functions, fla_functions

    _W.update(fla=fla_functions(), cula=cula_functions(), seed=seed, deadline=deadline, broken=None,
              device=torch.device("cuda", torch.cuda.current_device()))


def _run(case: Case) -> dict | str:
    """The case's record, or a string saying why it was not run."""
    from parity.runner import run_case

    if _W["broken"]:
        return f"worker's CUDA context broken by {_W['broken']}"
    if _W["deadline"] is not None and time.time() > _W["deadline"]:
        return "time budget reached"
    rec = run_case(case, _W["cula"], _W["fla"], _W["device"], _W["seed"])
    if rec.get("fatal"):
        _W["broken"] = case.id
    return rec


def _schedule(cases: list[Case]) -> tuple[list[int], dict[int, list[int]]]:
    """Pilots (the first case of each group that compiles the same FLA kernels: op, grad, dtype,
    head dims, varlen), slowest groups first, and each pilot's followers. A follower starts only
    after its pilot finished, so it finds FLA's kernels compiled and autotuned in the shared Triton
    cache instead of compiling them again beside it (12 processes compiling one kernel at once
    made each chunk case 50-145 s on the last H200 run)."""
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(cases):
        groups.setdefault((c.op, c.grad, c.dtype, c.K, c.V, c.varlen is not None), []).append(i)
    order = sorted(groups.values(), key=lambda g: (not cases[g[0]].op.startswith("chunk"),
                                                   not cases[g[0]].grad, -len(g), g[0]))
    return [g[0] for g in order], {g[0]: g[1:] for g in order}


def run_parallel(cases: list[Case], jobs: int, seed: int, budget: float | None) -> Iterator[tuple[int, dict | str]]:
    """Yield (index into cases, record or reason not run) as cases finish, in completion order.
    At most `jobs` cases are in flight: pilots first, then the followers of finished pilots."""
    deadline = time.time() + budget if budget is not None else None
    pilots, followers = _schedule(cases)
    todo, ready = deque(pilots), deque()
    ctx = mp.get_context("spawn")  # CUDA cannot be forked
    with cf.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init, initargs=(seed, deadline)) as ex:
        pending: dict[cf.Future, int] = {}
        broken = None
        while True:
            while broken is None and len(pending) < jobs and (todo or ready):
                i = todo.popleft() if todo else ready.popleft()
                try:
                    pending[ex.submit(_run, cases[i])] = i
                except cf.process.BrokenProcessPool:
                    broken = "a worker process died (crash in a kernel or in FLA)"
                    todo.appendleft(i)
            if not pending:
                break
            done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    yield i, fut.result()
                except cf.process.BrokenProcessPool:
                    broken = "a worker process died (crash in a kernel or in FLA)"
                    yield i, broken
                except Exception as e:  # noqa: BLE001 - a worker-side error outside run_case
                    yield i, f"worker error {type(e).__name__}: {str(e)[:200]}"
                ready.extend(followers.get(i, ()))  # a failed pilot still releases its group
        for i in list(todo) + list(ready) + [f for p in todo for f in followers.get(p, ())]:
            yield i, broken or "not scheduled"
