"""Host-side cost of one eager call, FLA vs fla_cula: ``python -m benchmarks.host_profile [--out DIR]``.

Why it exists: where an op's host work (Python, argument checks, kernel launches) takes about as
long as its GPU work, the eager column times the CPU, not the GPU. This tool measures the host
part alone and says what it is made of:

host µs   the GPU is first handed a long sleep kernel, so no call waits for the device and each
          call's wall time is pure host work; a call that synchronizes with the GPU waits for
          the sleep and shows as "syncs".
launches  CUDA runtime calls per op call, counted by torch.profiler: kernel launches, and
          synchronizations / memory copies (each one stalls a host-bound loop).
eager µs  the benchmark's eager protocol (back-to-back calls, wall time per call) repeated in
          alternating order (FLA, fla_cula, fla_cula, FLA, ...): its spread is the eager column's noise.
--cprofile  where each side's host time goes, per function.
--parts     fla_cula's kernel-routed decode calls taken apart (host µs of each piece alone, same
          protocol as "host us"): the whole call, the signature, the memoized routing decision, the
          outputs' allocations, the compiled kernel's TVM-FFI call alone, and references (an empty
          TVM-FFI call with the same arguments, a one-kernel torch op).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

SLEEP_CYCLES = 4_000_000_000  # ~2 s at the H200's ~1.98 GHz: longer than any loop below


def host_us(call, n: int = 100) -> tuple[float, bool]:
    """Median host wall time per call while the GPU is busy; True if some call waited for it."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t = []
    t_start = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        t.append(time.perf_counter() - t0)
    # the sleep is ~2 s, host work ~ms: longer means a sync (or a full launch queue) waited for it
    waited = time.perf_counter() - t_start > 0.5
    torch.cuda.synchronize()
    return 1e6 * statistics.median(t), waited


_KINDS = {"launch": ("LaunchKernel",), "sync": ("Synchronize",), "memcpy": ("Memcpy",),
          "alloc": ("cudaMalloc", "cuMemAlloc")}


def _profiled_counts(call, n: int) -> dict[str, int]:
    """CUDA runtime/driver calls by kind over n calls plus the closing synchronize."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    out = dict.fromkeys(_KINDS, 0)
    for ev in prof.key_averages():
        for kind, pats in _KINDS.items():
            if any(p in ev.key for p in pats):
                out[kind] += ev.count
    return out


def runtime_calls(call, n: int = 5) -> dict[str, float]:
    """CUDA runtime/driver calls per op call, by kind: the profiled loop minus an empty profiled
    loop (the closing synchronize and whatever the profiler itself issues)."""
    base = _profiled_counts(lambda: None, 1)
    got = _profiled_counts(call, n)
    return {k: (got[k] - base[k]) / n for k in _KINDS}


def cprofile_top(call, n: int = 200, top: int = 12) -> list[tuple[str, float, float]]:
    """(function, own µs per op call, cumulative µs per op call) of the top `top` by own time
    (cProfile's own overhead inflates small functions: read it as an attribution, not a timing)."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        call()
    pr.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(pr)
    rows = [(f"{os.path.basename(fn)}:{line}({name})", tt / n * 1e6, ct / n * 1e6)
            for (fn, line, name), (_, _, tt, ct, _) in st.stats.items()]
    return sorted(rows, key=lambda r: -r[1])[:top]


def _decode_pieces(op: str, x: dict, call) -> dict:
    """The pieces of one kernel-routed decode call, each a no-argument callable."""
    import tvm_ffi

    from fla_cula import routing
    from fla_cula.kernels import kda_decode, lightning_decode
    from fla_cula.ops import lightning_attn

    q, k, v, h0, cu = x["q"], x["k"], x["v"], x["initial_state"], x["cu_seqlens"]
    scale = k.shape[-1] ** -0.5
    if op == "fused_recurrent_kda":  # the arguments fla_cula.ops.kda builds from the benchmark's call
        host = kda_decode
        kargs = (q, k, v, x["g"], x["beta"], x["A_log"], x["dt_bias"], h0, scale, True, False, False, cu, None,
                 None, True, True, True, False, None, None)
        grads = kargs[:5] + (h0, None)
    else:
        host = lightning_decode
        gg = lightning_attn.g_gamma_for(q.shape[2], 3, 24, q.device)
        kargs = (q, k, v, gg, scale, h0, True, False, False, cu)
        grads = (q, k, v, h0)
    go = routing.route(op, kargs, grads)
    captured = []
    real_launch = host.launch
    host.launch = lambda fn, dev, *a: captured.append((fn, a))
    try:
        go(kargs)
    finally:
        host.launch = real_launch
    fn, largs = captured[0]
    nop = tvm_ffi.get_global_func("testing.nop")
    final = (v.shape[0], v.shape[2], 128, 128)
    return {
        "whole call": call,
        "routing.signature": lambda: routing.signature(kargs),
        "routing.route (memo hit)": lambda: routing.route(op, kargs, grads),
        "plan's go (allocs + launch)": lambda: go(kargs),
        "kernel TVM-FFI call alone": lambda: fn(*largs),
        "tvm_ffi nop, same arguments": lambda: nop(*largs),
        "torch.empty_like(v)": lambda: torch.empty_like(v),
        "torch.empty(final state)": lambda: torch.empty(final, dtype=torch.float32, device=v.device),
        "torch.cuda.current_device()": torch.cuda.current_device,
        "reference: v.add_(0) (1 kernel)": lambda: v.add_(0),
    }


def decode_parts(device) -> list[dict]:
    """Host µs of the pieces of fla_cula's kernel-routed decode calls (the quick B=1 shapes)."""
    from benchmarks.registry import registry
    from parity.runner import cula_functions

    fns = cula_functions()
    rows = []
    for b in registry():
        if b.op not in ("fused_recurrent_kda", "fused_recurrent_lightning_attn") or not b.quick:
            continue
        s = b.quick[0]
        torch.manual_seed(0)
        x = b.make_inputs(s, device, False)
        with torch.inference_mode():
            b.call(fns[b.op], x)
            pieces = _decode_pieces(b.op, x, lambda f=fns[b.op], b=b, x=x: b.call(f, x))
            row = {"op": b.op, "shape": s.desc, "parts": {}}
            print(f"-- {b.op} {s.desc}: host us per call (median of 100, GPU busy)")
            for name, c in pieces.items():
                h, waited = host_us(c)
                row["parts"][name] = h
                print(f"   {h:8.2f}  {name}" + ("  (waited for the GPU)" if waited else ""), flush=True)
            torch.cuda.synchronize()
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write host_profile.json here")
    p.add_argument("--rounds", type=int, default=3, help="alternating eager rounds per impl")
    p.add_argument("--cprofile", action="store_true", help="where each side's host time goes, per function")
    p.add_argument("--ops", nargs="+", help="only these ops")
    p.add_argument("--parts", action="store_true", help="only: fla_cula's decode calls taken apart")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_profile: no CUDA device", file=sys.stderr)
        return 2
    if args.parts:
        rows = decode_parts(torch.device("cuda", torch.cuda.current_device()))
        if args.out:
            with open(os.path.join(args.out, "host_parts.json"), "w") as f:
                json.dump(rows, f, indent=1)
        return 0

    from benchmarks.harness import _eager_ms
    from benchmarks.registry import registry
    from parity.runner import cula_functions, fla_functions

    fns = {"fla": fla_functions(), "fla_cula": cula_functions()}
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    print(f"{'op':<32} {'shape':<18} {'impl':<9} {'host us':>8} {'launch':>7} {'sync':>5} {'memcpy':>6} "
          f"{'eager us (rounds)':<30}", flush=True)
    for b in registry():
        if "eager" not in b.modes or not b.quick or (args.ops and b.op not in args.ops):
            continue
        s = b.quick[0]
        torch.manual_seed(0)
        x = b.make_inputs(s, device, False)
        row = {"op": b.op, "bench": b.name, "shape": s.desc}
        with torch.inference_mode():
            calls = {impl: (lambda f=fns[impl][b.op], b=b, x=x: b.call(f, x)) for impl in fns}
            for c in calls.values():
                c()  # compile / autotune outside the timing
            torch.cuda.synchronize()
            eager = {impl: [] for impl in calls}
            for r in range(args.rounds):
                order = list(calls) if r % 2 == 0 else list(calls)[::-1]
                for impl in order:
                    eager[impl].append(1e3 * _eager_ms(calls[impl]))
            for impl, c in calls.items():
                h, waited = host_us(c)
                rc = runtime_calls(c)
                row[impl] = {"host_us": h, "waited_for_gpu": waited, "runtime_calls": rc, "eager_us": eager[impl]}
                print(f"{b.op:<32} {s.desc:<18} {impl:<9} {h:>8.1f} {rc['launch']:>7.1f} {rc['sync']:>5.1f} "
                      f"{rc['memcpy']:>6.1f} {' '.join(f'{e:.1f}' for e in eager[impl]):<30}"
                      + ("  (a call waited for the GPU)" if waited else ""), flush=True)
            if args.cprofile:
                for impl, c in calls.items():
                    top = cprofile_top(c, n=50 if b.op.startswith("chunk") else 200)
                    row[impl]["cprofile"] = top
                    print(f"  cProfile {impl} (alloc calls/op call {row[impl]['runtime_calls']['alloc']:.1f}):")
                    for name, own, cum in top:
                        print(f"    {own:8.2f} us own {cum:8.2f} us cum  {name}", flush=True)
        rows.append(row)
        del x
        torch.cuda.empty_cache()
    if args.out:
        with open(os.path.join(args.out, "host_profile.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
