"""Host wrapper: FLA's `fused_recurrent_kda_fwd` on the CuTe DSL recurrent decode kernel.

`check(...)` re-validates everything the kernel relies on (FLA's dispatcher hands raw arguments
before its own checks) and returns a short reason when the call must stay on FLA; `run(...)`
allocates only outputs FLA would allocate and launches on the current stream. No host sync:
values (cu_seqlens, pool indices, num_accepted_tokens) are clamped / bounds-checked in the kernel.

Deviation from FLA, on purpose: a negative (or out-of-range) pool index marks a padding slot; the
kernel skips that sequence entirely (no state read or write) and writes zeros to its output rows.
"""

import math

import torch

from fla_cula.kernels import recurrent_decode_mma as mma
from fla_cula.kernels._host import FLOAT, I31, INT, KV, aligned, launch, qk_reason, seqs_reason, state_reason
from fla_cula.kernels.recurrent_decode import DecodeConfig, choose_bv, get_kernel


def check(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state,
          inplace_final_state, state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens,
          use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
          allow_neg_eigval, lower_bound, out) -> str | None:
    r = qk_reason((("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)))
    if r:
        return r
    B, T, H, K = q.shape
    if v.ndim != 4 or v.shape[0] != B or v.shape[1] != T:
        return f"v shape {tuple(v.shape)}: expected [{B}, {T}, HV, V]"
    HV, V = v.shape[2], v.shape[3]
    if V != KV:
        return f"value dim {V}: kernel supports 128"
    if H == 0 or HV % H:
        return f"HV={HV} not a multiple of H={H}"
    if g.ndim != 4 or tuple(g.shape) != (B, T, HV, K):
        return f"g shape {tuple(g.shape)}: expected [{B}, {T}, {HV}, {K}]"
    if beta.ndim == 4:
        return "headwise beta [B,T,HV,V]: kernel supports scalar beta"
    if tuple(beta.shape) != (B, T, HV):
        return f"beta shape {tuple(beta.shape)}: expected [{B}, {T}, {HV}]"
    dev = q.device
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.device != dev:
            return f"{name} on {x.device}, q on {dev}"
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not x.is_contiguous():
            return f"{name} not contiguous"
        if x.numel() >= I31:
            return f"{name} has >= 2^31 elements"
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if not aligned(x):
            return f"{name} not 16-byte aligned"
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        return f"scale {scale!r}: expected a finite float"
    # ---- gate parameters ----
    if use_gate_in_kernel:
        if A_log is not None:
            if not isinstance(A_log, torch.Tensor) or A_log.dtype not in FLOAT:
                return "A_log: expected a bf16/fp16/fp32 tensor"
            if A_log.numel() != HV or not A_log.is_contiguous() or A_log.device != dev:
                return f"A_log shape {tuple(A_log.shape)}: expected {HV} contiguous elements"
        if dt_bias is not None:
            if not isinstance(dt_bias, torch.Tensor) or dt_bias.dtype not in FLOAT:
                return "dt_bias: expected a bf16/fp16/fp32 tensor"
            if dt_bias.numel() != HV * K or not dt_bias.is_contiguous() or dt_bias.device != dev:
                return f"dt_bias shape {tuple(dt_bias.shape)}: expected {HV * K} contiguous elements"
            if not aligned(dt_bias):
                return "dt_bias not 16-byte aligned"
        if lower_bound is not None:
            if not isinstance(lower_bound, (int, float)) or not math.isfinite(lower_bound) \
                    or lower_bound >= 0:
                return f"lower_bound {lower_bound!r}: kernel supports a finite negative float"
        elif A_log is None:
            return "use_gate_in_kernel without A_log and lower_bound: FLA needs A_log"
    # ---- sequences ----
    r, N = seqs_reason(cu_seqlens, B, dev)
    if r:
        return r
    # ---- state ----
    if inplace_final_state and initial_state is None:
        return "inplace_final_state=True without initial_state (FLA asserts)"
    pool = ssm_state_indices is not None
    if initial_state is not None:
        r = state_reason(initial_state, N, HV, K, V, state_v_first, q, "initial_state")
        if r:
            return r
        if not pool and (initial_state.shape[0] != N or
                         (N > 1 and initial_state.stride(0) != HV * K * V)):
            return (f"initial_state batch {initial_state.shape[0]} (stride {initial_state.stride(0)})"
                    f": expected {N} contiguous states")
    if pool:
        if not inplace_final_state:
            return "ssm_state_indices without inplace_final_state: FLA writes per-token states by position"
        x = ssm_state_indices
        if not isinstance(x, torch.Tensor) or x.dtype not in INT or x.device != dev:
            return "ssm_state_indices: expected an int32/int64 tensor on the inputs' device"
        if x.ndim == 1:
            if x.shape[0] != N or not x.is_contiguous():
                return f"1-D ssm_state_indices shape {tuple(x.shape)}: expected contiguous [{N}]"
            if (T > 1 if cu_seqlens is None else T > N):
                return ("1-D ssm_state_indices with T>1 per sequence: "
                        "FLA's per-token slot semantics kept on FLA")
        elif x.ndim == 2:
            if x.shape[0] != N or x.stride(1) != 1:
                return f"2-D ssm_state_indices shape {tuple(x.shape)}: expected [{N}, Tmax], unit stride"
            if cu_seqlens is None and T > x.shape[1]:
                return f"T={T} > ssm_state_indices width {x.shape[1]}"
        else:
            return f"ssm_state_indices with {x.ndim} dims: expected [N] or [N, Tmax]"
        na = num_accepted_tokens
        if na is not None:
            if not isinstance(na, torch.Tensor) or na.dtype not in INT or na.device != dev:
                return "num_accepted_tokens: expected an int32/int64 tensor on the inputs' device"
            if na.ndim != 1 or na.shape[0] != N or not na.is_contiguous():
                return f"num_accepted_tokens shape {tuple(na.shape)}: expected contiguous [{N}]"
    # ---- out ----
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype not in FLOAT:
            return "out: expected a bf16/fp16/fp32 tensor"
        if out.shape != v.shape or not out.is_contiguous() or out.device != dev or not aligned(out):
            return f"out shape {tuple(out.shape)}: expected contiguous aligned {tuple(v.shape)}"
    return None


def plan(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state,
         inplace_final_state, state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens,
         use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
         allow_neg_eigval, lower_bound, out):
    """check(), then everything a call derives from its arguments' metadata: the compiled kernel and
    which optional inputs it takes, the outputs to allocate. (reason, None), or (None, go) where
    go(args) runs any call whose arguments have the same signature (routing.signature)."""
    r = check(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state,
              inplace_final_state, state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens,
              use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
              allow_neg_eigval, lower_bound, out)
    if r:
        return r, None
    pool = ssm_state_indices is not None
    gate = bool(use_gate_in_kernel)
    has_A = gate and A_log is not None
    has_bias = gate and dt_bias is not None
    has_lb = gate and lower_bound is not None
    new_final = not inplace_final_state and bool(output_final_state)
    has_ht = not pool and (new_final or bool(inplace_final_state))
    sig = bool(use_beta_sigmoid_in_kernel)
    na = num_accepted_tokens if pool else None
    o_dtype = (v if out is None else out).dtype
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    T = q.shape[1]
    multi = (T > N) if cu_seqlens is not None else (T > 1 and not (pool and ssm_state_indices.ndim == 1))
    cfg = DecodeConfig(
        mode="kda", state_v_first=bool(state_v_first), qk_dtype=FLOAT[q.dtype], v_dtype=FLOAT[v.dtype],
        g_dtype=FLOAT[g.dtype], beta_dtype=FLOAT[beta.dtype], o_dtype=FLOAT[o_dtype],
        has_h0=initial_state is not None, has_ht=has_ht, varlen=cu_seqlens is not None,
        cu_dtype=INT[cu_seqlens.dtype] if cu_seqlens is not None else "int32",
        pool=ssm_state_indices.ndim if pool else 0, idx_dtype=INT[ssm_state_indices.dtype] if pool else "int32",
        spec=na is not None, na_dtype=INT[na.dtype] if na is not None else "int32",
        l2norm=bool(use_qk_l2norm_in_kernel), gate_in_kernel=gate, has_A=has_A,
        a_dtype=FLOAT[A_log.dtype] if has_A else "float32", has_bias=has_bias,
        bias_dtype=FLOAT[dt_bias.dtype] if has_bias else "float32",
        has_lower_bound=has_lb, beta_sigmoid=sig, neg_eigval=sig and bool(allow_neg_eigval),
        bv=choose_bv(bool(state_v_first), multi, N * v.shape[2]))
    # multi-token steps without a pool: the chunked tensor-core kernel; the rest: the token-by-token one
    fn = mma.get_kernel(mma.MmaDecodeConfig.from_decode(cfg)) if mma.serves(cfg, multi) else get_kernel(cfg)
    dev = q.device
    final_shape = (N, v.shape[2], KV, KV)
    scale, lb = float(scale), float(lower_bound) if has_lb else 0.0
    flat_A = has_A and A_log.ndim != 1
    flat_bias = has_bias and dt_bias.ndim != 1

    def go(args):
        """args: fused_recurrent_kda_fwd's 21 arguments in order (see check)."""
        q, k, v, g, beta, A_log, dt_bias, h0 = args[:8]
        out = args[20]
        if out is None:
            out = torch.empty_like(v)
        final = h0 if inplace_final_state else (
            torch.empty(final_shape, dtype=torch.float32, device=dev) if new_final else None)
        if has_A:
            A_log = A_log.view(-1) if flat_A else A_log
        if has_bias:
            dt_bias = dt_bias.view(-1) if flat_bias else dt_bias
        launch(fn, dev, q, k, v, g, beta, A_log if has_A else None, dt_bias if has_bias else None,
               h0, final if has_ht else None, out, args[12], args[13], args[14] if pool else None, scale, lb)
        return out, final

    return None, go


def run(*args):
    """FLA's fused_recurrent_kda_fwd semantics (the arguments of check); returns (out, final_state).
    The op layer memoizes plan() per signature; this unmemoized form serves tests and tools."""
    r, go = plan(*args)
    if r:
        raise ValueError(f"kda_decode: {r}")
    return go(args)
