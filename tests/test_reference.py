"""The fp64 references in fla_cula.reference, checked three independent ways (CPU only):

1. against a direct per-element recurrence written here in plain Python floats (tiny shapes), so a
   bug shared by the vectorized code paths cannot hide;
2. against FLA's own naive references (fla.ops.kda.naive, fla.ops.kda.gate, fla.ops.simple_gla.naive),
   which compute in float32;
3. against FLA's actual Triton kernels (fused_recurrent_kda_fwd, fused_recurrent_kda,
   fused_recurrent_simple_gla, fused_recurrent_lightning_attn) run by the Triton interpreter in a
   subprocess (TRITON_INTERPRET=1), which is the only way to execute them without a GPU.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import zlib
from dataclasses import dataclass, field, replace

import pytest
import torch

from fla_cula.reference import (
    fla_close,
    kda_decode_pool,
    kda_forget_bound,
    kda_gate,
    kda_recurrent,
    lightning_g_gamma,
    lightning_recurrent,
    rel_rms,
    simple_gla_recurrent,
    softplus,
)

F64 = torch.float64


def rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=dtype)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.to(F64) - b.to(F64)).abs().max().item() if a.numel() else 0.0


# ------------------------------------------------------------------------------------------------
# 1. the direct per-element recurrence (plain Python floats; nothing shared with the package)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _softplus(x: float) -> float:
    return x if x > 20.0 else math.log(1.0 + math.exp(x))


def direct_gate(g, A_log, dt_bias, lower_bound):
    """Per element: x = g + dt_bias[hv*K + i]; softplus or lower-bound sigmoid form."""
    B, T, HV, K = g.shape
    gl = g.tolist()
    A = None if A_log is None else [float(x) for x in A_log.reshape(-1).tolist()]
    bias = None if dt_bias is None else [float(x) for x in dt_bias.reshape(-1).tolist()]
    out = torch.empty(B, T, HV, K, dtype=F64)
    for b in range(B):
        for t in range(T):
            for h in range(HV):
                for i in range(K):
                    x = gl[b][t][h][i] + (bias[h * K + i] if bias is not None else 0.0)
                    if lower_bound is None:
                        out[b, t, h, i] = -math.exp(A[h]) * _softplus(x)
                    else:
                        out[b, t, h, i] = lower_bound * _sigmoid((math.exp(A[h]) if A is not None else 1.0) * x)
    return out


def direct_kda_seq(q, k, v, a, beta, scale, S, l2norm, beta_sigmoid, neg):
    """One sequence, one value head, Python lists: q,k,a [T][K], v [T][V], beta [T] or [T][V], S [K][V].

    Returns (o [T][V], states after each token [T][K][V])."""
    K, V = len(S), len(S[0])
    S = [row[:] for row in S]
    outs, states = [], []
    for t in range(len(v)):
        qt, kt = list(q[t]), list(k[t])
        if l2norm:
            nq = math.sqrt(sum(x * x for x in qt) + 1e-6)
            nk = math.sqrt(sum(x * x for x in kt) + 1e-6)
            qt, kt = [x / nq for x in qt], [x / nk for x in kt]
        qt = [x * scale for x in qt]
        bt = beta[t] if isinstance(beta[t], list) else [beta[t]] * V
        if beta_sigmoid:
            bt = [_sigmoid(x) * (2.0 if neg else 1.0) for x in bt]
        for i in range(K):
            d = math.exp(a[t][i])
            for j in range(V):
                S[i][j] *= d
        for j in range(V):
            pred = sum(kt[i] * S[i][j] for i in range(K))
            u = bt[j] * (v[t][j] - pred)
            for i in range(K):
                S[i][j] += kt[i] * u
        outs.append([sum(qt[i] * S[i][j] for i in range(K)) for j in range(V)])
        states.append([row[:] for row in S])
    return outs, states


def direct_kda(q, k, v, g, beta, *, scale=None, initial_state=None, l2norm=False, gate=None, beta_sigmoid=False,
               neg=False, state_v_first=False, cu_seqlens=None, keep_states=False):
    """Direct reference for every sequence and value head. gate: None or (A_log, dt_bias, lower_bound).

    Returns o [B,T,HV,V], final [N,HV,K,V] (K-first always) and, with keep_states, per-sequence
    lists of per-token states [HV][K][V]."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    scale = K ** -0.5 if scale is None else scale
    a = direct_gate(g, *gate) if gate is not None else g.to(F64)
    ql, kl, vl, al, bl = (x.to(F64).tolist() for x in (q, k, v, a, beta))
    bounds = [(n * T, n * T + T) for n in range(B)] if cu_seqlens is None else \
        list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True))
    N = len(bounds)

    o = torch.zeros(B, T, HV, V, dtype=F64)
    final = torch.zeros(N, HV, K, V, dtype=F64)
    all_states = []
    for n, (bos, eos) in enumerate(bounds):
        b = n if cu_seqlens is None else 0
        t0 = 0 if cu_seqlens is None else bos
        Tn = eos - bos
        seq_states = [[None] * HV for _ in range(Tn)]
        for hv in range(HV):
            h = hv // G
            if initial_state is None:
                S0 = [[0.0] * V for _ in range(K)]
            else:
                s = initial_state[n, hv].to(F64)
                S0 = (s.t() if state_v_first else s).tolist()
            ts = range(t0, t0 + Tn)
            qs = [ql[b][t][h] for t in ts]
            ks = [kl[b][t][h] for t in ts]
            vs = [vl[b][t][hv] for t in ts]
            gs = [al[b][t][hv] for t in ts]
            bs = [bl[b][t][hv] for t in ts]
            outs, states = direct_kda_seq(qs, ks, vs, gs, bs, scale, S0, l2norm, beta_sigmoid, neg)
            for i, t in enumerate(ts):
                o[b, t, hv] = torch.tensor(outs[i], dtype=F64)
                seq_states[i][hv] = states[i]
            final[n, hv] = torch.tensor(states[-1] if states else S0, dtype=F64)
        all_states.append([torch.tensor(st, dtype=F64) for st in seq_states])
    return (o, final, all_states) if keep_states else (o, final)


def direct_simple_gla(q, k, v, g_gamma, *, scale=None, initial_state=None, reverse=False, cu_seqlens=None):
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    gam = [float(x) for x in g_gamma.tolist()]
    ql, kl, vl = (x.to(F64).tolist() for x in (q, k, v))
    bounds = [(b, 0, T) for b in range(B)] if cu_seqlens is None else \
        [(0, s, e) for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True)]
    o = torch.zeros(B, T, H, V, dtype=F64)
    final = torch.zeros(len(bounds), H, K, V, dtype=F64)
    for n, (b, s, e) in enumerate(bounds):
        for h in range(H):
            S = [[0.0] * V for _ in range(K)] if initial_state is None else initial_state[n, h].to(F64).tolist()
            for t in (range(e - 1, s - 1, -1) if reverse else range(s, e)):
                for i in range(K):
                    for j in range(V):
                        S[i][j] = math.exp(gam[h]) * S[i][j] + kl[b][t][h][i] * vl[b][t][h][j]
                o[b, t, h] = torch.tensor([sum(ql[b][t][h][i] * scale * S[i][j] for i in range(K)) for j in range(V)],
                                          dtype=F64)
            final[n, h] = torch.tensor(S, dtype=F64)
    return o, final


# ------------------------------------------------------------------------------------------------
# case descriptions


@dataclass(frozen=True)
class KDACase:
    B: int = 2
    T: int = 5
    H: int = 2
    HV: int = 2
    K: int = 4
    V: int = 3
    h0: bool = False
    l2norm: bool = False
    gate: str | None = None          # None | softplus | softplus_bias | lower_bound | lower_bound_noA | lb_A4d
    beta_sigmoid: bool = False
    neg: bool = False
    headwise: bool = False
    state_v_first: bool = False
    lens: tuple[int, ...] | None = None   # varlen sequence lengths (B becomes 1)
    scale: float | None = None
    extra: dict = field(default_factory=dict, hash=False, compare=False)


def make_kda(case: KDACase, seed: int):
    """Inputs as FLA expects them (float32), and the reference/direct keyword arguments."""
    gen = rng(seed)
    B, T = (1, sum(case.lens)) if case.lens is not None else (case.B, case.T)
    H, HV, K, V = case.H, case.HV, case.K, case.V
    N = len(case.lens) if case.lens is not None else B
    q, k = randn(gen, B, T, H, K), randn(gen, B, T, H, K)
    if not case.l2norm:  # keep the delta rule well conditioned, as FLA's tests do
        k = k / k.norm(dim=-1, keepdim=True)
    v = randn(gen, B, T, HV, V)
    if case.gate is None:
        g = torch.nn.functional.logsigmoid(randn(gen, B, T, HV, K)) * 0.5
    else:
        g = randn(gen, B, T, HV, K) * 2.0
    bshape = (B, T, HV, V) if case.headwise else (B, T, HV)
    beta = randn(gen, *bshape) if case.beta_sigmoid else torch.rand(*bshape, generator=gen)
    A_log = dt_bias = lower_bound = None
    if case.gate is not None:
        A_log = randn(gen, HV) * 0.5
        if case.gate == "lb_A4d":
            A_log = A_log.view(1, 1, HV, 1)
        if case.gate in ("softplus_bias", "lower_bound", "lb_A4d"):
            dt_bias = randn(gen, HV * K)
        if case.gate.startswith("lower_bound") or case.gate == "lb_A4d":
            lower_bound = -3.0
        if case.gate == "lower_bound_noA":
            A_log = None
    h0 = None
    if case.h0:
        h0 = randn(gen, N, HV, V, K) if case.state_v_first else randn(gen, N, HV, K, V)
    cu = None
    if case.lens is not None:
        cu = torch.tensor([0, *torch.tensor(case.lens).cumsum(0).tolist()], dtype=torch.long)
    ref_kw = dict(scale=case.scale, initial_state=h0, use_qk_l2norm_in_kernel=case.l2norm,
                  use_gate_in_kernel=case.gate is not None, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                  use_beta_sigmoid_in_kernel=case.beta_sigmoid, allow_neg_eigval=case.neg,
                  state_v_first=case.state_v_first, cu_seqlens=cu)
    direct_kw = dict(scale=case.scale, initial_state=h0, l2norm=case.l2norm,
                     gate=None if case.gate is None else (A_log, dt_bias, lower_bound),
                     beta_sigmoid=case.beta_sigmoid, neg=case.neg, state_v_first=case.state_v_first, cu_seqlens=cu)
    return (q, k, v, g, beta), ref_kw, direct_kw


KDA_CASES = {
    "plain": KDACase(),
    "h0": KDACase(h0=True),
    "gva_2x": KDACase(H=2, HV=4, h0=True),
    "gva_4x": KDACase(H=1, HV=4),
    "l2norm": KDACase(l2norm=True),
    "gate_softplus": KDACase(gate="softplus"),
    "gate_softplus_dt_bias": KDACase(gate="softplus_bias", HV=4, H=2),
    "gate_lower_bound": KDACase(gate="lower_bound"),
    "gate_lower_bound_A_log_none": KDACase(gate="lower_bound_noA"),
    "gate_lower_bound_A_log_4d": KDACase(gate="lb_A4d"),
    "beta_sigmoid": KDACase(beta_sigmoid=True),
    "beta_sigmoid_neg_eigval": KDACase(beta_sigmoid=True, neg=True),
    "headwise_beta": KDACase(headwise=True, h0=True),
    "headwise_beta_sigmoid_neg": KDACase(headwise=True, beta_sigmoid=True, neg=True),
    "state_v_first_h0": KDACase(state_v_first=True, h0=True),
    "scale_0.3": KDACase(scale=0.3),
    "varlen_len1_len0": KDACase(lens=(3, 1, 0, 2), h0=True),
    "varlen_gva_v_first_all_flags": KDACase(lens=(2, 0, 1, 3), H=1, HV=2, h0=True, l2norm=True, gate="lower_bound",
                                            beta_sigmoid=True, neg=True, state_v_first=True),
    "all_flags_gva4_headwise": KDACase(H=1, HV=4, h0=True, l2norm=True, gate="softplus_bias", beta_sigmoid=True,
                                       headwise=True, scale=0.7),
}


# ------------------------------------------------------------------------------------------------
# kda_gate


GATES = {
    "softplus": dict(A_log=True, dt_bias=False, lower_bound=None),
    "softplus_dt_bias": dict(A_log=True, dt_bias=True, lower_bound=None),
    "lower_bound": dict(A_log=True, dt_bias=True, lower_bound=-5.0),
    "lower_bound_no_dt_bias": dict(A_log=True, dt_bias=False, lower_bound=-1.0),
    "lower_bound_A_log_none": dict(A_log=False, dt_bias=True, lower_bound=-2.5),
}


@pytest.mark.parametrize("name", list(GATES), ids=list(GATES))
def test_kda_gate_matches_fla_naive_and_direct(name):
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate

    spec = GATES[name]
    gen = rng(100 + len(name))
    HV, K = 3, 8
    g = randn(gen, 2, 5, HV, K, dtype=F64) * 6.0
    A_log = randn(gen, HV, dtype=F64) if spec["A_log"] else None
    dt_bias = randn(gen, HV * K, dtype=F64) if spec["dt_bias"] else None
    lb = spec["lower_bound"]
    out = kda_gate(g, A_log, dt_bias, lb)
    assert out.dtype == F64 and out.shape == g.shape
    assert max_abs(out, direct_gate(g, A_log, dt_bias, lb)) < 1e-12
    if lb is None:
        fla = naive_kda_gate(g, A_log, dt_bias, output_dtype=F64)
    else:
        fla = naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound=lb, output_dtype=F64)
    assert rel_rms(fla, out) < 1e-6  # FLA's naive gate computes in float32
    if A_log is not None:  # A_log may have any shape with HV elements
        assert torch.equal(kda_gate(g, A_log.view(1, 1, HV, 1), dt_bias, lb), out)


def test_softplus_threshold_is_flas():
    x = torch.tensor([-30.0, -1.0, 0.0, 19.5, 20.0, 20.5, 50.0, 1000.0], dtype=F64)
    y = softplus(x)
    assert torch.equal(y[x > 20], x[x > 20])
    small = x <= 20
    assert torch.allclose(y[small], torch.log1p(torch.exp(x[small])), rtol=1e-15, atol=0)
    assert torch.isfinite(y).all()


def test_kda_gate_needs_A_log_without_lower_bound():
    with pytest.raises(ValueError, match="A_log` must be provided"):
        kda_gate(torch.zeros(1, 1, 2, 4))


@pytest.mark.parametrize("bad", ["A_log", "dt_bias"])
def test_kda_gate_rejects_wrong_sizes(bad):
    g = torch.zeros(1, 1, 2, 4)
    with pytest.raises(ValueError, match=f"{bad} must have"):
        kda_gate(g, torch.zeros(3) if bad == "A_log" else torch.zeros(2),
                 torch.zeros(7) if bad == "dt_bias" else None)


# ------------------------------------------------------------------------------------------------
# kda_recurrent


@pytest.mark.parametrize("name", list(KDA_CASES), ids=list(KDA_CASES))
def test_kda_recurrent_matches_direct(name):
    case = KDA_CASES[name]
    inputs, ref_kw, direct_kw = make_kda(case, seed=zlib.crc32(name.encode()) % 10_000)
    o, ht = kda_recurrent(*inputs, **ref_kw)
    o_d, ht_d = direct_kda(*inputs, **direct_kw)
    assert o.dtype == F64 and ht.dtype == F64
    assert o.shape == inputs[2].shape
    N = len(case.lens) if case.lens else case.B
    assert ht.shape == ((N, case.HV, case.V, case.K) if case.state_v_first else (N, case.HV, case.K, case.V))
    assert max_abs(o, o_d) < 1e-10
    assert max_abs(ht.transpose(-1, -2) if case.state_v_first else ht, ht_d) < 1e-10


def _fla_preprocess(inputs, ref_kw):
    """The in-kernel options applied in the test, with FLA's own gate reference, for FLA's naive code."""
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate

    q, k, v, g, beta = (x.to(F64) for x in inputs)
    if ref_kw["use_qk_l2norm_in_kernel"]:
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + 1e-6)
    if ref_kw["use_gate_in_kernel"]:
        if ref_kw["lower_bound"] is None:
            g = naive_kda_gate(g, ref_kw["A_log"], ref_kw["dt_bias"], output_dtype=F64)
        else:
            g = naive_kda_lowerbound_gate(g, ref_kw["A_log"], ref_kw["dt_bias"], ref_kw["lower_bound"], F64)
    if ref_kw["use_beta_sigmoid_in_kernel"]:
        beta = beta.sigmoid() * (2 if ref_kw["allow_neg_eigval"] else 1)
    return q, k, v, g, beta


NAIVE_CASES = [n for n, c in KDA_CASES.items() if not c.headwise]


@pytest.mark.parametrize("name", NAIVE_CASES, ids=NAIVE_CASES)
def test_kda_recurrent_matches_fla_naive_recurrent(name):
    from fla.ops.kda.naive import naive_recurrent_kda

    case = replace(KDA_CASES[name], T=24, K=16, V=8)
    if case.lens is not None:
        case = replace(case, lens=tuple(4 * n for n in case.lens))
    inputs, ref_kw, _ = make_kda(case, seed=7 + len(name))
    o, ht = kda_recurrent(*inputs, **ref_kw)
    q, k, v, g, beta = _fla_preprocess(inputs, ref_kw)
    h0 = ref_kw["initial_state"]
    if h0 is not None and case.state_v_first:
        h0 = h0.transpose(-1, -2)
    cu = ref_kw["cu_seqlens"]
    bounds = [(None, None)] if cu is None else list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
    o_parts, ht_parts = [], []
    for n, (s, e) in enumerate(bounds):
        sl = slice(s, e)
        h = h0 if cu is None or h0 is None else h0[n:n + 1]
        o_n, ht_n = naive_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], scale=ref_kw["scale"],
                                        initial_state=h, output_final_state=True)
        o_parts.append(o_n)
        ht_parts.append(ht_n)
    o_fla, ht_fla = torch.cat(o_parts, 1), torch.cat(ht_parts, 0)
    if case.state_v_first:
        ht_fla = ht_fla.transpose(-1, -2)
    assert fla_close(o, o_fla, 1e-5) and rel_rms(o, o_fla) < 1e-5
    assert fla_close(ht, ht_fla, 1e-5) and rel_rms(ht, ht_fla) < 1e-5


@pytest.mark.parametrize("chunk_size", [16, 32], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("name", ["h0", "gva_2x", "gate_lower_bound", "l2norm"])
def test_kda_recurrent_matches_fla_naive_chunk(name, chunk_size):
    from fla.ops.kda.naive import naive_chunk_kda

    case = replace(KDA_CASES[name], T=64, K=16, V=16)
    inputs, ref_kw, _ = make_kda(case, seed=11 + chunk_size)
    o, ht = kda_recurrent(*inputs, **ref_kw)
    q, k, v, g, beta = _fla_preprocess(inputs, ref_kw)
    o_fla, ht_fla = naive_chunk_kda(q, k, v, g, beta, scale=ref_kw["scale"], initial_state=ref_kw["initial_state"],
                                    output_final_state=True, chunk_size=chunk_size)
    assert rel_rms(o, o_fla) < 1e-4
    assert rel_rms(ht, ht_fla) < 1e-4


def test_kda_state_layouts_are_transposes():
    inputs, ref_kw, _ = make_kda(KDACase(h0=True, HV=4, H=2, K=5, V=3), seed=3)
    o, ht = kda_recurrent(*inputs, **ref_kw)
    o_t, ht_t = kda_recurrent(*inputs, **{**ref_kw, "initial_state": ref_kw["initial_state"].transpose(-1, -2),
                                          "state_v_first": True})
    assert torch.equal(o, o_t)
    assert torch.equal(ht, ht_t.transpose(-1, -2))


def test_kda_varlen_equals_separate_calls_and_len0_passes_state_through():
    case = KDACase(lens=(3, 1, 0, 2), h0=True, HV=4, H=2)
    inputs, ref_kw, _ = make_kda(case, seed=5)
    o, ht = kda_recurrent(*inputs, **ref_kw)
    cu = ref_kw["cu_seqlens"].tolist()
    for n in range(len(case.lens)):
        s = slice(cu[n], cu[n + 1])
        o_n, ht_n = kda_recurrent(*(x[:, s] for x in inputs), **{**ref_kw, "cu_seqlens": None,
                                                                  "initial_state": ref_kw["initial_state"][n:n + 1]})
        assert torch.equal(o[:, s], o_n) and torch.equal(ht[n:n + 1], ht_n)
    assert torch.equal(ht[2], ref_kw["initial_state"][2].to(F64))


def test_kda_no_final_state_and_zero_initial_state():
    inputs, ref_kw, _ = make_kda(KDACase(), seed=9)
    o, ht = kda_recurrent(*inputs, **{**ref_kw, "output_final_state": False})
    assert ht is None
    o0, _ = kda_recurrent(*inputs, **{**ref_kw, "initial_state": torch.zeros(2, 2, 4, 3)})
    assert torch.equal(o, o0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(allow_neg_eigval=True), "requires `use_beta_sigmoid_in_kernel=True`"),
        (dict(cu_seqlens=torch.tensor([0, 2, 5])), "batch size is expected to be 1"),
        (dict(initial_state=torch.zeros(3, 2, 4, 3)), "initial_state must be"),
        (dict(initial_state=torch.zeros(2, 2, 4, 3), state_v_first=True), "initial_state must be"),
        (dict(use_gate_in_kernel=True), "A_log` must be provided"),
    ],
    ids=["neg_eigval_without_sigmoid", "varlen_with_batch_2", "initial_state_rows", "initial_state_layout",
         "gate_without_A_log"],
)
def test_kda_recurrent_errors(kwargs, match):
    inputs, _, _ = make_kda(KDACase(), seed=1)
    with pytest.raises(ValueError, match=match):
        kda_recurrent(*inputs, **kwargs)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda q, k, v, g, b: (q, k, v[:, :, :1].expand(-1, -1, 3, -1), g, b), "multiple of H"),
        (lambda q, k, v, g, b: (q, k[..., :3], v, g, b), "k must have"),
        (lambda q, k, v, g, b: (q, k, v, g[..., :3], b), "g must be"),
        (lambda q, k, v, g, b: (q, k, v, g, b[..., None]), "beta must be"),
    ],
    ids=["hv_not_multiple_of_h", "k_shape", "g_shape", "beta_shape"],
)
def test_kda_recurrent_shape_errors(mutate, match):
    inputs, _, _ = make_kda(KDACase(), seed=2)
    with pytest.raises(ValueError, match=match):
        kda_recurrent(*mutate(*inputs))


@pytest.mark.parametrize("cu, match", [([0, 3, 2, 10], "non-decreasing"), ([0, 4, 9], "from 0 to T")],
                         ids=["decreasing", "not_ending_at_T"])
def test_kda_recurrent_bad_cu_seqlens(cu, match):
    inputs, _, _ = make_kda(KDACase(lens=(4, 6)), seed=2)
    with pytest.raises(ValueError, match=match):
        kda_recurrent(*inputs, cu_seqlens=torch.tensor(cu))


# ------------------------------------------------------------------------------------------------
# kda_decode_pool


def _pool_inputs(lens, seed, HV=4, H=2, K=4, V=3, P=9, headwise=False, v_first=False):
    case = KDACase(lens=tuple(lens), H=H, HV=HV, K=K, V=V, headwise=headwise, l2norm=True, gate="softplus_bias",
                   beta_sigmoid=True)
    inputs, ref_kw, direct_kw = make_kda(case, seed)
    gen = rng(seed + 1)
    pool = randn(gen, P, HV, V, K) if v_first else randn(gen, P, HV, K, V)
    fwd_kw = dict(A_log=ref_kw["A_log"], dt_bias=ref_kw["dt_bias"], cu_seqlens=ref_kw["cu_seqlens"],
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  state_v_first=v_first)
    return inputs, pool, fwd_kw, direct_kw


def _pool_kv(pool, v_first):
    return pool.to(F64).transpose(-1, -2) if v_first else pool.to(F64)


@pytest.mark.parametrize("v_first", [False, True], ids=["k_first", "v_first"])
def test_pool_1d_indices_single_token(v_first):
    lens = [1, 1, 0, 1]
    inputs, pool, fwd_kw, direct_kw = _pool_inputs(lens, seed=21, v_first=v_first)
    idx = torch.tensor([7, 2, 5, 0], dtype=torch.int32)
    pool_before = pool.clone()
    o, new = kda_decode_pool(*inputs, initial_state=pool, ssm_state_indices=idx, **fwd_kw)
    assert torch.equal(pool, pool_before)
    assert new.dtype == F64 and new.shape == pool.shape
    h0 = _pool_kv(pool, v_first)[idx.long()]
    o_d, ht_d = direct_kda(*inputs, **{**direct_kw, "initial_state": h0, "state_v_first": False})
    assert max_abs(o, o_d) < 1e-10
    new_kv = _pool_kv(new, v_first)
    for n, slot in enumerate(idx.tolist()):
        if lens[n] == 0:
            assert torch.equal(new_kv[slot], _pool_kv(pool, v_first)[slot])   # T == 0: skipped, no write
        else:
            assert max_abs(new_kv[slot], ht_d[n]) < 1e-10
    untouched = [s for s in range(pool.shape[0]) if s not in idx.tolist()]
    assert torch.equal(new[untouched], pool[untouched].to(F64))


@pytest.mark.parametrize("accepted", [None, [1, 2, 3, 1]], ids=["no_spec", "num_accepted_tokens"])
def test_pool_2d_indices_writes_every_token(accepted):
    lens = [3, 1, 0, 2]
    inputs, pool, fwd_kw, direct_kw = _pool_inputs(lens, seed=22, P=16)
    idx = torch.tensor([[3, 4, 5], [6, 11, 12], [13, 14, 15], [0, 1, 2]], dtype=torch.int64)
    acc = None if accepted is None else torch.tensor(accepted, dtype=torch.int32)
    o, new = kda_decode_pool(*inputs, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=acc, **fwd_kw)
    read_col = [0] * 4 if acc is None else [a - 1 for a in accepted]
    h0 = pool.to(F64)[[idx[n, read_col[n]].item() for n in range(4)]]
    o_d, _, states = direct_kda(*inputs, **{**direct_kw, "initial_state": h0}, keep_states=True)
    assert max_abs(o, o_d) < 1e-10
    expected = pool.to(F64).clone()
    for n, Tn in enumerate(lens):
        for t in range(Tn):
            expected[idx[n, t]] = states[n][t]
    assert max_abs(new, expected) < 1e-10


def test_pool_negative_read_slot_skips_the_sequence():
    lens = [2, 1, 1]
    inputs, pool, fwd_kw, direct_kw = _pool_inputs(lens, seed=23, P=8)
    idx = torch.tensor([[1, 2], [-1, 3], [4, 5]])
    o, new = kda_decode_pool(*inputs, initial_state=pool, ssm_state_indices=idx, **fwd_kw)
    assert torch.isnan(o[0, 2]).all()                      # sequence 1 (token 2): padding, NaN
    assert not torch.isnan(o[0, [0, 1, 3]]).any()
    assert torch.equal(new[3], pool[3].to(F64))            # sequence 1 wrote nothing
    h0 = pool.to(F64)[[1, 0, 4]]
    o_d, _, states = direct_kda(*inputs, **{**direct_kw, "initial_state": h0}, keep_states=True)
    assert max_abs(o[0, [0, 1, 3]], o_d[0, [0, 1, 3]]) < 1e-10
    assert max_abs(new[2], states[0][1]) < 1e-10 and max_abs(new[4], states[2][0]) < 1e-10


def test_pool_negative_write_slot_skips_only_that_write():
    lens = [3]
    inputs, pool, fwd_kw, direct_kw = _pool_inputs(lens, seed=24, P=4)
    idx = torch.tensor([[1, -1, 2]])
    o, new = kda_decode_pool(*inputs, initial_state=pool, ssm_state_indices=idx, **fwd_kw)
    o_d, _, states = direct_kda(*inputs, **{**direct_kw, "initial_state": pool[1:2]}, keep_states=True)
    assert max_abs(o, o_d) < 1e-10
    assert max_abs(new[1], states[0][0]) < 1e-10 and max_abs(new[2], states[0][2]) < 1e-10
    assert torch.equal(new[[0, 3]], pool[[0, 3]].to(F64))


def test_pool_without_indices_writes_final_state_in_place():
    inputs, pool, fwd_kw, direct_kw = _pool_inputs([2, 0, 3], seed=25, P=3)
    o, new = kda_decode_pool(*inputs, initial_state=pool, **fwd_kw)
    o_d, ht_d = direct_kda(*inputs, **{**direct_kw, "initial_state": pool})
    assert max_abs(o, o_d) < 1e-10 and max_abs(new, ht_d) < 1e-10
    assert torch.equal(new[1], pool[1].to(F64))            # T == 0 without indices: h0 stored back
    o2, ht2 = kda_decode_pool(*inputs, initial_state=pool, inplace_final_state=False, output_final_state=True,
                              **fwd_kw)
    assert torch.equal(o2, o) and torch.equal(ht2, new)
    assert kda_decode_pool(*inputs, initial_state=pool, inplace_final_state=False, **fwd_kw)[1] is None


def test_pool_indices_not_in_place_writes_row_bos_plus_t():
    lens = [1, 1, 1]
    inputs, pool, fwd_kw, direct_kw = _pool_inputs(lens, seed=26, P=5)
    idx = torch.tensor([4, 0, 2])
    o, ht = kda_decode_pool(*inputs, initial_state=pool, inplace_final_state=False, output_final_state=True,
                            ssm_state_indices=idx, **fwd_kw)
    o_d, ht_d = direct_kda(*inputs, **{**direct_kw, "initial_state": pool[idx]})
    assert ht.shape == (3, 4, 4, 3)
    assert max_abs(o, o_d) < 1e-10 and max_abs(ht, ht_d) < 1e-10


def test_pool_headwise_beta_and_neg_eigval_ignored_without_sigmoid():
    inputs, pool, fwd_kw, direct_kw = _pool_inputs([1, 1], seed=27, P=3, headwise=True)
    fwd_kw = {**fwd_kw, "use_beta_sigmoid_in_kernel": False}
    direct_kw = {**direct_kw, "beta_sigmoid": False}
    idx = torch.tensor([2, 0])
    o, new = kda_decode_pool(*inputs, initial_state=pool, ssm_state_indices=idx, allow_neg_eigval=True, **fwd_kw)
    o_d, ht_d = direct_kda(*inputs, **{**direct_kw, "initial_state": pool[idx]})
    assert max_abs(o, o_d) < 1e-10 and max_abs(new[idx], ht_d) < 1e-10


@pytest.mark.parametrize(
    "lens, idx, kwargs, match",
    [
        ([2, 1], [0, 1], {}, "1-D ssm_state_indices with 2 tokens"),
        ([1, 1], [0, 1], dict(num_accepted_tokens=torch.tensor([2, 1])), "1-D ssm_state_indices with num_accepted"),
        ([1, 1], [[0, 1], [2, 3]], dict(num_accepted_tokens=torch.tensor([3, 1])), "num_accepted_tokens\\[0\\]=3"),
        ([3, 1], [[0, 1], [2, 3]], {}, "only 2 columns"),
        ([1, 1], [0, 9], {}, "out of range"),
        ([1, 1], [0, 1], dict(initial_state=None), "needs initial_state"),
        ([1, 1], [0, 1], dict(inplace_final_state=False), "needs output_final_state=True"),
        ([2, 1], [[0, 1], [2, 3]], dict(inplace_final_state=False, output_final_state=True), "out of bounds|only N="),
    ],
    ids=["1d_multi_token", "1d_spec_decoding", "accepted_out_of_range", "too_few_columns", "slot_out_of_range",
         "in_place_without_pool", "indices_without_output", "row_bos_plus_t_out_of_bounds"],
)
def test_pool_errors(lens, idx, kwargs, match):
    inputs, pool, fwd_kw, _ = _pool_inputs(lens, seed=28, P=4)
    kw = {**fwd_kw, "initial_state": pool, "ssm_state_indices": torch.tensor(idx), **kwargs}
    with pytest.raises(ValueError, match=match):
        kda_decode_pool(*inputs, **kw)


# ------------------------------------------------------------------------------------------------
# simple GLA / lightning attention


def make_gla(B, T, H, K, V, seed, h0=False, lens=None, v_first=False):
    gen = rng(seed)
    if lens is not None:
        B, T = 1, sum(lens)
    q, k, v = randn(gen, B, T, H, K), randn(gen, B, T, H, K), randn(gen, B, T, H, V)
    g_gamma = -torch.rand(H, generator=gen)
    N = len(lens) if lens is not None else B
    init = None
    if h0:
        init = randn(gen, N, H, V, K) if v_first else randn(gen, N, H, K, V)
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return (q, k, v, g_gamma), dict(initial_state=init, cu_seqlens=cu)


GLA_CASES = {
    "plain": dict(),
    "h0": dict(h0=True),
    "reverse": dict(reverse=True),
    "reverse_h0": dict(reverse=True, h0=True),
    "varlen_len1_len0_h0": dict(lens=[3, 1, 0, 2], h0=True),
    "varlen_reverse": dict(lens=[2, 0, 4], reverse=True, h0=True),
    "v_first_h0": dict(h0=True, v_first=True),
}


@pytest.mark.parametrize("name", list(GLA_CASES), ids=list(GLA_CASES))
def test_simple_gla_matches_direct(name):
    spec = GLA_CASES[name]
    v_first = spec.get("v_first", False)
    (q, k, v, gg), kw = make_gla(2, 5, 3, 4, 3, seed=31 + len(name), h0=spec.get("h0", False),
                                 lens=spec.get("lens"), v_first=v_first)
    o, ht = simple_gla_recurrent(q, k, v, gg, reverse=spec.get("reverse", False), state_v_first=v_first, **kw)
    h0 = kw["initial_state"]
    o_d, ht_d = direct_simple_gla(q, k, v, gg, initial_state=None if h0 is None else
                                  (h0.transpose(-1, -2) if v_first else h0),
                                  reverse=spec.get("reverse", False), cu_seqlens=kw["cu_seqlens"])
    assert o.dtype == F64 and max_abs(o, o_d) < 1e-10
    assert max_abs(ht.transpose(-1, -2) if v_first else ht, ht_d) < 1e-10


@pytest.mark.parametrize("name", ["plain", "h0", "reverse_h0", "varlen_len1_len0_h0"])
def test_simple_gla_matches_fla_naive(name):
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    spec = GLA_CASES[name]
    (q, k, v, gg), kw = make_gla(2, 32, 4, 16, 8, seed=41, h0=spec.get("h0", False), lens=spec.get("lens"))
    rev = spec.get("reverse", False)
    o, ht = simple_gla_recurrent(q, k, v, gg, reverse=rev, scale=0.4, **kw)
    cu = kw["cu_seqlens"]
    bounds = [(None, None)] if cu is None else list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
    o_parts, ht_parts = [], []
    for n, (s, e) in enumerate(bounds):
        xs = [x[:, s:e] for x in (q, k, v)]
        if rev:
            xs = [x.flip(1) for x in xs]
        g = gg.expand(xs[0].shape[0], xs[0].shape[1], -1)
        h0 = kw["initial_state"]
        h0 = h0 if cu is None or h0 is None else h0[n:n + 1]
        o_n, ht_n = naive_recurrent_simple_gla(*xs, g, scale=0.4, initial_state=h0, output_final_state=True)
        o_parts.append(o_n.flip(1) if rev else o_n)
        ht_parts.append(ht_n)
    o_fla, ht_fla = torch.cat(o_parts, 1), torch.cat(ht_parts, 0)
    assert fla_close(o, o_fla, 1e-5) and rel_rms(o, o_fla) < 1e-5
    assert fla_close(ht, ht_fla, 1e-5) and rel_rms(ht, ht_fla) < 1e-5


LIGHTNING_LAYERS = [(4, 0, 24), (4, 7, 24), (16, 23, 24), (6, 1, 3), (32, 0, 1), (8, 12, 12)]


@pytest.mark.parametrize("H, layer_idx, num_layers", LIGHTNING_LAYERS,
                         ids=[f"H{h}_layer{i}of{n}" for h, i, n in LIGHTNING_LAYERS])
def test_lightning_g_gamma_is_flas_bit_for_bit(monkeypatch, H, layer_idx, num_layers):
    """Capture the g_gamma FLA's own lightning functions compute by stubbing what they call."""
    import fla.ops.lightning_attn.chunk as chunk_mod
    import fla.ops.lightning_attn.fused_recurrent as rec_mod

    seen = []

    def stub(*args, **kwargs):
        seen.append(kwargs["g_gamma"])
        return None, None

    monkeypatch.setattr(rec_mod, "fused_recurrent_simple_gla", stub)
    monkeypatch.setattr(chunk_mod, "chunk_simple_gla", stub)
    q = torch.zeros(1, 2, H, 4)
    rec_mod.fused_recurrent_lightning_attn(q, q, q, layer_idx, num_layers)
    chunk_mod.chunk_lightning_attn(q, q, q, layer_idx, num_layers)
    ours = lightning_g_gamma(H, layer_idx, num_layers)
    assert ours.dtype == torch.float32 and ours.shape == (H,)
    assert len(seen) == 2
    for fla_g in seen:
        assert fla_g.dtype == torch.float32 and torch.equal(fla_g, ours)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_lightning_recurrent_is_simple_gla_with_g_gamma(reverse):
    (q, k, v, _), kw = make_gla(2, 6, 4, 4, 3, seed=51, lens=[2, 1, 0, 3], h0=True)
    o, ht = lightning_recurrent(q, k, v, 3, 8, reverse=reverse, **kw)
    o_d, ht_d = direct_simple_gla(q, k, v, lightning_g_gamma(4, 3, 8), reverse=reverse, **kw)
    assert max_abs(o, o_d) < 1e-10 and max_abs(ht, ht_d) < 1e-10
    assert lightning_recurrent(q, k, v, 3, 8, output_final_state=False, **kw)[1] is None


# ------------------------------------------------------------------------------------------------
# inputs are never modified


def test_no_function_modifies_its_inputs():
    inputs, ref_kw, _ = make_kda(KDACase(h0=True, gate="softplus_bias", l2norm=True, beta_sigmoid=True), seed=61)
    tensors = [*inputs, ref_kw["initial_state"], ref_kw["A_log"], ref_kw["dt_bias"]]
    before = [t.clone() for t in tensors]
    kda_recurrent(*inputs, **ref_kw)
    kda_gate(inputs[3], ref_kw["A_log"], ref_kw["dt_bias"])
    # float64 inputs too (where a .to(float64) would not copy)
    inputs64 = [x.to(F64) for x in inputs]
    h064 = ref_kw["initial_state"].to(F64)
    snap64 = [x.clone() for x in (*inputs64, h064)]
    kda_recurrent(*inputs64, **{**ref_kw, "initial_state": h064})
    kda_decode_pool(*inputs64, initial_state=h064, ssm_state_indices=torch.tensor([[1, 0, 1, 0, 1], [0, 1, 0, 1, 0]]))
    kda_decode_pool(*inputs64, initial_state=h064)
    (q, k, v, gg), kw = make_gla(2, 4, 2, 4, 3, seed=62, h0=True)
    q, k, v, gg, h0g = (x.to(F64) for x in (q, k, v, gg, kw["initial_state"]))
    snap_gla = [x.clone() for x in (q, k, v, gg, h0g)]
    simple_gla_recurrent(q, k, v, gg, initial_state=h0g)
    lightning_recurrent(q, k, v, 1, 4, initial_state=h0g, reverse=True)
    for a, b in zip(tensors, before, strict=True):
        assert torch.equal(a, b)
    for a, b in zip((*inputs64, h064), snap64, strict=True):
        assert torch.equal(a, b)
    for a, b in zip((q, k, v, gg, h0g), snap_gla, strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# comparison helpers


def test_rel_rms_and_fla_close():
    ref = torch.tensor([3.0, 4.0])
    assert rel_rms(ref, ref) == 0.0
    assert rel_rms(ref, torch.tensor([3.0, 4.5])) == pytest.approx(0.1)
    assert rel_rms(torch.zeros(2), torch.ones(2)) == math.inf
    assert fla_close(ref, ref + 5e-7, 0.0)                      # max|diff| <= 1e-6 always passes
    assert fla_close(ref, torch.tensor([3.0, 4.04]), 0.01)      # RMS ratio 0.0283 / 3.536 = 0.008
    assert not fla_close(ref, torch.tensor([3.0, 4.5]), 0.05)
    assert not fla_close(ref, torch.tensor([3.0, float("nan")]), 1.0)
    with pytest.raises(ValueError, match="shapes differ"):
        rel_rms(ref, torch.zeros(3))


# ------------------------------------------------------------------------------------------------
# 3. against FLA's Triton kernels, run by the Triton interpreter on CPU

_WORKER = textwrap.dedent("""
    import sys, torch
    import fla.ops.common.fused_recurrent as common
    k = common.fused_recurrent_fwd_kernel
    while not hasattr(k, "configs"):   # one autotune config: the interpreter cannot benchmark
        k = k.fn
    k.configs = k.configs[:1]
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda, fused_recurrent_kda_fwd
    from fla.ops.lightning_attn import fused_recurrent_lightning_attn
    from fla.ops.simple_gla.fused_recurrent import fused_recurrent_simple_gla
    fns = dict(fused_recurrent_kda=fused_recurrent_kda, fused_recurrent_kda_fwd=fused_recurrent_kda_fwd,
               fused_recurrent_lightning_attn=fused_recurrent_lightning_attn,
               fused_recurrent_simple_gla=fused_recurrent_simple_gla)
    cases = torch.load(sys.argv[1])
    results = {}
    for name, (fn, args, kwargs) in cases.items():
        o, ht = fns[fn](*args, **kwargs)
        pool = kwargs.get("initial_state") if kwargs.get("inplace_final_state", True) and fn.endswith("_fwd") else None
        results[name] = (o.clone(), None if ht is None else ht.clone(), pool)
    torch.save(results, sys.argv[2])
""")


def _interp_cases():
    """name -> (FLA function, args, kwargs, our reference as a thunk)."""
    cases = {}
    for name in ["gva_2x", "gate_lower_bound_A_log_none", "headwise_beta_sigmoid_neg", "state_v_first_h0",
                 "varlen_gva_v_first_all_flags", "all_flags_gva4_headwise"]:
        case = replace(KDA_CASES[name], K=8, V=8)
        inputs, ref_kw, _ = make_kda(case, seed=71 + len(name))
        fla_kw = dict(ref_kw, output_final_state=True)
        cases[f"kda:{name}"] = ("fused_recurrent_kda", inputs, fla_kw,
                                lambda i=inputs, r=ref_kw: kda_recurrent(*i, **r))
    for name, lens, idx, acc, v_first in [
        ("1d_decode", [1, 1, 0, 1], [5, 1, 3, 0], None, False),
        ("2d_spec", [3, 1, 0, 2], [[3, 4, 5], [6, 7, 8], [9, 10, 11], [0, 1, 2]], [2, 1, 3, 3], False),
        ("2d_v_first_headwise", [2, 2], [[1, 2], [5, 0]], [1, 2], True),
    ]:
        inputs, pool, fwd_kw, _ = _pool_inputs(lens, seed=81 + len(name), P=12, K=8, V=8, v_first=v_first,
                                               headwise="headwise" in name)
        kw = dict(fwd_kw, initial_state=pool.clone(), ssm_state_indices=torch.tensor(idx, dtype=torch.int32),
                  num_accepted_tokens=None if acc is None else torch.tensor(acc, dtype=torch.int32))
        cases[f"pool:{name}"] = ("fused_recurrent_kda_fwd", inputs, kw,
                                 lambda i=inputs, kw=dict(kw, initial_state=pool): kda_decode_pool(*i, **kw))
    for name, spec in [("reverse_h0", dict(reverse=True, h0=True)), ("varlen", dict(lens=[3, 0, 1, 2], h0=True)),
                       ("v_first", dict(h0=True, v_first=True))]:
        v_first = spec.get("v_first", False)
        (q, k, v, gg), kw = make_gla(2, 5, 2, 8, 8, seed=91, h0=spec["h0"], lens=spec.get("lens"), v_first=v_first)
        fla_kw = dict(kw, g_gamma=gg, reverse=spec.get("reverse", False), state_v_first=v_first,
                      output_final_state=True)
        cases[f"gla:{name}"] = ("fused_recurrent_simple_gla", (q, k, v), fla_kw,
                                lambda a=(q, k, v, gg), f=fla_kw: simple_gla_recurrent(
                                    *a, **{x: y for x, y in f.items() if x != "g_gamma"}))
    (q, k, v, _), kw = make_gla(1, 6, 4, 8, 8, seed=95, lens=[4, 2], h0=True)
    cases["lightning:varlen_reverse"] = ("fused_recurrent_lightning_attn", (q, k, v, 2, 6),
                                         dict(kw, reverse=True, output_final_state=True),
                                         lambda a=(q, k, v), kw=kw: lightning_recurrent(*a, 2, 6, reverse=True, **kw))
    return cases


INTERP_CASES = _interp_cases()


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    d = tmp_path_factory.mktemp("interp")
    torch.save({n: (fn, args, kw) for n, (fn, args, kw, _) in INTERP_CASES.items()}, d / "in.pt")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _WORKER, str(d / "in.pt"), str(d / "out.pt")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(d / "out.pt")


@pytest.mark.parametrize("name", list(INTERP_CASES), ids=list(INTERP_CASES))
def test_matches_fla_triton_kernel_interpreted(interpreted, name):
    o_fla, ht_fla, pool_fla = interpreted[name]
    o, ht = INTERP_CASES[name][3]()
    assert fla_close(o, o_fla, 1e-5) and rel_rms(o, o_fla) < 1e-5
    assert fla_close(ht, pool_fla if pool_fla is not None else ht_fla, 1e-5)


# ----------------------------------------------------------------------------------------------
# the forget bound (a sequence split's certificate for starting a segment early from a zero state)
def _forget_case(regime: str, T: int = 256, HV: int = 4, K: int = 128, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    A_log = torch.log(torch.empty(HV, dtype=F64).uniform_(1, 16, generator=g))
    dt_bias = 0.5 * torch.randn(HV, K, dtype=F64, generator=g)
    if regime == "fast":
        A_log, dt_bias = torch.zeros_like(A_log), torch.zeros_like(dt_bias)
    if regime == "slow":
        dt_bias[:, : K // 4] = -13.0
    x = dict(q=torch.randn(1, T, HV, K, dtype=F64, generator=g), k=torch.randn(1, T, HV, K, dtype=F64, generator=g),
             v=torch.randn(1, T, HV, K, dtype=F64, generator=g), g=torch.randn(1, T, HV, K, dtype=F64, generator=g),
             beta=torch.randn(1, T, HV, dtype=F64, generator=g))
    return x, A_log, dt_bias.reshape(-1)


@pytest.mark.parametrize("regime", ["fast", "random", "slow"])
def test_forget_bound_holds_and_separates_the_gate_regimes(regime):
    """Two runs over the same w chunks from different start states end within 2^(sum of the chunks' bounds) of each
    other (the spectral-norm argument of kda_forget_bound); fast-decaying gates certify 2^-24 in one chunk, the gates
    of FLA's tests and of trained models (a slow channel) do not certify it in four."""
    x, A_log, dt_bias = _forget_case(regime)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
              use_beta_sigmoid_in_kernel=True, output_final_state=True)
    g = torch.Generator().manual_seed(11)
    S0, S1 = (torch.randn(1, 4, 128, 128, dtype=F64, generator=g) for _ in range(2))
    b = kda_forget_bound(kda_gate(x["g"], A_log, dt_bias, -5.0))       # [1, 4, HV]
    assert b.shape == (1, 4, 4) and bool((b <= 0).all())
    for w in (1, 2, 4):
        sl = {n: t[:, : 64 * w] for n, t in x.items()}
        _, e0 = kda_recurrent(**sl, initial_state=S0, **kw)
        _, e1 = kda_recurrent(**sl, initial_state=S1, **kw)
        got = (e1 - e0).flatten(2).norm(dim=-1)[0]                       # [HV]
        bound = torch.exp2(b[0, :w].sum(0)) * (S1 - S0).flatten(2).norm(dim=-1)[0]
        assert bool((got <= bound * (1 + 1e-9)).all()), (w, got, bound)
    four = b[0].sum(0)
    if regime == "fast":
        assert bool((b < -24).all()), b
    elif regime == "random":  # a head whose slowest channel (exp(A_log) large, dt_bias < 0) barely decays
        assert bool((four > -24).any()), four
    else:
        assert bool((four > -4).all()), four   # 1 - exp(a) < 0.01 per token on a quarter of the channels


def test_forget_bound_tail_chunk_and_shape():
    a = -torch.rand(2, 70, 3, 8, dtype=F64)
    b = kda_forget_bound(a, chunk=64)
    assert b.shape == (2, 2, 3)
    want_tail = a[:, 64:].amax(-1).sum(1) / math.log(2)
    assert torch.allclose(b[:, 1], want_tail)

