"""Memory bounds of a recurrent KDA call, checked from tensor metadata before any launch.

FLA 0.6.0's ``fused_recurrent_kda_fwd`` launches its Triton kernel on whatever it is given: the
kernel addresses q, k, v, g, beta, out, A_log, dt_bias, cu_seqlens, ssm_state_indices and
num_accepted_tokens as flat arrays from their first element (it reads no strides but the state's
and the index table's first), so a size mismatch becomes an out-of-bounds access, an illegal
memory access, and a CUDA context that is lost for the whole process.
:func:`check_recurrent_kda_bounds` raises ``ValueError`` (naming expected and actual) for every
argument combination whose shapes alone make FLA's kernel or fla_cula's decode kernel read or write
outside a tensor. It reads shapes, strides, ndim and devices only: no tensor values, no device sync.

What FLA's kernel addresses, per sequence n < N (N = B, or len(cu_seqlens) - 1) and value head
hv < HV, for the tokens t of the sequence (T per sequence, or cu_seqlens[n] .. cu_seqlens[n+1]):

  q, k [B, T, H, K]       (tok * H + hv // (HV // H)) * K + k      -> HV a multiple of H
  v, out [B, T, HV, V]    (tok * HV + hv) * V + v
  g [B, T, HV, K]         (tok * HV + hv) * K + k
  beta [B, T, HV] or [B, T, HV, V] (headwise)
  A_log, dt_bias          hv and hv * K + k (read with use_gate_in_kernel only): HV and HV * K values
  cu_seqlens              entries n and n + 1
  initial_state, no pool  (n * HV + hv) * K * V + ...: N states of [HV, K, V] ([HV, V, K]) from the first
  initial_state, pool     slot * stride(0) + hv * K * V + ...: each of the P slots holds HV * K * V
  ssm_state_indices       n * stride(0) + t: the read slot at t = 0 (or num_accepted_tokens[n] - 1),
                          the write slot of token t (inplace_final_state); 1-D [L] or 2-D [N, Tmax]
  num_accepted_tokens     entry n (with a pool and an initial state)
  final state, pool, not in place: FLA's own [N, HV, K, V] buffer at token position bos + t

Out-of-range VALUES remain the caller's responsibility (checking them needs the values, i.e. a
device sync): cu_seqlens nondecreasing within [0, B * T]; pool slots in [0, P);
1 <= num_accepted_tokens[n] <= length of sequence n (and <= Tmax); with 2-D indices and cu_seqlens,
every sequence at most Tmax tokens long; with 1-D indices and cu_seqlens, n * stride(0) + t inside
the table for every token (the check guarantees it for one token per sequence and for a single
sequence, the two layouts whose slots do not overlap). fla_cula's own decode kernel does not depend
on them: it clamps cu_seqlens to the token range, bounds-checks every index and num_accepted_tokens
read, and skips a negative or out-of-range slot (that sequence's state is neither read nor written,
its outputs are zeros; see fla_cula/kernels/kda_decode.py). FLA does none of this: a negative
padding slot sent to FLA's kernel is itself an out-of-bounds access.
"""

from __future__ import annotations

import torch

__all__ = ["check_recurrent_kda_bounds"]


def _span(x: torch.Tensor) -> int:
    """Elements from a tensor's first element to its last, inclusive: what a flat read from its data
    pointer may touch (smaller than numel for expanded / overlapping views)."""
    if x.is_contiguous():
        return x.numel()
    if x.numel() == 0:
        return 0
    span = 1
    for n, s in zip(x.shape, x.stride(), strict=True):
        span += (n - 1) * s
    return span


def _desc(x: torch.Tensor) -> str:
    return f"shape {tuple(x.shape)} stride {tuple(x.stride())}"


def _need_flat(name: str, x: torch.Tensor, n: int, what: str) -> None:
    """The kernel reads/writes x[0 .. n-1] as a flat array from x's first element."""
    if n > 0 and _span(x) < n:
        raise ValueError(f"{name}: the kernel addresses {n} elements ({what}) from its first, "
                         f"got {_desc(x)} spanning {_span(x)}")


def _tensor(name: str, x, dev: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(x).__name__}")
    if x.device != dev:
        raise ValueError(f"{name}: expected on {dev} (the device of k), got {x.device}")
    return x


def check_recurrent_kda_bounds(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                               output_final_state=False, inplace_final_state=True, state_v_first=False,
                               cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                               use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                               use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                               out=None) -> None:
    """Raise ValueError (TypeError for a non-tensor) if `fused_recurrent_kda_fwd` with these arguments
    (FLA's signature and order; `fused_recurrent_kda`'s call maps to inplace_final_state=False, no pool)
    would address memory outside one of them. Metadata only; see the module docstring for what stays
    the caller's. Two mistakes FLA asserts on before launching are left to FLA's AssertionError (same
    exception as FLA): `out` of another shape than v (a ValueError here under ``python -O``, where
    the assertion is gone), and `inplace_final_state=True` without `initial_state` (harmless without
    the assertion: nothing is stored)."""
    if inplace_final_state and initial_state is None:
        return
    dev = k.device if isinstance(k, torch.Tensor) else None
    k = _tensor("k", k, dev)
    if k.ndim != 4:
        raise ValueError(f"k: expected [B, T, H, K], got shape {tuple(k.shape)}")
    B, T, H, K = k.shape
    q, v, g, beta = (_tensor(n, x, dev) for n, x in (("q", q), ("v", v), ("g", g), ("beta", beta)))
    if q.shape != k.shape:
        raise ValueError(f"q: expected shape {tuple(k.shape)} (that of k), got {tuple(q.shape)}")
    if v.ndim != 4 or tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v: expected [{B}, {T}, HV, V], got shape {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H:
        raise ValueError(f"v heads: expected a multiple of the {H} q/k heads (GVA), got HV={HV}")
    if tuple(g.shape) != (B, T, HV, K):
        raise ValueError(f"g: expected shape {(B, T, HV, K)}, got {tuple(g.shape)}")
    if tuple(beta.shape) not in ((B, T, HV), (B, T, HV, V)):
        raise ValueError(f"beta: expected shape {(B, T, HV)} (or headwise {(B, T, HV, V)}), got {tuple(beta.shape)}")
    if out is not None:
        out = _tensor("out", out, dev)
        if out.shape != v.shape:
            if __debug__:
                return  # FLA: assert out.shape == v.shape
            raise ValueError(f"out: expected shape {tuple(v.shape)} (that of v), got {tuple(out.shape)}")
    ntok = B * T
    # shapes are exact now, so a contiguous tensor spans exactly what the kernel addresses
    for name, x, per_tok in (("q", q, H * K), ("k", k, H * K), ("v", v, HV * V), ("g", g, HV * K),
                             ("beta", beta, HV * (V if beta.ndim == 4 else 1)), ("out", out, HV * V)):
        if x is not None and not x.is_contiguous():
            _need_flat(name, x, ntok * per_tok, f"{ntok} tokens x {per_tok}")
    if use_gate_in_kernel:
        if A_log is not None:
            _need_flat("A_log", _tensor("A_log", A_log, dev), HV, f"one per value head, HV={HV}")
        if dt_bias is not None:
            _need_flat("dt_bias", _tensor("dt_bias", dt_bias, dev), HV * K, f"HV * K = {HV} x {K}")

    # ---- sequences ----
    if cu_seqlens is not None:
        cu = _tensor("cu_seqlens", cu_seqlens, dev)
        if cu.ndim != 1 or cu.shape[0] < 1:
            raise ValueError(f"cu_seqlens: expected [N + 1] with N >= 0, got shape {tuple(cu.shape)}")
        N = cu.shape[0] - 1
        _need_flat("cu_seqlens", cu, N + 1, f"N + 1 = {N + 1} offsets")
    else:
        N = B
    pool = ssm_state_indices is not None
    if N == 0 or HV == 0 or (pool and ntok == 0):
        return  # no program touches memory (FLA's pooled kernel returns on an empty sequence)
    state_inner = (HV, V, K) if state_v_first else (HV, K, V)
    per_state = HV * K * V

    # ---- initial state ----
    if initial_state is not None:
        h0 = _tensor("initial_state", initial_state, dev)
        if h0.ndim != 4 or tuple(h0.shape[1:]) != state_inner:
            raise ValueError(f"initial_state: expected [{'P' if pool else N}, {', '.join(map(str, state_inner))}]"
                             f" ({'[V, K]' if state_v_first else '[K, V]'} states), got shape {tuple(h0.shape)}")
        if pool:
            P = h0.shape[0]
            if P == 0:
                raise ValueError("initial_state: a state pool with ssm_state_indices needs at least one slot, "
                                 f"got shape {tuple(h0.shape)}")
            _need_flat("initial_state", h0, (P - 1) * h0.stride(0) + per_state,
                       f"slot * stride(0) + {per_state} for each of its {P} slots")
        elif h0.shape[0] < N:
            src = f"cu_seqlens has {N + 1} entries" if cu_seqlens is not None else f"batch B={B}"
            raise ValueError(f"initial_state: expected {N} states ({src}), got shape {tuple(h0.shape)}")
        else:
            _need_flat("initial_state", h0, N * per_state, f"{N} states x {per_state}, ignoring stride(0)")

    if not pool:
        return
    # ---- state pool: the per-token final states FLA writes when not in place ----
    if not inplace_final_state:
        if not output_final_state:
            raise ValueError("ssm_state_indices with inplace_final_state=False: FLA's kernel writes every token's "
                             "state into a final-state buffer, expected output_final_state=True, got False")
        if ntok > N:
            raise ValueError(f"ssm_state_indices with inplace_final_state=False: FLA writes token t's state to "
                             f"final_state[t] of its [N={N}, ...] buffer, expected at most {N} tokens, got "
                             f"B * T = {ntok} (use inplace_final_state=True for multi-token steps)")
    if initial_state is None:
        return  # the index table and num_accepted_tokens are read only with an initial state
    # ---- ssm_state_indices ----
    idx = _tensor("ssm_state_indices", ssm_state_indices, dev)
    varlen = cu_seqlens is not None
    # the largest token offset t added to n * stride(0): writes (in place) and speculative reads go up
    # to the sequence length; a plain read uses t = 0
    tokens = bool(inplace_final_state) or num_accepted_tokens is not None
    if idx.ndim == 1:
        L, s0 = idx.shape[0], idx.stride(0)
        if L < N:
            raise ValueError(f"1-D ssm_state_indices: expected one slot per sequence, at least {N} entries, "
                             f"got shape {tuple(idx.shape)}")
        if tokens:
            # fixed length: every sequence has T tokens; varlen: one token each, or one sequence
            need = (N - 1) * s0 + T if not varlen else max((N - 1) * s0 + 1, T)
            if _span(idx) < need:
                lay = (f"{N} sequences x T={T} tokens" if not varlen else f"{N} sequences, {T} tokens in all")
                raise ValueError(
                    f"1-D ssm_state_indices: FLA's kernel reads entry n * stride(0) + t for token t of sequence n "
                    f"({lay}), expected a table spanning at least {need} elements, got {_desc(idx)} spanning "
                    f"{_span(idx)}; multi-token steps need 2-D indices [N, Tmax]")
    elif idx.ndim == 2:
        R, W = idx.shape
        if R < N:
            raise ValueError(f"2-D ssm_state_indices: expected [N={N}, Tmax] (a row per sequence), "
                             f"got shape {tuple(idx.shape)}")
        if W == 0:
            raise ValueError(f"2-D ssm_state_indices: expected at least one column, got shape {tuple(idx.shape)}")
        if tokens and not varlen and W < T:
            raise ValueError(f"2-D ssm_state_indices: expected a slot per token, [N={N}, Tmax >= T={T}], "
                             f"got shape {tuple(idx.shape)}")
        if tokens and W > 1 and idx.stride(1) != 1:
            raise ValueError(f"2-D ssm_state_indices: FLA's kernel steps tokens by one element, expected "
                             f"stride(1) == 1, got {_desc(idx)}")
    else:
        raise ValueError(f"ssm_state_indices: expected [N] or [N, Tmax], got shape {tuple(idx.shape)}")
    if num_accepted_tokens is not None:
        na = _tensor("num_accepted_tokens", num_accepted_tokens, dev)
        if na.numel() < N:
            raise ValueError(f"num_accepted_tokens: expected one entry per sequence, [{N}], "
                             f"got shape {tuple(na.shape)}")
        _need_flat("num_accepted_tokens", na, N, f"one per sequence, N={N}")
