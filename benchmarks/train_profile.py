"""Where a chunk_kda training step's GPU time goes, FLA vs fla_cula, kernel by kernel.

    python -m benchmarks.train_profile [--rows '[[2,4096,32],[1,8192,32]]'] [--n 10] [--out DIR]

Each side runs the peers harness's training step (benchmarks.peers: random gates, FLA's layer flags,
forward + backward with do and dht) under torch.profiler; the table lists every kernel's µs per step
on both sides, so the backward kernels both share (FLA's chunk_kda_bwd) read as the same lines and the
forward's difference as the rest. What a backward kernel of our own would replace is read off here.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def training_step(impl: str, B: int, T: int, H: int):
    """The peers harness's training step of impl at (B, T, H), random gates: a callable (call it under grad)."""
    from benchmarks.peers import _backward_step, make_inputs, prepare
    from benchmarks.registry import _S

    s = _S(B, T, H)
    x = make_inputs(s, "random", torch.device("cuda"), grad=True)
    p = prepare(impl, s, x)
    step = _backward_step(p, x)

    def run():
        for t in p.grad_leaves:
            t.grad = None
        step()
    return run


def step_kernels(impl: str, B: int, T: int, H: int, n: int) -> dict[str, float]:
    from benchmarks.model import kernel_times

    with torch.enable_grad():
        return kernel_times(training_step(impl, B, T, H), n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="[[2,4096,32],[1,8192,32]]", help="JSON list of [B, T, H]")
    ap.add_argument("--n", type=int, default=10, help="profiled steps per side")
    ap.add_argument("--top", type=int, default=25, help="kernel lines printed per row")
    ap.add_argument("--out", default=None, help="directory for train_profile.json")
    a = ap.parse_args(argv)
    report = []
    for B, T, H in json.loads(a.rows):
        sides = {impl: step_kernels(impl, B, T, H, a.n) for impl in ("fla", "fla_cula")}
        names = sorted(set(sides["fla"]) | set(sides["fla_cula"]),
                       key=lambda k: -max(sides["fla"].get(k, 0.0), sides["fla_cula"].get(k, 0.0)))
        tot = {k: sum(v.values()) for k, v in sides.items()}
        print(f"\nB{B} T{T} H{H}: GPU us per step  FLA {tot['fla']:.1f}  fla_cula {tot['fla_cula']:.1f}  "
              f"({tot['fla'] / max(tot['fla_cula'], 1e-9):.2f}x)")
        print(f"  {'FLA':>9} {'fla_cula':>9}  kernel")
        for k in names[:a.top]:
            f, c = sides["fla"].get(k), sides["fla_cula"].get(k)
            print(f"  {'-' if f is None else f'{f:9.1f}':>9} {'-' if c is None else f'{c:9.1f}':>9}  {k[:110]}")
        report.append({"B": B, "T": T, "H": H, "us": sides, "total_us": tot})
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "train_profile.json"), "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
