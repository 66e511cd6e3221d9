"""Where a kernel's time goes between its barriers: Nsight Compute's SASS source page, cut at every ``BAR.SYNC``.

    python -m benchmarks.ncu_segments DIR/source_sass.csv [--min 1.0]

Reads the CSV that ``benchmarks.ncu_kda`` exports (``ncu --page source --csv --print-source sass``) and prints, per
kernel, one line per barrier-to-barrier segment of the SASS: its share of the executed warp instructions and of the
warp-stall samples (~ its share of the time), its largest stall reasons, and the counts of the instructions that name
a phase (MUFU, HMMA, HGMMA, LDS, STS, LDSM, STG, LDGSTS). Device builds carry no line table, so segments are named by
these contents; two trees' reports compare segment by segment when their barriers match. A measuring tool for
docs/kda_sm90.md, not part of the benchmark report.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from dataclasses import dataclass, field

OPS = ("MUFU", "HMMA", "HGMMA", "LDS", "STS", "LDSM", "STG", "LDGSTS")
SAMPLES, EXECUTED = "Warp Stall Sampling (All Samples)", "Instructions Executed"


@dataclass
class Segment:
    first: int
    last: int = -1
    executed: float = 0.0
    samples: float = 0.0
    stalls: Counter = field(default_factory=Counter)
    ops: Counter = field(default_factory=Counter)


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def _opcode(sass: str) -> str:
    words = sass.split()
    if words and words[0].startswith("@"):  # predicate guard
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def read_kernels(path: str) -> dict[str, list[dict[str, str]]]:
    """Kernel name -> its SASS rows (column -> text). A kernel listed twice keeps its first listing."""
    kernels: dict[str, list[dict[str, str]]] = {}
    rows: list[dict[str, str]] | None = None
    header: list[str] | None = None
    with open(path, newline="") as f:
        for rec in csv.reader(f):
            if not rec:
                continue
            if rec[0] == "Kernel Name":
                name = rec[1] if len(rec) > 1 else "?"
                rows = [] if name not in kernels else None
                if rows is not None:
                    kernels[name] = rows
                header = None
            elif rec[0] == "Address":
                header = rec
            elif header is not None and rows is not None:
                rows.append(dict(zip(header, rec, strict=False)))  # ncu may end a row with an extra empty cell
    return kernels


def segments(rows: list[dict[str, str]]) -> list[Segment]:
    """Cut the rows after every BAR.SYNC (the barrier belongs to the segment it ends)."""
    out = [Segment(0)]
    for i, row in enumerate(rows):
        seg = out[-1]
        seg.executed += _num(row.get(EXECUTED, ""))
        seg.samples += _num(row.get(SAMPLES, ""))
        for col, val in row.items():
            if col.startswith("stall_") and "(Not Issued)" not in col:
                seg.stalls[col[len("stall_"):]] += _num(val)
        op = _opcode(row.get("Source", ""))
        if op in OPS:
            seg.ops[op] += _num(row.get(EXECUTED, ""))
        if op == "BAR" and ".SYNC" in row.get("Source", ""):
            seg.last = i
            out.append(Segment(i + 1))
    out[-1].last = len(rows) - 1
    return [s for s in out if s.last >= s.first]


def report(name: str, rows: list[dict[str, str]], min_share: float) -> str:
    segs = segments(rows)
    executed = sum(s.executed for s in segs) or 1.0
    samples = sum(s.samples for s in segs) or 1.0
    lines = [f"{name}: {len(rows)} SASS lines, {executed:.4g} warp instructions executed, {samples:.4g} stall samples",
             f"  {'lines':>11}  {'instr':>6}  {'samples':>7}  largest stalls (% of the segment's samples) | counts"]
    for s in segs:
        share_i, share_s = 100 * s.executed / executed, 100 * s.samples / samples
        if max(share_i, share_s) < min_share:
            continue
        top = " ".join(f"{k}={100 * v / s.samples:.0f}" for k, v in s.stalls.most_common(3)) if s.samples else ""
        ops = " ".join(f"{k}={v:.3g}" for k, v in sorted(s.ops.items()))
        lines.append(f"  {s.first:5d}-{s.last:5d}  {share_i:5.1f}%  {share_s:6.1f}%  {top} | {ops}")
    return "\n".join(lines)


def report_file(path: str, min_share: float = 1.0) -> str:
    """report() of every kernel in the CSV at path, separated by blank lines ('' when it holds none)."""
    return "\n\n".join(report(name, rows, min_share) for name, rows in read_kernels(path).items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ncu_segments", description=__doc__.split("\n\n")[0])
    p.add_argument("csv", help="source_sass.csv of benchmarks.ncu_kda")
    p.add_argument("--min", type=float, default=1.0, help="hide segments below this share (%%) of both columns")
    args = p.parse_args(argv)
    text = report_file(args.csv, args.min)
    if not text:
        print(f"ncu_segments: no kernel in {args.csv}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
