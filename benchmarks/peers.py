"""KDA prefill against what a user would install instead: ``python -m benchmarks prefill --peers``.

Implementations, each timed on the same inputs in the same process, FLA 0.6.0's layer flags
(q/k l2norm, gate in kernel with A_log [HV] and dt_bias [HV*K], safe_gate, lower_bound=-5, beta
sigmoid, state_v_first, fp32 initial state given, final state returned):

    fla                     FLA 0.6.0's chunk_kda, its Triton kernels (FLA_FLASH_KDA=0, see below)
    fla_cula                fla_cula.chunk_kda; its route is recorded ("kernel" or "fallback: why")
    cudnn:kda_hopper_cuda   cudnn.linear_attention.ops.kimi_delta_attention, plan pinned (NVRTC CUDA C++)
    cudnn:kda_hopper        the same op, CuTe DSL plan pinned
    flash_kda               flash_kda.fwd (FlashKDA: the tokenspeed-flashkda wheel, or scripts/build_flashkda.sh's
                            source build where the wheel does not match torch's C++ ABI)

Peers are an optional extra (``pip install fla-cula[peers]``) and are imported lazily: a missing
package, a plan the peer declines or a call that raises becomes a record with ``status``
"unavailable" / "declined" / "failed" and the reason, never an exception and never a dropped row.

Layouts: FLA's are [B, T, H, D] with the state [N, HV, V, K] (state_v_first). cuDNN takes THD
([total_tokens, heads, dim], a view of the same memory), cu_seqlens int32 (a dense batch as
[0, T, 2T, ...]), dt_bias [HV, K]; FlashKDA takes FLA's layout, dt_bias [HV, K], cu_seqlens int64
and preallocated outputs. Every conversion is made once per row, before timing (`_Prepared`).

Gate regimes (the raw gate input g ~ randn, as in FLA's tests, in both):
    random  A_log = log U(1, 16), dt_bias = 0.5 * randn (as benchmarks.registry.kda_inputs)
    slow    as random, but in every value head a quarter of the key channels get dt_bias = -13:
            there, with a = lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) and exp(A_log) >= 1,
            every token decays the state by 1 - exp(a) < 0.01 (checked by `slow_share`, CPU test):
            long-memory channels as a trained model has, where a sequence split that restarts
            from a zero state after a warm-up (cuDNN's small-B*H split) loses accuracy or speed.
    fast    A_log = 0, dt_bias = 0: a = lower_bound * sigmoid(g), every channel decays by
            1 - exp(a) ~ 0.9 per token on average (checked by `fast_decay`, CPU test). cuDNN's
            kda_hopper_cuda splits each sequence into pieces that replay the chunks before their
            start until max over channels of the chunk gate sums attenuates the state by 2^-20:
            one chunk here, but the whole prefix for a head with one slow channel (`random` has
            such heads, `slow` has them everywhere), where its pieces run serially. This regime
            is its best case; anchors.md's cuDNN table was measured in a regime like it.

Errors: every record carries the output and final-state relative RMS error against the fp64
recurrence (fla_cula.reference.kda_recurrent) computed on the GPU over the full length for the
first value heads only (REF_HEADS; the record's "ref" says which), with the same inputs.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

from benchmarks.registry import _S, KDA_PREFILL_FLAGS, Shape, chunk_kda_flops, io_bytes, kda_inputs

LOWER_BOUND = KDA_PREFILL_FLAGS["lower_bound"]
SLOW_SHARE = 0.25  # share of key channels per value head with a slow decay in the "slow" regime
SLOW_DT_BIAS = -13.0  # z = exp(A_log) (g + dt) <= g - 13 < -6.2 for g < 6.8: 1 - exp(a) < 0.01
SLOW_DECAY = 0.01  # "slow": a channel decays the state by less than this per token
REF_HEADS = 8  # value heads checked against the fp64 reference (full length)
REGIMES = ("random", "slow", "fast")
CUDNN_PLANS = ("kda_hopper_cuda", "kda_hopper")
IMPLS = ("fla", "fla_cula") + tuple(f"cudnn:{p}" for p in CUDNN_PLANS) + ("flash_kda",)

SKEWED_16K = (8192, 4096, 2048, 1024, 512, 256, 128, 64, 32, 32)  # one long sequence, many short
MANY_SHORT = (256,) * 64

PREFILL_SHAPES = [
    _S(1, 8192, 64), _S(2, 8192, 64), _S(1, 16384, 64), _S(8, 4096, 64), _S(1, 32768, 16), _S(1, 8192, 8),
    _S(1, 2048, 16), _S(2, 8192, 16, 32),
    _S(1, sum(SKEWED_16K), 64, varlen=SKEWED_16K, label="skewed"),
    _S(1, sum(MANY_SHORT), 32, varlen=MANY_SHORT, label="many short"),
]
TRAIN_SHAPES = [_S(2, 4096, 32), _S(1, 8192, 32)]
QUICK_PREFILL = [_S(1, 8192, 64), _S(1, 8192, 8), _S(2, 8192, 16, 32)]

BENCH_PREFILL = "chunk_kda peers"
BENCH_TRAIN = "chunk_kda peers train"
FLAGS = ("l2norm, gate in kernel (A_log [HV], dt_bias [HV*K]), safe_gate, lower_bound=-5, beta sigmoid, "
         "state_v_first, fp32 h0 given, ht returned")


def disable_fla_flash_kda() -> bool:
    """Make FLA's own chunk_kda run its Triton kernels, and say whether FLA's FlashKDA backend is off.

    FLA 0.6.0 registers a FlashKDA backend for chunk_kda (fla/ops/kda/backends/flash_kda.py) that
    takes every inference-mode call with our flags once `flash_kda` is importable (the peers extra
    installs it). fla.backends reads the switch at *call* time (BaseBackend.is_enabled looks up
    os.environ in the dispatch wrapper on every call; only FLA_DISABLE_BACKEND_DISPATCH is read at
    import), so setting FLA_FLASH_KDA=0 here, before any timed call, is enough, whether or not fla
    was imported already. Both `FLA_FLASH_KDA` spellings FLA reads (the backend's env_var and
    FLA_<BACKEND_TYPE>) are this one name. The check below asks FLA's own backend object."""
    os.environ["FLA_FLASH_KDA"] = "0"
    try:
        from fla.ops.kda.backends.flash_kda import FlashKDABackend
    except Exception:  # noqa: BLE001 - an FLA without the backend: nothing to disable
        return True
    return not FlashKDABackend().is_enabled()


def run_header(command: str, argv: list[str] | None) -> dict:
    """The machine header every benchmark command writes, after turning FLA's FlashKDA backend off
    (so FLA rows are FLA's Triton kernels); `command` is the subcommand as typed."""
    from parity.machine import machine_header

    flash_off = disable_fla_flash_kda()
    header = machine_header()
    header["FLA_FLASH_KDA"] = f"0 (FLA's FlashKDA backend disabled: {flash_off})"
    header["command"] = f"{command} " + " ".join(argv if argv is not None else sys.argv[1:])
    return header


# ---------------------------------------------------------------------------------------------
# gate regimes
def gate_params(regime: str, HV: int, K: int, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_log [HV], dt_bias [HV*K]) float32 for a gate regime (module docstring)."""
    if regime not in REGIMES:
        raise ValueError(f"gate regime must be one of {REGIMES}, got {regime!r}")
    gen = torch.Generator().manual_seed(seed)
    A_log = torch.log(torch.empty(HV).uniform_(1, 16, generator=gen))
    dt_bias = 0.5 * torch.randn(HV, K, generator=gen)
    if regime == "fast":
        A_log, dt_bias = torch.zeros_like(A_log), torch.zeros_like(dt_bias)
    if regime == "slow":
        n_slow = round(SLOW_SHARE * K)
        for h in range(HV):
            dt_bias[h, torch.randperm(K, generator=gen)[:n_slow]] = SLOW_DT_BIAS
    return A_log.to(device), dt_bias.reshape(-1).to(device)


def slow_share(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float = LOWER_BOUND,
               threshold: float = SLOW_DECAY) -> float:
    """Share of (value head, key channel) pairs whose per-token decay 1 - exp(a) stays below
    `threshold` on every token of g ([B, T, HV, K]), a from the fp64 gate formula."""
    from fla_cula.reference.kda import kda_gate

    a = kda_gate(g, A_log, dt_bias, lower_bound)  # [B, T, HV, K] float64
    decay = -torch.expm1(a)  # 1 - exp(a)
    slow = (decay < threshold).flatten(0, 1).all(0)  # [HV, K]
    return float(slow.double().mean())


def fast_decay(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float = LOWER_BOUND
               ) -> float:
    """The smallest per-channel mean decay 1 - exp(a) over (value head, key channel) of g ([B, T, HV, K]), a from
    the fp64 gate formula: the channel that keeps the state longest."""
    from fla_cula.reference.kda import kda_gate

    decay = -torch.expm1(kda_gate(g, A_log, dt_bias, lower_bound))
    return float(decay.flatten(0, 1).mean(0).min())


def kernel_args(x: dict) -> tuple:
    """kda_prefill.run's arguments for make_inputs' tensors under FLA's layer flags (the peers' flags: l2norm, the
    bounded gate in kernel, beta sigmoid, state_v_first, the final state), for the tools that call the kernel alone."""
    from fla_cula.ops.chunk_autograd import KDAChunkConfig

    cfg = KDAChunkConfig(scale=x["q"].shape[-1] ** -0.5, output_final_state=True, use_beta_sigmoid_in_kernel=True,
                         allow_neg_eigval=False, state_v_first=True, chunk_size=64, disable_recompute=False,
                         return_intermediate_states=False, cp=False, use_graph=False, **KDA_PREFILL_FLAGS)
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["initial_state"], x["cu_seqlens"],
            x["cu_seqlens_cpu"], cfg)


def make_inputs(s: Shape, regime: str, device, grad: bool = False, seed: int = 0) -> dict:
    """FLA-layout inputs of one row (registry.kda_inputs, state [N, HV, V, K]) in a gate regime."""
    torch.manual_seed(seed)
    x = kda_inputs(s, device, False, state_v_first=True)
    x["A_log"], x["dt_bias"] = gate_params(regime, s.HV, s.K, device, seed)
    if grad:
        for n in ("q", "k", "v", "g", "beta"):
            x[n].requires_grad_(True)
    return x


# ---------------------------------------------------------------------------------------------
# layouts (pure: CPU-tested)
def to_thd(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, ...] -> [B*T, H, ...]: a view for contiguous inputs (no copy), differentiable."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def from_thd(x: torch.Tensor, B: int, T: int) -> torch.Tensor:
    return x.reshape(B, T, *x.shape[1:])


def dense_cu_seqlens(B: int, T: int, device, dtype=torch.int32) -> torch.Tensor:
    """A dense batch of B sequences of length T as packed-token boundaries [0, T, 2T, ..., B*T]."""
    return torch.arange(0, (B + 1) * T, T, dtype=dtype, device=device)


def state_kv_to_vk(state: torch.Tensor) -> torch.Tensor:
    """[N, H, K, V] -> [N, H, V, K] (contiguous copy); its own inverse."""
    return state.transpose(-1, -2).contiguous()


# ---------------------------------------------------------------------------------------------
# implementations: prepare() converts once, returns the timed closure and an output converter
class PeerUnavailable(Exception):
    """The peer cannot run here (not installed, or fails to load / run): status "unavailable"."""


class PeerDeclined(Exception):
    """The peer (or one of its plans) refuses these inputs: status "declined"."""


@dataclass
class _Prepared:
    call: object  # () -> raw outputs
    to_fla: object  # raw outputs -> (o [B, T, HV, V], ht [N, HV, V, K])
    grad_leaves: tuple = ()


def _fla_fns():
    from parity.runner import cula_functions, fla_functions

    return fla_functions()["chunk_kda"], cula_functions()["chunk_kda"]


def _chunk_kda_call(fn, x):
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], output_final_state=True,
              cu_seqlens=x["cu_seqlens"], cu_seqlens_cpu=x["cu_seqlens_cpu"], A_log=x["A_log"], dt_bias=x["dt_bias"],
              use_beta_sigmoid_in_kernel=True, state_v_first=True, **KDA_PREFILL_FLAGS)


def peer_version(dist: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:  # noqa: BLE001
        return None


def _import(name: str):
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - recorded
        raise PeerUnavailable(f"import {name} failed: {type(e).__name__}: {_first_line(e)}") from e


def _first_line(e: BaseException, n: int = 300) -> str:
    s = str(e).strip().splitlines()
    return s[0][:n] if s else ""


def prepare(impl: str, s: Shape, x: dict) -> _Prepared:
    """The closure timing `impl` on inputs `x` (FLA layout) and how to read its outputs back.
    Raises PeerUnavailable / PeerDeclined / ValueError for an impl that cannot take these inputs."""
    B, T = (1, s.tokens) if s.varlen else (s.B, s.T)
    leaves = tuple(x[n] for n in ("q", "k", "v", "g", "beta") if x[n].requires_grad)
    if impl in ("fla", "fla_cula"):
        fla, cula = _fla_fns()
        fn = fla if impl == "fla" else cula
        return _Prepared(lambda: _chunk_kda_call(fn, x), lambda out: (out[0], out[1]), grad_leaves=leaves)
    if impl.startswith("cudnn:"):
        plan = impl.split(":", 1)[1]
        _import("cudnn")
        la = _import("cudnn.linear_attention")
        try:
            kda_op = la.kimi_delta_attention
        except Exception as e:  # noqa: BLE001
            raise PeerUnavailable(f"cudnn.linear_attention.kimi_delta_attention: {type(e).__name__}: "
                                  f"{_first_line(e)}") from e
        HV, K = s.HV, s.K
        cu = (x["cu_seqlens"].to(torch.int32) if s.varlen
              else dense_cu_seqlens(s.B, s.T, x["q"].device))
        q, k, v, g, beta = (to_thd(x[n]) for n in ("q", "k", "v", "g", "beta"))
        h0 = x["initial_state"]  # [N, HV, V, K] already (HO = HV: FLA's value heads carry g, beta, o)
        a_log, dt_bias = x["A_log"].float(), x["dt_bias"].float().view(HV, K)

        def call():
            return kda_op(q, k, v, g, beta, cu, initial_state=h0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                          gate_lower_bound=LOWER_BOUND, a_log=a_log, dt_bias=dt_bias, plan_name=plan)

        return _Prepared(call, lambda out: (from_thd(out[0], B, T), out[1]), grad_leaves=leaves)
    if impl == "flash_kda":
        if s.HV != s.H:
            raise PeerDeclined(f"FlashKDA has no GVA (HV={s.HV} != H={s.H}): H == HV only")
        if leaves:
            raise PeerDeclined("FlashKDA is forward only (no backward)")
        fk = _import("flash_kda")
        HV, K, V = s.HV, s.K, s.V
        out = torch.empty_like(x["v"])
        fs = torch.empty(s.n_seqs, HV, V, K, dtype=torch.float32, device=x["q"].device)
        cu = x["cu_seqlens"].to(torch.int64) if s.varlen else None
        a_log, dt_bias = x["A_log"].float(), x["dt_bias"].float().view(HV, K)
        scale = K ** -0.5

        def call():
            fk.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, out, a_log, dt_bias, LOWER_BOUND,
                   initial_state=x["initial_state"], final_state=fs, cu_seqlens=cu)
            return out, fs

        return _Prepared(call, lambda o: (o[0], o[1]))
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


class _CudnnCacheGuard:
    """Evicts the cuDNN graphs a failed call added. A pinned plan that the graph does not offer
    leaves cuDNN's cached graph *unpinned* (ops/kda.py caches the graph before select_plan raises),
    so a second call of the same shape would silently run the default plan under this plan's name.
    Also asks cuDNN's own engine checks why the pinned engine declined (best effort)."""

    def __init__(self, plan: str):
        self.plan = plan
        self.caches: list = []
        self.before: list = []
        self.detail = ""

    def __enter__(self):
        with contextlib.suppress(Exception):
            from cudnn.linear_attention.ops import kda as ck
            self.caches = [c for c in (getattr(ck, "fprop_cache", None), getattr(ck, "bprop_cache", None))
                           if c is not None]
            self.before = [set(c) for c in self.caches]
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None:
            self.detail = _cudnn_decline_detail(self.caches, self.before, self.plan)
            for c, b in zip(self.caches, self.before, strict=True):
                for key in set(c) - b:
                    c.pop(key, None)
        return False


def _is_decline(e: BaseException) -> bool:
    name = type(e).__name__
    return "NotSupported" in name or isinstance(e, NotImplementedError) or "no kda" in str(e)


def _cudnn_decline_detail(caches, before, plan: str) -> str:
    """Why the pinned engine declined, asked from cuDNN's own engine checks (best effort)."""
    try:
        from cudnn.engines.heuristics import decline_reasons
        for c, b in zip(caches, before, strict=True):
            for key in set(c) - b:
                graph = c[key][0]
                declined, _ = decline_reasons(graph._candidate_engines(), graph)
                if plan in declined:
                    return declined[plan][:400]
    except Exception:  # noqa: BLE001 - detail is optional
        return ""
    return ""


# ---------------------------------------------------------------------------------------------
# fp64 reference on a subset of value heads
def ref_heads(s: Shape, limit: int = REF_HEADS) -> int:
    """How many leading value heads the reference covers: a multiple of the GVA group."""
    G = s.HV // s.H
    n = min(s.HV, max(limit, G))
    return n - n % G


def reference(s: Shape, x: dict, limit: int = REF_HEADS) -> tuple[torch.Tensor, torch.Tensor, str]:
    """fp64 (o, ht) of the first value heads, full length, on x's device, and a description."""
    from fla_cula.reference import kda_recurrent

    nh = ref_heads(s, limit)
    G = s.HV // s.H
    HVs, K = s.HV, s.K
    with torch.no_grad():
        o, ht = kda_recurrent(
            x["q"][:, :, : nh // G].detach(), x["k"][:, :, : nh // G].detach(), x["v"][:, :, :nh].detach(),
            x["g"][:, :, :nh].detach(), x["beta"][:, :, :nh].detach(), initial_state=x["initial_state"][:, :nh],
            output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            A_log=x["A_log"][:nh], dt_bias=x["dt_bias"].view(HVs, K)[:nh].reshape(-1), lower_bound=LOWER_BOUND,
            use_beta_sigmoid_in_kernel=True, state_v_first=True, cu_seqlens=x["cu_seqlens"])
    desc = f"fp64 recurrence on value heads 0-{nh - 1} of {s.HV}, full length"
    return o, ht, desc


def rel_errors(o: torch.Tensor, ht: torch.Tensor, ref: tuple) -> tuple[float | None, float | None]:
    from parity.rules import rel_rms

    ro, rh = ref[0], ref[1]
    nh = ro.shape[2]
    eo = rel_rms(ro, o[:, :, :nh]) if o is not None else None
    eh = rel_rms(rh, ht[:, :nh]) if ht is not None and ht.numel() else None
    return eo, eh


# ---------------------------------------------------------------------------------------------
# one row
def unavailable_record(impl: str, reason: str) -> dict:
    return {"impl": impl, "status": "unavailable", "error": f"peer unavailable: {reason}", "ms": None}


def run_impl(impl: str, s: Shape, x: dict, mode: str, ref, eager_budget_s: float = 0.3) -> dict:
    """Time one impl in one mode; never raises (the failure is the record)."""
    from benchmarks.harness import time_call

    rec: dict = {"impl": impl, "mode": mode, "ms": None, "peak_bytes": None, "status": "ok", "error": None,
                 "err_o": None, "err_ht": None, "route": "peer" if impl not in ("fla", "fla_cula") else impl}
    t0 = time.perf_counter()
    grad = mode == "fwdbwd"
    ctx = torch.enable_grad() if grad else torch.inference_mode()
    guard = _CudnnCacheGuard(impl.split(":", 1)[1]) if impl.startswith("cudnn:") else contextlib.nullcontext()
    try:
        with ctx, guard:
            p = prepare(impl, s, x)
            if grad:
                step = _backward_step(p, x)
                step()  # warm-up; cuDNN builds (or declines) its backward graph on the first backward
                res = time_call(step, "fwdbwd", grad_to_none=list(p.grad_leaves), warm=False)
            else:
                out = p.call()  # warm-up (compile / autotune) and the outputs the errors are read from
                if ref is not None:
                    o, ht = p.to_fla(out)
                    rec["err_o"], rec["err_ht"] = rel_errors(o, ht, ref)
                    del o, ht
                del out
                res = time_call(p.call, mode, warm=False, eager_budget_s=eager_budget_s)
            if impl == "fla_cula":
                from fla_cula import routing
                r = routing.last_route()
                rec["route"] = r[1] if r else "no route recorded"
            rec.update(ms=res["ms"], peak_bytes=res["peak_bytes"], error=res["error"])
            if res["error"]:
                rec["status"] = "failed"
    except PeerUnavailable as e:
        rec.update(status="unavailable", error=f"peer unavailable: {e}")
    except PeerDeclined as e:
        rec.update(status="declined", error=f"declined: {e}")
    except Exception as e:  # noqa: BLE001 - recorded per row
        msg = f"{type(e).__name__}: {_first_line(e)}"
        detail = getattr(guard, "detail", "")
        if detail:
            msg += f" [{detail}]"
        if impl in ("fla", "fla_cula"):
            rec.update(status="failed", error=msg)
        elif _is_decline(e):
            rec.update(status="declined", error=f"declined{' (backward)' if grad else ''}: {msg}")
        else:  # a peer's own failure (e.g. FlashKDA's device check under torch 2.11: anchors.md)
            rec.update(status="unavailable", error=f"peer unavailable: {msg}")
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
    rec["wall_s"] = round(time.perf_counter() - t0, 2)
    return rec


def _backward_step(p: _Prepared, x: dict):
    out = p.call()
    o, ht = p.to_fla(out)
    do = torch.randn_like(o)
    dht = torch.randn_like(ht) if ht is not None and ht.numel() else None
    del out, o, ht

    def step():
        o_, ht_ = p.to_fla(p.call())
        ts, gs = [o_], [do]
        if dht is not None and ht_ is not None and ht_.requires_grad:
            ts.append(ht_)
            gs.append(dht)
        torch.autograd.backward(ts, gs)

    return step


def shape_record(s: Shape, regime: str, mode: str, bench: str, x: dict) -> dict:
    return {"op": "chunk_kda", "bench": bench, "regime": regime, "mode": mode, "B": s.B, "T": s.T, "H": s.H,
            "HV": s.HV, "K": s.K, "V": s.V, "varlen": s.varlen_desc or None, "shape": s.desc,
            "bytes": io_bytes(s, x, mode), "flops": chunk_kda_flops(s, mode)}


@dataclass
class Row:
    shape: Shape
    regime: str
    train: bool

    @property
    def bench(self) -> str:
        return BENCH_TRAIN if self.train else BENCH_PREFILL

    @property
    def modes(self) -> tuple[str, ...]:
        return ("fwdbwd",) if self.train else ("eager", "graph")

    @property
    def desc(self) -> str:
        return f"{self.bench} | {self.shape.desc} | {self.regime}"


def plan_rows(quick: bool = False, rows: list[str] | None = None, regimes: tuple[str, ...] = REGIMES,
              train: bool = True) -> list[Row]:
    """The grid; `rows` keeps rows whose description contains any of the substrings."""
    shapes = QUICK_PREFILL if quick else PREFILL_SHAPES
    out = [Row(s, r, False) for s in shapes for r in regimes]
    if train and not quick:
        out += [Row(s, "random", True) for s in TRAIN_SHAPES]
    if rows:
        out = [r for r in out if any(w in r.desc for w in rows)]
    return out


def run_row(row: Row, device, impls: tuple[str, ...] = IMPLS, ref_limit: int = REF_HEADS,
            eager_budget_s: float = 0.3, log=print) -> list[dict]:
    """All impls and modes of one row: same inputs, fp64 reference once, eager in ABBA order."""
    s = row.shape
    x = make_inputs(s, row.regime, device, grad=row.train)
    ref, ref_desc = None, None
    if not row.train:
        t0 = time.perf_counter()
        ro, rh, ref_desc = reference(s, x, ref_limit)
        ref = (ro, rh)
        log(f"    reference ({ref_desc}): {time.perf_counter() - t0:.1f} s")
    out: list[dict] = []
    for mode in row.modes:
        passes = [list(impls), list(impls)[::-1]] if mode == "eager" else [list(impls)]
        best: dict[str, dict] = {}
        for p_impls in passes:
            for impl in p_impls:
                old = best.get(impl)
                if old is not None and old["status"] != "ok":
                    continue  # a decline or failure is not retried in the second pass
                r = run_impl(impl, s, x, mode, ref, eager_budget_s)
                if old is None or (r["ms"] is not None and (old["ms"] is None or r["ms"] < old["ms"])):
                    best[impl] = r
        for impl in impls:
            rec = shape_record(s, row.regime, mode, row.bench, x)
            rec.update(best[impl])
            rec["ref"] = ref_desc
            out.append(rec)
            ms = "-" if rec["ms"] is None else f"{rec['ms']:.4f} ms"
            err = "" if rec["err_o"] is None else f"  o {rec['err_o']:.2e} ht {_e(rec['err_ht'])}"
            log(f"  {s.desc:<44} {row.regime:<6} {mode:<6} {impl:<22} {ms:>12}  [{rec['route']}]{err}"
                + (f"  {rec['error'][:140]}" if rec["error"] else "") + f"  ({rec['wall_s']} s)")
    del x, ref
    torch.cuda.empty_cache()
    return out


def _e(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def roofline_fill(rec: dict, ceilings: dict) -> None:
    from benchmarks.registry import roofline_ms

    rec["roofline_ms"] = roofline_ms(rec["bytes"], rec["flops"], ceilings["copy_bw"], ceilings["matmul_rate"])
    rec["copy_bw"], rec["matmul_rate"] = ceilings["copy_bw"], ceilings["matmul_rate"]


def versions() -> dict[str, str]:
    v = {"nvidia-cudnn-frontend": peer_version("nvidia-cudnn-frontend") or "not installed",
         "tokenspeed-flashkda": peer_version("tokenspeed-flashkda") or "not installed"}
    src = peer_version("flash_kda")  # scripts/build_flashkda.sh: a source build installed over the wheel's package
    if src:
        v["flash_kda"] = f"{src} (source build; it is what `import flash_kda` runs)"
    return v


def expected_seconds(rows: list[Row]) -> float:
    """A rough wall-time estimate (for --list): reference + timing per row, H200."""
    t = 0.0
    for r in rows:
        steps = max(r.shape.varlen) if r.shape.varlen else r.shape.T
        ref = 0.0 if r.train else 40e-6 * (sum(r.shape.varlen) if r.shape.varlen else steps)
        t += ref + (6.0 if r.train else 9.0) + math.log2(max(r.shape.tokens, 2)) * 0.2
    return t


# ---------------------------------------------------------------------------------------------
# command line: python -m benchmarks prefill [--peers] ...
def output_paths(out: str | None, tag: str) -> tuple[str, str]:
    """(markdown, JSON) as python -m benchmarks names them: --out DIR or the repo's defaults."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if out:
        return os.path.join(out, f"BENCHMARK_{tag}.md"), os.path.join(out, f"benchmark_{tag}.json")
    return os.path.join(root, f"BENCHMARK_{tag}.md"), os.path.join(root, "benchmarks", "results", f"{tag}.json")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", action="store_true", help="time the peers too (default: fla and fla_cula only)")
    p.add_argument("--quick", action="store_true", help=f"{len(QUICK_PREFILL)} shapes, no training rows")
    p.add_argument("--rows", nargs="+", help="rows whose 'bench | shape | regime' contains any of these")
    p.add_argument("--regimes", nargs="+", choices=REGIMES, default=list(REGIMES))
    p.add_argument("--impls", nargs="+", choices=IMPLS, help="subset of implementations")
    p.add_argument("--no-train", action="store_true", help="skip the forward+backward rows")
    p.add_argument("--ref-heads", type=int, default=REF_HEADS, help="value heads checked against fp64")
    p.add_argument("--eager-budget", type=float, default=0.3, help="seconds per eager measurement")
    p.add_argument("--out", help="directory for BENCHMARK_<tag>.md and benchmark_<tag>.json (merged into)")
    p.add_argument("--tag", default=None, help="report suffix (default: the GPU's, e.g. H200)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds: start no new row after this (the rows left are named in the report header)")
    p.add_argument("--list", action="store_true", help="print the rows and exit")
    a = p.parse_args(argv)
    impls = tuple(a.impls) if a.impls else (IMPLS if a.peers else ("fla", "fla_cula"))
    rows = plan_rows(a.quick, a.rows, tuple(a.regimes), not a.no_train)
    if a.list:
        for r in rows:
            print(f"{r.desc:<70} {','.join(r.modes)}")
        print(f"{len(rows)} rows x {len(impls)} impls ({', '.join(impls)}); ~{expected_seconds(rows):.0f} s on an H200")
        return 0
    if not torch.cuda.is_available():
        print("benchmarks prefill: no CUDA device; nothing to time (use --list to see the grid).", file=sys.stderr)
        return 2
    from benchmarks import report
    from benchmarks.harness import measure_ceilings

    device = torch.device("cuda", torch.cuda.current_device())
    header = run_header("python -m benchmarks prefill", argv)
    header.update(versions())
    a.tag = report.resolve_tag(a.tag)
    md, js = output_paths(a.out, a.tag)
    t_start = time.perf_counter()
    print(f"benchmarks prefill: {len(rows)} rows x {len(impls)} impls on {header['gpu']}; "
          f"peers {versions()}; {header['FLA_FLASH_KDA']}", flush=True)
    ceilings = measure_ceilings()
    meta = {BENCH_PREFILL: {"op": "chunk_kda", "flags": FLAGS}, BENCH_TRAIN: {"op": "chunk_kda", "flags": FLAGS}}
    done: list[dict] = []
    for i, row in enumerate(rows):
        if a.budget is not None and time.perf_counter() - t_start > a.budget:
            left = [r.desc for r in rows[i:]]
            header["INCOMPLETE"] = f"time budget {a.budget:.0f} s reached; not run: " + "; ".join(left)
            report.write_merged([], header, ceilings, meta, md, js, f"fla_cula vs FLA 0.6.0 benchmarks ({a.tag})")
            print(f"benchmarks prefill: budget reached, {len(left)} rows not run: {left}", flush=True)
            break
        print(f"  [{i + 1}/{len(rows)}] {row.desc}  ({time.perf_counter() - t_start:.0f} s)", flush=True)
        recs = run_row(row, device, impls, a.ref_heads, a.eager_budget, log=lambda m: print(m, flush=True))
        for r in recs:
            roofline_fill(r, ceilings)
            r.update(commit=header["fla_cula commit"], gpu=header["gpu"], peers=versions())
        done += recs
        header["wall time"] = f"{time.perf_counter() - t_start:.0f} s ({i + 1} of {len(rows)} rows)"
        report.write_merged(recs, header, ceilings, meta, md, js, f"fla_cula vs FLA 0.6.0 benchmarks ({a.tag})")
    print(f"benchmarks prefill: wrote {md} and {js} ({time.perf_counter() - t_start:.0f} s)", flush=True)
    print("\n".join(report.peer_tables(done)), flush=True)
    return 0
