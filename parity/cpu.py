"""``python -m parity --cpu``: the references alone, on the CPU (CI).

Checks ``fla_cula.reference`` against FLA's naive references (``fla.ops.kda.naive``,
``fla.ops.simple_gla.naive``; float32 arithmetic, so the bound is 2e-5 relative RMS), with the
in-kernel options applied to the naive inputs by hand (l2norm, both gate forms, beta sigmoid,
state layouts, varlen as one naive call per sequence, GVA); ``kda_decode_pool`` against a
composition of ``kda_recurrent`` calls (state pools, speculative decoding, padding); and the
references' autograd (parity's gradient oracle) with ``torch.autograd.gradcheck``.
Writes nothing; prints one line per check and exits non-zero on a failure.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from parity import rules
from parity.cases import Case, make_inputs

NAIVE_TOL = 2e-5


def _prep(case: Case, x: dict):
    """Inputs as FLA's naive references take them: gates/l2norm/sigmoid applied, float64."""
    from fla_cula.reference import kda_gate

    q, k, v, g, beta = (x[n].double() for n in ("q", "k", "v", "g", "beta"))
    if case.l2norm:
        q = q / torch.sqrt(q.square().sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt(k.square().sum(-1, keepdim=True) + 1e-6)
    if case.gate != "pre":
        g = _manual_gate(case, x)
        g_ref = kda_gate(x["g"], x["A_log"], x["dt_bias"], x["lower_bound"]).double()
        err = rules.rel_rms(g, g_ref)
        if err > 1e-12:
            raise AssertionError(f"kda_gate differs from the documented formula: {err:.2e}")
    if case.beta_sigmoid:
        beta = beta.sigmoid() * (2.0 if case.neg_eig else 1.0)
    return q, k, v, g, beta


def _manual_gate(case: Case, x: dict) -> torch.Tensor:
    g = x["g"].double()
    HV, K = case.HV, case.K
    if x["dt_bias"] is not None:
        g = g + x["dt_bias"].double().view(HV, K)
    A = x["A_log"].double().view(HV, 1) if x["A_log"] is not None else None
    if x["lower_bound"] is None:
        return -torch.exp(A) * F.softplus(g)
    return x["lower_bound"] * torch.sigmoid((torch.exp(A) * g) if A is not None else g)


def _naive_kda(case: Case, x: dict):
    from fla.ops.kda.naive import naive_recurrent_kda

    q, k, v, g, beta = _prep(case, x)
    h0 = x["h0"].double() if x["h0"] is not None else None
    if h0 is not None and case.state_v_first:
        h0 = h0.transpose(-1, -2)
    scale = case.scale if case.scale is not None else case.K ** -0.5
    if case.seqlens is None:
        o, S = naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)
    else:
        os_, Ss = [], []
        pos = 0
        for n, L in enumerate(case.seqlens):
            s = slice(pos, pos + L)
            o_n, S_n = naive_recurrent_kda(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], scale=scale,
                                           initial_state=h0[n:n + 1] if h0 is not None else None,
                                           output_final_state=True)
            os_.append(o_n)
            Ss.append(S_n)
            pos += L
        o, S = torch.cat(os_, 1), torch.cat(Ss, 0)
    if case.state_v_first:
        S = S.transpose(-1, -2)
    return o, S


def _ref_kda(case: Case, x: dict):
    from fla_cula.reference import kda_recurrent

    return kda_recurrent(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=case.scale, initial_state=x["h0"],
                         output_final_state=True, use_qk_l2norm_in_kernel=case.l2norm,
                         use_gate_in_kernel=case.gate != "pre", A_log=x["A_log"], dt_bias=x["dt_bias"],
                         lower_bound=x["lower_bound"], use_beta_sigmoid_in_kernel=case.beta_sigmoid,
                         allow_neg_eigval=case.neg_eig, state_v_first=case.state_v_first, cu_seqlens=x["cu_seqlens"])


def _naive_chunk_check(x: dict, case: Case):
    """FLA's naive chunk form (T a multiple of the chunk) vs kda_recurrent."""
    from fla.ops.kda.naive import naive_chunk_kda

    q, k, v, g, beta = _prep(case, x)
    o, S = naive_chunk_kda(q, k, v, g, beta, scale=None, initial_state=x["h0"].double(), output_final_state=True,
                           chunk_size=16)
    return o, S


def _lightning_naive(case: Case, x: dict):
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    from fla_cula.reference import lightning_g_gamma

    gg = lightning_g_gamma(case.H, case.layer_idx, case.num_layers).double()
    q, k, v = (x[n].double() for n in ("q", "k", "v"))
    if case.reverse:
        q, k, v = (t.flip(1) for t in (q, k, v))
    h0 = x["h0"].double() if x["h0"] is not None else None
    scale = case.scale if case.scale is not None else case.K ** -0.5

    def one(qs, ks, vs, h):
        g = gg.view(1, 1, -1).expand(qs.shape[0], qs.shape[1], -1)
        return naive_recurrent_simple_gla(qs, ks, vs, g, scale=scale, initial_state=h, output_final_state=True)

    if case.seqlens is None:
        o, S = one(q, k, v, h0)
    else:
        os_, Ss, pos = [], [], 0
        for n, L in enumerate(case.seqlens):
            s = slice(pos, pos + L)
            o_n, S_n = one(q[:, s], k[:, s], v[:, s], h0[n:n + 1] if h0 is not None else None)
            os_.append(o_n)
            Ss.append(S_n)
            pos += L
        o, S = torch.cat(os_, 1), torch.cat(Ss, 0)
    if case.reverse:
        o = o.flip(1)
    return o, S


def _ref_lightning(case: Case, x: dict):
    from fla_cula.reference import lightning_recurrent

    return lightning_recurrent(x["q"], x["k"], x["v"], case.layer_idx, case.num_layers, scale=case.scale,
                               initial_state=x["h0"], output_final_state=True, reverse=case.reverse,
                               cu_seqlens=x["cu_seqlens"])


def cpu_cases() -> list[tuple[str, Case]]:
    b = Case(op="fused_recurrent_kda", B=2, T=9, H=2, HV=2, K=8, V=8, dtype="fp32")
    kda = [b, b.with_(HV=4), b.with_(HV=8, K=6, V=10), b.with_(h0=False), b.with_(state_v_first=True),
           b.with_(l2norm=True), b.with_(beta_sigmoid=True), b.with_(beta_sigmoid=True, neg_eig=True),
           b.with_(scale=0.3), b.with_(dtype="bf16")]
    kda += [b.with_(gate=g) for g in ("softplus", "softplus_nobias", "lb", "lb_noA")]
    kda += [b.with_(gate="softplus", l2norm=True, beta_sigmoid=True, state_v_first=True, HV=4)]
    kda += [b.with_(varlen="skewed", seqlens=(1, 7, 3), B=1, T=11), b.with_(varlen="len1", seqlens=(1,), B=1, T=1),
            b.with_(varlen="skewed", seqlens=(4, 1, 5), B=1, T=10, state_v_first=True, gate="lb")]
    lb = Case(op="fused_recurrent_lightning_attn", B=2, T=9, H=4, HV=4, K=8, V=8, dtype="fp32")
    light = [lb, lb.with_(h0=False), lb.with_(reverse=True), lb.with_(layer_idx=0), lb.with_(layer_idx=23),
             lb.with_(scale=0.5), lb.with_(varlen="skewed", seqlens=(1, 6, 2), B=1, T=9), lb.with_(K=6, V=10)]
    pb = Case(op="fused_recurrent_kda_fwd", B=3, T=1, H=2, HV=4, K=8, V=8, dtype="fp32", gate="softplus",
              l2norm=True, beta_sigmoid=True, pool="idx1d", inplace=True)
    pools = [pb, pb.with_(state_v_first=True), pb.with_(T=3, pool="idx2d"), pb.with_(T=3, pool="idx2d_spec"),
             pb.with_(pool="idx1d_pad", B=4), pb.with_(T=3, pool="idx2d_spec_pad", B=4),
             pb.with_(varlen="skewed", seqlens=(1, 3, 2), B=1, T=6, pool="idx2d_spec")]
    return ([("kda vs naive_recurrent_kda", c) for c in kda] + [("lightning vs naive_recurrent_simple_gla", c)
                                                                  for c in light]
            + [("kda_decode_pool vs kda_recurrent composition", c) for c in pools])


def run(seed: int = 0) -> int:
    from parity.runner import pool_reference, reference

    failures = 0
    t0 = time.perf_counter()
    lines: list[str] = []

    def report(name: str, cid: str, err: float, tol: float):
        nonlocal failures
        ok = err <= tol
        failures += not ok
        lines.append(f"{'ok  ' if ok else 'FAIL'} {name:<46} {err:9.2e} (tol {tol:.0e})  {cid}")
        print(lines[-1], flush=True)

    for i, (name, case) in enumerate(cpu_cases()):
        x = make_inputs(case, "cpu", seed * 1000 + i)
        try:
            if name.startswith("kda vs"):
                o_r, S_r = _ref_kda(case, x)
                o_n, S_n = _naive_kda(case, x)
                report(name, case.id, max(rules.rel_rms(o_n, o_r), rules.rel_rms(S_n, S_r)), NAIVE_TOL)
            elif name.startswith("lightning"):
                o_r, S_r = _ref_lightning(case, x)
                o_n, S_n = _lightning_naive(case, x)
                report(name, case.id, max(rules.rel_rms(o_n, o_r), rules.rel_rms(S_n, S_r)), NAIVE_TOL)
            else:
                from fla_cula import reference as ref

                o_r, P_r = reference(case, x)  # kda_decode_pool
                o_c, P_c = pool_reference(ref, case, x)
                from parity.cases import padded_token_mask

                m = padded_token_mask(case, x)
                if m is not None:
                    o_r, o_c = o_r[~m], o_c[~m]
                report(name, case.id, max(rules.rel_rms(o_c, o_r), rules.rel_rms(P_c, P_r)), 1e-12)
        except Exception as e:  # noqa: BLE001
            failures += 1
            print(f"FAIL {name:<46} raised {type(e).__name__}: {e}  {case.id}", flush=True)

    # naive chunk form (the algorithm chunk_kda implements) vs the recurrence
    c = Case(op="chunk_kda", B=1, T=32, H=2, HV=4, K=8, V=8, dtype="fp32")
    x = make_inputs(c, "cpu", seed * 1000 + 999)
    try:
        o_n, S_n = _naive_chunk_check(x, c)
        o_r, S_r = _ref_kda(c, x)
        report("kda vs naive_chunk_kda", c.id, max(rules.rel_rms(o_n, o_r), rules.rel_rms(S_n, S_r)), NAIVE_TOL)
    except Exception as e:  # noqa: BLE001
        failures += 1
        print(f"FAIL naive_chunk_kda raised {type(e).__name__}: {e}", flush=True)

    failures += _gradchecks(seed)
    print(f"parity --cpu: {failures} failure(s), {time.perf_counter() - t0:.1f} s", flush=True)
    return 1 if failures else 0


def _gradchecks(seed: int) -> int:
    """The references are parity's gradient oracle: check their autograd against finite differences."""
    from parity.runner import differentiable_reference, grad_leaf_names, reference

    failures = 0
    cases = [
        Case(op="chunk_kda", B=1, T=3, H=1, HV=2, K=3, V=2, dtype="fp32", gate="softplus", l2norm=True,
             beta_sigmoid=True, grad=True),
        Case(op="chunk_kda", B=1, T=3, H=1, HV=1, K=3, V=2, dtype="fp32", gate="lb", state_v_first=True, grad=True),
        Case(op="chunk_lightning_attn", B=1, T=3, H=2, HV=2, K=3, V=2, dtype="fp32", grad=True),
        Case(op="chunk_kda", B=1, T=4, H=1, HV=2, K=2, V=2, dtype="fp32", varlen="skewed", seqlens=(1, 3),
             gate="softplus_nobias", grad=True),
        Case(op="fused_recurrent_lightning_attn", B=1, T=4, H=2, HV=2, K=2, V=2, dtype="fp32", varlen="skewed",
             seqlens=(3, 1), reverse=True, grad=True),
    ]
    for i, case in enumerate(cases):
        x = make_inputs(case, "cpu", seed * 1000 + 500 + i)
        names = grad_leaf_names(case, x)
        leaves = [x[n].double().detach().requires_grad_(True) for n in names]
        # forward of the differentiable twin == fla_cula.reference
        o_r, s_r = reference(case, x)
        o_d, s_d = differentiable_reference(case, x, dict(zip(names, leaves, strict=True)))
        agree = max(rules.rel_rms(o_r, o_d), rules.rel_rms(s_r, s_d))
        print(f"{'ok  ' if agree < 1e-10 else 'FAIL'} autograd_ref forward == fla_cula.reference {agree:9.2e}  "
              f"{case.id}", flush=True)
        failures += not agree < 1e-10

        def f(*ts, case=case, x=x, names=names):
            o, st = differentiable_reference(case, x, dict(zip(names, ts, strict=True)))
            return o, st

        try:
            ok = torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-6, rtol=1e-5)
        except Exception as e:  # noqa: BLE001
            ok = False
            print(f"FAIL gradcheck {case.id}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        else:
            print(f"{'ok  ' if ok else 'FAIL'} gradcheck of the fp64 reference ({', '.join(names)})  {case.id}",
                  flush=True)
        failures += not ok
    return failures
