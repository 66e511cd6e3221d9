"""Fused KDA prefill forward for SM90 (issue 18): host plan of the CUDA C++ kernel ``fla_cula._C.kda_fwd``.

Design: docs/kda_sm90.md; v1 as built: its "v1 as built" section and csrc/kda_sm90/. One launch per
call: one CTA per (sequence, value head, V block of 64 or 128 columns: block_v_for), chunks of 64 tokens,
the state on chip across chunks; l2norm, beta sigmoid and the bounded gate fused.

Scope of v1 (everything else returns a reason and runs FLA):
  - q, k, v, g bfloat16, K = V = 128, HV % H == 0 (GVA); beta bf16 or fp32 [B,T,HV];
  - use_gate_in_kernel with lower_bound in [-5, 0): a = lb * sigmoid(exp(A_log) * (g + dt_bias))
    (A_log / dt_bias fp32 or bf16, or None); safe_gate either way;
  - use_qk_l2norm_in_kernel and use_beta_sigmoid_in_kernel (allow_neg_eigval) on or off;
  - initial_state fp32 in either layout or None; output_final_state; fixed length and varlen;
  - inference and grad. Under grad FLA's backward (fla_cula.ops.chunk_autograd) reads q^, k^, rstd and
    the sigmoid beta, made here with FLA's own l2norm_fwd / fused_beta_sigmoid_fwd (the kernel then
    runs on q^, k^ and that beta, so its Aqk/Akk see FLA's rounding of q^, k^), and Aqk / Akk, which
    the kernel writes (FLA's [B,T,HV,64] layout, Akk zero above the diagonal).
Per call (through ``fwd.size_reason``): chunk_size=32 and disable_recompute under grad (the kernel's scope),
then the op's routing policy (``_route_reason``: grad, small grids -> FLA; run() ignores it).

``plan`` is memoized per size-free signature (fla_cula.routing): it reads dtypes, head counts and
dims, devices, contiguity and alignment, never B, T, N or the varlen layout.
"""

import functools

import torch
from fla.modules.norm.l2norm import l2norm_fwd
from fla.ops.common.gate import fused_beta_sigmoid_fwd
from fla.ops.utils import prepare_chunk_indices

from fla_cula import _ext, routing
from fla_cula.ops.chunk_autograd import KDAChunkConfig, KDAForward, needs_grad

_ok, _why = _ext.available()
if not _ok:
    raise ImportError(_why)
_C = _ext.require()
if not hasattr(_C, "kda_fwd"):
    raise ImportError("fla_cula._C has no kda_fwd (stale build); rebuild it")

HEAD_DIM = 128
CHUNK = 64
GATE_REASON = "v1: bounded (lower_bound) in-kernel gate only"
_BF16 = torch.bfloat16
_PARAM_DTYPES = (torch.float32, torch.bfloat16)


# block_v None: block_v_for(); 64 or 128: forced (tests, benchmarks). wgmma: the state-side products (phases
# 6-8) on warpgroup MMA (docs/kda_sm90.md "v2.1": 20% faster per chunk than mma.sync at block_v 128);
# False: the same phases on mma.sync, kept for comparison.
_TUNING = {"block_v": None, "wgmma": True}


def set_tuning(block_v: int | None = None, wgmma: bool = True) -> None:
    """Force the V columns per CTA (64 or 128) for every call (None: chosen per call) and pick the instruction of the
    state-side products (wgmma or mma.sync); no argument: the defaults."""
    if block_v not in (None, 64, 128):
        raise ValueError(f"block_v={block_v!r}: expected None, 64 or 128")
    if not isinstance(wgmma, bool):
        raise TypeError(f"wgmma: expected a bool, got {type(wgmma).__name__}")
    _TUNING.update(block_v=block_v, wgmma=wgmma)


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def block_v_for(N: int, HV: int, sms: int) -> int:
    """V columns per CTA for N sequences x HV value heads (one CTA per SM: 202-229 KB of shared memory).
    64 while the 2 * N * HV half-state CTAs fit one wave: each recomputes its pair's K-side prep, but a wave
    of them is as long as one CTA's chunks at the smaller state cost; 128 beyond: the prep (most of a chunk's
    time) is done once per pair, N * HV CTAs."""
    return 64 if 2 * N * HV <= sms else 128


def _block_v(N: int, HV: int, device: torch.device) -> int:
    bv = _TUNING["block_v"]
    return bv if bv is not None else block_v_for(N, HV, _sm_count(device))


def _aligned(x: torch.Tensor, n: int = 16) -> bool:
    """16-byte aligned data (vector loads), or a non-contiguous tensor, which go() copies (fresh storage)."""
    return not x.is_contiguous() or x.data_ptr() % n == 0


def plan(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, cfg: KDAChunkConfig):
    """(reason, None) or (None, fwd) for routing.route; fwd(..., cfg, need_grad) -> KDAForward."""
    if cfg.cp:
        return "cp_context: context-parallel KDA stays on FLA", None
    if cfg.use_graph:
        return "use_graph: FLA's fixed-shape varlen path stays on FLA", None
    if not cfg.use_gate_in_kernel or cfg.lower_bound is None:
        return GATE_REASON, None
    if not -5.0 <= cfg.lower_bound < 0.0:
        return f"lower_bound {cfg.lower_bound}: kernel needs -5 <= lower_bound < 0 (overflow-free gate anchors)", None
    if cfg.return_intermediate_states:
        return "v1: return_intermediate_states (chunk-start states are not written)", None
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if x.dtype != _BF16:
            return f"{name} dtype {x.dtype}: kernel supports bfloat16 q/k/v/g", None
    if q.dim() != 4 or v.dim() != 4:
        return f"q/v of rank {q.dim()}/{v.dim()}: expected [B, T, heads, dim]", None
    K, V, H, HV = q.shape[-1], v.shape[-1], q.shape[2], v.shape[2]
    if K != HEAD_DIM or V != HEAD_DIM:
        return f"head dims K={K} V={V}: kernel supports 128", None
    if HV % H != 0:
        return f"HV={HV} not a multiple of H={H}", None
    if beta.dtype not in _PARAM_DTYPES or beta.dim() != 3:
        return f"beta {beta.dtype} of rank {beta.dim()}: kernel supports bfloat16/float32 [B, T, HV]", None
    if A_log is not None and (A_log.dtype not in _PARAM_DTYPES or A_log.numel() != HV):
        return f"A_log {A_log.dtype} with {A_log.numel()} elements: kernel needs float32/bfloat16 with HV", None
    if dt_bias is not None and (dt_bias.dtype not in _PARAM_DTYPES or dt_bias.numel() != HV * K):
        return f"dt_bias {dt_bias.dtype} with {dt_bias.numel()} elements: kernel needs float32/bfloat16 with HV*K", None
    if initial_state is not None:
        if initial_state.dtype != torch.float32 or tuple(initial_state.shape[1:]) != (HV, HEAD_DIM, HEAD_DIM):
            return f"initial_state {initial_state.dtype} {tuple(initial_state.shape)}: kernel needs float32 " \
                   f"[N, {HV}, 128, 128]", None
    if cu_seqlens is not None and cu_seqlens.dtype not in (torch.int32, torch.int64):
        return f"cu_seqlens dtype {cu_seqlens.dtype}: kernel supports int32/int64", None
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if not _aligned(x):
            return f"{name} is not 16-byte aligned: kernel uses 16-byte loads", None
    return None, _forward


# Routing policy of the op (not the kernel's scope: run() ignores it). Under grad the routed op runs FLA, forward
# and backward. Our forward + FLA's backward passes the gradient bars (tests/gpu/test_kda_prefill.py: test_grad,
# and dA_log over 8 draws, 1.11x FLA's error), but the forward under grad (FLA's l2norm on the host, the Aqk/Akk
# writes) has not been timed against FLA's, and the cost model below is for the inference forward. Without grad
# the kernel serves a call when a cost model predicts it below ROUTE_GAIN x FLA's time. Measured on the H200
# (graph replay, docs/kda_sm90.md "v2.1"): a CTA takes US_PER_CHUNK[block_v] per 64-token chunk
# whatever the grid (1 CTA per SM, latency-bound phases), so the kernel's time is waves x chunks per CTA; FLA's
# chunk-parallel kernels take ~FLA_NS_PER_TOKEN_HEAD per token and value head on large calls. The tests set
# ROUTE_GRAD and turn the model off.
ROUTE_GRAD = False
ROUTE_BY_COST = True
US_PER_CHUNK = {64: 14.0, 128: 15.4}   # B2 T8192 H64, 128 chunks per CTA: block_v 64 3.589 ms / 2 waves; 128: 1.970 ms
FLA_NS_PER_TOKEN_HEAD = 3.21           # FLA 0.6.0, B2 T8192 H64: 3.367 ms / (2 * 8192 * 64)
ROUTE_GAIN = 0.9


def predicted_us(lens: list[int], HV: int, sms: int) -> tuple[float, float]:
    """(kernel, FLA) predicted microseconds for sequences of these lengths x HV value heads (pure). The kernel:
    CTAs of ceil(len / 64) chunks in launch order on `sms` SMs, bounded by full waves of the average work plus
    the longest sequence (equal lengths: exactly waves x chunks)."""
    bv = block_v_for(len(lens), HV, sms)
    per = HEAD_DIM // bv
    chunks = [-(-L // CHUNK) for L in lens]
    ctas = len(lens) * HV * per
    if len(set(chunks)) <= 1:
        kernel = -(-ctas // sms) * (chunks[0] if chunks else 0) * US_PER_CHUNK[bv]
    else:
        kernel = (sum(chunks) * HV * per / sms + max(chunks)) * US_PER_CHUNK[bv]
    return kernel, sum(lens) * HV * FLA_NS_PER_TOKEN_HEAD * 1e-3


def _route_reason(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
                  cfg: KDAChunkConfig) -> str | None:
    """Why the routed op sends this call to FLA although the kernel could run it, or None (always None under
    FLA_CULA_FORCE=1)."""
    if routing.force():
        return None
    if not ROUTE_GRAD and needs_grad(q, k, v, g, beta, A_log, dt_bias, initial_state):
        return "grad -> FLA (the forward under grad is not yet timed against FLA's)"
    if not ROUTE_BY_COST:
        return None
    if cu_seqlens is None:
        lens = [q.shape[1]] * q.shape[0]
    elif cu_seqlens_cpu is not None:
        lens = (cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]).tolist()
    else:
        return "v1: varlen without cu_seqlens_cpu (no host lengths to predict the kernel's time with)"
    sms = _sm_count(q.device) if q.is_cuda else 132
    ours, fla = predicted_us(lens, v.shape[2], sms)
    if ours >= ROUTE_GAIN * fla:
        return (f"predicted {ours / 1e3:.2f} ms vs FLA {fla / 1e3:.2f} ms: v1's serial chunk chain per CTA "
                f"(no sequence split) does not pay on this grid")
    return None


def _size_reason(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
                 cfg: KDAChunkConfig) -> str | None:
    """Per-call checks that depend on grad (the memo key does not hold requires_grad)."""
    if needs_grad(q, k, v, g, beta, A_log, dt_bias, initial_state):
        if cfg.chunk_size != CHUNK:
            return f"v1: chunk_size={cfg.chunk_size} under grad (Aqk/Akk are written for chunk 64)"
        if cfg.disable_recompute:
            return "v1: disable_recompute under grad (w, u, qg, kg, v_new, h are not written)"
    return None


def _forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, cfg: KDAChunkConfig,
             need_grad: bool) -> KDAForward:
    """Run the kernel on the current stream; allocates only outputs (and, under grad, what FLA's backward
    reads). Inputs are made contiguous as FLA's input_guard does (no copy when they already are)."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if A_log is not None:
        A_log = A_log.contiguous()
    if dt_bias is not None:
        dt_bias = dt_bias.contiguous()
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    B, T, H, K = q.shape
    HV = v.shape[2]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dev = q.device
    o = torch.empty(B, T, HV, HEAD_DIM, dtype=q.dtype, device=dev)
    ht = torch.empty(N, HV, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=dev) if cfg.output_final_state else None
    beta_scale = 2.0 if cfg.allow_neg_eigval else 1.0
    bv = _block_v(N, HV, dev)
    if not need_grad:
        _C.kda_fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, o, ht, None, None, cfg.scale,
                   cfg.lower_bound, cfg.use_qk_l2norm_in_kernel, cfg.use_beta_sigmoid_in_kernel, beta_scale,
                   cfg.state_v_first, block_v=bv, wgmma=_TUNING["wgmma"])
        return KDAForward(o, ht)

    # Grad: what FLA's backward reads, made by FLA's own functions; the kernel runs on those tensors.
    q_rstd = k_rstd = None
    if cfg.use_qk_l2norm_in_kernel:
        q, q_rstd = l2norm_fwd(q)
        k, k_rstd = l2norm_fwd(k)
    if cfg.use_beta_sigmoid_in_kernel:
        beta = fused_beta_sigmoid_fwd(beta, beta_scale)
    Aqk = torch.empty(B, T, HV, CHUNK, dtype=k.dtype, device=dev)
    Akk = torch.empty(B, T, HV, CHUNK, dtype=k.dtype, device=dev)
    _C.kda_fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, o, ht, Aqk, Akk, cfg.scale,
               cfg.lower_bound, False, False, 1.0, cfg.state_v_first, block_v=bv, wgmma=_TUNING["wgmma"])
    chunk_indices = None
    if cu_seqlens is not None:
        chunk_indices = prepare_chunk_indices(cu_seqlens=cu_seqlens, chunk_size=CHUNK, cu_seqlens_cpu=cu_seqlens_cpu)
    return KDAForward(o, ht, q=q, q_rstd=q_rstd, k=k, k_rstd=k_rstd, beta=beta, g_cumsum=None, Aqk=Aqk, Akk=Akk,
                      initial_state=initial_state, chunk_indices=chunk_indices, chunk_offsets=None)


def _call_reason(*args) -> str | None:
    return _size_reason(*args) or _route_reason(*args)


_forward.size_reason = _call_reason


def run(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, cfg: KDAChunkConfig,
        need_grad: bool = False) -> KDAForward:
    """plan + forward in one call (tests and tools): ValueError with the reason outside the scope."""
    args = (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, cfg)
    r, fwd = plan(*args)
    r = r or (_size_reason(*args) if need_grad else None)
    if r:
        raise ValueError(f"kda_prefill: {r}")
    return fwd(*args, need_grad)


def phase_profile(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
                  cfg: KDAChunkConfig) -> dict[str, float]:
    """Run the instrumented kernel (clock64 at each phase's CTA barrier, thread 0) once in inference form and
    return the mean cycles per chunk of each phase over the CTAs that had chunks (synchronizes; a
    measuring tool, not a call path), with the block_v the forward would take. Phases:
    ``_C.KDA_FWD_PHASE_NAMES``."""
    args = (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, cfg)
    r, _ = plan(*args)
    if r:
        raise ValueError(f"kda_prefill: {r}")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    B, T = q.shape[:2]
    HV = v.shape[2]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    o = torch.empty(B, T, HV, HEAD_DIM, dtype=q.dtype, device=q.device)
    bv = _block_v(N, HV, q.device)
    cycles = torch.zeros(N * HV * (HEAD_DIM // bv), _C.KDA_FWD_PHASES, dtype=torch.int64, device=q.device)
    _C.kda_fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, o, None, None, None, cfg.scale,
               cfg.lower_bound, cfg.use_qk_l2norm_in_kernel, cfg.use_beta_sigmoid_in_kernel,
               2.0 if cfg.allow_neg_eigval else 1.0, cfg.state_v_first, block_v=bv, phase_cycles=cycles,
               wgmma=_TUNING["wgmma"])
    lens = torch.full((N,), T, dtype=torch.int64) if cu_seqlens is None else (cu_seqlens[1:] - cu_seqlens[:-1]).cpu()
    chunks = ((lens + CHUNK - 1) // CHUNK).repeat_interleave(HV * (HEAD_DIM // bv)).to(torch.float64)
    busy = chunks > 0
    per_chunk = cycles.cpu().to(torch.float64)[busy].sum(0) / chunks[busy].sum().clamp(min=1)
    return dict(zip(_C.KDA_FWD_PHASE_NAMES, per_chunk.tolist(), strict=True))


def cpp_kernels_info() -> list[dict]:
    """This kernel's entry of ``fla_cula._ext.cpp_kernels()`` (CTA size, dynamic smem, registers, spills)."""
    return [k for k in _ext.cpp_kernels() if k["name"] == "kda_prefill"]
