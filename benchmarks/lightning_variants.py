"""Lightning prefill builds side by side (H200): FLA's chunk_lightning_attn and the kernel under tuning knobs.

    python -m benchmarks.lightning_variants                          # default, one stage, one stage + P in smem
    python -m benchmarks.lightning_variants --variants '{"a": {}, "b": {"kv_stages": 2, "mma": "sync"}}'

Each row: one shape (K = V = 128, bf16, layer 3 of 24, h0 and final state), CUDA-graph replay timed with
triton's do_bench (L2 flushed between replays), FLA first, then every build of ``--variants`` (a JSON object:
name -> LightningPrefillConfig knobs, applied with ``lightning_prefill.set_tuning``). A cell is ms and the
speedup over FLA. The cell is marked ``!`` when its o or final state differs in any bit from the first build's.
A measuring tool for docs/lightning_prefill.md, not part of the report.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

ROWS = ((2, 8192, 64), (1, 16384, 64), (8, 4096, 64), (16, 2048, 64), (1, 8192, 8), (1, 16384, 16), (1, 2048, 16))
DEFAULT_VARIANTS = '{"default": {}, "kv1": {"kv_stages": 1}, "kv1_psmem": {"kv_stages": 1, "p_regs": false}}'


def graph_ms(fn) -> float:
    """Median ms of a CUDA-graph replay of fn (the harness's capture: warmed up on a side stream first)."""
    import triton

    from benchmarks.harness import capture_graph
    return triton.testing.do_bench(capture_graph(fn).replay, warmup=25, rep=200)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lightning_variants", description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="JSON: name -> set_tuning knobs")
    p.add_argument("--rows", default=None, help="JSON list of [B, T, H] (default: the seven report rows)")
    args = p.parse_args(argv)
    variants = json.loads(args.variants)
    rows = [tuple(r) for r in json.loads(args.rows)] if args.rows else ROWS

    from fla.ops.lightning_attn import chunk_lightning_attn as fla_chunk

    from fla_cula.kernels import lightning_prefill as lp
    from fla_cula.reference.lightning import lightning_g_gamma

    print(f"{'B':>3} {'T':>6} {'H':>3} {'FLA':>8} " + " ".join(f"{name:>15}" for name in variants), flush=True)
    for B, T, H in rows:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, T, H, 128, device="cuda", generator=gen).bfloat16() for _ in range(3))
        h0 = torch.randn(B, H, 128, 128, device="cuda", generator=gen)
        g, scale = lightning_g_gamma(H, 3, 24, device="cuda"), 128 ** -0.5
        t_fla = graph_ms(functools.partial(fla_chunk, q, k, v, 3, 24, initial_state=h0, output_final_state=True))
        first, cells = None, []
        for knobs in variants.values():
            lp.set_tuning(**knobs)
            try:
                o, ht = lp.run(q, k, v, g, scale, h0, True, None)
                first = first or (o, ht)
                same = torch.equal(o, first[0]) and torch.equal(ht, first[1])
                t = graph_ms(functools.partial(lp.run, q, k, v, g, scale, h0, True, None))
            finally:
                lp.set_tuning()
            cells.append(f"{t:.3f} ({t_fla / t:.2f}x){'' if same else '!'}")
        print(f"{B:>3} {T:>6} {H:>3} {t_fla:8.3f} " + " ".join(f"{c:>15}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
