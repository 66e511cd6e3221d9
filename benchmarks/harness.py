"""Timing: FLA and fla_cula side by side in one process, on the same inputs.

eager  : plain Python calls back to back, as a serving or training loop without graphs makes them:
         wall time per call over batches of 20 calls (synchronized at the end of each batch),
         median of 15 batches, after untimed warm-up calls (compiles and Triton autotuning stay
         out). A call costs max(its host work, its GPU work): where the host is slower, this column
         times the host. (do_bench would flush L2 before each call: the ~85 µs flush lets the host
         prepare the next call unseen, so host costs below that never showed - see
         benchmarks/host_profile.py, which measures the host part alone.)
graph  : the same call captured once in a CUDA graph (after warm-up on a side stream), then
         ``do_bench(graph.replay)``: GPU time without Python/launch overhead, L2 flushed before each
         replay (a decode step reads states that other layers evicted). Capture failures are
         recorded with their reason.
graph_warm : the same graph replayed back to back (median of 20 batches of 25 replays, CUDA
         events), no flush: small states stay in the 60 MB L2 - the condition of the decode numbers
         in baseline-h200.md, against which the issue targets were set.
fwdbwd : forward + backward (``torch.autograd.backward`` with fixed random output gradients),
         ``grad_to_none`` clears the input gradients between repetitions.
Peak memory: ``torch.cuda.max_memory_allocated()`` during one call minus what was allocated before.
do_bench flushes L2 between repetitions, so small decode states are not served from cache.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

WARMUP_MS, REP_MS = 25, 100


def _do_bench(fn, grad_to_none=None) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, grad_to_none=grad_to_none,
                                         return_mode="median"))


def _copy_ms(n: int) -> float:
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    return _do_bench(lambda: y.copy_(x))


def _matmul_ms(m: int) -> float:
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    return _do_bench(lambda: a @ b)


def _eager_ms(call, batches: int = 15, inner: int = 20) -> float:
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(inner):
            call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / inner)
    return 1e3 * statistics.median(times)


def _replay_warm_ms(g, batches: int = 20, inner: int = 25) -> float:
    for _ in range(5):
        g.replay()
    times = []
    for _ in range(batches):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(inner):
            g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / inner)
    return statistics.median(times)


def _launch_floor_ms() -> tuple[float, float]:
    """A graph of one 1-element kernel, timed as the decode rows are (flushed, warm): the part of a
    small-batch row that no kernel can remove (graph launch, kernel launch, event timing)."""
    x = torch.zeros(1, device="cuda")
    g = capture_graph(lambda: x.add_(1.0))
    return _do_bench(g.replay), _replay_warm_ms(g)


def copy_same_mode_ms(nbytes: int, mode: str) -> float:
    """A device-to-device copy that reads and writes `nbytes` in all, captured in a graph and timed in
    `mode` ("graph": L2 flushed before each replay; "graph_warm": back to back): the floor of a
    memory-bound row measured the way the row is, launch and ramp-up included."""
    n = max(1, nbytes // 8)  # float32 elements copied: n * 4 read + n * 4 written
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    # an SM kernel (vectorized elementwise), not copy_: a captured D2D copy_ becomes a memcpy node
    # that runs on a copy engine (1.3-2.4 TB/s measured that way, far below what kernels reach)
    g = capture_graph(lambda: torch.mul(x, 1.0, out=y))
    return _do_bench(g.replay) if mode == "graph" else _replay_warm_ms(g)


def measure_ceilings() -> dict[str, float]:
    """Device-to-device copy bandwidth (bytes read + written per second), bf16 matmul flop/s, and
    the launch floor of a one-kernel graph replay (with and without the L2 flush)."""
    n = 1 << 28  # 1 GiB of float32
    ms = _copy_ms(n)
    copy_bw = 2 * n * 4 / (ms * 1e-3)
    m = 8192
    ms_mm = _matmul_ms(m)
    rate = 2 * m ** 3 / (ms_mm * 1e-3)
    floor_flushed, floor_warm = _launch_floor_ms()
    torch.cuda.empty_cache()
    return {"copy_bw": copy_bw, "matmul_rate": rate, "copy_ms_1GiB": ms, "matmul_ms_8192": ms_mm,
            "launch_floor_graph_ms": floor_flushed, "launch_floor_graph_warm_ms": floor_warm}


def peak_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def median_cell(ts: list, t_ref: float | None = None, same: bool = True) -> str:
    """A variant-table cell: the median ms of ts, (t_ref / median)x when t_ref is given, the spread (max - min) /
    median when above 3%, and '!' when not `same` (the variant's outputs disagree)."""
    t = statistics.median(ts)
    spread = (max(ts) - min(ts)) / t
    return (f"{t:.3f}" + (f" ({t_ref / t:.2f}x)" if t_ref else "") + (f" ±{spread:.0%}" if spread > 0.03 else "")
            + ("" if same else "!"))


def variant_row(graphs: dict, rounds: int, same: dict) -> str:
    """A variants-table row: every graph's replay timed `rounds` times in turn (triton do_bench, L2 flushed between
    replays; machine drift spreads over all of them). graphs[None] is the reference (FLA), the others the variants
    in order; same[name] False marks a variant whose outputs disagree."""
    import triton
    ts = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, gr in graphs.items():
            ts[name].append(triton.testing.do_bench(gr.replay, warmup=25, rep=200))
    t_ref = statistics.median(ts[None])
    return f"{median_cell(ts[None]):>14} " + " ".join(f"{median_cell(ts[n], t_ref, same[n]):>20}" for n in graphs
                                                     if n is not None)


def route_of(op: str) -> str:
    from fla_cula import routing
    from fla_cula.kernels.registry import OPS
    if op not in OPS:
        return "kernel (a building block, not a routed op)"
    r = routing.last_route()
    if r is None:
        return "no route recorded"
    return r[1] if r[0] == op else f"{r[1]} ({r[0]})"


def _backward_fn(call, fn, x, names):
    outs = call(fn, x)
    o, ht = outs[0], outs[1]
    do = torch.randn_like(o)
    dht = torch.randn_like(ht) if ht is not None else None
    leaves = [x[n] for n in names]

    def step():
        o_, ht_ = call(fn, x)[:2]
        ts, gs = [o_], [do]
        if ht_ is not None:
            ts.append(ht_)
            gs.append(dht)
        torch.autograd.backward(ts, gs)

    return step, leaves


def time_impl(bench, shape, mode: str, impl: str, fn, x: dict) -> dict:
    """One (impl, mode) measurement; returns {"ms", "peak_bytes", "route", "error"}."""
    rec: dict = {"ms": None, "peak_bytes": None, "route": "fla" if impl == "fla" else None, "error": None}
    infer = mode != "fwdbwd"
    ctx = torch.inference_mode() if infer else torch.enable_grad()
    t0 = time.perf_counter()
    try:
        with ctx:
            if mode == "fwdbwd":
                step, leaves = _backward_fn(bench.call, fn, x, bench.grad_inputs)
                call, grad_to_none = step, leaves
            else:
                def call():
                    return bench.call(fn, x)
                grad_to_none = None
            call()  # warm-up (compile / autotune)
            if impl == "fla_cula":
                rec["route"] = route_of(bench.op)
            rec.update(time_call(call, mode, grad_to_none=grad_to_none, warm=False))
    except Exception as e:  # noqa: BLE001 - recorded per row
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    rec["wall_s"] = round(time.perf_counter() - t0, 2)
    return rec


def _eager_plan(call, budget_s: float | None) -> tuple[int, int]:
    """(batches, inner) for _eager_ms so one eager measurement takes about `budget_s` (None: the
    default 15 x 20): batches of >= ~20 ms (at most 20 calls), 5 to 15 of them."""
    if budget_s is None:
        return 15, 20
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    t = max((time.perf_counter() - t0) / 2, 1e-6)
    inner = max(1, min(20, int(0.02 / t)))
    batches = max(5, min(15, int(budget_s / (inner * t))))
    return batches, inner


def time_call(call, mode: str, *, grad_to_none=None, warm: bool = True, eager_budget_s: float | None = None) -> dict:
    """Time a zero-argument closure as time_impl times a registry row: "eager" (back-to-back calls,
    optionally on a time budget), "graph" / "graph_warm" (captured once, replayed; a capture failure
    is the record's error), "fwdbwd" (do_bench of a forward + backward step, `grad_to_none` cleared).
    `warm`: make one untimed call first (the caller did when False). Returns {"ms", "peak_bytes", "error"}."""
    rec: dict = {"ms": None, "peak_bytes": None, "error": None}
    if warm:
        call()
    torch.cuda.synchronize()
    if mode == "eager":
        rec["ms"] = _eager_ms(call, *_eager_plan(call, eager_budget_s))
        rec["peak_bytes"] = peak_bytes(call)
    elif mode == "fwdbwd":
        rec["ms"] = _do_bench(call, grad_to_none=grad_to_none)
        rec["peak_bytes"] = peak_bytes(call)
    elif mode in ("graph", "graph_warm"):
        try:
            g = capture_graph(call)
        except Exception as e:  # noqa: BLE001 - recorded
            rec["error"] = f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
        else:
            rec["ms"] = _do_bench(g.replay) if mode == "graph" else _replay_warm_ms(g)
            del g
    else:
        raise ValueError(f"mode must be eager, graph, graph_warm or fwdbwd, got {mode!r}")
    return rec
