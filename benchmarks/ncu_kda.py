"""Nsight Compute on the KDA prefill's passes (H200): where the prep and state kernels' time goes.

    python -m benchmarks.ncu_kda --out DIR [--shape 2 8192 64] [--regime random] [--old-state]

Runs ``ncu`` over a child process that calls ``kda_prefill.run`` (the peers benchmark's inputs, FLA's layer flags)
twice and profiles the second call's kernels whose names match ``--kernels``. Per kernel it prints the sections that
name the limiter (speed of light, pipe utilization, shared-memory wavefronts and bank conflicts, warp stall reasons,
occupancy) and saves the full report (``DIR/kda.ncu-rep``, open it in the Nsight Compute GUI for the source view),
the SASS source page (``DIR/source_sass.csv``) and its barrier-to-barrier segments (``DIR/segments.txt``,
benchmarks/ncu_segments.py).
A measuring tool for docs/kda_sm90.md, not part of the benchmark report.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

from benchmarks import ncu_segments

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "MemoryWorkloadAnalysis_Tables",
            "WarpStateStats", "SchedulerStats", "Occupancy", "LaunchStats", "InstructionStats", "SourceCounters")


def child(B: int, T: int, H: int, regime: str, old_state: bool) -> None:
    import torch

    from benchmarks.peers import kernel_args, make_inputs
    from benchmarks.registry import Shape
    from fla_cula.kernels import kda_prefill as kp

    if old_state:
        kp.set_tuning(two_kernel=True, state_rs=False)
    args = kernel_args(make_inputs(Shape(B, T, H, H), regime, torch.device("cuda")))
    with torch.inference_mode():
        kp.run(*args)  # compiles / loads; not profiled (ncu starts with profiling off)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()  # profile every matching launch of the second call, however many passes it has
        kp.run(*args)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ncu_kda", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shape", nargs=3, type=int, default=(2, 8192, 64), metavar=("B", "T", "H"))
    p.add_argument("--regime", choices=("random", "slow", "fast"), default="random")
    p.add_argument("--kernels", default="regex:kda_(prep|state|state_rs)_kernel")
    p.add_argument("--old-state", action="store_true",
                   help="the state passes on kda_state_kernel (set_tuning(state_rs=False)) instead of the default")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(*args.shape, args.regime, args.old_state)
        return 0
    ncu = shutil.which("ncu") or next((c for c in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/ncu")
                                       if os.path.exists(c)), None)
    if ncu is None:
        print("ncu_kda: no ncu on this machine", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    rep = os.path.join(args.out, "kda")
    # only the second call's launches (the child brackets it with cudaProfilerStart / Stop): a call has one to three
    # passes (prep, the split's maps pass, pass 2), so counting launches to skip would depend on the plan and --kernels
    cmd = [ncu, "--kernel-name", args.kernels, "--profile-from-start", "off", "--import-source", "yes",
           "-f", "-o", rep] + [a for s in SECTIONS for a in ("--section", s)]
    cmd += [sys.executable, "-m", "benchmarks.ncu_kda", "--child", "--out", args.out, "--shape",
            *map(str, args.shape), "--regime", args.regime] + (["--old-state"] if args.old_state else [])
    print(" ".join(cmd), flush=True)
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        return rc
    shown = [a for s in SECTIONS if s != "SourceCounters" for a in ("--section", s)]
    text = subprocess.run([ncu, "--import", rep + ".ncu-rep", "--page", "details", "--print-units", "base"] + shown,
                          capture_output=True, text=True).stdout
    with open(os.path.join(args.out, "details.txt"), "w") as f:
        f.write(text)
    src = subprocess.run([ncu, "--import", rep + ".ncu-rep", "--page", "source", "--csv", "--print-source", "sass"],
                         capture_output=True, text=True).stdout
    csv_path = os.path.join(args.out, "source_sass.csv")
    with open(csv_path, "w") as f:
        f.write(src)
    print(text)
    seg = ncu_segments.report_file(csv_path)   # per-barrier segments of each kernel's SASS
    with open(os.path.join(args.out, "segments.txt"), "w") as f:
        f.write(seg + "\n")
    print(seg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
