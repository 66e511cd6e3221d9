"""Charge an Nsight Compute source page to the KDA kernel's phases (CPU machine, after `benchmarks.ncu_kda`).

    python -m benchmarks.ncu_phases DIR/source_sass.csv [--kernel prep|state] [--rev REV]

The device build has no line table, so the per-instruction counters of ncu's SASS page (`source_sass.csv`) cannot be
mapped to source there. This compiles csrc/kda_sm90/kda_fwd.cu here with `-lineinfo` (nvcc, sm_90a; the working
tree, or git revision REV: the one the device ran), disassembles the kernel with its inline chains (`nvdisasm -gi`),
aligns the two instruction streams by opcode (difflib; -lineinfo leaves the instruction sequence nearly unchanged)
and charges each profiled instruction to the outermost line of `kda_fwd_body` it came from, so a lambda or helper
counts where the body calls it. Phases are the body's `// ---- N:` comment blocks. Prints instructions executed and
warp-stall samples (a proxy for time) per phase, with the largest stall reasons. A measuring tool for
docs/kda_sm90.md.
"""

from __future__ import annotations

import argparse
import collections
import csv
import difflib
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_SRC = "csrc/kda_sm90/kda_fwd_kernel.cuh"
SYMBOLS = {"prep": "_ZN8fla_cula8kda_sm9015kda_prep_kernelILNS0_8GateFormE0ELb0ELb0EEEvNS_12KdaFwdParamsE",
           "state": "_ZN8fla_cula8kda_sm9016kda_state_kernelILi128ELb0EEEvNS_12KdaFwdParamsE"}
STALLS = ("short_sb", "barrier", "wait", "selected", "not_selected", "mio", "long_sb", "math", "dispatch", "lg")


def _opcode(sass: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", sass.strip()).split(" ")[0].split(".")[0]


def _num(x: str) -> float:
    return 0.0 if x in ("", "-") else float(x.replace(",", ""))


def read_ncu_csv(path: str, kernel: str) -> list[dict]:
    """The rows (one per SASS instruction, first occurrence) of the kernel whose name contains `kernel`."""
    rows, name, header, seen = [], "", None, set()
    with open(path, newline="") as f:
        for r in csv.reader(f):
            if not r:
                continue
            if r[0] == "Kernel Name":
                name, header = r[1], None
            elif r[0] == "Address":
                header = r
            elif header and f"kda_{kernel}_kernel" in name and r[0] not in seen:
                seen.add(r[0])
                rows.append(dict(zip(header, r, strict=False)))
    return rows


def lineinfo_sass(src_root: str, symbol: str) -> list[tuple[list[tuple[str, int]], str]]:
    """(inline chain innermost first, instruction) for each instruction of `symbol`, built with -lineinfo."""
    from fla_cula import _ext

    objdump = _ext.cuobjdump()
    nvdisasm = objdump and os.path.join(os.path.dirname(objdump), "nvdisasm")
    inc = _ext.cutlass_include()
    if not nvdisasm or not os.path.exists(nvdisasm) or inc is None:
        raise SystemExit("ncu_phases: needs nvdisasm (triton's wheel) and the CUTLASS headers")
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "kda.cubin")
        subprocess.run(["nvcc", "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a",
                        "--expt-relaxed-constexpr", "-DNDEBUG", '-DFLA_CULA_BUILT_ARCH="sm_90a"', "-lineinfo",
                        f"-I{inc}", f"-I{src_root}", f"-I{src_root}/csrc", "-cubin", "-o", cubin,
                        os.path.join(src_root, "csrc/kda_sm90/kda_fwd.cu")], check=True)
        text = subprocess.run([nvdisasm, "-gi", "-c", cubin], check=True, capture_output=True, text=True).stdout
    body = text.split(f".text.{symbol} ")[1] if f".text.{symbol} " in text else text.split(f".text.{symbol}")[1]
    body = body.split("//--------------------- .text.")[0]
    out, chain, cur = [], [], []
    for line in body.splitlines():
        if "//## File" in line:
            chain += [(f.rsplit("/", 1)[-1], int(n)) for f, n in re.findall(r'"([^"]+)", line (\d+)', line)]
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            if chain:
                cur, chain = chain, []
            out.append((cur, m.group(2)))
    return out


def phase_marks(src: str) -> list[tuple[int, str]]:
    """(first line, name) of each `// ---- name:` block of the kernel source, in order."""
    marks = []
    with open(src) as f:
        for i, line in enumerate(f, 1):
            m = re.match(r"\s*// ---- ([^:]+):", line)
            if m:
                marks.append((i, m.group(1).strip()))
    return marks


def attribute(rows: list[dict], sass: list[tuple[list, str]], marks: list[tuple[int, str]], body: tuple[int, int]):
    a = [_opcode(r["Source"]) for r in rows]
    b = [_opcode(t) for _, t in sass]
    match = {}
    for blk in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        for i in range(blk.size):
            match[blk.a + i] = blk.b + i
    table: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    last = []
    for i, r in enumerate(rows):
        if i in match:
            last = sass[match[i]][0]
        lines = [n for f, n in last if f == os.path.basename(KERNEL_SRC) and body[0] <= n < body[1]]
        site = lines[-1] if lines else -1
        name = "prologue / hoisted"
        for start, nm in marks:
            if site >= start:
                name = nm
        t = table[name]
        t["instructions"] += _num(r.get("Instructions Executed", ""))
        t["samples"] += _num(r.get("Warp Stall Sampling (All Samples)", ""))
        for s in STALLS:
            t[s] += _num(r.get(f"stall_{s}", ""))
    return table, len(match), len(a)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ncu_phases", description=__doc__.split("\n\n")[0])
    p.add_argument("csv")
    p.add_argument("--kernel", choices=tuple(SYMBOLS), default="prep")
    p.add_argument("--rev", help="git revision whose source the device ran (default: the working tree)")
    args = p.parse_args(argv)
    rows = read_ncu_csv(args.csv, args.kernel)
    if not rows:
        print(f"ncu_phases: no kda_{args.kernel}_kernel rows in {args.csv}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tree:
        src_root = ROOT
        if args.rev:
            subprocess.run(f"git -C {ROOT} archive {args.rev} csrc | tar xf - -C {tree}", shell=True, check=True)
            src_root = tree
        sass = lineinfo_sass(src_root, SYMBOLS[args.kernel])
        src = os.path.join(src_root, KERNEL_SRC)
        with open(src) as f:
            text = f.read()
        # kda_fwd_body: from its signature to the first kernel after it
        head, rest = text.split("void kda_fwd_body(", 1)
        start = head.count("\n") + 1
        end = start + rest.split("__global__", 1)[0].count("\n")
        marks = [(n, nm) for n, nm in phase_marks(src) if start <= n < end]
        table, matched, total = attribute(rows, sass, marks, (start, end))
    ti = sum(t["instructions"] for t in table.values()) or 1
    ts = sum(t["samples"] for t in table.values()) or 1
    print(f"kda_{args.kernel}_kernel: {total} SASS instructions profiled, {matched} aligned with the -lineinfo build; "
          f"{ti:.4g} warp instructions executed, {ts:.4g} stall samples")
    print("| phase | instructions | stall samples | " + " | ".join(STALLS[:7]) + " |")
    print("|---|---|---|" + "---|" * 7)
    order = ["prologue / hoisted"] + [nm for _, nm in marks]
    for nm in order:
        t = table.get(nm)
        if not t:
            continue
        print(f"| {nm[:40]} | {100 * t['instructions'] / ti:.1f}% | {100 * t['samples'] / ts:.1f}% | "
              + " | ".join(f"{100 * t[s] / ts:.1f}" for s in STALLS[:7]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
