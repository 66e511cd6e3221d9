"""Where a KDA prefill chunk's time goes (H200): cycles per chunk of each phase of the fused forward.

    python -m benchmarks.kda_phases                      # B=2 T=8192 H=64, FLA's layer flags, random gates
    python -m benchmarks.kda_phases --shape 1 8192 8 --regime slow
    python -m benchmarks.kda_phases --block-v 64        # force the V columns per CTA (default: as routed)
    python -m benchmarks.kda_phases --mma-sync          # phases 6-8 on mma.sync (default: wgmma, as routed)

Runs the kernel's instrumented instantiation once (``fla_cula.kernels.kda_prefill.phase_profile``: thread 0
of each CTA reads clock64 at every phase's CTA barrier) on the peers benchmark's inputs, and prints mean
cycles per chunk per phase, their sum, and the time that sum implies at the SM clock, next to the measured
per-chunk time of the uninstrumented kernel (graph replay / chunks per CTA / waves). A measuring tool for
docs/kda_sm90.md, not part of the report.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kda_phases", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=int, nargs=3, default=[2, 8192, 64], metavar=("B", "T", "H"))
    p.add_argument("--regime", choices=("random", "slow", "fast"), default="random")
    p.add_argument("--block-v", type=int, choices=(64, 128), help="V columns per CTA (default: the call's choice)")
    p.add_argument("--mma-sync", action="store_true", help="phases 6-8 on mma.sync (set_tuning(wgmma=False))")
    p.add_argument("--json", help="write the result here too")
    a = p.parse_args(argv)

    from benchmarks.harness import _do_bench, capture_graph
    from benchmarks.peers import kernel_args, make_inputs
    from benchmarks.registry import Shape
    from fla_cula.kernels import kda_prefill

    B, T, H = a.shape
    dev = torch.device("cuda")
    x = make_inputs(Shape(B, T, H, H), a.regime, dev)
    args = kernel_args(x)
    props = torch.cuda.get_device_properties(dev)
    bv = a.block_v or kda_prefill.block_v_for(B, H, props.multi_processor_count)
    kda_prefill.set_tuning(block_v=bv, wgmma=not a.mma_sync)
    try:
        phases = kda_prefill.phase_profile(*args)
        r, fwd = kda_prefill.plan(*args)
        if r:
            raise SystemExit(f"kda_prefill declines these inputs: {r}")
        graph = capture_graph(lambda: fwd(*args, False))
        ms = _do_bench(graph.replay)
    finally:
        kda_prefill.set_tuning()
    ctas = B * H * (128 // bv)                         # one CTA per (sequence, value head, V block of bv columns)
    waves = -(-ctas // props.multi_processor_count)   # 1 CTA per SM (202-229 KB shared memory)
    chunks = -(-T // 64)
    clock_ghz = props.clock_rate / 1e6 if getattr(props, "clock_rate", 0) else 1.98
    total = sum(phases.values())
    print(f"kda_prefill phases, B={B} T={T} H={H} ({a.regime} gates), block_v {bv}, phases 6-8 on "
          f"{'mma.sync' if a.mma_sync else 'wgmma'}: cycles per chunk per CTA")
    for name, cyc in phases.items():
        print(f"  {name:<32} {cyc:10.0f}  {100 * cyc / total:5.1f}%")
    print(f"  {'sum':<32} {total:10.0f}  = {total / clock_ghz / 1e3:.2f} us at {clock_ghz:.2f} GHz")
    print(f"graph replay {ms:.3f} ms = {ms * 1e3 / (waves * chunks):.2f} us per chunk per CTA "
          f"({ctas} CTAs, {waves} waves, {chunks} chunks each)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": [B, T, H], "regime": a.regime, "block_v": bv, "wgmma": not a.mma_sync, "phases": phases,
                       "graph_ms": ms, "ctas": ctas, "waves": waves, "chunks": chunks}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
