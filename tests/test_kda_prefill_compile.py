"""CPU tests of the fused KDA prefill forward (csrc/kda_sm90/, fla_cula/kernels/kda_prefill.py):

- the chunk algorithm the kernel implements (docs/kda_sm90.md section 1 and "v1 as built": chunk 64 in
  four 16-token blocks, integer-anchored gate factors, blocked fp32 inverse, the WY products, with the
  kernel's bf16 rounding points), modelled in torch on the CPU, is within rel-RMS 0.005 of the fp64
  recurrence (fla_cula.reference.kda.kda_recurrent) on o and the final state, for tails, T < 64,
  varlen with an empty sequence, GVA, lb = -5 with random and slow-decay gates (and so is the same algorithm at
  chunk 32, two 16-token blocks: the next kernel step's design, checked before its code). This model is the
  spec of the CUDA code: the first thing to compare with when the GPU disagrees (kda_chunk_model
  also returns the Aqk / Akk the kernel writes under grad);
- every exponent the model forms is <= 0 (factors e, f, Qg, Kg, Kd, gamma) and every power-of-two
  block scalar 2^(A_r - B_s) is <= 2^118 (the bound of docs/kda_sm90.md 1.3);
- the extension exposes kda_fwd, its argument checks name expected and actual values (CPU tensors);
- the plan's fallback reasons for calls outside v1's scope (on meta tensors, no GPU needed);
- the SASS of the built kernels: HMMA present, no local memory (spills).

    python -m pytest -q -s tests/test_kda_prefill_compile.py
"""

import functools
import math
import os
import re

import pytest
import torch

from fla_cula import _ext
from fla_cula.ops.chunk_autograd import KDAChunkConfig
from fla_cula.reference.compare import rel_rms
from fla_cula.reference.kda import kda_recurrent

C = 64          # chunk
BC = 16         # sub-block
LOG2E = 1.4426950408889634


def _bf(x: torch.Tensor) -> torch.Tensor:
    """Round to bf16 and back to fp32 (a kernel rounding point)."""
    return x.to(torch.bfloat16).to(torch.float32)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """An MMA with fp32 accumulation of exact (bf16) operands: fp64 product, fp32 result."""
    return (a.double() @ b.double()).float()


def kda_chunk_model(q, k, v, g, beta, *, A_log, dt_bias, lower_bound, scale, initial_state=None,
                    use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False,
                    cu_seqlens=None, state_v_first=False, bounds=None, chunk=C, chunk_states=None):
    """The kernel's algorithm in fp32 torch with its bf16 rounding points.

    Inputs as chunk_kda (q, k [B,T,H,128] bf16; v [B,T,HV,128]; g raw gate [B,T,HV,128]; beta raw
    [B,T,HV]); sigmoid-form gate with lower_bound. Returns (o [B,T,HV,V] (bf16 values as fp32),
    ht [N,HV,K,V] fp32 in the caller's layout, Aqk [B,T,HV,chunk], Akk [B,T,HV,chunk] (bf16 values)).
    `chunk` 64 is the kernel's; 32 is the chunk-32 design of docs/kda_sm90.md (two 16-token blocks).
    `bounds` (a dict) collects the largest exponent of each factor kind (all must be <= 0) and the
    largest block scalar exponent A_r - B_s. `chunk_states` (a list) collects bf16(S) [HV, K, V] at every chunk
    start, sequence by sequence (FLA's h, return_intermediate_states).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    grp = HV // H
    f32 = torch.float32
    qf = q.float().repeat_interleave(grp, dim=2)
    kf = k.float().repeat_interleave(grp, dim=2)
    vf, gf = v.float(), g.float()
    bf = beta.float()
    if use_beta_sigmoid_in_kernel:
        bf = torch.sigmoid(bf) * (2.0 if allow_neg_eigval else 1.0)
    expA = torch.ones(HV, dtype=f32) if A_log is None else torch.exp(A_log.float().reshape(HV))
    dtb = torch.zeros(HV, K, dtype=f32) if dt_bias is None else dt_bias.float().reshape(HV, K)
    if cu_seqlens is None:
        seqs = [(b, 0, T) for b in range(B)]
    else:
        cu = [int(x) for x in cu_seqlens.tolist()]
        seqs = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    N = len(seqs)
    o = torch.zeros(B, T, HV, V, dtype=f32)
    C, nb = chunk, chunk // BC
    Aqk_out = torch.zeros(B, T, HV, C, dtype=f32)
    Akk_out = torch.zeros(B, T, HV, C, dtype=f32)
    if initial_state is None:
        S0 = torch.zeros(N, HV, K, V, dtype=f32)
    else:
        S0 = initial_state.float().transpose(-1, -2) if state_v_first else initial_state.float()
    ht = torch.zeros(N, HV, K, V, dtype=f32)
    bounds = {} if bounds is None else bounds

    def note(name, x):
        if x.numel():
            bounds[name] = max(bounds.get(name, -math.inf), float(x.max()))

    rows = torch.arange(C)
    causal = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    for n, (b, bos, eos) in enumerate(seqs):
        S = S0[n].clone()                                     # [HV, K, V] fp32
        for c0 in range(bos, eos, C):
            if chunk_states is not None:
                chunk_states.append(_bf(S))
            Lr = min(C, eos - c0)
            sl = slice(c0, c0 + Lr)

            def pad(x, Lr=Lr):                                 # [Lr, HV, D] -> [HV, C, D], rows >= L zero
                out = torch.zeros(C, *x.shape[1:], dtype=f32)
                out[:Lr] = x
                return out.transpose(0, 1)

            qc, kc, vc, gc = pad(qf[b, sl]), pad(kf[b, sl]), pad(vf[b, sl]), pad(gf[b, sl])
            bc = pad(bf[b, sl].unsqueeze(-1)).squeeze(-1)     # [HV, 64]
            if use_qk_l2norm_in_kernel:
                qc = qc * torch.rsqrt(qc.square().sum(-1, keepdim=True) + 1e-6)
                kc = kc * torch.rsqrt(kc.square().sum(-1, keepdim=True) + 1e-6)
            # gate -> a (rows >= L: 0) -> G, chunk-local cumsum in log2 units
            a = lower_bound * torch.sigmoid(expA[:, None, None] * (gc + dtb[:, None, :]))
            a[:, Lr:] = 0
            G = torch.cumsum(a * LOG2E, dim=1)                 # [HV, 64, K]
            nr = torch.stack([G[:, BC * r] for r in range(nb)] + [G[:, C - 1]], 1)  # [HV, nb + 1, K]
            Aanc = torch.ceil(nr[:, :nb])                      # row anchors A_r
            Banc = torch.floor(nr[:, 1:])                      # column anchors B_s
            blk = rows // BC
            Arow = Aanc[:, blk]                                # [HV, 64, K]: A_{r(i)}
            Bcol = Banc[:, blk]
            note("e", G - Arow)
            note("f", Bcol - G)
            note("Qg/Kg", G)
            note("Kd", G[:, C - 1:C] - G)
            Qe = _bf(scale * qc * torch.exp2(G - Arow))
            Ke = _bf(kc * torch.exp2(G - Arow))
            Kf = _bf(kc * torch.exp2(Bcol - G))
            Aqk = torch.zeros(HV, C, C, dtype=f32)
            Lm = torch.zeros(HV, C, C, dtype=f32)
            for r in range(nb):
                rs = slice(BC * r, BC * r + BC)
                for s in range(r + 1):
                    ss = slice(BC * s, BC * s + BC)
                    e2 = (Aanc[:, r] - Banc[:, s])             # [HV, K] integer exponents
                    note("P", e2)
                    p2 = torch.exp2(e2)[:, None, :]
                    Aqk[:, rs, ss] = _mm(_bf(Qe[:, rs] * p2), Kf[:, ss].transpose(1, 2))
                    Lm[:, rs, ss] = _mm(_bf(Ke[:, rs] * p2), Kf[:, ss].transpose(1, 2))
            Aqk = _bf(torch.where(causal, Aqk, 0.0))
            Lm = torch.where(strict, Lm * bc[:, :, None], 0.0)
            eye = torch.eye(C, dtype=torch.float64)
            X = torch.linalg.solve_triangular(eye + Lm.double(), eye.expand(HV, C, C), upper=False).float()
            AkkB = _bf(X * bc[:, None, :])                     # Akk diag(b)
            Kg = _bf(kc * torch.exp2(G))
            Wn = _bf(-_mm(AkkB, Kg))                            # -W, [HV, 64, K]
            Sb = _bf(S)                                        # bf16 S operand
            Vp = _bf(_mm(AkkB, vc) + _mm(Wn, Sb))              # V' = U - W S
            Qg = _bf(scale * qc * torch.exp2(G))
            Oc = _mm(Qg, Sb) + _mm(Aqk, Vp)
            Kd = _bf(kc * torch.exp2(G[:, C - 1:C] - G))
            gamma = torch.exp2(G[:, C - 1])                    # [HV, K]
            S = gamma[:, :, None] * S + _mm(Kd.transpose(1, 2), Vp)
            o[b, sl] = _bf(Oc[:, :Lr]).transpose(0, 1)
            Aqk_out[b, sl] = Aqk[:, :Lr].transpose(0, 1)
            Akk_out[b, sl] = _bf(X[:, :Lr]).transpose(0, 1)
        ht[n] = S
    if state_v_first:
        ht = ht.transpose(-1, -2).contiguous()
    return o, ht, Aqk_out, Akk_out


def _inputs(B, T, H, HV, gate="random", seed=0, h0=True):
    gen = torch.Generator().manual_seed(seed)
    K = V = 128
    q = torch.randn(B, T, H, K, generator=gen).to(torch.bfloat16)
    k = torch.randn(B, T, H, K, generator=gen).to(torch.bfloat16)
    v = torch.randn(B, T, HV, V, generator=gen).to(torch.bfloat16)
    g = (2 * torch.randn(B, T, HV, K, generator=gen)).to(torch.bfloat16)
    beta = torch.randn(B, T, HV, generator=gen).to(torch.bfloat16)
    A_log = torch.randn(HV, generator=gen) * 0.5
    dt_bias = torch.randn(HV * K, generator=gen) * 0.5
    if gate == "slow":
        # a quarter of the channels decay < 0.01/token: sigmoid(z) < 0.002 with lb = -5
        dt_bias = dt_bias.reshape(HV, K)
        dt_bias[:, ::4] = -12.0
        dt_bias = dt_bias.reshape(-1)
    elif gate == "fast":
        dt_bias = dt_bias + 8.0                                # sigmoid ~ 1: a ~ lb every token
    N = B
    h0t = torch.randn(N, HV, K, V, generator=gen) * 0.5 if h0 else None
    return q, k, v, g, beta, A_log, dt_bias, h0t


CASES = [
    # (B, T, H, HV, gate)
    (1, 1, 2, 2, "random"),
    (2, 63, 1, 2, "random"),
    (1, 64, 2, 2, "slow"),
    (1, 65, 1, 1, "random"),
    (1, 200, 1, 2, "slow"),
    (1, 200, 1, 1, "fast"),
    (1, 200, 2, 4, "random"),
]


@pytest.mark.parametrize("chunk", [64, 32])
@pytest.mark.parametrize("B, T, H, HV, gate", CASES, ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-HV{c[3]}-{c[4]}" for c in CASES])
def test_chunk_model_matches_fp64_recurrence(B, T, H, HV, gate, chunk):
    q, k, v, g, beta, A_log, dt_bias, h0 = _inputs(B, T, H, HV, gate)
    lb, scale = -5.0, 128 ** -0.5
    bounds = {}
    o, ht, Aqk, Akk = kda_chunk_model(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lb, scale=scale,
                                      initial_state=h0, bounds=bounds, chunk=chunk)
    o_ref, ht_ref = kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                                  dt_bias=dt_bias, lower_bound=lb, use_beta_sigmoid_in_kernel=True)
    eo, eh = rel_rms(o_ref, o), rel_rms(ht_ref, ht)
    print(f"\nchunk {chunk} B{B} T{T} H{H} HV{HV} {gate}: o {eo:.2e}  ht {eh:.2e}  bounds {bounds}")
    assert eo < 0.005 and eh < 0.005, (eo, eh)
    for kind in ("e", "f", "Qg/Kg", "Kd"):
        assert bounds[kind] <= 0.0, (kind, bounds)
    assert bounds["P"] <= 118, bounds
    assert not torch.isnan(Aqk).any() and not torch.isnan(Akk).any()
    assert (torch.triu(Akk[0, : min(T, chunk), 0].reshape(-1, chunk)[:, : min(T, chunk)], 1) == 0).all()


@pytest.mark.parametrize("chunk", [64, 32])
def test_chunk_model_varlen_gva_state_layout(chunk):
    """Varlen with an empty sequence first and last, tails, no h0 / h0 in [V, K] layout, allow_neg_eigval."""
    cu = torch.tensor([0, 0, 70, 70, 133, 197, 197], dtype=torch.int64)
    T = int(cu[-1])
    q, k, v, g, beta, A_log, dt_bias, _ = _inputs(1, T, 1, 2, "slow", seed=3, h0=False)
    N, lb, scale = len(cu) - 1, -2.5, 0.1
    h0 = torch.randn(N, 2, 128, 128, generator=torch.Generator().manual_seed(5)) * 0.5
    o, ht, _, _ = kda_chunk_model(q, k, v, g, beta, A_log=None, dt_bias=dt_bias, lower_bound=lb, scale=scale,
                                  initial_state=h0, allow_neg_eigval=True, cu_seqlens=cu, state_v_first=True,
                                  chunk=chunk)
    o_ref, ht_ref = kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=None,
                                  dt_bias=dt_bias, lower_bound=lb, use_beta_sigmoid_in_kernel=True,
                                  allow_neg_eigval=True, state_v_first=True, cu_seqlens=cu)
    eo, eh = rel_rms(o_ref, o), rel_rms(ht_ref, ht)
    print(f"\nchunk {chunk} varlen: o {eo:.2e}  ht {eh:.2e}")
    assert eo < 0.005 and eh < 0.005, (eo, eh)
    assert torch.equal(ht[0], h0[0]) and torch.equal(ht[2], h0[2]) and torch.equal(ht[5], h0[5])


def _split_model(q, k, v, g, beta, h0, segs, **kw):
    """The exact two-pass sequence split on kda_chunk_model (one sequence, fixed length): pass 1 runs each segment
    s < P - 1 from its own start (h0 for s = 0, else 0) to its end state H_s and, for s >= 1, the same recurrence on
    v = 0 from the identity to its transition map M_s; the combine (fla_cula's, in fp64) makes the true start states;
    pass 2 runs every segment from its start. segs: the token bounds [(t0, t1), ...], multiples of 64."""
    HV = v.shape[2]
    eye = torch.eye(128).expand(1, HV, 128, 128).contiguous()
    zero = torch.zeros(1, HV, 128, 128)
    H, M = [], []
    for s, (t0, t1) in enumerate(segs[:-1]):
        sl = (slice(None), slice(t0, t1))
        H.append(kda_chunk_model(q[sl], k[sl], v[sl], g[sl], beta[sl], initial_state=h0 if s == 0 else zero, **kw)[1])
        if s >= 1:
            M.append(kda_chunk_model(q[sl], k[sl], torch.zeros_like(v[sl]), g[sl], beta[sl], initial_state=eye,
                                     **kw)[1])
    seg_H = torch.stack(H)
    seg_M = torch.stack(M) if M else torch.zeros(0, 1, HV, 128, 128)
    from fla_cula.kernels.kda_prefill import combine_segments
    combine_segments(seg_H, seg_M)
    outs, ht = [], None
    for s, (t0, t1) in enumerate(segs):
        sl = (slice(None), slice(t0, t1))
        o, ht, _, _ = kda_chunk_model(q[sl], k[sl], v[sl], g[sl], beta[sl],
                                      initial_state=h0 if s == 0 else seg_H[s - 1], **kw)
        outs.append(o)
    return torch.cat(outs, 1), ht


@pytest.mark.parametrize("gate", ["slow", "random"])
def test_split_model_is_exact(gate):
    """The split's numerics before any kernel: at T = 1024 (16 chunks) in 4 segments, on slow-decay gates (transition
    maps near the identity) and random ones, o and the final state are as close to the fp64 recurrence as the
    unsplit algorithm's (no approximation: the split only regroups the fp32 products) and within the 0.005 bar."""
    _ext_or_skip()  # combine_segments lives in the extension's host module
    q, k, v, g, beta, A_log, dt_bias, h0 = _inputs(1, 1024, 1, 2, gate, seed=7)
    kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, scale=128 ** -0.5)
    o1, ht1, _, _ = kda_chunk_model(q, k, v, g, beta, initial_state=h0, **kw)
    o2, ht2 = _split_model(q, k, v, g, beta, h0, [(0, 256), (256, 512), (512, 768), (768, 1024)], **kw)
    o_ref, ht_ref = kda_recurrent(q, k, v, g, beta, scale=kw["scale"], initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                                  dt_bias=dt_bias, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True)
    e1 = (rel_rms(o_ref, o1), rel_rms(ht_ref, ht1))
    e2 = (rel_rms(o_ref, o2), rel_rms(ht_ref, ht2))
    d = (rel_rms(o1, o2), rel_rms(ht1, ht2))
    print(f"\nsplit model {gate}: unsplit o {e1[0]:.2e} ht {e1[1]:.2e} | split o {e2[0]:.2e} ht {e2[1]:.2e} | "
          f"split vs unsplit o {d[0]:.2e} ht {d[1]:.2e}")
    assert max(e2) < 0.005, e2
    assert e2[0] <= 1.1 * e1[0] and e2[1] <= 1.1 * e1[1], (e1, e2)


# ---------------------------------------------------------------------------------------------
# The extension and the plan (no GPU needed)
# ---------------------------------------------------------------------------------------------


def _ext_or_skip():
    ok, why = _ext.available()
    if not ok:
        pytest.skip(why)
    return _ext.require()


def test_extension_exposes_kda_fwd():
    mod = _ext_or_skip()
    assert hasattr(mod, "kda_fwd")
    fams = {f["name"]: f for f in mod.kernels()}
    assert "kda_prefill" in fams
    for s in fams["kda_prefill"]["specializations"]:
        # 256 threads, but the one-warpgroup kda_state_rs_kernel<false, 64>
        assert s["threads"] == (128 if s["state_rs"] and s["block_v"] == 64 else 256), s
        assert 0 < s["smem_bytes"] <= 227 * 1024


def _abi_args(q):
    B, T, H, K = q.shape
    x = torch.zeros(B, T, 2 * H, 128, dtype=torch.bfloat16)
    return (q, q, x, x, torch.zeros(B, T, 2 * H), None, None, None, None, x, None, None, None, 0.1, -1.0, True, True,
            1.0, False)


@pytest.mark.parametrize("q, err, match", [
    (torch.zeros(1, 4, 2, 128), TypeError, r"^q: expected dtype bfloat16, got float32$"),
    (torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16), ValueError,
     r"^q: expected head dim 128, got shape \(1, 4, 2, 64\)$"),
    (torch.zeros(1, 4, 128, 2, dtype=torch.bfloat16).transpose(2, 3), ValueError, r"^q: expected a contiguous tensor"),
    (torch.zeros(1, 4, 2, 128, dtype=torch.bfloat16), ValueError, r"^q: expected a CUDA tensor, got cpu$"),
], ids=["float", "K64", "strided", "cpu"])
def test_abi_errors_name_expected_and_actual(q, err, match):
    mod = _ext_or_skip()
    with pytest.raises(err, match=match):
        mod.kda_fwd(*_abi_args(q))


def _cfg(**kw):
    base = dict(scale=128 ** -0.5, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False, safe_gate=True, lower_bound=-5.0,
                state_v_first=True, chunk_size=64, disable_recompute=False, return_intermediate_states=False,
                cp=False, use_graph=False)
    base.update(kw)
    return KDAChunkConfig(**base)


def _plan_args(device="meta", K=128, dtype=torch.bfloat16, beta_dtype=torch.float32, h0=True, T=100, **cfg):
    B, H, HV = 1, 2, 4
    q = torch.empty(B, T, H, K, dtype=dtype, device=device)
    v = torch.empty(B, T, HV, K, dtype=dtype, device=device)
    g = torch.empty(B, T, HV, K, dtype=dtype, device=device)
    beta = torch.empty(B, T, HV, dtype=beta_dtype, device=device)
    A_log = torch.empty(HV, dtype=torch.float32, device=device)
    dt_bias = torch.empty(HV * K, dtype=torch.float32, device=device)
    s = torch.empty(B, HV, K, K, dtype=torch.float32, device=device) if h0 else None
    return (q, q.clone(), v, g, beta, A_log, dt_bias, s, None, None, _cfg(**cfg))


def _plan():
    _ext_or_skip()
    from fla_cula.kernels import kda_prefill

    return kda_prefill.plan


@pytest.mark.parametrize("cfg, match", [
    (dict(lower_bound=-6.0, safe_gate=False), "lower_bound"),
    (dict(return_intermediate_states=True, chunk_size=32), "return_intermediate_states with chunk_size=32"),
    (dict(cp=True), "cp_context"),
    (dict(use_graph=True), "use_graph"),
], ids=["lb-out-of-range", "intermediate-chunk32", "cp", "graph"])
def test_plan_reasons(cfg, match):
    import re

    r, go = _plan()(*_plan_args(**cfg))
    assert go is None and r is not None and re.search(match, r), r


@pytest.mark.parametrize("cfg", [dict(lower_bound=None, safe_gate=False), dict(use_gate_in_kernel=False)],
                         ids=["softplus", "precomputed"])
def test_plan_unbounded_gates(cfg, monkeypatch):
    """The unbounded gates: the plan's memoized answer holds no reason; per call, with UNBOUNDED_ROUTED on (the
    default), served in inference and under grad; turned off, the reason that sends them to FLA in both; a reason
    where set_tuning turned the two-kernel form off; the two-kernel plan is taken even where the fused kernel would be
    predicted faster (it takes the bounded gate only)."""
    from fla_cula.kernels import kda_prefill
    plan = _plan()
    monkeypatch.setattr(kda_prefill, "ROUTE_BY_COST", False)
    args = _plan_args(**cfg)
    r, go = plan(*args)
    assert r is None, r
    assert kda_prefill.gate_form(args[-1]) == ("softplus" if "lower_bound" in cfg else "precomputed")
    x = args[0].clone().requires_grad_(True)
    assert kda_prefill.UNBOUNDED_ROUTED
    assert go.size_reason(*args) is None
    assert go.size_reason(x, *args[1:]) is None
    monkeypatch.setattr(kda_prefill, "UNBOUNDED_ROUTED", False)
    assert go.size_reason(*args) == go.size_reason(x, *args[1:]) == kda_prefill.UNBOUNDED_WAIT_REASON
    monkeypatch.setattr(kda_prefill, "UNBOUNDED_ROUTED", True)
    try:
        kda_prefill.set_tuning(two_kernel=False)
        assert "two-kernel form only" in go.size_reason(*args)
    finally:
        kda_prefill.set_tuning()
    if "lower_bound" not in cfg:  # precomputed: A_log / dt_bias are not read (as FLA), whatever their dtype
        bad = list(args)
        bad[5] = bad[5].to(torch.float16)
        assert plan(*bad)[0] is None
    # a grid where the fused kernel is predicted faster (B4 T64 HV4): the bounded gate takes it, an unbounded one the
    # two-kernel plan
    lens, HV = [64] * 4, 4
    assert kda_prefill.two_kernel_choice(lens, HV, 132) is None
    assert kda_prefill.two_kernel_choice(lens, HV, 132, wide=True) is not None


def test_plan_reasons_tensors():
    plan = _plan()
    r, _ = plan(*_plan_args(K=64))
    assert r is not None and "128" in r, r
    r, _ = plan(*_plan_args(dtype=torch.float16))
    assert r is not None and "bfloat16" in r, r
    r, _ = plan(*_plan_args(beta_dtype=torch.float16))
    assert r is not None and "beta" in r, r


def test_plan_grad_only_reasons_are_per_call(monkeypatch):
    """chunk_size=32 and disable_recompute matter only under grad: the plan serves the call and says so
    per call through its size_reason hook."""
    from fla_cula.kernels import kda_prefill
    plan = _plan()
    monkeypatch.setattr(kda_prefill, "ROUTE_BY_COST", False)
    monkeypatch.setattr(kda_prefill, "ROUTE_GRAD", True)
    args = _plan_args(chunk_size=32)
    r, go = plan(*args)
    if r is not None and r.startswith(("no CUDA", "tensors on")):
        pytest.skip(r)
    assert r is None, r
    assert go.size_reason(*args) is None  # no grad here
    x = args[0].clone().requires_grad_(True)
    assert "chunk_size=32" in go.size_reason(x, *args[1:])


def test_routing_policy_per_call(monkeypatch):
    """The op's policy (not the kernel's scope): grad -> FLA while ROUTE_GRAD is off; otherwise the cost model
    (measured per-chunk time vs FLA's fitted time) decides; run() ignores the policy."""
    from fla_cula.kernels import kda_prefill
    monkeypatch.setattr(kda_prefill, "ROUTE_GRAD", False)
    monkeypatch.setitem(kda_prefill._TUNING, "roles", False)  # (its one launch is priced under FLA's here)
    plan = _plan()
    long = _plan_args(T=1024)   # B=1 T=1024, 4 value heads: 16 chunks; the two launches' fixed costs exceed FLA's
    r, go = plan(*long)
    if r is not None and r.startswith(("no CUDA", "tensors on")):
        pytest.skip(r)
    assert "does not pay on this grid" in go.size_reason(*long)
    args = _plan_args()                                   # T=100: two chunks per CTA, under FLA's fixed cost
    r, go = plan(*args)
    assert go.size_reason(*args) is None
    x = args[0].clone().requires_grad_(True)
    assert "grad -> FLA" in go.size_reason(x, *args[1:])
    monkeypatch.setattr(kda_prefill, "ROUTE_BY_COST", False)
    assert go.size_reason(*args) is None
    assert "grad -> FLA" in go.size_reason(x, *args[1:])
    monkeypatch.setattr(kda_prefill, "ROUTE_GRAD", True)
    assert go.size_reason(x, *args[1:]) is None
    monkeypatch.setattr(kda_prefill, "ROUTE_BY_COST", True)
    cu = torch.zeros(33, dtype=torch.int32, device="meta")
    assert "cu_seqlens_cpu" in go.size_reason(*args[:8], cu, None, args[10])   # varlen: host lengths needed
    monkeypatch.setattr(kda_prefill, "ROUTE_GRAD", False)
    monkeypatch.setattr(kda_prefill, "ROUTE_BY_COST", False)
    inter = _plan_args(return_intermediate_states=True)
    assert plan(*inter)[1].size_reason(*inter) is None                # h checked against FLA's on the H200
    monkeypatch.setattr(kda_prefill, "ROUTE_INTERMEDIATE", False)
    assert "return_intermediate_states -> FLA" in plan(*inter)[1].size_reason(*inter)
    monkeypatch.setattr(kda_prefill, "ROUTE_BY_COST", True)
    monkeypatch.setenv("FLA_CULA_FORCE", "1")                                    # coverage runs: no speed gates
    assert go.size_reason(*args) is None and go.size_reason(x, *args[1:]) is None


def test_routing_cost_model():
    """The predictions behind the routing, at the measured rows and around a wave boundary (132 SMs)."""
    from fla_cula.kernels import kda_prefill as kp

    def ratio(lens, HV):
        ours, fla = kp.predicted_us(lens, HV, 132)
        return ours / fla
    ours, fla = kp.predicted_us([8192] * 2, 64, 132)      # measured: 1.970 ms (v2.1) vs FLA 3.367 ms (session 20)
    assert abs(ours - 1971) < 1 and abs(fla - 3367) < 5
    for lens, HV, measured in (([8192], 8, 414), ([2048], 16, 178), ([32768], 16, 2195)):   # FLA, session 20
        assert abs(kp.fla_us(lens, HV) / measured - 1) < 0.08, (lens, HV, kp.fla_us(lens, HV))
    assert ratio([8192] * 2, 64) < kp.ROUTE_GAIN          # 128 pairs: one wave of 128-column CTAs
    assert ratio([4096] * 8, 64) < kp.ROUTE_GAIN          # 512 pairs: 4 full waves
    assert 0.7 < ratio([8192] * 3, 64) < kp.ROUTE_GAIN    # 192 pairs: a second, 45%-full wave (0.78: routed)
    assert ratio([8192] * 133, 1) > 1                     # 133 pairs: a second wave of one CTA (1.13)

    assert ratio([8192], 64) > 1 and ratio([8192], 8) > 1  # 64-column CTAs (<= 66 pairs): never routed
    assert ratio([8192] + [64] * 100, 64) > 1             # one long sequence dominates its CTAs' chain
    assert kp.predicted_us([], 64, 132) == (0.0, 0.0)


def test_two_kernel_plan_state_rs():
    """With state_rs the plan prices kda_state_rs_kernel (its own constants: predicted until measured) and is memoized
    apart from the default plan; forced segments and block_v still hold."""
    from fla_cula.kernels import kda_prefill as kp
    for lens, HV in (([8192] * 2, 64), ([8192], 8), ([256] * 64, 32)):
        a, b = kp.two_kernel_plan(lens, HV, 132), kp.two_kernel_plan(lens, HV, 132, state_rs=True)
        assert b.us < a.us, (a, b)                         # the predicted constants: faster on these rows
        assert kp.two_kernel_plan(lens, HV, 132) == a      # the default plan is not the state_rs one from the cache
    forced = kp.two_kernel_plan([8192], 8, 132, segments=3, block_v=128, state_rs=True)
    assert (forced.segments, forced.block_v) == (3, 128)
    # a chunk costs the longer of the chain and its bytes' share of DRAM with every concurrent CTA streaming
    one = kp._rs_pass_us([10], 1, 132, "pass2")
    assert one == 10 * kp.RS_CHAIN_US["pass2"] + kp.RS_WAVE_US
    full = kp._rs_pass_us([10], 132, 132, "pass2")
    assert full == 10 * kp.RS_BYTES["pass2"] * 132 / kp.RS_DRAM_BYTES_PER_US + kp.RS_WAVE_US


# ---------------------------------------------------------------------------------------------
# SASS of the built kernels
# ---------------------------------------------------------------------------------------------


def test_sass_hmma_no_spills():
    mod = _ext_or_skip()
    if _ext.cuobjdump() is None:
        pytest.skip("cuobjdump not found")
    sass = _ext.sass_opcodes(mod.__file__)
    usage = {r["symbol"]: r for r in _ext.resource_usage(mod.__file__)}
    names = _ext.demangle(list(sass))
    kda = [s for s in sass if "kda_fwd_kernel" in names[s] or "kda_prep_kernel" in names[s]
           or "kda_state_kernel" in names[s] or "kda_state_rs_kernel" in names[s]]
    assert len(kda) == 26, sorted(names.values())   # csrc/kda_sm90/kda_fwd.h kKdaFwdSpecializations
    for s in kda:
        arch, ops = sass[s]
        assert arch == "sm_90a"
        if "kda_state_kernel" not in names[s] and "kda_state_rs_kernel" not in names[s]:
            assert any(op.startswith("HMMA") for op in ops), sorted(ops)  # mma.sync products of the prep
        if "kda_fwd_kernel" not in names[s]:
            assert any(op.startswith("HGMMA") for op in ops), sorted(ops)  # the two-kernel form is wgmma-only
        assert any(op.startswith("LDGSTS") for op in ops), sorted(ops)    # cp.async prefetch
        r = usage[s]
        print(f"\n{names[s][:90]}: {r['registers']} regs, stack {r['stack']}, local {r['local']}")
        # The prep runs at the 128-register cap of two CTAs per SM without a spill; the instrumented build keeps one
        # prologue value (a sequence-bound offset, read twice per chunk) on the stack. Nothing else spills.
        stack_cap = 8 if re.search(r"kda_prep_kernel<[^,]*, true, ", names[s]) else 0
        assert r["stack"] <= stack_cap and r["local"] == 0, r
    assert os.path.exists(mod.__file__)


# ---------------------------------------------------------------------------------------------
# The CUDA kernel's own source, run on the CPU: csrc/kda_sm90/kda_fwd_kernel.cuh compiled by g++ with
# one std::thread per CUDA thread (barriers for __syncthreads, the warp-wide mma.sync and shuffles
# emulated from the PTX fragment layouts). It checks the kernel's indexing, phases and barriers
# against kda_chunk_model before any GPU run; shared memory is poisoned (0xff) per CTA and the outputs
# start as NaN, so a value read before it is written or a row left unwritten shows up.
# ---------------------------------------------------------------------------------------------

EMULATOR_CPP = r"""
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#include <cuda_bf16.h>
#include <vector_types.h>

#define __global__
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__
#ifndef __forceinline__
#define __forceinline__ inline
#endif

struct Idx { unsigned x = 0, y = 0, z = 0; };
thread_local Idx threadIdx;
Idx blockIdx;
namespace fla_cula::kda_sm90 { alignas(1024) unsigned char smem_raw[232448]; }
using fla_cula::kda_sm90::smem_raw;
std::barrier<>* g_bar;
std::barrier<>* g_wbar[8];
float g_x[8][32];
uint32_t g_a[8][32][4], g_b[8][32][2];
float g_c[8][32][4];

inline void __syncthreads() { g_bar->arrive_and_wait(); }
inline void __syncwarp() { g_wbar[threadIdx.x >> 5]->arrive_and_wait(); }
// stmatrix.x4.trans as the hardware does it: lane l writes stored row l % 8 of tile l / 8 at its own address, with
// the tile's column l % 8 gathered from the lanes that hold it (row r: lane 4 r + c / 2, half c % 2)
__nv_bfloat16* g_sp[8][32];
uint32_t g_sr[8][32][4];
inline void kda_emulated_stmatrix_trans(__nv_bfloat16* row, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  g_sp[w][l] = row;
  g_sr[w][l][0] = r0; g_sr[w][l][1] = r1; g_sr[w][l][2] = r2; g_sr[w][l][3] = r3;
  g_wbar[w]->arrive_and_wait();
  int m = l >> 3, j = l & 7;
  for (int r = 0; r < 8; ++r) {
    uint32_t x = g_sr[w][4 * r + j / 2][m];
    uint16_t bits = (j & 1) ? uint16_t(x >> 16) : uint16_t(x & 0xffff);
    std::memcpy(g_sp[w][l] + r, &bits, 2);
  }
  g_wbar[w]->arrive_and_wait();
}
// ldmatrix.x4 as the hardware does it: register m of lane l is row l / 4, columns 2 (l % 4) and + 1 of tile m,
// whose row j lane 8 m + j addressed
__nv_bfloat16 const* g_lp[8][32];
inline void kda_emulated_ldmatrix(uint32_t (&r)[4], __nv_bfloat16 const* row) {
  int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  g_lp[w][l] = row;
  g_wbar[w]->arrive_and_wait();
  for (int m = 0; m < 4; ++m) std::memcpy(&r[m], g_lp[w][8 * m + l / 4] + 2 * (l % 4), 4);
  g_wbar[w]->arrive_and_wait();
}
// ldmatrix.x4.trans: register m of lane l holds stored rows 2 (l % 4) and + 1 of tile m at column l / 4, whose row j
// lane 8 m + j addressed
inline void kda_emulated_ldmatrix_trans(uint32_t (&r)[4], __nv_bfloat16 const* row) {
  int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  g_lp[w][l] = row;
  g_wbar[w]->arrive_and_wait();
  for (int m = 0; m < 4; ++m) {
    uint16_t lo16, hi16;
    std::memcpy(&lo16, g_lp[w][8 * m + 2 * (l % 4)] + l / 4, 2);
    std::memcpy(&hi16, g_lp[w][8 * m + 2 * (l % 4) + 1] + l / 4, 2);
    r[m] = uint32_t(lo16) | (uint32_t(hi16) << 16);
  }
  g_wbar[w]->arrive_and_wait();
}
inline float __shfl_xor_sync(unsigned, float v, int o) {
  int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  g_x[w][l] = v;
  g_wbar[w]->arrive_and_wait();
  float r = g_x[w][l ^ o];
  g_wbar[w]->arrive_and_wait();
  return r;
}
bool g_any[8][32];
inline bool __any_sync(unsigned, bool p) {
  int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  g_any[w][l] = p;
  g_wbar[w]->arrive_and_wait();
  bool r = false;
  for (int i = 0; i < 32; ++i) r = r || g_any[w][i];
  g_wbar[w]->arrive_and_wait();
  return r;
}
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline long long clock64() { return std::chrono::steady_clock::now().time_since_epoch().count(); }
inline float __frcp_rn(float x) { return 1.f / x; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static float lo(uint32_t x) { return __bfloat162float(__ushort_as_bfloat16(uint16_t(x & 0xffff))); }
static float hi(uint32_t x) { return __bfloat162float(__ushort_as_bfloat16(uint16_t(x >> 16))); }
inline void kda_emulated_mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                             uint32_t b1) {
  int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  g_a[w][l][0] = a0; g_a[w][l][1] = a1; g_a[w][l][2] = a2; g_a[w][l][3] = a3;
  g_b[w][l][0] = b0; g_b[w][l][1] = b1;
  g_wbar[w]->arrive_and_wait();
  float A[16][16], B[16][8];
  for (int ln = 0; ln < 32; ++ln) {
    int g = ln >> 2, t = ln & 3;
    uint32_t const* a = g_a[w][ln];
    A[g][2 * t] = lo(a[0]); A[g][2 * t + 1] = hi(a[0]);
    A[g + 8][2 * t] = lo(a[1]); A[g + 8][2 * t + 1] = hi(a[1]);
    A[g][2 * t + 8] = lo(a[2]); A[g][2 * t + 9] = hi(a[2]);
    A[g + 8][2 * t + 8] = lo(a[3]); A[g + 8][2 * t + 9] = hi(a[3]);
    uint32_t const* b = g_b[w][ln];
    B[2 * t][g] = lo(b[0]); B[2 * t + 1][g] = hi(b[0]);
    B[2 * t + 8][g] = lo(b[1]); B[2 * t + 9][g] = hi(b[1]);
  }
  g_wbar[w]->arrive_and_wait();
  int g = l >> 2, t = l & 3;
  for (int e = 0; e < 4; ++e) {
    int r = g + (e >> 1) * 8, cc = 2 * t + (e & 1);
    double s = 0;
    for (int k = 0; k < 16; ++k) s += double(A[r][k]) * double(B[k][cc]);
    c[e] += float(s);
  }
}

// element (r, c) of a K-major 128-byte-swizzled tile as the hardware reads it (the 16-byte chunk j of row r stored
// at chunk j ^ (r % 8); a second 64-column atom `rows` rows further)
inline double kda_emu_sw(__nv_bfloat16 const* t, int rows, int r, int c) {
  int const c6 = c & 63;
  return double(__bfloat162float(t[(c >> 6) * rows * 64 + r * 64 + (((c6 >> 3) ^ (r & 7)) << 3) + (c6 & 7)]));
}
// wgmma m64nNk16 x K / 16 of the warpgroup, for the thread's own accumulator entries, A and B K-major sw128 tiles,
// each 16-column block summed as kda_emulated_mma sums it
template <int N, int K, int BRows>
inline void kda_emulated_wgmma(float (&acc)[N / 8][4], __nv_bfloat16 const* A, __nv_bfloat16 const* B, int lane,
                               int wi) {
  int g = lane >> 2, t = lane & 3;
  for (int kb = 0; kb < K / 16; ++kb)
    for (int nt = 0; nt < N / 8; ++nt)
      for (int e = 0; e < 4; ++e) {
        int r = 16 * wi + g + (e >> 1) * 8, col = nt * 8 + 2 * t + (e & 1);
        double s = 0;
        for (int k = 0; k < 16; ++k) s += kda_emu_sw(A, 64, r, 16 * kb + k) * kda_emu_sw(B, BRows, col, 16 * kb + k);
        acc[nt][e] += float(s);
      }
}

// kda_state_rs_kernel's warpgroup products. The warpgroup's 128 threads meet at g_wgbar[w] (also its named
// barrier). RS: A is gathered from the threads' m64k16 fragments (a[kb][0..3] = rows g, g + 8 x column pairs 2 t,
// 2 t + 8 of warp i's 16 rows, as kda_emulated_mma reads an A fragment); MN: A (m, k) at sw128(k, m) of a [64][64]
// tile. Each 16-column block is summed as kda_emulated_wgmma sums it, so the products have its bits.
std::barrier<>* g_wgbar[2];
uint32_t g_ra[2][128][8][4];
inline void kda_emulated_wg_barrier(int w) { g_wgbar[w]->arrive_and_wait(); }
template <int N, int K, int BRows, bool kBmn = false>
inline void kda_emulated_wgmma_rs(float (&acc)[N / 8][4], uint32_t const (&a)[K / 16][4], __nv_bfloat16 const* B,
                                  bool accumulate) {
  int const w = threadIdx.x >> 7, t = threadIdx.x & 127;
  std::memcpy(g_ra[w][t], a, sizeof(a));
  g_wgbar[w]->arrive_and_wait();
  auto aat = [w](int r, int c) {  // A (row r of 64, column c of K) from the fragment that holds it
    int const wi = r >> 4, g = r & 7, hi8 = (r >> 3) & 1, kb = c >> 4, cc = c & 15, tq = (cc & 7) >> 1;
    uint32_t const x = g_ra[w][32 * wi + 4 * g + tq][kb][hi8 + 2 * (cc >> 3)];
    return double((cc & 1) ? hi(x) : lo(x));
  };
  int const wi = t >> 5, l = t & 31, g = l >> 2, tq = l & 3;
  for (int kb = 0; kb < K / 16; ++kb)
    for (int nt = 0; nt < N / 8; ++nt)
      for (int e = 0; e < 4; ++e) {
        int r = 16 * wi + g + (e >> 1) * 8, col = nt * 8 + 2 * tq + (e & 1);
        double s = 0;
        for (int k = 0; k < 16; ++k) {
          double const b = kBmn ? kda_emu_sw(B, 64, 16 * kb + k, col) : kda_emu_sw(B, BRows, col, 16 * kb + k);
          s += aat(r, 16 * kb + k) * b;
        }
        acc[nt][e] = (kb == 0 && !accumulate ? 0.f : acc[nt][e]) + float(s);
      }
  g_wgbar[w]->arrive_and_wait();
}
template <int N>
inline void kda_emulated_wgmma_mn(float (&acc)[N / 8][4], __nv_bfloat16 const* A, __nv_bfloat16 const* B,
                                  bool accumulate) {
  int const t = threadIdx.x & 127, wi = t >> 5, l = t & 31, g = l >> 2, tq = l & 3;
  for (int kb = 0; kb < 4; ++kb)
    for (int nt = 0; nt < N / 8; ++nt)
      for (int e = 0; e < 4; ++e) {
        int r = 16 * wi + g + (e >> 1) * 8, col = nt * 8 + 2 * tq + (e & 1);
        double s = 0;
        for (int k = 0; k < 16; ++k) s += kda_emu_sw(A, 64, 16 * kb + k, r) * kda_emu_sw(B, N, col, 16 * kb + k);
        acc[nt][e] = (kb == 0 && !accumulate ? 0.f : acc[nt][e]) + float(s);
      }
}

// the roles kernel's record flags: the emulator runs its prep CTAs first, so pass 2 finding a flag unset is an error
int g_unset_flags = 0;
inline void kda_emulated_unset_flag() { ++g_unset_flags; }

#define FLA_CULA_KDA_HOST_EMULATION 1
#include "kda_sm90/kda_fwd_kernel.cuh"
#include "kda_sm90/kda_combine_kernel.cuh"
#include "kda_sm90/kda_state_rs_kernel.cuh"
#include "kda_sm90/kda_roles_kernel.cuh"

extern "C" int emu_unset_flags() {
  int const n = g_unset_flags;
  g_unset_flags = 0;
  return n;
}

using namespace fla_cula;

extern "C" void emu_combine(float* seg_H, float const* seg_M, int slots, long long pairs) {
  std::barrier<> bar(kda_sm90::kCombineThreads);
  g_bar = &bar;
  for (long long b = 0; b < pairs * (128 / kda_sm90::kCombineCols); ++b) {
    blockIdx.x = unsigned(b);
    std::memset(smem_raw, 0xff, sizeof(smem_raw));
    std::vector<std::thread> th;
    for (int t = 0; t < kda_sm90::kCombineThreads; ++t)
      th.emplace_back([=] {
        threadIdx.x = t;
        kda_sm90::kda_combine_kernel(seg_H, seg_M, slots, pairs);
      });
    for (auto& x : th) x.join();
  }
}

extern "C" int emu_sw128(int r, int c) { return kda_sm90::sw128(r, c); }
extern "C" int emu_sw128k(int rows, int r, int c) {
  return rows == 64 ? kda_sm90::sw128k<64>(r, c) : kda_sm90::sw128k<128>(r, c);
}

extern "C" int emu_smem_bytes(int block_v) {
  return block_v == 128 ? kda_sm90::kSmemBytes<128> : kda_sm90::kSmemBytes<64>;
}

extern "C" void emu_run(void const* q, void const* k, void const* v, void const* g, void const* beta, int beta_fp32,
                        void const* A_log, void const* dt_bias, float const* h0, int state_v_first, void* o, float* ht,
                        void* Aqk, void* Akk, int B, int T, int N, int H, int HV, float scale, float lb, int l2,
                        int bsig, float bscale, void const* cu, int cu64, long long* prof, int block_v, int wgmma,
                        int pass, void* rec, long long rec_slots, int cpc, int units, int maps, float* seg_H,
                        float* seg_M, void* h_inter, void const* chunk_offsets, int NT, int state_rs, void* q_hat,
                        void* k_hat, float* q_rstd, float* k_rstd, int seg_lo, int seg_hi, int gate, int* rec_ready) {
  KdaFwdParams p{};
  p.gate = gate;
  p.q = q; p.k = k; p.qk_tok_stride = int64_t(H) * 128; p.qk_head_stride = 128;
  p.v = v; p.v_tok_stride = int64_t(HV) * 128; p.v_head_stride = 128;
  p.g = g; p.g_tok_stride = int64_t(HV) * 128; p.g_head_stride = 128;
  p.beta = beta; p.beta_fp32 = beta_fp32; p.beta_tok_stride = HV;
  p.A_log = A_log; p.A_log_fp32 = true; p.dt_bias = dt_bias; p.dt_bias_fp32 = true;
  p.h0 = h0; p.state_v_first = state_v_first;
  p.o = o; p.o_tok_stride = int64_t(HV) * 128; p.o_head_stride = 128;
  p.ht = ht; p.Aqk = Aqk; p.Akk = Akk; p.extras_tok_stride = int64_t(HV) * 64;
  p.B = B; p.T = T; p.N = N; p.H = H; p.HV = HV;
  p.scale = scale; p.lower_bound = lb; p.beta_scale = bscale; p.use_qk_l2norm = l2; p.use_beta_sigmoid = bsig;
  p.cu_seqlens = cu; p.cu_seqlens_int64 = cu64; p.phase_cycles = prof; p.block_v = block_v;
  p.pass = pass; p.rec = rec; p.rec_slots = rec_slots; p.chunks_per_cta = cpc; p.units = units; p.maps = maps;
  p.seg_H = seg_H; p.seg_M = seg_M;
  // the binding's segment arguments: units P (2 P - 3 with maps), pass 2 over [seg_lo, seg_hi or P)
  p.segments = pass != kKdaState ? 1 : maps ? (units + 3) / 2 : units;
  seg_hi = seg_hi ? seg_hi : p.segments;
  p.seg_lo = seg_lo;
  p.seg_H_out = pass == kKdaState && !maps && seg_hi < p.segments;
  if (pass == kKdaState) p.units = units = maps ? units - seg_lo : seg_hi - seg_lo;
  p.h_inter = h_inter; p.chunk_offsets = chunk_offsets; p.chunk_offsets_int64 = true; p.NT = NT;
  p.state_rs = state_rs;
  p.q_hat = q_hat; p.k_hat = k_hat; p.q_rstd = q_rstd; p.k_rstd = k_rstd;
  p.rec_ready = rec_ready;
  // pass 3 (the roles kernel): its prep CTAs R .. first, then pass 2's 0 .. R - 1, which then find every flag set
  kda_sm90::KdaRolesParams const roles = kda_sm90::roles_params(p);
  int const R = 2 * N * HV;
  int ctas = pass == kKdaPrep ? N * HV * units
             : pass == kKdaRoles ? R + N * HV * units
                                 : N * HV * (128 / block_v) * (pass == kKdaState ? units : 1);
  int const nthreads = pass == kKdaState && state_rs && block_v == 64 ? 128 : 256;  // kda_state_rs_kernel<., 64>
  std::vector<std::barrier<>*> wb;
  for (int w = 0; w < 8; ++w) g_wbar[w] = new std::barrier<>(32);
  for (int w = 0; w < 2; ++w) g_wgbar[w] = new std::barrier<>(128);
  for (int i = 0; i < ctas; ++i) {
    int const b = pass != kKdaRoles ? i : i < ctas - R ? R + i : i - (ctas - R);
    int const nt = pass == kKdaRoles && b < R ? 128 : nthreads;  // (a roles pass-2 CTA's second warpgroup exits)
    std::barrier<> bar(nt);
    g_bar = &bar;
    blockIdx.x = b;
    std::memset(smem_raw, 0xff, sizeof(smem_raw));  // poison: NaN-ish bf16/fp32 patterns
    std::vector<std::thread> th;
    for (int t = 0; t < nt; ++t)
      th.emplace_back([&p, &roles, t, block_v, wgmma, pass] {
        threadIdx.x = t;
        constexpr auto kG = kda_sm90::GateForm::SigmoidLB;
        bool const qk = p.q_hat != nullptr;  // the grad-extras instantiations, as kda_roles.cu / kda_fwd.cu pick them
        using kda_sm90::GateForm;
        if (pass == kKdaRoles) {
          if (p.gate == 1) {
            qk ? kda_sm90::kda_roles_kernel<GateForm::Softplus, true>(roles)
               : kda_sm90::kda_roles_kernel<GateForm::Softplus>(roles);
          } else if (p.gate == 2) {
            qk ? kda_sm90::kda_roles_kernel<GateForm::Precomputed, true>(roles)
               : kda_sm90::kda_roles_kernel<GateForm::Precomputed>(roles);
          } else {
            qk ? kda_sm90::kda_roles_kernel<kG, true>(roles) : kda_sm90::kda_roles_kernel<kG>(roles);
          }
        } else if (pass == kKdaPrep && p.gate == 1) {
          qk ? kda_sm90::kda_prep_kernel<GateForm::Softplus, false, true>(p)
             : kda_sm90::kda_prep_kernel<GateForm::Softplus>(p);
        } else if (pass == kKdaPrep && p.gate == 2) {
          qk ? kda_sm90::kda_prep_kernel<GateForm::Precomputed, false, true>(p)
             : kda_sm90::kda_prep_kernel<GateForm::Precomputed>(p);
        } else if (pass == kKdaPrep) {
          qk ? kda_sm90::kda_prep_kernel<kG, false, true>(p) : kda_sm90::kda_prep_kernel<kG>(p);
        } else if (pass == kKdaState && p.state_rs) {
          if (p.maps) kda_sm90::kda_state_rs_kernel<true>(p);
          else if (block_v == 64) kda_sm90::kda_state_rs_kernel<false, 64>(p);
          else kda_sm90::kda_state_rs_kernel<false>(p);
        } else if (pass == kKdaState) {
          block_v == 128 ? kda_sm90::kda_state_kernel<128>(p) : kda_sm90::kda_state_kernel<64>(p);
        } else if (qk) {
          if (block_v == 128) {
            wgmma ? kda_sm90::kda_fwd_kernel<kG, false, 128, true, true>(p)
                  : kda_sm90::kda_fwd_kernel<kG, false, 128, false, true>(p);
          } else {
            wgmma ? kda_sm90::kda_fwd_kernel<kG, false, 64, true, true>(p)
                  : kda_sm90::kda_fwd_kernel<kG, false, 64, false, true>(p);
          }
        } else if (block_v == 128) {
          wgmma ? kda_sm90::kda_fwd_kernel<kG, true, 128, true>(p) : kda_sm90::kda_fwd_kernel<kG, true, 128>(p);
        } else {
          wgmma ? kda_sm90::kda_fwd_kernel<kG, true, 64, true>(p) : kda_sm90::kda_fwd_kernel<kG, true, 64>(p);
        }
      });
    for (auto& x : th) x.join();
  }
  for (int w = 0; w < 8; ++w) delete g_wbar[w];
  for (int w = 0; w < 2; ++w) delete g_wgbar[w];
}
"""


def build_emulator(source: str, tmp_path_factory, name: str):
    """g++ builds `source` (an emulator: kernel headers under FLA_CULA_KDA_HOST_EMULATION) into a shared library and
    loads it; skips the test where g++ or the CUDA headers are missing."""
    import ctypes
    import shutil
    import subprocess
    from pathlib import Path

    gxx = shutil.which("g++")
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    inc = Path(home) / "include"
    if gxx is None or not (inc / "cuda_bf16.h").is_file():
        pytest.skip("g++ or the CUDA headers (cuda_bf16.h) not found")
    root = Path(__file__).resolve().parent.parent
    d = tmp_path_factory.mktemp(name)
    (d / "emu.cpp").write_text(source)
    so = d / f"lib{name}.so"
    r = subprocess.run([gxx, "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", f"-I{inc}", f"-I{root / 'csrc'}",
                        str(d / "emu.cpp"), "-o", str(so)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return ctypes.CDLL(str(so))


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build_emulator(EMULATOR_CPP, tmp_path_factory, "kda_emu")


def _ptr(x):
    import ctypes
    return ctypes.c_void_p(0 if x is None else x.data_ptr())


def _emu_call(lib, q, k, v, g, beta, A_log, dt_bias, h0, cu, o, ht, Aqk, Akk, prof, *, scale, lb, l2, bsig, neg, svf,
              block_v, wgmma, pass_=0, rec=None, cpc=0, units=1, maps=False, seg_H=None, seg_M=None, h_inter=None,
              chunk_offsets=None, state_rs=False, q_hat=None, k_hat=None, q_rstd=None, k_rstd=None, seg_lo=0,
              seg_hi=0, gate=0, rec_ready=None):
    import ctypes
    ptr = _ptr
    B, T, H, _ = q.shape
    HV = v.shape[2]
    N = B if cu is None else cu.shape[0] - 1
    lib.emu_run(ptr(q), ptr(k), ptr(v), ptr(g), ptr(beta), ctypes.c_int(beta.dtype == torch.float32), ptr(A_log),
                ptr(dt_bias), ptr(h0), ctypes.c_int(svf), ptr(o), ptr(ht), ptr(Aqk), ptr(Akk), B, T, N, H, HV,
                ctypes.c_float(scale), ctypes.c_float(lb), int(l2), int(bsig), ctypes.c_float(2.0 if neg else 1.0),
                ptr(cu), int(cu is not None and cu.dtype == torch.int64), ptr(prof), block_v, int(wgmma), pass_,
                ptr(rec), ctypes.c_longlong(0 if rec is None else rec.shape[1]), cpc, units, int(maps), ptr(seg_H),
                ptr(seg_M), ptr(h_inter), ptr(chunk_offsets), 0 if h_inter is None else h_inter.shape[1],
                int(state_rs), ptr(q_hat), ptr(k_hat), ptr(q_rstd), ptr(k_rstd), seg_lo, seg_hi, gate,
                ptr(rec_ready))


def _emulate(lib, q, k, v, g, beta, A_log, dt_bias, h0, cu, *, scale, lb, l2, bsig, neg, svf, block_v, wgmma=False,
             qk_kw=None):

    B, T, H, _ = q.shape
    HV = v.shape[2]
    N = B if cu is None else cu.shape[0] - 1
    o = torch.full((B, T, HV, 128), float("nan"), dtype=torch.bfloat16)
    ht = torch.full((N, HV, 128, 128), float("nan"))
    Aqk = torch.full((B, T, HV, 64), float("nan"), dtype=torch.bfloat16)
    Akk = torch.full((B, T, HV, 64), float("nan"), dtype=torch.bfloat16)
    prof = torch.full((N * HV * (128 // block_v), 10), -1, dtype=torch.int64)  # csrc/kda_sm90/kda_fwd.h kKdaFwdPhases
    _emu_call(lib, q, k, v, g, beta, A_log, dt_bias, h0, cu, o, ht, Aqk, Akk, prof, scale=scale, lb=lb, l2=l2,
              bsig=bsig, neg=neg, svf=svf, block_v=block_v, wgmma=wgmma, **(qk_kw or {}))
    return o, ht, Aqk, Akk, prof


def _emulator_case(case):
    if case == "fixed-tail-svf":
        q, k, v, g, beta, A_log, dt_bias, h0 = _inputs(1, 20, 1, 1, "fast", seed=1)
        h0 = h0.transpose(-1, -2).contiguous()
        return (q, k, v, g, beta, A_log, dt_bias, h0, None), dict(scale=128 ** -0.5, lb=-5.0, l2=True, bsig=True,
                                                                 neg=False, svf=True)
    q, k, v, g, beta, A_log, dt_bias, _ = _inputs(1, 70, 1, 2, "slow", seed=2)
    cu = torch.tensor([0, 0, 66, 70], dtype=torch.int64)
    h0 = torch.randn(3, 2, 128, 128, generator=torch.Generator().manual_seed(4)) * 0.5
    return (q, k, v, g, beta.float(), None, dt_bias, h0, cu), dict(scale=0.1, lb=-2.0, l2=True, bsig=True, neg=True,
                                                                   svf=False)


@pytest.mark.parametrize("block_v", [64, 128])
@pytest.mark.parametrize("case", ["fixed-tail-svf", "varlen-gva-empty"])
def test_wgmma_variant_emulated_same_bits(emulator, case, block_v):
    """The wgmma instantiation (phase 8 on warpgroup MMA, its operand tiles in the 128-byte swizzle) against the
    mma.sync one, both emulated: the emulated warpgroup product reads the tiles as the hardware does and sums like the
    emulated mma.sync, so every output must be bit-identical; a tile written or read in the wrong layout is not."""
    args, kw = _emulator_case(case)
    ref = _emulate(emulator, *args, block_v=block_v, **kw)[:4]
    got = _emulate(emulator, *args, block_v=block_v, wgmma=True, **kw)[:4]
    for name, a, b in zip(("o", "ht", "Aqk", "Akk"), ref, got, strict=True):
        assert not a.isnan().any() and torch.equal(a, b), name


def test_sw128_is_cutes_layout(emulator, tmp_path):
    """The kernel's swizzled tile addressing (sw128, sw128k) is CuTe's GMMA::Layout_K_SW128_Atom<bf16> tiled to
    128 x 64, 64 x 128 and 128 x 128 (through a 1024-byte aligned smem pointer): the layout the wgmma descriptors of
    kda_fwd_kernel describe; and sw128(k, m) is GMMA::Layout_MN_SW128_Atom<bf16> tiled to 64 x 64, the MN-major A of
    kda_state_rs_kernel."""
    import ctypes
    import shutil
    import subprocess
    from pathlib import Path

    gxx = shutil.which("g++")
    home = Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda")
    inc = _ext.cutlass_include()
    if gxx is None or inc is None or not (home / "include" / "cccl").is_dir():
        pytest.skip("g++, the CUTLASS headers or CUDA's cccl headers not found")
    (tmp_path / "sw.cpp").write_text(r"""
#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
alignas(1024) cutlass::bfloat16_t buf[128 * 128];
template <int Rows, int Cols>
int offset(int r, int c) {
  using namespace cute;
  auto layout = tile_to_shape(SM90::GMMA::Layout_K_SW128_Atom<cutlass::bfloat16_t>{}, Shape<Int<Rows>, Int<Cols>>{});
  return int(&make_tensor(make_smem_ptr(buf), layout)(r, c) - buf);
}
extern "C" int cute_sw128(int rows, int cols, int r, int c) {
  if (cols == 64) return offset<128, 64>(r, c);
  return rows == 64 ? offset<64, 128>(r, c) : offset<128, 128>(r, c);
}
// element (m, k) of GMMA::Layout_MN_SW128_Atom tiled to 64 x 64 (kda_state_rs_kernel's v^T operand)
extern "C" int cute_sw128_mn(int m, int k) {
  using namespace cute;
  auto layout = tile_to_shape(SM90::GMMA::Layout_MN_SW128_Atom<cutlass::bfloat16_t>{}, Shape<_64, _64>{});
  return int(&make_tensor(make_smem_ptr(buf), layout)(m, k) - buf);
}
""")
    so = tmp_path / "libsw.so"
    r = subprocess.run([gxx, "-std=c++17", "-O1", "-fPIC", "-shared", f"-I{inc}", f"-I{home / 'include'}",
                        f"-I{home / 'include' / 'cccl'}", str(tmp_path / "sw.cpp"), "-o", str(so)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    cute = ctypes.CDLL(str(so))
    bad = [(i, j) for i in range(128) for j in range(64) if cute.cute_sw128(128, 64, i, j) != emulator.emu_sw128(i, j)]
    for rows in (64, 128):  # [rows][128] tiles (Wn, Qg: 64 rows; S^T: 128), two atoms along K
        bad += [(rows, i, j) for i in range(rows) for j in range(128)
                if cute.cute_sw128(rows, 128, i, j) != emulator.emu_sw128k(rows, i, j)]
    # the MN-major 64 x 64 tile: element (m, k) at sw128(k, m), so v's rows [token k][column m] are the v^T operand
    bad += [("mn", m, k) for m in range(64) for k in range(64) if cute.cute_sw128_mn(m, k) != emulator.emu_sw128(k, m)]
    assert not bad, bad[:8]


@pytest.mark.parametrize("block_v", [64, 128])
@pytest.mark.parametrize("case", ["fixed-tail-svf", "varlen-gva-empty"])
def test_kernel_source_emulated_on_cpu_matches_model(emulator, case, block_v):
    (q, k, v, g, beta, A_log, dt_bias, h0, cu), kw = _emulator_case(case)
    o, ht, Aqk, Akk, prof = _emulate(emulator, q, k, v, g, beta, A_log, dt_bias, h0, cu, block_v=block_v, **kw)
    lens = [20] if cu is None else (cu[1:] - cu[:-1]).tolist()
    for cta in range(prof.shape[0]):  # phase_cycles: every phase timed in CTAs with chunks, zeros without
        busy = lens[cta // ((128 // block_v) * v.shape[2])] > 0
        assert ((prof[cta] > 0) if busy else (prof[cta] == 0)).all(), (cta, prof[cta])
    om, htm, Aqkm, Akkm = kda_chunk_model(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=kw["lb"], scale=kw["scale"], initial_state=h0,
        use_qk_l2norm_in_kernel=kw["l2"], use_beta_sigmoid_in_kernel=kw["bsig"], allow_neg_eigval=kw["neg"],
        cu_seqlens=cu, state_v_first=kw["svf"])
    o_ref, ht_ref = kda_recurrent(q, k, v, g, beta, scale=kw["scale"], initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=kw["l2"], use_gate_in_kernel=True, A_log=A_log,
                                  dt_bias=dt_bias, lower_bound=kw["lb"], use_beta_sigmoid_in_kernel=kw["bsig"],
                                  allow_neg_eigval=kw["neg"], state_v_first=kw["svf"], cu_seqlens=cu)
    for x in (o, ht, Aqk, Akk):
        assert not x.isnan().any()
    errs = dict(o_model=rel_rms(om, o.float()), ht_model=rel_rms(htm, ht), aqk=rel_rms(Aqkm, Aqk.float()),
                akk=rel_rms(Akkm, Akk.float()), o_ref=rel_rms(o_ref, o.float()), ht_ref=rel_rms(ht_ref, ht))
    print(f"\n{case} block_v {block_v}: " + "  ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    # the model and the kernel differ only by fp32 evaluation order / intrinsics (a few bf16 flips)
    assert errs["o_model"] < 2e-3 and errs["ht_model"] < 1e-3 and errs["aqk"] < 2e-3 and errs["akk"] < 1e-3, errs
    assert errs["o_ref"] < 0.005 and errs["ht_ref"] < 0.005, errs
    assert (torch.triu(Akk[0, : min(64, Akk.shape[1]), 0].float()[:, : min(64, Akk.shape[1])], 1) == 0).all()


def _emu_combine(lib, seg_H, seg_M):
    """The combine kernel (kda_combine_kernel.cuh) emulated, in place on seg_H."""
    import ctypes
    lib.emu_combine(_ptr(seg_H), _ptr(seg_M), seg_H.shape[0], ctypes.c_longlong(seg_H.shape[1] * seg_H.shape[2]))


def test_combine_kernel_emulated(emulator):
    """The combine kernel against the fp64 torch combine (kda_prefill.combine_segments): fp32 sums of 128 products per
    element and boundary, within fp32 rounding; with zero maps it returns H exactly; one slot is a no-op."""
    _ext_or_skip()
    from fla_cula.kernels.kda_prefill import combine_segments
    gen = torch.Generator().manual_seed(21)
    H = torch.randn(4, 2, 3, 128, 128, generator=gen)
    M = torch.eye(128) * 0.9 + torch.randn(3, 2, 3, 128, 128, generator=gen) * 0.02   # maps near the identity
    ref, got = H.clone(), H.clone()
    combine_segments(ref, M)
    _emu_combine(emulator, got, M)
    assert rel_rms(ref, got) < 1e-6 and torch.equal(got[0], H[0])
    got = H.clone()
    _emu_combine(emulator, got, torch.zeros_like(M))
    assert torch.equal(got, H)
    one = H[:1].clone()
    _emu_combine(emulator, one, M[:0])
    assert torch.equal(one, H[:1])


def _h_buffers(q, cu, HV):
    """NaN-poisoned h_inter [B, NT, HV, 128, 128] bf16 and, for varlen, the chunk offsets (FLA's layout)."""
    B, T = q.shape[:2]
    if cu is None:
        return torch.full((B, -(-T // 64), HV, 128, 128), float("nan"), dtype=torch.bfloat16), None
    chunks = [-(-int(L) // 64) for L in (cu[1:] - cu[:-1]).tolist()]
    off = torch.tensor([0] + chunks, dtype=torch.int64).cumsum(0)
    return torch.full((1, int(off[-1]), HV, 128, 128), float("nan"), dtype=torch.bfloat16), off


def _emulate_two_kernel(lib, q, k, v, g, beta, A_log, dt_bias, h0, cu, *, scale, lb, l2, bsig, neg, svf, block_v,
                        segments, seg_chunks=None, out_kw=None, state_rs=False, qk_kw=None, gate=0, prep_chunks=None,
                        roles=False):
    """fla_cula's two-kernel orchestration (kda_prefill.run_two_kernel: prep, maps, combine, pass 2) with every
    pass emulated; records poisoned (0xff) and segment states NaN before the pass that writes them."""
    import dataclasses

    from fla_cula.kernels import kda_prefill as kp
    B, T, H, _ = q.shape
    HV = v.shape[2]
    N = B if cu is None else cu.shape[0] - 1
    lens = [T] * B if cu is None else (cu[1:] - cu[:-1]).tolist()
    plan = kp.two_kernel_plan(lens, HV, 132, segments=segments, block_v=block_v, prep_chunks=prep_chunks,
                              state_rs=roles, roles=roles or None)
    assert plan.roles == roles
    if seg_chunks is not None:
        plan = dataclasses.replace(plan, seg_chunks=seg_chunks)
    o = torch.full((B, T, HV, 128), float("nan"), dtype=torch.bfloat16)
    ht = torch.full((N, HV, 128, 128), float("nan"))
    Aqk = torch.full((B, T, HV, 64), float("nan"), dtype=torch.bfloat16)
    Akk = torch.full((B, T, HV, 64), float("nan"), dtype=torch.bfloat16)

    poisoned = set()

    def launch(*, pass_kind, rec, chunks_per_cta, units, maps, seg_H, seg_M, block_v, o, ht, Aqk, Akk, **kw):
        if pass_kind in (1, 3):
            rec.fill_(0xff)
        for t in (seg_H, seg_M):  # NaN before the first pass that sees them (pass 2 of segment 0 may precede maps)
            if t is not None and t.data_ptr() not in poisoned:
                poisoned.add(t.data_ptr())
                t.fill_(float("nan"))
        _emu_call(lib, q, k, v, g, beta, A_log, dt_bias, h0, cu, o, ht, Aqk, Akk, None, scale=scale, lb=lb, l2=l2,
                  bsig=bsig, neg=neg, svf=svf, block_v=block_v, wgmma=True, pass_=pass_kind, rec=rec,
                  cpc=chunks_per_cta, units=units, maps=maps, seg_H=seg_H, seg_M=seg_M,
                  gate=gate if pass_kind in (1, 3) else 0, **kw)

    kp.run_two_kernel(launch, N, HV, kp.record_slots(B, T, N), "cpu", plan, o, ht, Aqk, Akk, out_kw,
                      functools.partial(_emu_combine, lib), state_rs=state_rs or roles, qk_kw=qk_kw)
    assert lib.emu_unset_flags() == 0, "pass 2 read a record before its flag was set"
    return o, ht, Aqk, Akk


def _wide_gate_case(form):
    """Unbounded gates (softplus without lower_bound, or a precomputed log decay) with drops of ~100 (natural log) at
    a few (token, channel) places inside 16-row blocks: those blocks' spans pass kSpanMax (120 log2 units) on those
    channels, the others stay under it. Returns the inputs, the gate in log2 units (fp32, as the kernel forms it) and
    the reference's gate flags."""
    q, k, v, g, beta, A_log, dt_bias, h0 = _inputs(1, 150, 1, 2, "random", seed=7)
    drops = [(5, 0), (5, 1), (37, 3), (70, 64), (101, 127), (140, 9)]  # (token, channel), mid-block, both heads
    if form == "softplus":
        A_log = torch.full((2,), 0.5)
        g = g.float()
        for t, c in drops:
            g[0, t, :, c] = 60.0 - dt_bias.reshape(2, 128)[:, c]  # softplus ~ 60: a ~ -exp(0.5) 60 ~ -99 (-143 log2)
        g = g.to(torch.bfloat16)
        z = g.float() + dt_bias.reshape(1, 1, 2, 128)
        a2 = -A_log.exp().reshape(1, 1, 2, 1) * torch.nn.functional.softplus(z) * 1.4426950408889634
        flags = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=None)
    else:
        g = -torch.nn.functional.softplus(g.float())  # log decay, mostly in (-4, 0)
        for t, c in drops:
            g[0, t, :, c] = -100.0
        g = g.to(torch.bfloat16)
        A_log = dt_bias = None
        a2 = g.float() * 1.4426950408889634
        flags = dict(use_gate_in_kernel=False)
    return (q, k, v, g, beta, A_log, dt_bias, h0, None), a2, flags


def _block_spans(a2):
    """A_r - B_r (the kernel's integer anchors) of every (chunk, 16-row block, head, channel) of a fixed-length a2
    [1, T, HV, K] in log2 units: G is the chunk-local cumsum, A_r = ceil(G_16r), B_r = floor(G_16(r+1)) (floor(G_63)
    for the last block), rows past the end frozen."""
    T = a2.shape[1]
    a = torch.nn.functional.pad(a2[0], (0, 0, 0, 0, 0, (-T) % 64)).reshape(-1, 64, *a2.shape[2:])
    G = a.cumsum(1)
    A = torch.ceil(G[:, ::16])
    nxt = torch.cat([G[:, 16::16], G[:, 63:64]], 1)
    return A - torch.floor(nxt)


@pytest.mark.parametrize("segments", [1, 2])
@pytest.mark.parametrize("form", ["softplus", "precomputed"])
def test_unbounded_gate_prep_emulated_matches_fp64(emulator, form, segments):
    """The prep kernel's unbounded gate forms (softplus, precomputed) through the two-kernel form, emulated, against
    the fp64 recurrence. The inputs make a few channels' block spans pass kSpanMax: there the anchored diagonal
    products would overflow their 2^(A_r - B_r) scalar, and the kernel takes those channels' diagonal share from the
    exact pairwise sums instead. Both kinds of block must occur, and o and the final state must meet the 0.005 bar."""
    _ext_or_skip()
    args, a2, flags = _wide_gate_case(form)
    spans = _block_spans(a2)
    assert (spans > 120).sum() >= 6 and (spans <= 120).float().mean() > 0.9, spans.max()
    q, k, v, g, beta, A_log, dt_bias, h0, cu = args
    kw = dict(scale=128 ** -0.5, lb=-5.0, l2=True, bsig=True, neg=False, svf=False)
    o, ht, _, _ = _emulate_two_kernel(emulator, *args, block_v=64, segments=segments, gate=1 if form == "softplus"
                                      else 2, **kw)
    o_ref, ht_ref = kda_recurrent(q, k, v, g, beta, scale=kw["scale"], initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, **flags)
    eo, eh = rel_rms(o_ref, o.float()), rel_rms(ht_ref, ht)
    print(f"\n{form} segments {segments}: o {eo:.2e}  ht {eh:.2e}  wide blocks {(spans > 120).sum().item()}")
    assert not o.isnan().any() and not ht.isnan().any()
    assert eo < 0.005 and eh < 0.005, (eo, eh)


def _heavy_gate_case(form):
    """Strong unbounded gates everywhere (softplus with exp(A_log) = e^2 and dt_bias ~ randn, or a precomputed
    -6 softplus(randn)): about half of all (block, channel) spans pass kSpanMax, so most warps hold several wide
    channels at once and every lane's butterfly share counts (the regime where the first wide path's per-channel
    shared-memory atomics ran the prep ~30x slower)."""
    q, k, v, g, beta, A_log, dt_bias, h0 = _inputs(1, 150, 1, 2, "random", seed=7)
    if form == "softplus":
        A_log = torch.full((2,), 2.0)
        dt_bias = torch.randn(256, generator=torch.Generator().manual_seed(3))
        z = g.float() + dt_bias.reshape(1, 1, 2, 128)
        a2 = -A_log.exp().reshape(1, 1, 2, 1) * torch.nn.functional.softplus(z) * 1.4426950408889634
        flags = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=None)
    else:
        g = (-6.0 * torch.nn.functional.softplus(g.float())).to(torch.bfloat16)
        A_log = dt_bias = None
        a2 = g.float() * 1.4426950408889634
        flags = dict(use_gate_in_kernel=False)
    return (q, k, v, g, beta, A_log, dt_bias, h0, None), a2, flags


@pytest.mark.parametrize("form", ["softplus", "precomputed"])
def test_unbounded_gate_prep_emulated_heavy(emulator, form):
    """The wide channels' exact diagonal share where about half of all channel blocks are wide (several per warp,
    whole warps of them), emulated through the two-kernel form at two segments, against the fp64 recurrence."""
    _ext_or_skip()
    args, a2, flags = _heavy_gate_case(form)
    wide = (_block_spans(a2) > 120).float().mean().item()
    assert 0.3 < wide < 0.8, wide
    kw = dict(scale=128 ** -0.5, lb=-5.0, l2=True, bsig=True, neg=False, svf=False)
    o, ht, _, _ = _emulate_two_kernel(emulator, *args, block_v=64, segments=2, gate=1 if form == "softplus" else 2,
                                      **kw)
    q, k, v, g, beta, A_log, dt_bias, h0, cu = args
    o_ref, ht_ref = kda_recurrent(q, k, v, g, beta, scale=kw["scale"], initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, **flags)
    eo, eh = rel_rms(o_ref, o.float()), rel_rms(ht_ref, ht)
    print(f"\n{form} heavy: o {eo:.2e}  ht {eh:.2e}  wide share {wide:.2f}")
    assert o.isfinite().all() and ht.isfinite().all()
    assert eo < 0.005 and eh < 0.005, (eo, eh)


@pytest.mark.parametrize("form", ["softplus", "precomputed"])
def test_unbounded_gate_infinite_decay_emulated(emulator, form):
    """A gate of -inf at the last token of chunk 0 (bf16's largest g: the softplus form overflows to -inf, and so
    does a precomputed -3e38 in log2 units): the state forgets everything before it, exactly. The kernel floors a
    gate at -2^24 (log2), so G stays finite and its integer anchors in range; o and the final state meet the fp64 bar
    (without the floor: inf - inf = NaN in the chunk's factors)."""
    _ext_or_skip()
    args, _, flags = _wide_gate_case(form)
    q, k, v, g, beta, A_log, dt_bias, h0, cu = args
    g = g.clone()
    g[0, 63] = 3e38 if form == "softplus" else -3e38
    kw = dict(scale=128 ** -0.5, lb=-5.0, l2=True, bsig=True, neg=False, svf=False)
    o, ht, _, _ = _emulate_two_kernel(emulator, q, k, v, g, beta, A_log, dt_bias, h0, cu, block_v=64, segments=2,
                                      gate=1 if form == "softplus" else 2, **kw)
    o_ref, ht_ref = kda_recurrent(q.double(), k.double(), v.double(), g.double(), beta.double(), scale=kw["scale"],
                                  initial_state=h0.double(), output_final_state=True, use_qk_l2norm_in_kernel=True,
                                  use_beta_sigmoid_in_kernel=True, **{n: (x.double() if torch.is_tensor(x) else x)
                                                                      for n, x in flags.items()})
    assert o.isfinite().all() and ht.isfinite().all()
    eo, eh = rel_rms(o_ref, o.double()), rel_rms(ht_ref, ht.double())
    assert eo < 0.005 and eh < 0.005, (eo, eh)


@pytest.mark.parametrize("block_v", [64, 128])
@pytest.mark.parametrize("case", ["fixed-tail-svf", "varlen-gva-empty"])
def test_two_kernel_emulated_same_bits_as_fused(emulator, case, block_v):
    """Prep kernel + state kernel over whole sequences (no split) against the fused wgmma kernel, all emulated: the
    records carry the fused kernel's own bf16 / fp32 tiles, so o, the final state, Aqk and Akk are bit-identical; a
    tile copied to the wrong place, a record slot shared by two chunks or a missed chunk is not."""
    _ext_or_skip()
    args, kw = _emulator_case(case)
    ref = _emulate(emulator, *args, block_v=block_v, wgmma=True, **kw)[:4]
    got = _emulate_two_kernel(emulator, *args, block_v=block_v, segments=1, **kw)
    for name, a, b in zip(("o", "ht", "Aqk", "Akk"), ref, got, strict=True):
        assert not b.isnan().any() and torch.equal(a, b), name


@pytest.mark.parametrize("case, prep_chunks, gate", [
    ("fixed-tail-svf", 1, 0),     # one chunk (a tail), V-first states
    ("varlen-gva-empty", 2, 0),   # an empty sequence, two and one chunks, GVA, no A_log
    ("varlen-prep3", 3, 0),       # a prep CTA of a partial block at a sequence's end
    ("varlen-prep3", 1, 1),       # the softplus gate
])
def test_roles_emulated_same_bits(emulator, case, prep_chunks, gate):
    """The one-launch form (kda_roles_kernel: prep CTAs and pass-2 CTAs of 64 columns by CTA index, pass 2 reading
    a record only once its flag is set) against the two launches (prep, then kda_state_rs_kernel<64> over whole
    sequences) on the same inputs, both emulated with the prep CTAs first: same records, same products, so o, the
    final state, Aqk and Akk are bit-identical (NaN-poisoned); a role decoded from the wrong CTA index, a flag index
    off by a slot (pass 2 would find it unset: the harness counts those) or a record read early is not."""
    _ext_or_skip()
    if case == "varlen-prep3":
        q, k, v, g, beta, A_log, dt_bias, _ = _inputs(1, 390, 1, 2, "slow", seed=5)
        cu = torch.tensor([0, 0, 320, 390], dtype=torch.int64)
        h0 = torch.randn(3, 2, 128, 128, generator=torch.Generator().manual_seed(6)) * 0.5
        args = (q, k, v, g, beta.float(), None if gate else A_log, dt_bias, h0, cu)
        kw = dict(scale=0.1, lb=-2.0, l2=True, bsig=True, neg=False, svf=False)
    else:
        args, kw = _emulator_case(case)
    ref = _emulate_two_kernel(emulator, *args, block_v=64, segments=1, state_rs=True, prep_chunks=prep_chunks,
                              gate=gate, **kw)
    got = _emulate_two_kernel(emulator, *args, block_v=64, segments=1, prep_chunks=prep_chunks, gate=gate,
                              roles=True, **kw)
    for name, a, b in zip(("o", "ht", "Aqk", "Akk"), ref, got, strict=True):
        assert not b.isnan().any() and torch.equal(a, b), name


@pytest.mark.parametrize("prep_chunks", [1, 3])
def test_two_kernel_prep_chunks_emulated_same_bits(emulator, prep_chunks):
    """The prep is chunk-parallel: any number of chunks per prep CTA (set_tuning(prep_chunks=...); here 1, and 3,
    which leaves a CTA of a partial block at a sequence's end) writes the same records, so the split's o, final
    state, Aqk and Akk are bit-identical to the default's (4); a chunk prepared from the wrong rows or a record left
    poisoned is not. (The kernel's last prep unit takes whatever lies beyond, so units only set the grid:
    test_set_tuning_prep_chunks checks the plan's.)"""
    _ext_or_skip()
    q, k, v, g, beta, A_log, dt_bias, _ = _inputs(1, 390, 1, 2, "slow", seed=5)
    cu = torch.tensor([0, 0, 320, 390], dtype=torch.int64)  # an empty sequence, 5 chunks, 2 chunks (one a tail)
    h0 = torch.randn(3, 2, 128, 128, generator=torch.Generator().manual_seed(6)) * 0.5
    args = (q, k, v, g, beta.float(), None, dt_bias, h0, cu)
    kw = dict(scale=0.1, lb=-2.0, l2=True, bsig=True, neg=False, svf=False)
    ref = _emulate_two_kernel(emulator, *args, block_v=64, segments=2, **kw)
    got = _emulate_two_kernel(emulator, *args, block_v=64, segments=2, prep_chunks=prep_chunks, **kw)
    for name, a, b in zip(("o", "ht", "Aqk", "Akk"), ref, got, strict=True):
        assert not b.isnan().any() and torch.equal(a, b), name


def test_set_tuning_prep_chunks():
    """prep_chunks: validated, carried by the plan (prep CTAs per pair = ceil(chunks / prep_chunks)), and None
    restores the plan's choice."""
    from fla_cula.kernels import kda_prefill as kp
    for bad in (0, 17, 2.0, True):
        with pytest.raises(ValueError, match="prep_chunks"):
            kp.set_tuning(prep_chunks=bad)
    lens = [64 * 30]
    plan = kp.two_kernel_plan(lens, 8, 132, prep_chunks=2)
    assert (plan.prep_chunks, plan.prep_units) == (2, 15)
    try:
        kp.set_tuning(two_kernel=True, prep_chunks=8)
        assert kp.two_kernel_choice(lens, 8, 132).prep_units == 4
    finally:
        kp.set_tuning()
    assert kp.two_kernel_choice(lens, 8, 132).prep_chunks == kp.two_kernel_plan(lens, 8, 132).prep_chunks


def test_prep_chunks_choice():
    """The plan keeps PREP_CHUNKS where its prep CTAs outnumber the SMs, and takes fewer chunks per CTA only where
    PREP_CHUNKS leaves SMs idle and the model prices fewer faster; a tie keeps the larger (the two launches: the one
    launch is test_roles_plan's)."""
    from fla_cula.kernels import kda_prefill as kp
    # B1 T2048 H16: 512 chunk-heads, 128 CTAs of 4 run alone (4 x 9.7 us); 256 CTAs of 2 fill the SMs two each
    # (2 x 14.8); 512 of 1 take two waves (2 x 14.8): a tie with 2, which keeps 2
    assert kp.two_kernel_plan([2048], 16, 132, state_rs=True, roles=False).prep_chunks == 2
    # B1 T1024 H16: 256 chunk-heads, 1 chunk a CTA fills the SMs two each in one wave
    assert kp.two_kernel_plan([1024], 16, 132, state_rs=True, roles=False).prep_chunks == 1
    # 133 CTAs of 4 on 132 SMs: no SM idle at 4, so no search
    for lens, HV in (([8192] * 2, 64), ([256] * 64, 32), ([32768], 16), ([64 * 4 * 133], 1)):
        plan = kp.two_kernel_plan(lens, HV, 132, state_rs=True, roles=False)
        assert plan.prep_chunks == kp.PREP_CHUNKS, (lens[:1], HV)
    # exactly as many CTAs of 4 as SMs: searched (132 CTAs alone vs 264 of 2 in one wave two per SM)
    assert kp.two_kernel_plan([64 * 4 * 132], 1, 132, state_rs=True, roles=False).prep_chunks == 2
    # a forced value wins over the choice
    assert kp.two_kernel_plan([2048], 16, 132, state_rs=True, prep_chunks=4, roles=False).prep_chunks == 4


def test_roles_plan():
    """The one-launch form: offered only where its 2 N HV pass-2 CTAs take at most half the SMs, with state_rs, one
    segment and 64 columns; roles=True takes it there, False never; by default it is taken only where it prices
    ROLES_MARGIN_US under unsplit two launches, or under ROLES_SPLIT_SHARE of a split plan's price (H100: B1 T2048
    H16 and B2 T2048 H8 86 vs 93 us; not B1 T2048 H8, where the split's 66 us beat its 77, nor B4 T1024 H8, 112 vs
    75); set_tuning validates the knob."""
    from fla_cula.kernels import kda_prefill as kp
    assert kp.roles_apply(1, 33, 132) and not kp.roles_apply(1, 34, 132) and not kp.roles_apply(0, 8, 132)
    assert kp.two_kernel_plan([2048], 16, 132, state_rs=True).roles
    assert not kp.two_kernel_plan([2048], 8, 132, state_rs=True).roles
    # several sequences: by the same prices (B2 T2048 H8 taken; B4 T1024 H8 and B2 T1024 H16 left to two launches)
    assert kp.two_kernel_plan([2048] * 2, 8, 132, state_rs=True).roles
    assert not kp.two_kernel_plan([1024] * 4, 8, 132, state_rs=True).roles
    assert not kp.two_kernel_plan([1024] * 2, 16, 132, state_rs=True).roles
    assert kp.two_kernel_plan([1024] * 4, 8, 132, state_rs=True, roles=True).roles
    # against a split plan only below ROLES_SPLIT_SHARE of its price (H100: B3 T4096 H4 129 vs P 6's 144 us, taken;
    # B3 T8192 H4 239 vs 228 and B1 T4096 H16 149 vs 157, priced at 0.91-0.92 of the split: left to it)
    for lens, H, taken in (([4096] * 3, 4, True), ([8192] * 3, 4, False), ([4096], 16, False)):
        assert kp.two_kernel_plan(lens, H, 132, state_rs=True, roles=False).segments > 1
        assert kp.two_kernel_plan(lens, H, 132, state_rs=True).roles == taken, (lens, H)
    forced = kp.two_kernel_plan([2048], 8, 132, state_rs=True, roles=True)
    assert forced.roles and (forced.segments, forced.block_v) == (1, 64)
    assert forced.prep_units == -(-32 // forced.prep_chunks)
    assert not kp.two_kernel_plan([2048], 16, 132, state_rs=True, roles=False).roles
    for kw in (dict(state_rs=False), dict(segments=3), dict(block_v=128)):  # outside its scope: never
        assert not kp.two_kernel_plan([2048], 16, 132, roles=True, **{"state_rs": True, **kw}).roles, kw
    assert not kp.two_kernel_plan([2048], 34, 132, state_rs=True, roles=True).roles
    with pytest.raises(TypeError, match="roles"):
        kp.set_tuning(roles=1)
    kp.set_tuning(two_kernel=True, roles=True)
    try:
        assert kp.two_kernel_choice([2048], 8, 132).roles
    finally:
        kp.set_tuning()
    assert kp._TUNING["roles"] is None


@pytest.mark.parametrize("form", ["fused", "two-kernel"])
@pytest.mark.parametrize("case", ["fixed-tail-svf", "varlen-gva-empty"])
def test_qk_hat_emulated(emulator, case, form):
    """The grad extras q^, k^ (FLA's l2norm_fwd: bf16(x rstd), rstd = 1 / sqrt(sum x^2 + 1e-6)) written by the fused
    kernel (V block 0) or the prep pass (one CTA per q head: GVA's other value heads write nothing): within one bf16
    rounding of the fp64 formula, rstd within 1e-6, every token row written once (NaN-poisoned), and o, the final
    state, Aqk and Akk bit-identical to the same call without them."""
    _ext_or_skip()
    args, kw = _emulator_case(case)
    q, k = args[0], args[1]
    B, T, H, _ = q.shape

    def extras():
        return dict(q_hat=torch.full_like(q, float("nan")), k_hat=torch.full_like(k, float("nan")),
                    q_rstd=torch.full((B, T, H), float("nan")), k_rstd=torch.full((B, T, H), float("nan")))

    def run(qk_kw):
        if form == "fused":
            return _emulate(emulator, *args, block_v=64, wgmma=True, qk_kw=qk_kw, **kw)[:4]
        return _emulate_two_kernel(emulator, *args, block_v=64, segments=1, qk_kw=qk_kw, **kw)

    base, x = run(None), extras()
    got = run(x)
    for name, a, b in zip(("o", "ht", "Aqk", "Akk"), base, got, strict=True):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), name
    for n, raw in (("q", q), ("k", k)):
        r = raw.double()
        rstd = 1.0 / (r.pow(2).sum(-1) + 1e-6).sqrt()
        assert not x[f"{n}_rstd"].isnan().any(), f"{n}_rstd: rows not written"
        assert (x[f"{n}_rstd"].double() / rstd - 1).abs().max() < 1e-6, f"{n}_rstd"
        y = (r * rstd.unsqueeze(-1))
        got_y = x[f"{n}_hat"].double()
        assert not got_y.isnan().any(), f"{n}_hat: rows not written"
        assert ((got_y - y).abs() <= y.abs() * 2.0 ** -8 + 1e-30).all(), f"{n}_hat: beyond one bf16 rounding"


@pytest.mark.parametrize("block_v", [64, 128])
@pytest.mark.parametrize("case, segments, seg_chunks", [
    ("fixed-tail-svf", 1, None),     # 20 tokens: one chunk with a tail, V-first h0 / ht
    ("varlen-gva-empty", 1, None),   # an empty sequence (ht = h0), GVA, K-major states
    ("fixed-random", 4, 1),          # pass 2 from the combined seg_H, segment 3 taking the remaining chunks
    ("varlen-slow", 3, 1),           # segments past a sequence's end, an empty sequence
    ("varlen-slow", 2, 2),           # no maps: segment 0's end state from pass 2 alone; a one-segment sequence
])
def test_state_rs_emulated_same_bits(emulator, case, segments, seg_chunks, block_v):
    """kda_state_rs_kernel (the state transposed in wgmma registers, RS products, v^T as an MN-major A, O through
    stmatrix.trans; split: its maps pass too, and pass 2 of segment 0 writing seg_H[0] in place of the maps pass's
    segment 0, the later segments' pass 2 after the combine) against kda_state_kernel<block_v> (the maps pass over
    every segment, then pass 2 over all of them) on the same records, both emulated: the
    operands, the rounding points and the order of every sum are the same, so o and the final state are bit-identical
    (NaN-poisoned outputs and segment states); a fragment, a swizzle, a stage or a store index out of place is not."""
    _ext_or_skip()
    if case.startswith("fixed-random") or case.startswith("varlen-slow"):
        args, kw = _split_case(case)
    else:
        args, kw = _emulator_case(case)
    ref = _emulate_two_kernel(emulator, *args, block_v=block_v, segments=segments, seg_chunks=seg_chunks, **kw)
    got = _emulate_two_kernel(emulator, *args, block_v=block_v, segments=segments, seg_chunks=seg_chunks,
                              state_rs=True, **kw)
    for name, a, b in zip(("o", "ht"), ref[:2], got[:2], strict=True):
        assert not b.isnan().any() and torch.equal(a, b), (name, (a.float() - b.float()).abs().max())


def _split_case(case):
    q, k, v, g, beta, A_log, dt_bias, _ = _inputs(1, 340, 1, 2, "slow" if "slow" in case else "random", seed=11)
    h0 = torch.randn(4 if "varlen" in case else 1, 2, 128, 128, generator=torch.Generator().manual_seed(12)) * 0.5
    kw = dict(scale=128 ** -0.5, lb=-5.0, l2=True, bsig=True, neg=False, svf=False)
    if "varlen" in case:  # an empty sequence, 4, 3 and 1 chunks: segments past a sequence's end are empty
        cu = torch.tensor([0, 0, 200, 330, 340], dtype=torch.int32)
        return (q, k, v, g, beta, A_log, dt_bias, h0, cu), kw
    return (q, k, v, g, beta, A_log, dt_bias, h0, None), kw


@pytest.mark.parametrize("case, segments, seg_chunks, block_v", [
    ("fixed-slow", 3, 2, 64),        # 6 chunks (a tail): three segments of 2
    ("fixed-random", 4, 1, 128),     # four segments of 1, the last taking the remaining 3
    ("varlen-slow", 3, 1, 64),       # per sequence 0 / 3 / 3 / 1 segments in use of 3 (empty maps: (I, 0))
    ("varlen-random", 2, 2, 128),
])
def test_split_emulated_matches_fused_and_fp64(emulator, case, segments, seg_chunks, block_v):
    """The exact sequence split, every pass emulated (prep, maps, fla_cula's combine, pass 2): o and the final state
    within the 0.005 bar of the fp64 recurrence and as close to it as the fused kernel, on slow-decay gates (maps near
    the identity) and random ones, fixed length with a tail and varlen with empty segments; Aqk / Akk (the prep's)
    bit-identical to the fused kernel's."""
    _ext_or_skip()
    (q, k, v, g, beta, A_log, dt_bias, h0, cu), kw = _split_case(case)
    args = (q, k, v, g, beta, A_log, dt_bias, h0, cu)
    ref = _emulate(emulator, *args, block_v=block_v, wgmma=True, **kw)[:4]
    got = _emulate_two_kernel(emulator, *args, block_v=block_v, segments=segments, seg_chunks=seg_chunks, **kw)
    o_ref, ht_ref = kda_recurrent(q, k, v, g, beta, scale=kw["scale"], initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                                  dt_bias=dt_bias, lower_bound=kw["lb"], use_beta_sigmoid_in_kernel=True,
                                  cu_seqlens=cu)
    for x in got:
        assert not x.isnan().any()
    assert torch.equal(ref[2], got[2]) and torch.equal(ref[3], got[3])
    ef = (rel_rms(o_ref, ref[0].float()), rel_rms(ht_ref, ref[1]))
    es = (rel_rms(o_ref, got[0].float()), rel_rms(ht_ref, got[1]))
    d = (rel_rms(ref[0].float(), got[0].float()), rel_rms(ref[1], got[1]))
    print(f"\n{case} P={segments}: fused o {ef[0]:.2e} ht {ef[1]:.2e} | split o {es[0]:.2e} ht {es[1]:.2e} | "
          f"split vs fused o {d[0]:.2e} ht {d[1]:.2e}")
    assert max(es) < 0.005, es
    assert es[0] <= 1.1 * ef[0] and es[1] <= 1.1 * ef[1], (ef, es)


@pytest.mark.parametrize("case", ["fixed-tail-svf", "varlen-gva-empty", "varlen-slow"])
def test_intermediate_states_emulated(emulator, case):
    """return_intermediate_states: h_inter holds bf16(S) at every chunk start in FLA's layout ([B, NT, HV, K, V],
    V-first with state_v_first; varlen chunks at FLA's chunk offsets). The fused kernel's h against the model's
    chunk-start states (and h0 exactly at each sequence's chunk 0); the two-kernel form's, unsplit, bit-identical to
    the fused kernel's; split (P = 3), close to it. Every entry is written (NaN-poisoned)."""
    _ext_or_skip()
    if case == "varlen-slow":
        (q, k, v, g, beta, A_log, dt_bias, h0, cu), kw = _split_case(case)
    else:
        (q, k, v, g, beta, A_log, dt_bias, h0, cu), kw = _emulator_case(case)
    args = (q, k, v, g, beta, A_log, dt_bias, h0, cu)
    B, T, _, _ = q.shape
    HV, N = v.shape[2], (B if cu is None else cu.shape[0] - 1)
    h_f, off = _h_buffers(q, cu, HV)
    o = torch.empty(B, T, HV, 128, dtype=torch.bfloat16)
    _emu_call(emulator, *args, o, torch.empty(N, HV, 128, 128), None, None, None, block_v=128, wgmma=True,
              h_inter=h_f, chunk_offsets=off, **kw)
    assert not h_f.isnan().any()
    states = []
    kda_chunk_model(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=kw["lb"], scale=kw["scale"],
                    initial_state=h0, use_qk_l2norm_in_kernel=kw["l2"], use_beta_sigmoid_in_kernel=kw["bsig"],
                    allow_neg_eigval=kw["neg"], cu_seqlens=cu, state_v_first=kw["svf"], chunk_states=states)
    model = torch.stack(states)                                        # [chunks, HV, K, V], sequence by sequence
    got = h_f.reshape(-1, HV, 128, 128).float()
    if kw["svf"]:
        got = got.transpose(-1, -2)
    h0k = h0.transpose(-1, -2) if kw["svf"] else h0
    seqs = [0] if cu is None else [n for n in range(N) if off[n] < off[n + 1]]   # sequences with chunks
    for n in seqs:
        f = 0 if cu is None else int(off[n])
        assert torch.equal(got[f], h0k[n].to(torch.bfloat16).float()), n   # chunk 0 starts from h0
    e = rel_rms(model, got)
    print(f"\n{case}: h vs model {e:.1e}")
    assert e < 1e-3, e
    for segments, exact in ((1, True), (3, False)):
        h_t, _ = _h_buffers(q, cu, HV)
        _emulate_two_kernel(emulator, *args, block_v=64, segments=segments, seg_chunks=None if exact else 1,
                            out_kw=dict(h_inter=h_t, chunk_offsets=off), **kw)
        assert not h_t.isnan().any()
        if exact:
            assert torch.equal(h_t, h_f)
        else:
            assert rel_rms(h_f.float(), h_t.float()) < 2e-3

