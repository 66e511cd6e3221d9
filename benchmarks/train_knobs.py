"""The chunk_kda training step with each of fla_cula's backward knobs off in turn, FLA beside it, one process.

    python -m benchmarks.train_knobs [--rows '[[2,4096,32],[1,8192,32]]']

The peers harness's training step (benchmarks.peers: random gates, FLA's layer flags, forward + backward with do
and dht); ms per step as the harness's do_bench median (its fwdbwd mode's clock). Settings: FLA, fla_cula
with every knob of fla_cula.ops.kda_bwd on, then with one knob off at a time (the knobs this build has: WY_KERNEL,
INTRA_KERNEL, FUSED_INTRA, FUSED_L2NORM, DV_KERNEL, GATE_KERNEL), so each fused part's share of the step is read in
one run.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.harness import _do_bench
from benchmarks.train_profile import training_step

KNOBS = ("WY_KERNEL", "INTRA_KERNEL", "FUSED_INTRA", "FUSED_L2NORM", "DV_KERNEL", "GATE_KERNEL")


def main(argv: list[str] | None = None) -> int:
    from fla_cula.ops import kda_bwd

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="[[2,4096,32],[1,8192,32]]", help="JSON list of [B, T, H]")
    a = ap.parse_args(argv)
    knobs = [k for k in KNOBS if hasattr(kda_bwd, k)]
    print(f"{'B':>3} {'T':>6} {'H':>4}  {'setting':<20} {'ms':>8} {'vs FLA':>7}")
    with torch.enable_grad():
        for B, T, H in json.loads(a.rows):
            fla = _do_bench(training_step("fla", B, T, H))
            print(f"{B:>3} {T:>6} {H:>4}  {'FLA':<20} {fla:8.3f} {1.0:6.2f}x")
            run = training_step("fla_cula", B, T, H)
            for off in (None, *knobs):
                saved = {k: getattr(kda_bwd, k) for k in knobs}
                try:
                    for k in knobs:
                        setattr(kda_bwd, k, k != off)
                    ms = _do_bench(run)
                finally:
                    for k, v in saved.items():
                        setattr(kda_bwd, k, v)
                name = "fla_cula" if off is None else f"{off} off"
                print(f"{B:>3} {T:>6} {H:>4}  {name:<20} {ms:8.3f} {fla / ms:6.2f}x")
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
