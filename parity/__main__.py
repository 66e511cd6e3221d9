"""python -m parity [--quick] [--cpu] [--force] [--out DIR] [--ops OP ...] [--seed N] [--jobs N] [--budget S]
[--list]"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    from parity.cases import OPS, grid

    p = argparse.ArgumentParser(prog="python -m parity", description=__doc__)
    p.add_argument("--cpu", action="store_true", help="references only, on the CPU (CI); writes nothing")
    p.add_argument("--quick", action="store_true", help="reduced GPU grid")
    p.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)),
                   help="directory for REPORT_H200.md and report_H200.json (default: parity/)")
    p.add_argument("--tag", default="H200", help="report file suffix (default H200)")
    p.add_argument("--ops", nargs="+", choices=OPS, help="only these ops")
    p.add_argument("--match", help="only cases whose id contains this substring")
    p.add_argument("--seed", type=int, default=None, help="run seed (default: from the clock; recorded in the report)")
    p.add_argument("--list", action="store_true", help="print the case ids and exit")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds: start no new case after this; the report lists what did not run (exit 3)")
    p.add_argument("--force", action="store_true",
                   help="FLA_CULA_FORCE=1: kernels also take the small cases their speed heuristics send to FLA, "
                        "so the grid's small shapes test the kernels (the report's route column shows it)")
    p.add_argument("--jobs", type=int, default=1,
                   help="worker processes sharing the GPU (FLA's Triton compiles run in parallel); default 1")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")

    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    if args.force:
        os.environ["FLA_CULA_FORCE"] = "1"   # read per call; inherited by --jobs worker processes

    if args.cpu:
        from parity import cpu

        print(f"parity --cpu: fla_cula.reference vs FLA's naive references (seed {seed})", flush=True)
        return cpu.run(seed)

    cases = grid(args.ops, quick=args.quick)
    if args.match:
        cases = [c for c in cases if args.match in c.id]
    if args.list:
        for c in cases:
            print(c.id)
        print(f"{len(cases)} cases")
        return 0

    import torch

    if not torch.cuda.is_available():
        print("parity: no CUDA device. Use --cpu for the reference checks, or run on the H200.", file=sys.stderr)
        return 2

    from parity import pool, report
    from parity.machine import machine_header
    from parity.runner import cula_functions, fla_functions

    fla_fns = cula_fns = None
    if args.jobs == 1:
        fla_fns, cula_fns = fla_functions(), cula_functions()
    device = torch.device("cuda", torch.cuda.current_device())
    header = machine_header()
    header["grid"] = ("quick" if args.quick else "full") + (", forced routes" if args.force else "") + (
        f", ops {args.ops}" if args.ops else "") + (
        f", match {args.match!r}" if args.match else "")
    header["seed"] = str(seed)
    header["command"] = "python -m parity " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"parity: {len(cases)} cases on {header['gpu']}, seed {seed}", flush=True)

    records: list[dict] = []
    t0 = time.perf_counter()
    fatal = False
    not_run: dict[int, str] = {}
    results = (_serial(cases, cula_fns, fla_fns, device, seed, args.budget, t0) if args.jobs == 1
               else pool.run_parallel(cases, args.jobs, seed, args.budget))
    done = 0
    by_index: dict[int, dict] = {}
    for i, rec in results:
        if isinstance(rec, str):
            not_run[i] = rec
            continue
        done += 1
        by_index[i] = rec
        mark = {"pass": "ok  ", "FLA-defect": "FLA-"}.get(rec["status"], "FAIL")
        print(f"{mark} {done:4d}/{len(cases)} {rec['seconds']:6.2f}s {rec['id']}  [{rec['route']}]"
              + ("" if rec["status"] == "pass" else "  " + "; ".join(rec.get("notes", []))), flush=True)
        if rec.get("fatal"):
            print(f"parity: CUDA error (sticky) in {rec['id']}", flush=True)
            fatal = True
        if done % 5 == 0:  # a partial report survives a crash or a kill at a time limit, and says so
            partial = dict(header, INCOMPLETE=f"partial report written during the run: {done} of {len(cases)} "
                                              "cases had finished (the run did not reach its end)")
            report.write([by_index[j] for j in sorted(by_index)], partial, args.out, args.tag)
    records = [by_index[j] for j in sorted(by_index)]  # grid order, whatever the completion order
    for op in dict.fromkeys(c.op for c in cases):
        secs = sum(r["seconds"] for r in records if r["op"] == op)
        print(f"  [{op}: {secs:.1f} s in cases]", flush=True)
    header["wall time"] = (f"{time.perf_counter() - t0:.1f} s" + (f", {args.jobs} worker processes" if args.jobs > 1
                           else "") + (" (CUDA error: see the failing case)" if fatal else ""))
    if not_run:
        first, last = min(not_run), max(not_run)
        reasons = sorted(set(not_run.values()))
        header["INCOMPLETE"] = (f"{len(not_run)} of {len(cases)} cases not run ({'; '.join(reasons)}); first: "
                                f"{cases[first].id}; last: {cases[last].id}")
        print(f"parity: {header['INCOMPLETE']}", flush=True)
    md, js = report.write(records, header, args.out, args.tag)
    s = report.summarize(records)
    print(f"parity: {s['cases']} cases, {s['passed']} passed, {s['failed']} failed, {s['fla_defects']} FLA defects "
          f"reproduced on fallback routes, {s['kernel_routed']} kernel-routed; fallbacks {s['fallbacks_by_reason']}",
          flush=True)
    print(f"parity: wrote {md} and {js}", flush=True)
    if s["failed"] or fatal:
        return 1
    return 3 if not_run else 0


def _serial(cases, cula_fns, fla_fns, device, seed, budget, t0):
    """Cases one after another in this process: (index, record or reason not run)."""
    from parity.runner import run_case

    broken = None
    for i, case in enumerate(cases):
        if broken:
            yield i, f"CUDA context broken by {broken}"
        elif budget is not None and time.perf_counter() - t0 > budget:
            yield i, "time budget reached"
        else:
            rec = run_case(case, cula_fns, fla_fns, device, seed)
            broken = case.id if rec.get("fatal") else None
            yield i, rec


if __name__ == "__main__":
    sys.exit(main())
