"""python -m parity [--quick] [--cpu] [--out DIR] [--ops OP ...] [--seed N] [--list]"""

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
    args = p.parse_args(argv)

    seed = args.seed if args.seed is not None else int(time.time()) % 100000

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

    from parity import report
    from parity.machine import machine_header
    from parity.runner import cula_functions, fla_functions, run_case

    fla_fns = fla_functions()
    cula_fns = cula_functions()
    device = torch.device("cuda", torch.cuda.current_device())
    header = machine_header()
    header["grid"] = ("quick" if args.quick else "full") + (f", ops {args.ops}" if args.ops else "") + (
        f", match {args.match!r}" if args.match else "")
    header["seed"] = str(seed)
    header["command"] = "python -m parity " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"parity: {len(cases)} cases on {header['gpu']}, seed {seed}", flush=True)

    records: list[dict] = []
    t0 = time.perf_counter()
    op_t0, cur_op = t0, None
    fatal = False
    not_run: list[str] = []
    for i, case in enumerate(cases):
        if args.budget is not None and time.perf_counter() - t0 > args.budget:
            not_run = [c.id for c in cases[i:]]
            print(f"parity: budget of {args.budget:.0f} s reached; {len(not_run)} cases not run", flush=True)
            break
        if case.op != cur_op:
            if cur_op is not None:
                print(f"  [{cur_op}: {time.perf_counter() - op_t0:.1f} s]", flush=True)
                report.write(records, header, args.out, args.tag)  # partial report survives a crash
            cur_op, op_t0 = case.op, time.perf_counter()
        if case.padded:  # report written first: a padding-slot case could crash the process
            report.write(records, header, args.out, args.tag)
        rec = run_case(case, cula_fns, fla_fns, device, seed)
        records.append(rec)
        mark = "ok  " if rec["status"] == "pass" else "FAIL"
        print(f"{mark} {i + 1:4d}/{len(cases)} {rec['seconds']:6.2f}s {case.id}  [{rec['route']}]"
              + ("" if rec["status"] == "pass" else "  " + "; ".join(rec.get("notes", []))), flush=True)
        if rec.get("fatal"):
            print("parity: CUDA error is sticky; stopping here", flush=True)
            fatal = True
            break
    if cur_op is not None:
        print(f"  [{cur_op}: {time.perf_counter() - op_t0:.1f} s]", flush=True)
    header["wall time"] = f"{time.perf_counter() - t0:.1f} s" + (" (stopped early: CUDA error)" if fatal else "")
    if not_run:
        header["INCOMPLETE"] = (f"time budget {args.budget:.0f} s reached: {len(not_run)} of {len(cases)} cases "
                                f"not run (first: {not_run[0]}; last: {not_run[-1]})")
    md, js = report.write(records, header, args.out, args.tag)
    s = report.summarize(records)
    print(f"parity: {s['cases']} cases, {s['passed']} passed, {s['failed']} failed, "
          f"{s['kernel_routed']} kernel-routed; fallbacks {s['fallbacks_by_reason']}", flush=True)
    print(f"parity: wrote {md} and {js}", flush=True)
    if s["failed"] or fatal:
        return 1
    return 3 if not_run else 0


if __name__ == "__main__":
    sys.exit(main())
