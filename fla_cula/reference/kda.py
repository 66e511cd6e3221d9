"""fp64 reference for KDA (Kimi Delta Attention), as FLA 0.6.0 defines it.

Written as a plain token-by-token recurrence: readable first, vectorized only over sequences and
heads (the loop is over time), so it runs on any device and a T=4096 case takes seconds on CPU.
Every function computes in float64 and returns float64 tensors; inputs are never modified.

Layouts (FLA's):
  q, k            [B, T, H, K]       query/key heads
  v               [B, T, HV, V]      value heads; GVA when HV > H (HV % H == 0): value head hv
                                     reads query/key head hv // (HV // H)
  g               [B, T, HV, K]      log decay a (or the raw gate input with use_gate_in_kernel)
  beta            [B, T, HV]         scalar per value head, or head-wise [B, T, HV, V]
  state           [N, HV, K, V]      (state_v_first=True: [N, HV, V, K])
  cu_seqlens      [N + 1]            varlen: B == 1 and sequence n is tokens cu[n]:cu[n+1]
  o               [B, T, HV, V]

Math, per sequence and value head, S in R^{K x V}, S_0 = initial state (zeros if none):
  S'_t = diag(exp(a_t)) S_{t-1}                 a_t in R^K (per key channel decay, log space)
  u_t  = beta_t * (v_t - S'_t^T k_t)            delta rule; beta_t scalar or in R^V
  S_t  = S'_t + k_t u_t^T
  o_t  = S_t^T (scale * q_t)                    scale defaults to K ** -0.5
Options applied to the inputs first, as FLA's kernels do:
  use_qk_l2norm_in_kernel:    q <- q / sqrt(sum(q^2) + 1e-6), same for k (before the scale)
  use_gate_in_kernel:         a = kda_gate(g, A_log, dt_bias, lower_bound)
  use_beta_sigmoid_in_kernel: beta <- sigmoid(beta), times 2 with allow_neg_eigval
"""

from __future__ import annotations

import math

import torch

__all__ = ["kda_decode_pool", "kda_forget_bound", "kda_gate", "kda_recurrent", "softplus"]

_F64 = torch.float64


def softplus(x: torch.Tensor) -> torch.Tensor:
    """FLA's softplus (``fla/ops/utils/softplus.py``): ``x`` where ``x > 20``, else ``log(1 + exp(x))``.

    The threshold is FLA's; above it softplus(x) and x agree to float32 precision anyway.
    """
    x = x.to(_F64)
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(torch.clamp(x, max=20.0))))


def kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """KDA's fused gate (``use_gate_in_kernel=True``): raw gate input -> log decay ``a``, float64.

    g: ``[..., HV, K]``; A_log: any shape with HV elements; dt_bias: ``[HV * K]`` (any shape with
    HV*K elements, read as ``[HV, K]``), added to g first: ``x = g + dt_bias``. Then
      lower_bound None:  a = -exp(A_log) * softplus(x)
      lower_bound set:   a = lower_bound * sigmoid(exp(A_log) * x)    (A_log None: lower_bound * sigmoid(x))

    A_log None with lower_bound None raises ValueError, as ``chunk_kda`` does. (FLA's Triton gate
    kernels, fused_recurrent_kda's included, silently use ``A_log = 1.0`` there, i.e.
    ``-e * softplus(x)``; we do not reproduce that.)
    """
    if g.ndim < 2:
        raise ValueError(f"kda_gate: g must be [..., HV, K], got shape {tuple(g.shape)}")
    HV, K = g.shape[-2:]
    x = g.to(_F64)
    if dt_bias is not None:
        if dt_bias.numel() != HV * K:
            raise ValueError(f"kda_gate: dt_bias must have HV*K = {HV * K} elements, got {dt_bias.numel()}")
        x = x + dt_bias.to(device=g.device, dtype=_F64).reshape(HV, K)
    A = None
    if A_log is not None:
        if A_log.numel() != HV:
            raise ValueError(f"kda_gate: A_log must have HV = {HV} elements, got {A_log.numel()}")
        A = A_log.to(device=g.device, dtype=_F64).reshape(HV, 1)
    if lower_bound is None:
        if A is None:
            raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set.")
        return -torch.exp(A) * softplus(x)
    z = torch.exp(A) * x if A is not None else x
    return float(lower_bound) * torch.sigmoid(z)


def kda_forget_bound(a: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """How much the recurrence forgets over each chunk, provably: b = sum over its tokens of max_d a_{t, d} / ln 2.

    a: log decays [B, T, HV, K] (``kda_gate``'s output); returns float64 [B, ceil(T / chunk), HV] (log2 units, <= 0;
    a tail chunk sums its tokens only). The homogeneous step S -> (I - beta_t k_t k_t^T) diag(exp(a_t)) S has spectral
    norm <= max_d exp(a_{t, d}) when 0 <= beta_t |k_t|^2 <= 1 (beta in [0, 1], |k| <= 1: l2norm in kernel, no
    allow_neg_eigval), so two runs over the same chunks from states S_0, S_0' end within 2^(sum of their b) |S_0 - S_0'|
    (Frobenius). A sequence split may start a segment w chunks early from a zero state instead of its exact start when
    that sum is small enough (docs/kda_sm90.md, "Session 22"). Taking the channel max after summing the tokens (as
    cuDNN's kda_hopper_cuda certificate does) gives a smaller number that this argument does not cover.
    """
    B, T, HV, K = a.shape
    m = a.to(_F64).amax(-1)                                        # [B, T, HV]: the slowest channel, per token
    pad = (-T) % chunk
    if pad:
        m = torch.cat([m, m.new_zeros(B, pad, HV)], 1)
    return m.view(B, -1, chunk, HV).sum(2) / math.log(2.0)


# ----------------------------------------------------------------------------------------------
# shared pieces


def _check_shapes(q, k, v, g, beta) -> tuple[int, int, int, int, int, int]:
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B={B}, T={T}, HV, V], got shape {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"HV={HV} value heads must be a multiple of H={H} query/key heads")
    if g.shape != (B, T, HV, K):
        raise ValueError(f"g must be [B, T, HV, K]={[B, T, HV, K]}, got {list(g.shape)}")
    if beta.shape not in ((B, T, HV), (B, T, HV, V)):
        raise ValueError(f"beta must be [B, T, HV]={[B, T, HV]} or head-wise [B, T, HV, V], got {list(beta.shape)}")
    return B, T, H, HV, K, V


def _check_cu_seqlens(cu_seqlens: torch.Tensor, B: int, T: int) -> list[int]:
    if B != 1:
        raise ValueError(f"The batch size is expected to be 1 rather than {B} when using `cu_seqlens`.")
    cu = [int(c) for c in cu_seqlens.reshape(-1).tolist()]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu[:-1], cu[1:], strict=True)):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T={T}, got {cu}")
    return cu


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
             lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval):
    """Inputs -> float64 (q, k, v, a, beta) with every in-kernel option applied.

    q and k come back expanded to the HV value heads (GVA), q already scaled; beta as
    [B, T, HV, 1] (scalar) or [B, T, HV, V] (head-wise) so it broadcasts over V.
    """
    B, T, H, HV, K, V = _check_shapes(q, k, v, g, beta)
    if scale is None:
        scale = K ** -0.5
    qd, kd = q.to(_F64), k.to(_F64)
    if use_qk_l2norm_in_kernel:
        qd = qd / torch.sqrt(qd.square().sum(-1, keepdim=True) + 1e-6)
        kd = kd / torch.sqrt(kd.square().sum(-1, keepdim=True) + 1e-6)
    qd = qd * float(scale)
    G = HV // H
    qd, kd = qd.repeat_interleave(G, dim=2), kd.repeat_interleave(G, dim=2)
    a = kda_gate(g, A_log, dt_bias, lower_bound) if use_gate_in_kernel else g.to(_F64)
    b = beta.to(_F64)
    if use_beta_sigmoid_in_kernel:
        b = torch.sigmoid(b) * (2.0 if allow_neg_eigval else 1.0)
    if b.ndim == 3:
        b = b.unsqueeze(-1)
    return qd, kd, v.to(_F64), a, b, (B, T, H, HV, K, V)


def _to_kv(state: torch.Tensor, state_v_first: bool) -> torch.Tensor:
    """A state tensor in the caller's layout -> float64 [..., K, V] (a new tensor)."""
    s = state.to(_F64)
    return (s.transpose(-1, -2) if state_v_first else s).clone()


def _from_kv(state: torch.Tensor, state_v_first: bool) -> torch.Tensor:
    return state.transpose(-1, -2).contiguous() if state_v_first else state


def _check_state(state: torch.Tensor, rows: int | None, HV: int, K: int, V: int, state_v_first: bool, what: str):
    want = (HV, V, K) if state_v_first else (HV, K, V)
    if state.ndim != 4 or tuple(state.shape[1:]) != want or (rows is not None and state.shape[0] != rows):
        lead = "N" if rows is None else str(rows)
        raise ValueError(f"{what} must be [{lead}, {', '.join(map(str, want))}] "
                         f"({'state_v_first' if state_v_first else 'K-first'} layout), got {list(state.shape)}")


def _kda_scan(q, k, v, a, beta, S, keep_states: bool = False):
    """The recurrence itself, over equal-length sequences.

    q, k, a: [N, T, HV, K]; v: [N, T, HV, V]; beta: [N, T, HV, 1 or V]; S: [N, HV, K, V] (float64,
    not modified). Returns o [N, T, HV, V], the final S, and (keep_states) the list of S_t.
    """
    N, T, HV, V = v.shape
    K = q.shape[-1]
    M = N * HV

    def time_major(x):  # [N, T, HV, D] -> contiguous [T, N*HV, D]: each step reads one slab
        return x.transpose(0, 1).reshape(T, M, x.shape[-1]).contiguous()

    q, k, v, beta = map(time_major, (q, k, v, beta))
    decay = torch.exp(time_major(a))
    S = S.reshape(M, K, V).clone()
    o = v.new_empty(T, M, V)
    states = []
    for t in range(T):
        k_t = k[t].unsqueeze(-1)                                   # [M, K, 1]
        S.mul_(decay[t].unsqueeze(-1))                             # S' = diag(exp(a_t)) S
        pred = torch.bmm(k_t.transpose(1, 2), S).squeeze(1)        # S'^T k_t            [M, V]
        u = beta[t] * (v[t] - pred)                                # beta_t (v_t - S'^T k_t)
        S.baddbmm_(k_t, u.unsqueeze(1))                            # S = S' + k_t u_t^T
        o[t] = torch.bmm(q[t].unsqueeze(1), S).squeeze(1)          # o_t = S^T (scale q_t)
        if keep_states:
            states.append(S.reshape(N, HV, K, V).clone())
    o = o.reshape(T, N, HV, V).transpose(0, 1).contiguous()
    return o, S.reshape(N, HV, K, V), states


# ----------------------------------------------------------------------------------------------
# public


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp64 reference of ``chunk_kda`` / ``fused_recurrent_kda`` (forward).

    Layouts and math: see the module docstring. A_log, dt_bias and lower_bound are read only with
    use_gate_in_kernel (as in FLA). allow_neg_eigval without use_beta_sigmoid_in_kernel raises
    ValueError (as chunk_kda and fused_recurrent_kda do). A length-0 varlen sequence passes its
    initial state through unchanged.

    Returns ``(o [B, T, HV, V], final_state [N, HV, K, V] (or [N, HV, V, K]) or None)``, float64.
    """
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    qd, kd, vd, a, b, (B, T, H, HV, K, V) = _prepare(
        q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound,
        use_beta_sigmoid_in_kernel, allow_neg_eigval)
    cu = None if cu_seqlens is None else _check_cu_seqlens(cu_seqlens, B, T)
    N = B if cu is None else len(cu) - 1
    if initial_state is not None:
        _check_state(initial_state, N, HV, K, V, state_v_first, "initial_state")
        S0 = _to_kv(initial_state, state_v_first)
    else:
        S0 = vd.new_zeros(N, HV, K, V)

    if cu is None:
        o, S, _ = _kda_scan(qd, kd, vd, a, b, S0)
    else:
        o = vd.new_zeros(1, T, HV, V)
        finals = []
        for n in range(N):
            s = slice(cu[n], cu[n + 1])
            o_n, S_n, _ = _kda_scan(qd[:, s], kd[:, s], vd[:, s], a[:, s], b[:, s], S0[n:n + 1])
            o[:, s] = o_n
            finals.append(S_n)
        S = torch.cat(finals, 0)
    return o, (_from_kv(S, state_v_first) if output_final_state else None)


def kda_decode_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    output_final_state: bool = False,
    inplace_final_state: bool = True,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp64 reference of FLA's ``fused_recurrent_kda_fwd`` (the serving entry point), state pools included.

    Same arguments, order and defaults as ``fused_recurrent_kda_fwd`` (without ``out``). Returns
    ``(o, final_state)`` in float64; nothing passed in is modified. ``final_state`` is
      - inplace_final_state=True (FLA's default): a float64 copy of the pool ``initial_state``
        ``[P, HV, K, V]`` (or ``[P, HV, V, K]``) after the step, i.e. what FLA leaves in it;
      - else, with output_final_state: a new ``[N, HV, K, V]`` tensor (rows FLA never writes: NaN);
      - else None.

    Which pool slots are read and written (as FLA's kernel does):
      - No ssm_state_indices: sequence n reads ``initial_state[n]`` (zeros if None) and its final
        state goes to row n (of the pool when in place); a length-0 varlen sequence writes its
        initial state back.
      - ssm_state_indices ``[N]`` (1-D): sequence n reads and writes slot ``indices[n]``; every
        sequence must then have at most one token (ValueError otherwise: FLA would write token t
        of sequence n to ``indices[n + t]``), and num_accepted_tokens, if given, must be all 1.
      - ssm_state_indices ``[N, Tmax]`` (2-D): sequence n reads slot ``indices[n, c]`` with
        ``c = num_accepted_tokens[n] - 1`` (speculative decoding) or ``c = 0``, and after each of
        its tokens t writes the state to slot ``indices[n, t]``.
      - With indices, sequences with T == 0 are skipped (no write); without in-place, the state
        after token t goes to row ``bos + t`` of the new final_state (FLA's indexing; ValueError
        where that row does not exist, since FLA would write out of bounds).
      - Reads happen from the pool as passed in, before any write; writes apply in sequence then
        token order. (FLA runs sequences concurrently, so slots shared between sequences race there.)

    Deliberate difference from FLA: a negative slot is a padding slot (vLLM's PAD_SLOT_ID).
    A sequence whose read slot is negative is skipped entirely (no read, no write; its outputs are
    unspecified and returned as NaN here); a negative write slot skips only that write. FLA itself
    would index out of bounds.

    Other FLA behaviours kept: allow_neg_eigval has no effect without use_beta_sigmoid_in_kernel
    (no error at this level); output_final_state is ignored when inplace_final_state=True.
    """
    qd, kd, vd, a, b, (B, T, H, HV, K, V) = _prepare(
        q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound,
        use_beta_sigmoid_in_kernel, allow_neg_eigval and use_beta_sigmoid_in_kernel)
    cu = None if cu_seqlens is None else _check_cu_seqlens(cu_seqlens, B, T)
    N = B if cu is None else len(cu) - 1
    bounds = [(n * T, n * T + T) for n in range(N)] if cu is None else list(zip(cu[:-1], cu[1:], strict=True))

    # flatten [B, T, ...] -> [B*T, ...]; sequence n is rows bos:eos
    qd, kd, vd, a, b = (x.reshape(B * T, *x.shape[2:]) for x in (qd, kd, vd, a, b))

    if initial_state is not None:
        _check_state(initial_state, None, HV, K, V, state_v_first, "initial_state")
        pool_in = _to_kv(initial_state, state_v_first)          # read-only snapshot
    else:
        pool_in = None
    if inplace_final_state:
        if pool_in is None:
            raise ValueError("inplace_final_state=True needs initial_state (the state pool)")
        out_state = pool_in.clone()
    elif output_final_state:
        out_state = vd.new_full((N, HV, K, V), float("nan"))
    else:
        out_state = None
    P = None if pool_in is None else pool_in.shape[0]

    o = vd.new_zeros(B * T, HV, V)

    if ssm_state_indices is None:
        if pool_in is not None and P < N:
            raise ValueError(f"initial_state has {P} rows, fewer than the N={N} sequences")
        for n, (bos, eos) in enumerate(bounds):
            S0 = pool_in[n:n + 1] if pool_in is not None else vd.new_zeros(1, HV, K, V)
            o_n, S_n, _ = _kda_scan(qd[None, bos:eos], kd[None, bos:eos], vd[None, bos:eos], a[None, bos:eos],
                                    b[None, bos:eos], S0)
            o[bos:eos] = o_n[0]
            if out_state is not None:
                out_state[n] = S_n[0]
        return o.reshape(B, T, HV, V), (None if out_state is None else _from_kv(out_state, state_v_first))

    idx = ssm_state_indices
    if idx.ndim not in (1, 2) or idx.shape[0] < N:
        raise ValueError(f"ssm_state_indices must be [N] or [N, Tmax] with N >= {N}, got {list(idx.shape)}")
    idx = [[int(i) for i in row] for row in idx.reshape(idx.shape[0], -1).tolist()]
    two_d = ssm_state_indices.ndim == 2
    acc = None if num_accepted_tokens is None else [int(x) for x in num_accepted_tokens.reshape(-1).tolist()]
    if acc is not None and len(acc) < N:
        raise ValueError(f"num_accepted_tokens must have N={N} entries, got {len(acc)}")
    if not inplace_final_state and out_state is None:
        raise ValueError("ssm_state_indices without inplace_final_state needs output_final_state=True "
                         "(FLA's kernel would store through a null pointer)")

    def check_slot(slot: int, what: str) -> None:
        if P is not None and slot >= P:
            raise ValueError(f"{what} slot {slot} is out of range for a pool of {P} states")

    for n, (bos, eos) in enumerate(bounds):
        Tn = eos - bos
        if Tn == 0:
            continue
        if not two_d and Tn > 1:
            raise ValueError(f"1-D ssm_state_indices with {Tn} tokens in sequence {n} is ambiguous; "
                             f"pass [N, Tmax] indices for multi-token steps")
        if acc is not None:
            if not two_d and acc[n] != 1:
                raise ValueError(f"1-D ssm_state_indices with num_accepted_tokens[{n}]={acc[n]} is ambiguous; "
                                 f"pass [N, Tmax] indices for speculative decoding")
            if not 1 <= acc[n] <= len(idx[n]):
                raise ValueError(f"num_accepted_tokens[{n}]={acc[n]} must be in [1, {len(idx[n])}]")
        if two_d and Tn > len(idx[n]):
            raise ValueError(f"sequence {n} has {Tn} tokens but ssm_state_indices has only {len(idx[n])} columns")
        read = idx[n][acc[n] - 1 if acc is not None else 0]
        if read < 0:                                           # padding slot: skip the sequence
            o[bos:eos] = float("nan")
            continue
        if pool_in is not None:
            check_slot(read, "read")
            S0 = pool_in[read:read + 1]
        else:
            S0 = vd.new_zeros(1, HV, K, V)
        o_n, _, states = _kda_scan(qd[None, bos:eos], kd[None, bos:eos], vd[None, bos:eos], a[None, bos:eos],
                                   b[None, bos:eos], S0, keep_states=True)
        o[bos:eos] = o_n[0]
        for t, S_t in enumerate(states):
            if inplace_final_state:
                write = idx[n][t]
                if write < 0:
                    continue
                check_slot(write, "write")
                out_state[write] = S_t[0]
            else:
                row = bos + t
                if row >= N:
                    raise ValueError(f"without inplace_final_state FLA writes token {t} of sequence {n} to "
                                     f"final_state row {row}, but final_state has only N={N} rows")
                out_state[row] = S_t[0]
    return o.reshape(B, T, HV, V), _from_kv(out_state, state_v_first)


def bwd_wy_reference(q, k, v, v_new, g, beta, A, h, do, dh, dv, scale: float, state_v_first: bool,
                     cu_seqlens: torch.Tensor | None = None, chunk: int = 64) -> dict[str, torch.Tensor]:
    """fp64 model of FLA 0.6.0's chunk_kda_bwd_wy_dqkg_fused (the kernel fla_cula's kda_bwd_wy replaces), per chunk,
    with its bf16 rounding points (dw = bf16(-(dv H)), bf16(kg) in dA's product, X = bf16(M(dA) diag(beta)),
    Y = bf16(X Akk)). Layouts as FLA's: q, k [B,T,H,K]; v, v_new, do, dv [B,T,HV,V]; g [B,T,HV,K] (chunk-local
    cumsum, log2); beta [B,T,HV]; A = Akk [B,T,HV,chunk]; h, dh [B or 1, NT, HV, ...] chunk-start states, [V][K]
    with state_v_first else [K][V]; varlen: B = 1 and cu_seqlens, h's chunks in sequence order.
    Returns dq, dk, dg [B,T,HV,K], dv2 [B,T,HV,V], db [B,T,HV], dA [B,T,HV,chunk] (fp64; rows past a sequence's
    end zero)."""
    f64, bf = torch.float64, torch.bfloat16
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    seqs = ([(b, 0, T) for b in range(B)] if cu_seqlens is None else
            [(0, int(cu_seqlens[i]), int(cu_seqlens[i + 1])) for i in range(cu_seqlens.numel() - 1)])
    out = {n: torch.zeros(B, T, HV, K, dtype=f64) for n in ("dq", "dk", "dg")}
    out["dv2"] = torch.zeros(B, T, HV, V, dtype=f64)
    out["db"] = torch.zeros(B, T, HV, dtype=f64)
    out["dA"] = torch.zeros(B, T, HV, chunk, dtype=f64)
    hf, dhf = h.reshape(-1, HV, h.shape[-2], h.shape[-1]), dh.reshape(-1, HV, h.shape[-2], h.shape[-1])

    def rb(x):  # round to bf16, back to fp64
        return x.to(bf).to(f64)

    ci = 0
    for b, bos, eos in seqs:
        for t0 in range(bos, eos, chunk):
            L = min(chunk, eos - t0)
            rows = slice(t0, t0 + L)
            for hv in range(HV):
                hq = hv // G
                Hm = hf[ci, hv].to(f64)
                dHm = dhf[ci, hv].to(f64)
                if not state_v_first:  # stored [K][V]: FLA reads [V][K]
                    Hm, dHm = Hm.T, dHm.T
                qc, kc = q[b, rows, hq].to(f64), k[b, rows, hq].to(f64)
                vc, vn, doc, dvc = (x[b, rows, hv].to(f64) for x in (v, v_new, do, dv))
                gc, bc = g[b, rows, hv].to(f64), beta[b, rows, hv].to(f64)
                bA = A[b, rows, hv, :L].to(f64).T  # bA[t][s] = Akk[s][t]
                gn = gc[L - 1]
                e = torch.exp2(gc)
                dvb = bA @ dvc
                db = (dvb * vc).sum(1)
                dq = (doc @ Hm) * e * scale
                dkp = (vn @ dHm) * torch.exp2(gn[None, :] - gc)
                dw = rb(-(dvc @ Hm))
                kg = kc * e
                dA = dvc @ vc.T + dw @ rb(kg).T
                dkgb = bA @ dw
                db = db + (dkgb * kg).sum(1)
                dgk = (Hm * dHm).sum(0) * torch.exp2(gn) + (kc * dkp).sum(0)
                dg = qc * dq - kc * dkp + kg * dkgb * bc[:, None]
                dg[L - 1] += dgk
                M = torch.tril(torch.ones(L, L, dtype=torch.bool), -1)
                X = rb(torch.where(M, dA * bc[None, :], 0.0))
                Y = rb(X @ bA)
                out["dq"][b, rows, hv] = dq
                out["dk"][b, rows, hv] = dkp + dkgb * e * bc[:, None]
                out["dg"][b, rows, hv] = dg
                out["dv2"][b, rows, hv] = dvb * bc[:, None]
                out["db"][b, rows, hv] = db
                out["dA"][b, rows, hv, :L] = torch.where(M, -(bA @ Y), 0.0)
            ci += 1
    return out


def bwd_dAv_reference(v_new, do, Aqk=None, scale: float = 1.0, cu_seqlens: torch.Tensor | None = None,
                      chunk: int = 64) -> dict[str, torch.Tensor]:
    """fp64 model of FLA 0.6.0's chunk_kda_bwd_dAv per chunk: dAqk[t][s] = scale sum_v do[t][v] v_new[s][v] for
    s <= t, and dv[s] = sum_{t >= s} Aqk[t][s] do[t] (Aqk read on and below the diagonal only; the bf16 inputs
    exact in fp64). Layouts: v_new, do [B,T,HV,V]; Aqk [B,T,HV,chunk] (row t of its chunk, column s); varlen: B = 1
    and cu_seqlens. Returns dAqk [B,T,HV,chunk] and, with Aqk, dv [B,T,HV,V] (fp64; rows past a sequence's end
    zero)."""
    f64 = torch.float64
    B, T, HV, V = do.shape
    seqs = ([(b, 0, T) for b in range(B)] if cu_seqlens is None else
            [(0, int(cu_seqlens[i]), int(cu_seqlens[i + 1])) for i in range(cu_seqlens.numel() - 1)])
    out = {"dAqk": torch.zeros(B, T, HV, chunk, dtype=f64), "dv": torch.zeros(B, T, HV, V, dtype=f64)}
    for b, bos, eos in seqs:
        for t0 in range(bos, eos, chunk):
            L = min(chunk, eos - t0)
            rows = slice(t0, t0 + L)
            M = torch.tril(torch.ones(L, L, dtype=torch.bool))
            doc, vn = do[b, rows].to(f64).transpose(0, 1), v_new[b, rows].to(f64).transpose(0, 1)  # [HV, L, V]
            out["dAqk"][b, rows, :, :L] = torch.where(M, scale * doc @ vn.transpose(1, 2), 0.0).transpose(0, 1)
            if Aqk is not None:
                A = torch.where(M, Aqk[b, rows, :, :L].to(f64).transpose(0, 1), 0.0)  # [HV, t, s]
                out["dv"][b, rows] = (A.transpose(1, 2) @ doc).transpose(0, 1)
    return out


def bwd_intra_reference(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, cu_seqlens: torch.Tensor | None = None,
                        chunk: int = 64) -> dict[str, torch.Tensor]:
    """fp64 model of FLA 0.6.0's chunk_kda_bwd_intra (the gradients through Aqk[t][s] = sum_c q_tc k_sc
    exp2(g_tc - g_sc), s <= t, and Akk[t][s] = beta_t sum_c k_tc k_sc exp2(g_tc - g_sc), s < t, within each chunk),
    added to the incoming dq, dk, db, dg as FLA adds them. Layouts: q, k [B,T,H,K]; g (chunk-local cumsum, log2),
    dq, dk, dg [B,T,HV,K]; beta, db [B,T,HV]; dAqk, dAkk [B,T,HV,chunk] (row t of its chunk, column s). Returns dq, dk,
    db, dg in fp64 ([B,T,HV,...]; dq, dk at value heads, before FLA's GVA reduction). dg is FLA's: the derivative
    in natural-log units of g (exp2's ln 2 and g's 1 / ln 2 cancel; autograd through exp2 gives ln 2 dg)."""
    f64 = torch.float64
    B, T, H, K = q.shape
    HV = g.shape[2]
    G = HV // H
    seqs = ([(b, 0, T) for b in range(B)] if cu_seqlens is None else
            [(0, int(cu_seqlens[i]), int(cu_seqlens[i + 1])) for i in range(cu_seqlens.numel() - 1)])
    out = {"dq": dq.to(f64).clone(), "dk": dk.to(f64).clone(), "db": db.to(f64).clone(), "dg": dg.to(f64).clone()}
    for b, bos, eos in seqs:
        for t0 in range(bos, eos, chunk):
            L = min(chunk, eos - t0)
            rows = slice(t0, t0 + L)
            for hv in range(HV):
                qc, kc = q[b, rows, hv // G].to(f64), k[b, rows, hv // G].to(f64)
                gc, bc = g[b, rows, hv].to(f64), beta[b, rows, hv].to(f64)
                Aq = torch.tril(dAqk[b, rows, hv, :L].to(f64))
                Ak = torch.tril(dAkk[b, rows, hv, :L].to(f64), -1)
                E = torch.exp2(gc[:, None, :] - gc[None, :, :]) * torch.tril(torch.ones(L, L, dtype=f64))[:, :, None]
                dq2 = torch.einsum("ts,tsc,sc->tc", Aq, E, kc)
                dk2 = torch.einsum("ts,tsc,sc->tc", Ak, E, kc)       # row side, before beta
                dkt = torch.einsum("ts,tsc,tc->sc", Aq, E, qc) + torch.einsum("ts,tsc,tc->sc", Ak, E, kc * bc[:, None])
                out["db"][b, rows, hv] += (dk2 * kc).sum(1)
                dk2 = dk2 * bc[:, None]
                out["dq"][b, rows, hv] += dq2
                out["dk"][b, rows, hv] += dk2 + dkt
                out["dg"][b, rows, hv] += qc * dq2 + (dk2 - dkt) * kc
    return out
