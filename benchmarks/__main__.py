"""python -m benchmarks [--quick] [--out DIR] [--only NAME ...] [--modes MODE ...] [--list]
   python -m benchmarks prefill [--peers] [--quick] [--rows ...] [--regimes ...]   (benchmarks/peers.py)
   python -m benchmarks model [--rows ...] [--layers 4 24]                          (benchmarks/model.py)
   python -m benchmarks report [--add RUN.json ...] [--json PATH] [--md PATH]   (merge runs, rebuild the md)

Times FLA 0.6.0 and fla_cula side by side (see benchmarks/harness.py and benchmarks/registry.py).
Writes BENCHMARK_<tag>.md (default: repo root) and benchmarks/results/<tag>.json; with --out DIR
both go to DIR (BENCHMARK_<tag>.md and benchmark_<tag>.json). Every command merges its records
into that JSON (an op-grid run replaces the records of the benches it ran; prefill and model replace
records of the rows they ran) and regenerates the markdown from all of them, so the peer and model
tables and the op tables of separate runs end up in one report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


SUBCOMMANDS = ("prefill", "model", "report")


def main(argv: list[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in and args_in[0] in SUBCOMMANDS:
        cmd, rest = args_in[0], args_in[1:]
        if cmd == "prefill":
            from benchmarks import peers
            return peers.main(rest)
        if cmd == "model":
            from benchmarks import model
            return model.main(rest)
        return report_main(rest)
    from benchmarks.registry import registry

    benches = registry()
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small grid, mostly decode (~5 min on an H200)")
    p.add_argument("--out", help="directory for the report and the JSON (default: repo root + benchmarks/results)")
    p.add_argument("--tag", default=None, help="report suffix (default: the GPU's, e.g. H200)")
    p.add_argument("--only", nargs="+", help="bench names (substring match), e.g. 'kda decode'")
    p.add_argument("--modes", nargs="+", choices=("eager", "graph", "graph_warm", "fwdbwd"), help="only these modes")
    p.add_argument("--impls", nargs="+", choices=("fla", "fla_cula"), default=["fla", "fla_cula"])
    p.add_argument("--list", action="store_true", help="print the rows that would run and exit")
    args = p.parse_args(argv)

    plan = []
    for b in benches:
        if args.only and not any(o in b.name for o in args.only):
            continue
        shapes = b.quick if args.quick else b.shapes
        modes = [m for m in b.modes if not args.modes or m in args.modes]
        for s in shapes:
            plan.append((b, s, modes))
    if args.list:
        for b, s, modes in plan:
            print(f"{b.name:<40} {s.desc:<50} {','.join(modes)}")
        print(f"{len(plan)} shapes")
        return 0

    import torch

    from benchmarks.peers import run_header

    if not torch.cuda.is_available():
        print("benchmarks: no CUDA device; nothing to time (use --list to see the grid).", file=sys.stderr)
        return 2

    from benchmarks import report
    from benchmarks.harness import copy_same_mode_ms, measure_ceilings, time_impl
    from benchmarks.registry import roofline_ms
    from parity.runner import cula_functions, fla_functions

    header = run_header("python -m benchmarks", argv)  # FLA rows = FLA's Triton kernels (see peers.py)
    fns = {"fla": fla_functions(), "fla_cula": cula_functions()}
    device = torch.device("cuda", torch.cuda.current_device())
    header["grid"] = "quick" if args.quick else "full"
    t_start = time.perf_counter()
    print(f"benchmarks: {len(plan)} shapes on {header['gpu']}; measuring ceilings", flush=True)
    ceilings = measure_ceilings()
    print(f"  copy {ceilings['copy_bw'] / 1e12:.2f} TB/s, bf16 matmul {ceilings['matmul_rate'] / 1e12:.0f} TFLOP/s, "
          f"launch floor {1e3 * ceilings['launch_floor_graph_ms']:.1f} / "
          f"{1e3 * ceilings['launch_floor_graph_warm_ms']:.1f} µs (graph / graph_warm)", flush=True)

    records: list[dict] = []
    copy_cache: dict[tuple[int, str], float] = {}
    for b, s, modes in plan:
        torch.manual_seed(0)
        for mode in modes:
            x = b.make_inputs(s, device, mode == "fwdbwd")
            nbytes = b.nbytes(s, x, mode)
            flops = b.flops(s, mode)
            floor = roofline_ms(nbytes, flops, ceilings["copy_bw"], ceilings["matmul_rate"])
            copy_ms = None
            memory_bound = flops / ceilings["matmul_rate"] < nbytes / ceilings["copy_bw"]
            if mode in ("graph", "graph_warm") and memory_bound:  # the same bytes copied, timed the same way
                copy_ms = copy_cache.get((nbytes, mode))
                if copy_ms is None:
                    copy_ms = copy_cache[(nbytes, mode)] = copy_same_mode_ms(nbytes, mode)
            # Eager calls of host-bound ops drift with the host's state: measure in order, then in
            # reverse order (ABBA), and keep each impl's faster median, so neither side gains by order.
            passes = [list(args.impls), list(args.impls)[::-1]] if mode == "eager" else [list(args.impls)]
            best: dict[str, dict] = {}
            for p_impls in passes:
                for impl in p_impls:
                    r = time_impl(b, s, mode, impl, fns[impl][b.op], x)
                    old = best.get(impl)
                    if old is None or (r["ms"] is not None and (old["ms"] is None or r["ms"] < old["ms"])):
                        best[impl] = r
            for impl in args.impls:
                r = best[impl]
                rec = {"op": b.op, "bench": b.name, "impl": impl, "mode": mode, "B": s.B, "T": s.T, "H": s.H,
                       "HV": s.HV, "K": s.K, "V": s.V, "varlen": s.varlen_desc or None, "shape": s.desc,
                       "ms": r["ms"], "peak_bytes": r["peak_bytes"], "route": r["route"], "error": r["error"],
                       "bytes": nbytes, "flops": flops, "roofline_ms": floor, "copy_same_mode_ms": copy_ms,
                       "commit": header["fla_cula commit"],
                       "gpu": header["gpu"], "copy_bw": ceilings["copy_bw"], "matmul_rate": ceilings["matmul_rate"],
                       "wall_s": r["wall_s"]}
                records.append(rec)
                ms = "-" if r["ms"] is None else f"{r['ms']:.4f} ms"
                print(f"  {b.name:<38} {s.desc:<44} {mode:<6} {impl:<8} {ms:>12}  [{r['route']}]"
                      + (f"  {r['error']}" if r["error"] else "") + f"  ({r['wall_s']} s)", flush=True)
            del x
            torch.cuda.empty_cache()

    header["wall time"] = f"{time.perf_counter() - t_start:.0f} s"
    args.tag = report.resolve_tag(args.tag)
    if args.out:
        md = os.path.join(args.out, f"BENCHMARK_{args.tag}.md")
        js = os.path.join(args.out, f"benchmark_{args.tag}.json")
    else:
        md = os.path.join(ROOT, f"BENCHMARK_{args.tag}.md")
        js = os.path.join(ROOT, "benchmarks", "results", f"{args.tag}.json")
    meta = {b.name: {"op": b.op, "flags": b.flags} for b in benches}
    # the op grid's records replace the earlier records of the benches it ran (report.grid_drop)
    report.write_merged(records, header, ceilings, meta, md, js, f"fla_cula vs FLA 0.6.0 benchmarks ({args.tag})",
                        drop=report.grid_drop(records))
    print(f"benchmarks: wrote {md} and {js} ({header['wall time']})", flush=True)
    print(report.short_table(records), flush=True)
    return 0


def report_main(argv: list[str]) -> int:
    """Regenerate the markdown from a JSON of records (CPU only)."""
    from benchmarks import report

    p = argparse.ArgumentParser(prog="python -m benchmarks report",
                                description="Merge run JSONs (--add) into --json and regenerate --md from it.")
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "H200.json"))
    p.add_argument("--md", default=os.path.join(ROOT, "BENCHMARK_H200.md"))
    p.add_argument("--add", nargs="+", default=[], help="benchmark_<tag>.json files of device runs to merge in")
    p.add_argument("--tag", default="H200")
    a = p.parse_args(argv)
    records = report.load_records(a.json)
    runs = report.load_runs(a.json)
    for path in a.add:
        new = report.load_records(path)
        report.check_same_gpu(records, new, f"{a.json} (merging {path})")
        drop = report.grid_drop(new)   # as python -m benchmarks does: the benches this run timed
        records = report.merge_records([r for r in records if not drop(r)], new)
        runs.update(report.load_runs(path))
    if a.add:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)
        report.save_runs(a.json, runs)
    by_date = sorted(runs.values(), key=lambda r: r["header"].get("date (UTC)", ""))
    latest = by_date[-1] if by_date else None
    header, ceilings = (dict(latest["header"]), latest["ceilings"]) if latest else report.header_from_records(records)
    floored = [r["ceilings"] for r in by_date if "launch_floor_graph_ms" in (r.get("ceilings") or {})]
    if floored and "launch_floor_graph_ms" not in (ceilings or {}):
        ceilings = floored[-1]   # a run that timed no graph row measured no launch floor: the last one that did
    if not ceilings:
        ceilings = report.header_from_records(records)[1]
    header.pop("command", None)
    from benchmarks.registry import registry

    meta = {b.name: {"op": b.op, "flags": b.flags} for b in registry()}
    meta.update({k: v for r in runs.values() for k, v in (r.get("meta") or {}).items()})
    title = f"fla_cula vs FLA 0.6.0 benchmarks ({a.tag})"
    with open(a.md, "w") as f:
        f.write(report.markdown(records, header, ceilings, meta, title, runs=runs))
    print(f"benchmarks report: {len(records)} records ({len(a.add)} files merged) -> {a.json}, {a.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
