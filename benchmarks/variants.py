"""Decode-kernel variant sweep (H200): the same calls with different DecodeConfig tuning knobs,
side by side with FLA, CUDA-graph replay medians. Used to pick the defaults recorded in
docs/decode_kernels.md; not part of the report.

    python -m benchmarks.variants [--variants JSON] [--old-module path/to/old_recurrent_decode.py]

A variant is a dict of DecodeConfig fields (e.g. {"l2_prefetch": false}) plus "mma": whether
multi-token KDA steps without a pool run on the tensor-core kernel (recurrent_decode_mma; default
true, as in production), or a dict of its MmaDecodeConfig knobs (e.g. {"min_ctas": 4});
"old" runs a previous version of the kernel module from a file, for before/after comparisons in
one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys

import torch

from benchmarks.harness import _do_bench, capture_graph, measure_ceilings

H_KDA, H_LA, KV = 32, 64, 128


def _kda_args(B, T, vf, dev, lower_bound=-5.0):
    g = torch.Generator(device=dev).manual_seed(B * 7 + T)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
    q, k = r(B, T, H_KDA, KV).bfloat16(), r(B, T, H_KDA, KV).bfloat16()
    v, gg = r(B, T, H_KDA, KV).bfloat16(), r(B, T, H_KDA, KV).bfloat16()
    beta = r(B, T, H_KDA).bfloat16()
    h0 = r(B, H_KDA, KV, KV)
    A_log, dt_bias = torch.log(torch.empty(H_KDA, device=dev).uniform_(1, 16)), 0.5 * r(H_KDA * KV)
    out = torch.empty_like(v)
    # fused_recurrent_kda_fwd positional arguments (inplace state, preallocated out)
    return (q, k, v, gg, beta, A_log, dt_bias, h0, KV ** -0.5, False, True, vf, None, None, None,
            True, True, True, False, lower_bound, out)


def _la_args(B, T, dev):
    g = torch.Generator(device=dev).manual_seed(B * 11 + T)
    q, k, v = (torch.randn(B, T, H_LA, KV, device=dev, generator=g).bfloat16() for _ in range(3))
    h0 = torch.randn(B, H_LA, KV, KV, device=dev, generator=g)
    gam = -(8 / H_LA * (1 - 3 / 24)) * torch.arange(H_LA, dtype=torch.float, device=dev)
    return (q, k, v, gam, KV ** -0.5, h0, True, False, False, None)


def _graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = capture_graph(fn)
    return 1e3 * _do_bench(g.replay)


def _use(mod_rd, variant: dict):
    """Route the host wrappers to `mod_rd` (a recurrent_decode module) with `variant` tuning knobs."""
    from fla_cula import routing
    from fla_cula.kernels import kda_decode, lightning_decode, recurrent_decode, recurrent_decode_mma
    variant = dict(variant)
    m = variant.pop("mma", mod_rd is recurrent_decode)  # False, True or a dict of MmaDecodeConfig knobs
    recurrent_decode_mma.set_enabled(bool(m) or m == {})
    recurrent_decode_mma.set_tuning(**(m if isinstance(m, dict) else {}))
    if mod_rd is recurrent_decode:
        routing.clear_plans()
        for host in (kda_decode, lightning_decode):
            host.get_kernel, host.DecodeConfig = recurrent_decode.get_kernel, recurrent_decode.DecodeConfig
        recurrent_decode.set_tuning(**variant)
        return
    names = {f.name for f in dataclasses.fields(mod_rd.DecodeConfig)}

    def old_kernel(cfg, m=mod_rd):  # an older module: translate the configs it knows
        fn = m.get_kernel(m.DecodeConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                                            if f.name in names}))
        # modules of the persistent-CTA era returned (fn, CTAs per SM) and took a trailing max_ctas
        return (lambda *a, f=fn[0]: f(*a, 0)) if isinstance(fn, tuple) else fn

    routing.clear_plans()
    for host in (kda_decode, lightning_decode):
        host.get_kernel = old_kernel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default='{"default": {}, "v2": {"kv_rows": false}, '
                                          '"no_l2_prefetch": {"l2_prefetch": false}, '
                                          '"bv16": {"bv": 16, "kv_rows": false}, "bv64": {"bv": 64, "kv_rows": false}, '
                                          '"bv32": {"bv": 32}, "bv64_kv_rows": {"bv": 64}, '
                                          '"no_tok_smem": {"tok_smem": false}}')
    ap.add_argument("--old-module", default=None, help="file of an earlier recurrent_decode.py ('old' row)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="1,8,32,128,256")
    ap.add_argument("--gate", choices=("lower_bound", "softplus"), default="lower_bound",
                    help="KDA gate in kernel: lower_bound=-5 sigmoid, or softplus (the benchmark's flags)")
    ap.add_argument("--layouts", default="kv,vk", help="KDA state layouts to run: kv, vk")
    a = ap.parse_args()
    dev = torch.device("cuda")
    os.environ["FLA_CULA_NO_DISK_CACHE"] = "1"  # variants share spec names: keep compiles in process
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_kda
    from fla.ops.simple_gla.fused_recurrent import fused_recurrent_simple_gla as fla_sgla

    from fla_cula.kernels import kda_decode, lightning_decode, recurrent_decode

    mods = {name: (recurrent_decode, v) for name, v in json.loads(a.variants).items()}
    if a.old_module:
        spec = importlib.util.spec_from_file_location("rd_old", a.old_module)
        old = importlib.util.module_from_spec(spec)
        sys.modules["rd_old"] = old  # dataclasses look their module up while the class is built
        src = open(a.old_module).read().replace('KernelSpec("recurrent_decode"', 'KernelSpec("recurrent_decode_old"')
        exec(compile(src, a.old_module, "exec", dont_inherit=True), old.__dict__)  # no __future__ annotations
        mods = {"old": (old, {}), **mods}
    ceil = measure_ceilings()
    bw = ceil["copy_bw"]
    rows = []
    batches = [int(b) for b in a.batches.split(",")]
    vfs = [lay == "vk" for lay in a.layouts.split(",")]
    cases = ([("kda", B, T, vf) for vf in vfs for T in (1, 4) for B in batches]
             + [("lightning", B, T, False) for T in (1, 4) for B in batches])
    for op, B, T, vf in cases:
        if op == "kda":
            args = _kda_args(B, T, vf, dev, -5.0 if a.gate == "lower_bound" else None)
            nstates = B * H_KDA
            fla = lambda args=args: fla_kda(*args[:20], out=args[20])  # noqa: E731
        else:
            args = _la_args(B, T, dev)
            nstates = B * H_LA
            fla = lambda args=args: fla_sgla(args[0], args[1], args[2], g_gamma=args[3],  # noqa: E731
                                             scale=args[4], initial_state=args[5], output_final_state=True)
        row = {"op": op, "B": B, "T": T, "vf": vf, "fla_us": _graph_us(fla)}
        for name, (m, var) in mods.items():
            _use(m, var)
            host = kda_decode if op == "kda" else lightning_decode
            try:
                row[name + "_us"] = _graph_us(lambda h=host, args=args: h.run(*args))
            except ValueError as e:  # a knob this config cannot take (e.g. tok_smem with 8 warps)
                print(f"  {name}: n/a ({e})")
        row["state_GB"] = nstates * KV * KV * 4 * 2 / 1e9
        rows.append(row)
        best = min((k for k in row if k.endswith("_us")), key=lambda k: row[k])
        print(f"{op:9} B={B:<4} T={T} vf={int(vf)} " + " ".join(
            f"{k[:-3]}={row[k]:7.1f}us({row['state_GB'] / row[k] * 1e3:4.2f}TB/s)"
            for k in row if k.endswith("_us")) + f"  best={best[:-3]}", flush=True)
    print(f"copy ceiling {bw / 1e12:.2f} TB/s")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"ceilings": ceil, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
