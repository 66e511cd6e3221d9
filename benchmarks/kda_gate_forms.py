"""chunk_kda per gate form, FLA beside fla_cula, one process: inference forward and the training step.

    python -m benchmarks.kda_gate_forms [--rows '[[2,4096,32],[1,8192,32]]'] [--forms sigmoid_lb softplus precomputed]

Gate forms (FLA's KDA layer flags otherwise: q/k l2norm and beta sigmoid in kernel, h0 and ht fp32, state_v_first):
  sigmoid_lb   use_gate_in_kernel, safe_gate, lower_bound=-5 (the bounded gate)
  softplus     use_gate_in_kernel, lower_bound None: a = -exp(A_log) softplus(g + dt_bias), the layer's default
               (A_log = log(1 + 15 u) as its init, dt_bias ~ randn: about half of the 16-token channel blocks span
               more than 120 log2 units, the prep's wide-channel path)
  softplus_init  the same with the layer's dt_bias init (softplus(dt_bias) log-uniform in [1e-3, 0.1]): no wide blocks
  precomputed  g a log decay (logsigmoid of randn), use_gate_in_kernel off
ms as the harness's do_bench median (eager; warm-up excluded); fwd under inference_mode, train = forward + backward
with do and dht. The route column is fla_cula's for the call (kernel, or the fallback's reason).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from benchmarks.harness import _do_bench

FORMS = ("sigmoid_lb", "softplus", "softplus_init", "precomputed")


def make_inputs(form: str, B: int, T: int, H: int, grad: bool, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    K = 128
    x = {n: randn(B, T, H, K).bfloat16() for n in ("q", "k", "v")}
    x["beta"] = randn(B, T, H).bfloat16()
    x["h0"] = randn(B, H, K, K) * 0.1
    x["A_log"] = x["dt_bias"] = None
    kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True)
    if form == "precomputed":
        x["g"] = torch.nn.functional.logsigmoid(randn(B, T, H, K)).bfloat16()
        kw.update(use_gate_in_kernel=False)
    else:
        x["g"] = randn(B, T, H, K).bfloat16()
        x["A_log"] = torch.log(1.0 + 15.0 * torch.rand(H, device="cuda", generator=gen))
        x["dt_bias"] = randn(H * K)
        if form == "softplus_init":  # FLA's KDA layer init: dt log-uniform in [1e-3, 0.1], dt_bias = softplus^-1(dt)
            dt = torch.exp(torch.rand(H * K, device="cuda", generator=gen) * math.log(100.0) + math.log(1e-3))
            x["dt_bias"] = dt + torch.log(-torch.expm1(-dt))
        kw.update(use_gate_in_kernel=True, safe_gate=form == "sigmoid_lb",
                  lower_bound=-5.0 if form == "sigmoid_lb" else None)
    if grad:
        for n in ("q", "k", "v", "g", "beta"):
            x[n].requires_grad_(True)
    x["kw"] = kw
    return x


def _call(fn, x):
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
              A_log=x["A_log"], dt_bias=x["dt_bias"], **x["kw"])


def _route(run) -> str:
    """fla_cula's routes in one run(): each op with its kernel calls, and every fallback's reason"""
    import fla_cula

    fla_cula.reset_status()
    run()
    torch.cuda.synchronize()
    parts = []
    for op, st in fla_cula.status().items():
        parts.append(f"{op} {st['kernel']}/{st['calls']}")
        parts += [f"{op} -> FLA: {r}" for r in st["fallback"]]
    return ", ".join(parts)


def _fns():
    from parity.runner import cula_functions, fla_functions

    return fla_functions()["chunk_kda"], cula_functions()["chunk_kda"]


def _train(fn, x):
    o, ht = _call(fn, x)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    leaves = [x[n] for n in ("q", "k", "v", "g", "beta")]

    def step():
        for t in leaves:
            t.grad = None
        o_, ht_ = _call(fn, x)
        torch.autograd.backward([o_, ht_], [do, dht])
    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="[[2,4096,32],[1,8192,32]]", help="JSON list of [B, T, H] (HV = H)")
    ap.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    ap.add_argument("--modes", nargs="+", default=["fwd", "train"], choices=["fwd", "train"])
    a = ap.parse_args(argv)
    fla, cula = _fns()
    print(f"{'B':>3} {'T':>6} {'H':>4} {'form':<14} {'mode':<6} {'FLA ms':>8} {'ours ms':>8} {'speedup':>8}  route")
    for B, T, H in json.loads(a.rows):
        for form in a.forms:
            for mode in a.modes:
                x = make_inputs(form, B, T, H, grad=mode == "train")
                def run_of(fn, mode=mode, x=x):
                    if mode == "fwd":
                        def fwd():
                            with torch.inference_mode():
                                _call(fn, x)
                        return fwd
                    step = _train(fn, x)

                    def train():
                        with torch.enable_grad():
                            step()
                    return train
                t_fla, t_ours = _do_bench(run_of(fla)), _do_bench(run_of(cula))
                route = _route(run_of(cula))
                sp = t_fla / t_ours if t_ours > 0 and math.isfinite(t_ours) else float("nan")
                print(f"{B:>3} {T:>6} {H:>4} {form:<14} {mode:<6} {t_fla:8.3f} {t_ours:8.3f} {sp:7.2f}x  {route}")
                del x
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
