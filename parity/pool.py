"""Parity cases spread over worker processes sharing the one GPU (``python -m parity --jobs N``).

FLA's Triton kernels compile and autotune for minutes on a fresh machine, one kernel at a time per
process; N processes compile N at once (the CPU has the cores). Each worker holds its own CUDA
context, takes the next case from a queue and returns its record. A worker whose CUDA context is
broken (a sticky error) runs no more cases; a worker that dies ends the run (the parent reports
the cases that did not run). Autotuning under contention may pick slower FLA configurations: that
changes FLA's speed, never a result, so gpu_check gives parity its own Triton cache.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import time
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


def run_parallel(cases: list[Case], jobs: int, seed: int, budget: float | None) -> Iterator[tuple[int, dict | str]]:
    """Yield (index into cases, record or reason not run) as cases finish, in completion order."""
    deadline = time.time() + budget if budget is not None else None
    ctx = mp.get_context("spawn")  # CUDA cannot be forked
    with cf.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init, initargs=(seed, deadline)) as ex:
        futs = {ex.submit(_run, c): i for i, c in enumerate(cases)}
        for fut in cf.as_completed(futs):
            i = futs[fut]
            try:
                yield i, fut.result()
            except cf.process.BrokenProcessPool:
                yield i, "a worker process died (crash in a kernel or in FLA)"
            except Exception as e:  # noqa: BLE001 - a worker-side error outside run_case
                yield i, f"worker error {type(e).__name__}: {str(e)[:200]}"
