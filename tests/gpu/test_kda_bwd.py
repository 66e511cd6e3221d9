"""kda_bwd_wy on the GPU (csrc/kda_sm90/kda_bwd_wy_kernel.cuh): FLA's chunk_kda_bwd_wy_dqkg_fused replaced.

Fresh random inputs (tests/test_kda_bwd_compile.py's generator) on the GPU; outputs NaN-poisoned before the call,
so an unwritten row shows; each output compared with the fp64 model (fla_cula.reference.kda.bwd_wy_reference)
and with FLA's Triton kernel on the same inputs: within 1.5x FLA's own error vs fp64 (plus an fp32 floor).
Then the training path: chunk_kda forward + backward under FLA_CULA_STRICT=1 runs the kernel (route count)."""

import pytest
import torch

import fla_cula
from fla_cula import _ext
from fla_cula.ops import kda as ops_kda
from fla_cula.ops import kda_bwd
from fla_cula.reference.compare import rel_rms
from fla_cula.reference.kda import bwd_dAv_reference, bwd_intra_reference, bwd_wy_reference
from tests.test_kda_bwd_compile import LOWER_BOUND, bwd_dv_inputs, bwd_intra_inputs, bwd_wy_inputs, chunk_indices_of

CASES = {
    "B1-T100-vfirst": dict(B=1, T=100, H=1, HV=1),
    "B2-T1000-H2-HV4-kfirst": dict(B=2, T=1000, H=2, HV=4, state_v_first=False),
    "B1-T4096-H4-vfirst": dict(B=1, T=4096, H=4, HV=4),
    "varlen-5seq-GVA": dict(B=1, T=1100, H=1, HV=2, lens=[1, 63, 64, 65, 907]),
}
NAMES = ("dq", "dk", "dv2", "db", "dg", "dA")


def _cuda(x):
    return {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bwd_wy_against_fp64_and_fla(case):
    kw = dict(CASES[case])
    lens = kw.get("lens")
    x = _cuda(bwd_wy_inputs(**kw, seed=7))
    B, T, H, _ = x["q"].shape
    HV = x["v"].shape[2]
    f32 = torch.float32
    out = {n: torch.full((B, T, HV, 128), float("nan"), dtype=f32, device="cuda") for n in ("dq", "dk", "dg")}
    out["dv2"] = torch.full((B, T, HV, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    out["db"] = torch.full((B, T, HV), float("nan"), dtype=f32, device="cuda")
    out["dA"] = torch.full((B, T, HV, 64), float("nan"), dtype=f32, device="cuda")
    ci = None if lens is None else chunk_indices_of(lens).cuda()
    cu = x["cu_seqlens"]
    before = {n: t.clone() for n, t in x.items() if isinstance(t, torch.Tensor)}
    _ext.require().kda_bwd_wy(x["q"], x["k"], x["v"], x["v_new"], x["g"], x["beta"], x["A"], x["h"], x["do"], x["dh"],
                              x["dv"], out["dq"], out["dk"], out["dv2"], out["dg"], out["db"], out["dA"], 128 ** -0.5,
                              x["state_v_first"], cu, ci)
    torch.cuda.synchronize()
    for n, t in before.items():
        assert torch.equal(t, x[n]), f"input {n} modified"
    fla = kda_bwd.FLA_CHUNK_KDA_BWD_WY(q=x["q"], k=x["k"], v=x["v"], v_new=x["v_new"], g=x["g"], beta=x["beta"],
                                       A=x["A"], h=x["h"], do=x["do"], dh=x["dh"], dv=x["dv"], scale=128 ** -0.5,
                                       state_v_first=x["state_v_first"], cu_seqlens=cu,
                                       chunk_indices=None if ci is None else ci.long())
    fla = dict(zip(("dq", "dk", "dv2", "db", "dg", "dA"), fla, strict=True))
    cpu = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    ref = bwd_wy_reference(cpu["q"], cpu["k"], cpu["v"], cpu["v_new"], cpu["g"], cpu["beta"], cpu["A"], cpu["h"],
                           cpu["do"], cpu["dh"], cpu["dv"], 128 ** -0.5, cpu["state_v_first"], cpu["cu_seqlens"])
    report = []
    for n in NAMES:
        o = out[n].cpu().double()
        assert not o.isnan().any(), f"{n}: {int(o.isnan().sum())} entries unwritten (NaN)"
        e_ours, e_fla = rel_rms(o, ref[n]), rel_rms(fla[n].cpu().double(), ref[n])
        report.append(f"{n} {e_ours:.2e}/{e_fla:.2e}")
        floor = 4e-3 if n == "dv2" else 1e-5
        assert e_ours <= 1.5 * e_fla + floor, f"{n}: rel RMS vs fp64 {e_ours:.2e}, FLA's {e_fla:.2e}"
    print(f"  {case}: ours / FLA vs fp64: " + " ".join(report))


def test_bwd_wy_rejects_bad_arguments():
    x = _cuda(bwd_wy_inputs(B=1, T=64, H=1, HV=1))
    o = {n: torch.empty(1, 64, 1, 128, device="cuda") for n in ("dq", "dk", "dg")}
    args = [x["q"], x["k"], x["v"], x["v_new"], x["g"], x["beta"], x["A"], x["h"], x["do"], x["dh"], x["dv"],
            o["dq"], o["dk"], torch.empty_like(x["v"]), o["dg"], torch.empty(1, 64, 1, device="cuda"),
            torch.empty(1, 64, 1, 64, device="cuda")]
    C = _ext.require()
    with pytest.raises(TypeError, match="g"):
        C.kda_bwd_wy(*args[:4], x["g"].bfloat16(), *args[5:], 1.0, True)
    with pytest.raises(ValueError, match="h: expected shape"):
        C.kda_bwd_wy(*args[:7], x["h"][:, :, :, :64].contiguous(), *args[8:], 1.0, True)
    with pytest.raises(ValueError, match="both or neither"):
        C.kda_bwd_wy(*args, 1.0, True, torch.tensor([0, 64], device="cuda", dtype=torch.int32), None)


@pytest.mark.parametrize("knob", [None, "WY_KERNEL", "DV_KERNEL"])
def test_training_step_runs_the_kernel_strict(strict_mode, monkeypatch, knob):
    """chunk_kda forward + backward with the KDA layer's flags: fla_cula's backward takes kda_bwd_wy (strict: a
    fallback raises), and the gradients agree with FLA's (relative RMS; test_kda_prefill's test_grad judges them
    against fp64). With a knob off: WY_KERNEL, FLA's wy after the fused form was planned (dAqk then from FLA's dAv,
    the intra step on our own kernel); DV_KERNEL, FLA's dAv for dv beside the fused kernel."""
    monkeypatch.setenv("FLA_CULA_FORCE", "1")  # the forward on the kernel whatever the routing policy says
    if knob is not None:
        monkeypatch.setattr(kda_bwd, knob, False)
    torch.manual_seed(0)
    B, T, H, HV = 2, 1000, 2, 4
    dev = "cuda"
    q, k = (torch.randn(B, T, H, 128, dtype=torch.bfloat16, device=dev) for _ in range(2))
    v, g = (torch.randn(B, T, HV, 128, dtype=torch.bfloat16, device=dev) for _ in range(2))
    beta = torch.randn(B, T, HV, dtype=torch.bfloat16, device=dev)
    A_log = torch.randn(HV, device=dev)
    dt_bias = torch.randn(HV * 128, device=dev)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0,
              use_beta_sigmoid_in_kernel=True, state_v_first=True, output_final_state=True)
    do = torch.randn(B, T, HV, 128, device=dev)
    grads = {}
    for name, fn in (("fla", ops_kda.FLA_CHUNK_KDA), ("cula", fla_cula.chunk_kda)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, g, beta)]
        fla_cula.reset_status()
        o, _ = fn(*leaves, A_log=A_log, dt_bias=dt_bias, **kw)
        (o.float() * do).sum().backward()
        grads[name] = [t.grad.float() for t in leaves]
        if name == "cula":
            st = fla_cula.status()
            assert st.get(kda_bwd.OP_WY, {}).get("kernel", 0) == (knob != "WY_KERNEL"), st
            assert st.get(kda_bwd.OP_INTRA, {}).get("kernel", 0) == 1, st
            assert st.get(kda_bwd.OP_GATE, {}).get("kernel", 0) == 1, st
            assert st.get(kda_bwd.OP_DV, {}).get("kernel", 0) == (knob != "DV_KERNEL"), st
    for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), grads["fla"], grads["cula"], strict=True):
        assert rel_rms(b.double(), a.double()) < 2e-2, f"{n}: rel RMS vs FLA {rel_rms(b.double(), a.double()):.2e}"


@pytest.mark.parametrize("form", ["bounded", "unbounded"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bwd_intra_against_fp64_and_fla(case, form):
    """kda_bwd_intra's added terms (the output less the incoming gradient) against the fp64 model, within 1.5x of
    FLA's chunk_kda_bwd_intra's error on the same inputs (FLA: tf32 products off the diagonal sub-chunks). unbounded:
    softplus-like gates with decays of 150 (log2) at a few places (gate_shift None: per-channel anchors, the wide
    channels pairwise) against FLA's safe_gate=False form."""
    import math

    unbounded = form == "unbounded"
    kw = {n: v for n, v in CASES[case].items() if n != "state_v_first"}
    lens = kw.get("lens")
    x = _cuda(bwd_intra_inputs(**kw, seed=11, unbounded=unbounded))
    ci = None if lens is None else chunk_indices_of(lens).cuda()
    cu = x["cu_seqlens"]
    before = {n: t.clone() for n, t in x.items() if isinstance(t, torch.Tensor)}
    out = {n: torch.full_like(x[n], float("nan")) for n in ("dq", "dk", "dg", "db")}
    _ext.require().kda_bwd_intra(x["q"], x["k"], x["g"], x["beta"], x["dAqk"], x["dAkk"], x["dq"], x["dk"], x["dg"],
                                 x["db"], out["dq"], out["dk"], out["dg"], out["db"],
                                 None if unbounded else -LOWER_BOUND / math.log(2), cu, ci)
    torch.cuda.synchronize()
    for n, t in before.items():
        assert torch.equal(t, x[n]), f"input {n} modified"
    fdq, fdk, fdb, fdg = kda_bwd.FLA_CHUNK_KDA_BWD_INTRA(
        q=x["q"], k=x["k"], g=x["g"], beta=x["beta"], dAqk=x["dAqk"], dAkk=x["dAkk"], dq=x["dq"].clone(),
        dk=x["dk"].clone(), db=x["db"].clone(), dg=x["dg"].clone(), cu_seqlens=cu,
        chunk_indices=None if ci is None else ci.long(), chunk_size=64, safe_gate=not unbounded,
        lower_bound=None if unbounded else LOWER_BOUND)
    fla = {"dq": fdq, "dk": fdk, "db": fdb, "dg": fdg}
    cpu = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    ref = bwd_intra_reference(cpu["q"], cpu["k"], cpu["g"], cpu["beta"], cpu["dAqk"], cpu["dAkk"], cpu["dq"], cpu["dk"],
                              cpu["db"], cpu["dg"], cpu["cu_seqlens"])
    report = []
    for n in ("dq", "dk", "db", "dg"):
        inc = cpu[n].double()
        o = out[n].cpu().double()
        assert not o.isnan().any(), f"{n}: {int(o.isnan().sum())} entries unwritten (NaN)"
        e_ours = rel_rms(o - inc, ref[n] - inc)
        e_fla = rel_rms(fla[n].cpu().double() - inc, ref[n] - inc)
        report.append(f"{n} {e_ours:.2e}/{e_fla:.2e}")
        assert e_ours <= 1.5 * e_fla + 1e-5, f"{n}: rel RMS vs fp64 {e_ours:.2e}, FLA's {e_fla:.2e}"
    print(f"  {case} {form}: intra terms, ours / FLA vs fp64: " + " ".join(report))


def test_bwd_intra_rejects_bad_gate_shift():
    """gate_shift: > 0 up to 16.6 (the bounded form) or None (the unbounded one); 0 and past 16.6 are ValueErrors."""
    x = _cuda(bwd_intra_inputs(B=1, T=64, H=1, HV=1, seed=3))
    outs = [torch.empty_like(x[n]) for n in ("dq", "dk", "dg", "db")]
    args = [x[n] for n in ("q", "k", "g", "beta", "dAqk", "dAkk", "dq", "dk", "dg", "db")] + outs
    C = _ext.require()
    for bad in (0.0, -1.0, 20.0):
        with pytest.raises(ValueError, match="gate_shift"):
            C.kda_bwd_intra(*args, bad)


@pytest.mark.parametrize("form", ["bounded", "unbounded"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bwd_wy_fused_intra_against_fp64_and_fla(case, form):
    """kda_bwd_wy with intra (chunk_kda_bwd_intra fused in, its dAqk made in the kernel) against FLA's three
    kernels in sequence (chunk_kda_bwd_dAv's dAqk, wy, intra) and the fp64 models composed the same way (each within
    1.5x of FLA's error, plus an fp32 floor), and against our own two kernels in sequence (plain kda_bwd_wy, then
    kda_bwd_intra on FLA's dAqk): the same values up to summation order."""
    import math

    kw = dict(CASES[case])
    lens = kw.get("lens")
    unbounded = form == "unbounded"
    x = _cuda(bwd_wy_inputs(**kw, seed=9, unbounded=unbounded))
    B, T, H, _ = x["q"].shape
    HV = x["v"].shape[2]
    ci = None if lens is None else chunk_indices_of(lens).cuda()
    cu, shift, C = x["cu_seqlens"], None if unbounded else -LOWER_BOUND / math.log(2), _ext.require()
    ck = None if ci is None else ci.long()
    dAqk = kda_bwd.chunk_kda_bwd_dAv(q=x["q"], k=x["k"], v=x["v_new"], do=x["do"], A=x["A"], scale=128 ** -0.5,
                                     cu_seqlens=cu, chunk_indices=ck)[0]
    args = [x[n] for n in ("q", "k", "v", "v_new", "g", "beta", "A", "h", "do", "dh", "dv")]

    def outputs():
        o = {n: torch.full((B, T, HV, 128), float("nan"), device="cuda") for n in ("dq", "dk", "dg")}
        o["dv2"] = torch.full((B, T, HV, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
        o["db"] = torch.full((B, T, HV), float("nan"), device="cuda")
        return o

    fused, plain = outputs(), outputs()
    before = {n: t.clone() for n, t in x.items() if isinstance(t, torch.Tensor)}
    C.kda_bwd_wy(*args, fused["dq"], fused["dk"], fused["dv2"], fused["dg"], fused["db"], None, 128 ** -0.5,
                 x["state_v_first"], cu, ci, True, shift)
    dA = torch.full((B, T, HV, 64), float("nan"), device="cuda")
    C.kda_bwd_wy(*args, plain["dq"], plain["dk"], plain["dv2"], plain["dg"], plain["db"], dA, 128 ** -0.5,
                 x["state_v_first"], cu, ci)
    C.kda_bwd_intra(x["q"], x["k"], x["g"], x["beta"], dAqk, dA, plain["dq"], plain["dk"], plain["dg"], plain["db"],
                    plain["dq"], plain["dk"], plain["dg"], plain["db"], shift, cu, ci)
    torch.cuda.synchronize()
    for n, t in before.items():
        assert torch.equal(t, x[n]), f"input {n} modified"
    f = kda_bwd.FLA_CHUNK_KDA_BWD_WY(q=x["q"], k=x["k"], v=x["v"], v_new=x["v_new"], g=x["g"], beta=x["beta"],
                                     A=x["A"], h=x["h"], do=x["do"], dh=x["dh"], dv=x["dv"], scale=128 ** -0.5,
                                     state_v_first=x["state_v_first"], cu_seqlens=cu, chunk_indices=ck)
    fdq, fdk, fdb, fdg = kda_bwd.FLA_CHUNK_KDA_BWD_INTRA(
        q=x["q"], k=x["k"], g=x["g"], beta=x["beta"], dAqk=dAqk, dAkk=f[5], dq=f[0], dk=f[1], db=f[3], dg=f[4],
        cu_seqlens=cu, chunk_indices=ck, chunk_size=64, safe_gate=not unbounded,
        lower_bound=None if unbounded else LOWER_BOUND)
    fla = {"dq": fdq, "dk": fdk, "db": fdb, "dg": fdg, "dv2": f[2]}
    cpu = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    wy = bwd_wy_reference(cpu["q"], cpu["k"], cpu["v"], cpu["v_new"], cpu["g"], cpu["beta"], cpu["A"], cpu["h"],
                          cpu["do"], cpu["dh"], cpu["dv"], 128 ** -0.5, cpu["state_v_first"], cpu["cu_seqlens"])
    dAqk64 = bwd_dAv_reference(cpu["v_new"], cpu["do"], scale=128 ** -0.5, cu_seqlens=cpu["cu_seqlens"])["dAqk"]
    ref = bwd_intra_reference(cpu["q"], cpu["k"], cpu["g"], cpu["beta"], dAqk64, wy["dA"], wy["dq"], wy["dk"],
                              wy["db"], wy["dg"], cpu["cu_seqlens"])
    ref["dv2"] = wy["dv2"]
    report = []
    for n in ("dq", "dk", "dv2", "db", "dg"):
        o = fused[n].cpu().double()
        assert not o.isnan().any(), f"{n}: {int(o.isnan().sum())} entries unwritten (NaN)"
        assert rel_rms(o, plain[n].cpu().double()) < 1e-6, f"{n}: fused differs from wy + intra"
        e_ours, e_fla = rel_rms(o, ref[n]), rel_rms(fla[n].cpu().double(), ref[n])
        report.append(f"{n} {e_ours:.2e}/{e_fla:.2e}")
        floor = 4e-3 if n == "dv2" else 1e-5
        assert e_ours <= 1.5 * e_fla + floor, f"{n}: rel RMS vs fp64 {e_ours:.2e}, FLA's {e_fla:.2e}"
    print(f"  {case} {form}: fused wy + intra, ours / FLA vs fp64: " + " ".join(report))


def test_bwd_wy_fused_rejects_bad_arguments():
    x = _cuda(bwd_wy_inputs(B=1, T=64, H=1, HV=1))
    o = {n: torch.empty(1, 64, 1, 128, device="cuda") for n in ("dq", "dk", "dg")}
    args = [x["q"], x["k"], x["v"], x["v_new"], x["g"], x["beta"], x["A"], x["h"], x["do"], x["dh"], x["dv"],
            o["dq"], o["dk"], torch.empty_like(x["v"]), o["dg"], torch.empty(1, 64, 1, device="cuda")]
    dA = torch.empty(1, 64, 1, 64, device="cuda")
    C = _ext.require()
    with pytest.raises(ValueError, match="dA must be None"):
        C.kda_bwd_wy(*args, dA, 1.0, True, None, None, True, 7.0)
    for bad in (20.0, 0.0):  # None is the unbounded form; 0 is no shift
        with pytest.raises(ValueError, match="gate_shift"):
            C.kda_bwd_wy(*args, None, 1.0, True, None, None, True, bad)
    with pytest.raises(TypeError):  # intra is a bool (the dAqk tensor argument of API 10 is gone)
        C.kda_bwd_wy(*args, None, 1.0, True, None, None, torch.zeros(1, 64, 1, 64, device="cuda"), 7.0)


@pytest.mark.parametrize("case", ["B1-T100-vfirst", "B1-T4096-H4-vfirst"])
def test_bwd_wy_fused_l2norm_matches_fla_l2norm_bwd(case):
    """kda_bwd_wy with intra, q_rstd, k_rstd (H == HV): dqx, dkx against FLA's l2norm_bwd applied to the same call's
    final dq, dk (which the kernel still writes), within bf16's rounding; dg, db, dv2 as without it."""
    import math

    from fla.modules.norm.l2norm import l2norm_bwd

    kw = dict(CASES[case])
    x = _cuda(bwd_wy_inputs(**kw, seed=13))
    B, T, H, _ = x["q"].shape
    rstd = [torch.rand(B, T, H, device="cuda") + 0.5 for _ in range(2)]
    args = [x[n] for n in ("q", "k", "v", "v_new", "g", "beta", "A", "h", "do", "dh", "dv")]
    C, shift = _ext.require(), -LOWER_BOUND / math.log(2)
    outs = []
    for l2 in (False, True):
        o = {n: torch.full((B, T, H, 128), float("nan"), device="cuda") for n in ("dq", "dk", "dg")}
        o["dv2"] = torch.full((B, T, H, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
        o["db"] = torch.full((B, T, H), float("nan"), device="cuda")
        o["dqx"], o["dkx"] = (torch.full_like(x["q"], float("nan")) for _ in range(2))
        extra = (rstd[0], rstd[1], o["dqx"], o["dkx"]) if l2 else (None, None, None, None)
        C.kda_bwd_wy(*args, o["dq"], o["dk"], o["dv2"], o["dg"], o["db"], None, 128 ** -0.5, x["state_v_first"],
                     None, None, True, shift, *extra)
        outs.append(o)
    torch.cuda.synchronize()
    base, got = outs
    for n in ("dq", "dk", "dg", "db", "dv2"):
        assert rel_rms(got[n].double(), base[n].double()) < 1e-6, f"{n} differs with the l2norm backward fused"
    for n, y, r in (("q", x["q"], rstd[0]), ("k", x["k"], rstd[1])):
        ref = l2norm_bwd(y, r, got["d" + n])
        o = got[f"d{n}x"]
        assert not o.isnan().any(), f"d{n}x: unwritten entries"
        err = rel_rms(o.double(), ref.double())
        assert err < 8e-3, f"d{n}x: rel RMS {err:.2e} vs FLA's l2norm_bwd (both bf16)"


@pytest.mark.parametrize("form", ["plain", "fused", "fused-l2norm"])
def test_bwd_wy_same_bits_every_run(form):
    """Every output of kda_bwd_wy is the same bits in three runs on the same inputs (dg's chunk-last rows and db are
    sums over warps, taken in a fixed order from per-warp slots, not by atomics): a training run is reproducible."""
    import math

    kw = dict(CASES["B2-T1000-H2-HV4-kfirst"]) if form != "fused-l2norm" else dict(B=2, T=1000, H=4, HV=4)
    x = _cuda(bwd_wy_inputs(**kw, seed=21))
    B, T, H, _ = x["q"].shape
    HV = x["v"].shape[2]
    rstd = [torch.rand(B, T, H, device="cuda") + 0.5 for _ in range(2)]
    args = [x[n] for n in ("q", "k", "v", "v_new", "g", "beta", "A", "h", "do", "dh", "dv")]
    C, shift = _ext.require(), -LOWER_BOUND / math.log(2)
    runs = []
    for _ in range(3):
        o = {n: torch.full((B, T, HV, 128), float("nan"), device="cuda") for n in ("dq", "dk", "dg")}
        o["dv2"] = torch.full((B, T, HV, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
        o["db"] = torch.full((B, T, HV), float("nan"), device="cuda")
        if form == "plain":
            o["dA"] = torch.full((B, T, HV, 64), float("nan"), device="cuda")
            tail = (o["dA"], 128 ** -0.5, x["state_v_first"], None, None)
        else:
            tail = (None, 128 ** -0.5, x["state_v_first"], None, None, True, shift)
        if form == "fused-l2norm":
            o["dqx"], o["dkx"] = (torch.full_like(x["q"], float("nan")) for _ in range(2))
            tail += (rstd[0], rstd[1], o["dqx"], o["dkx"])
        C.kda_bwd_wy(*args, o["dq"], o["dk"], o["dv2"], o["dg"], o["db"], *tail)
        runs.append(o)
    torch.cuda.synchronize()
    for n, t in runs[0].items():
        assert not t.isnan().any(), f"{form}: {n} has unwritten entries"
        for r in runs[1:]:
            assert torch.equal(t, r[n]), f"{form}: {n} differs between runs (max |diff| {(t - r[n]).abs().max()})"


DV_GPU_CASES = {
    "B1-T100": dict(B=1, T=100, HV=1),
    "B2-T1000-HV4": dict(B=2, T=1000, HV=4),
    "varlen-5seq": dict(B=1, T=1100, HV=2, lens=[1, 63, 64, 65, 907]),
}


@pytest.mark.parametrize("case", sorted(DV_GPU_CASES))
def test_bwd_dv_against_fp64_and_fla(case):
    """kda_bwd_dv against the fp64 model and FLA's chunk_kda_bwd_dAv's dv on the same inputs (Aqk NaN above the
    diagonal: not read; dv NaN-poisoned: every row written), within 1.5x FLA's error plus bf16's rounding; inputs
    unchanged."""
    kw = dict(DV_GPU_CASES[case])
    lens = kw.get("lens")
    x = _cuda(bwd_dv_inputs(**kw, seed=5))
    B, T, HV = kw["B"], kw["T"], kw["HV"]
    ci = None if lens is None else chunk_indices_of(lens).cuda()
    before = {n: t.clone() for n, t in x.items() if isinstance(t, torch.Tensor)}
    dv = torch.full((B, T, HV, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    _ext.require().kda_bwd_dv(x["Aqk"], x["do"], dv, x["cu_seqlens"], ci)
    torch.cuda.synchronize()
    for n, t in before.items():
        assert torch.equal(t.nan_to_num(7.0), x[n].nan_to_num(7.0)), f"input {n} modified"
    qk = torch.zeros(B, T, 1, 128, dtype=torch.bfloat16, device="cuda")  # FLA's kernel reads only their shapes
    fla = kda_bwd.chunk_kda_bwd_dAv(q=qk, k=qk, v=x["do"], do=x["do"], A=x["Aqk"].nan_to_num(0.0), scale=1.0,
                                    cu_seqlens=x["cu_seqlens"], chunk_indices=None if ci is None else ci.long())[1]
    cpu = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    ref = bwd_dAv_reference(cpu["do"], cpu["do"], cpu["Aqk"], cu_seqlens=cpu["cu_seqlens"])["dv"]
    o = dv.cpu().double()
    assert not o.isnan().any(), f"dv: {int(o.isnan().sum())} entries unwritten (NaN) or masked entries read"
    e_ours, e_fla = rel_rms(o, ref), rel_rms(fla.cpu().double(), ref)
    assert e_ours <= 1.5 * e_fla + 4e-3, f"dv: rel RMS vs fp64 {e_ours:.2e}, FLA's {e_fla:.2e}"
    print(f"  {case}: dv ours / FLA vs fp64: {e_ours:.2e}/{e_fla:.2e}")


def test_bwd_dv_rejects_bad_arguments():
    x = _cuda(bwd_dv_inputs(B=1, T=64, HV=1))
    C = _ext.require()
    dv = torch.empty_like(x["do"])
    with pytest.raises(ValueError, match="Aqk"):
        C.kda_bwd_dv(x["Aqk"][:, :, :, :32].contiguous(), x["do"], dv)
    with pytest.raises(TypeError, match="do"):
        C.kda_bwd_dv(x["Aqk"], x["do"].float(), dv)
    with pytest.raises(ValueError, match="cu_seqlens"):
        C.kda_bwd_dv(x["Aqk"], x["do"], dv, torch.tensor([0, 64], device="cuda", dtype=torch.int32), None)


GATE_GPU_CASES = {
    "B2-T1000-HV4-bf16": dict(B=2, T=1000, HV=4, dtype=torch.bfloat16),
    "B1-T4096-HV8-fp32-noA": dict(B=1, T=4096, HV=8, dtype=torch.float32, A_log=False),
    "varlen-5seq-bf16-nobias": dict(B=1, T=1100, HV=2, dtype=torch.bfloat16, lens=[1, 63, 64, 65, 907], dt_bias=False),
    # the softplus gate -exp(A_log) softplus(g_raw + dt_bias) (lower_bound None)
    "softplus-B2-T1000-HV4-bf16": dict(B=2, T=1000, HV=4, dtype=torch.bfloat16, lb=None),
    "softplus-varlen-5seq-fp32-nobias": dict(B=1, T=1100, HV=2, dtype=torch.float32, lens=[1, 63, 64, 65, 907],
                                             dt_bias=False, lb=None),
}


@pytest.mark.parametrize("case", sorted(GATE_GPU_CASES))
def test_bwd_gate_against_fp64_and_fla(case):
    """kda_bwd_gate (dg's reverse chunk cumsum + the gate backward, one pass) against FLA's chunk_local_cumsum +
    kda_gate_bwd and the fp64 formulas on the same fresh inputs: dg_raw (NaN-poisoned before the call: every sequence
    row written) within 1.5x FLA's error vs fp64 plus half an ulp of its dtype; dA_log and dt_bias's gradient
    likewise; the inputs unchanged."""
    from fla.ops.kda.gate import kda_gate_bwd
    from fla.ops.utils import chunk_local_cumsum

    from tests.test_kda_bwd_compile import gate_bwd_reference

    kw = dict(GATE_GPU_CASES[case])
    B, T, HV, dt, lens, lb = kw["B"], kw["T"], kw["HV"], kw["dtype"], kw.get("lens"), kw.get("lb", LOWER_BOUND)
    gen = torch.Generator().manual_seed(len(case))
    dg = torch.randn(B, T, HV, 128, generator=gen).cuda()
    g_raw = (torch.randn(B, T, HV, 128, generator=gen) * 2).to(dt).cuda()
    A_log = (torch.randn(HV, generator=gen) * 0.5).cuda() if kw.get("A_log", True) else None
    dt_bias = torch.randn(HV * 128, generator=gen).cuda() if kw.get("dt_bias", True) else None
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    ci = None if lens is None else chunk_indices_of(lens).cuda()
    before = [t.clone() for t in (dg, g_raw) if t is not None]
    chunks = B * ((T + 63) // 64) if lens is None else ci.shape[0]
    dg_raw = torch.full_like(g_raw, float("nan"))
    dA_part = torch.empty(chunks, HV, device="cuda") if A_log is not None else None
    dbias_part = torch.empty(chunks, HV * 128, device="cuda") if dt_bias is not None else None
    _ext.require().kda_bwd_gate(dg, g_raw, A_log, dt_bias, lb, dg_raw, dA_part, dbias_part, cu, ci)
    dyg = chunk_local_cumsum(dg, chunk_size=64, reverse=True, cu_seqlens=cu,
                             chunk_indices=None if ci is None else ci.long())
    f_dg, f_dA, f_dbias = kda_gate_bwd(g=g_raw, A_log=A_log, dt_bias=dt_bias, dyg=dyg, lower_bound=lb)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, (dg, g_raw), strict=True)), "an input was modified"
    seqs = ([(b, 0, T) for b in range(B)] if lens is None
            else [(0, int(cu[i]), int(cu[i + 1])) for i in range(len(lens))])
    ref, dA_ref, dbias_ref = gate_bwd_reference(dg.cpu(), g_raw.cpu(), None if A_log is None else A_log.cpu(),
                                                None if dt_bias is None else dt_bias.cpu(), lb, seqs)
    ulp = 2.0 ** -9 if dt == torch.bfloat16 else 2.0 ** -24
    o = dg_raw.cpu().double()
    assert not o.isnan().any(), "dg_raw: unwritten entries"
    e_ours, e_fla = rel_rms(o, ref), rel_rms(f_dg.cpu().double(), ref)
    assert e_ours <= 1.5 * e_fla + ulp, f"dg_raw: rel RMS vs fp64 {e_ours:.2e}, FLA's {e_fla:.2e}"
    report = [f"dg_raw {e_ours:.2e}/{e_fla:.2e}"]
    for n, part, theirs, want in (("dA_log", dA_part, f_dA, dA_ref), ("dt_bias", dbias_part, f_dbias, dbias_ref)):
        if part is None:
            continue
        ours = part.sum(0).cpu().double()
        e_ours, e_fla = rel_rms(ours, want.sum(0)), rel_rms(theirs.cpu().double().reshape(-1), want.sum(0))
        assert e_ours <= 1.5 * e_fla + 1e-6, f"{n}: rel RMS vs fp64 {e_ours:.2e}, FLA's {e_fla:.2e}"
        report.append(f"{n} {e_ours:.2e}/{e_fla:.2e}")
    print(f"  {case}: ours / FLA vs fp64: " + " ".join(report))


def test_bwd_gate_rejects_bad_arguments():
    dg = torch.randn(1, 64, 2, 128, device="cuda")
    g_raw = torch.randn(1, 64, 2, 128, device="cuda").bfloat16()
    A_log, dt_bias = torch.zeros(2, device="cuda"), torch.zeros(256, device="cuda")
    dg_raw = torch.empty_like(g_raw)
    dA_part, dbias_part = torch.empty(1, 2, device="cuda"), torch.empty(1, 256, device="cuda")
    C = _ext.require()
    with pytest.raises(TypeError, match="dg"):
        C.kda_bwd_gate(dg.bfloat16(), g_raw, A_log, dt_bias, -5.0, dg_raw, dA_part, dbias_part)
    with pytest.raises(TypeError, match="dg_raw"):
        C.kda_bwd_gate(dg, g_raw, A_log, dt_bias, -5.0, dg_raw.float(), dA_part, dbias_part)
    with pytest.raises(ValueError, match="lower_bound"):
        C.kda_bwd_gate(dg, g_raw, A_log, dt_bias, 0.0, dg_raw, dA_part, dbias_part)
    with pytest.raises(ValueError, match="A_log: expected a tensor in the softplus form"):
        C.kda_bwd_gate(dg, g_raw, None, dt_bias, None, dg_raw, None, dbias_part)
    with pytest.raises(ValueError, match="A_log"):
        C.kda_bwd_gate(dg, g_raw, A_log[:1], dt_bias, -5.0, dg_raw, dA_part, dbias_part)
    with pytest.raises(ValueError, match="dbias_part"):
        C.kda_bwd_gate(dg, g_raw, A_log, dt_bias, -5.0, dg_raw, dA_part, dbias_part[:, :128])
    with pytest.raises(ValueError, match="dA_part: expected None"):
        C.kda_bwd_gate(dg, g_raw, None, dt_bias, -5.0, dg_raw, dA_part, dbias_part)
    with pytest.raises(ValueError, match="both or neither"):
        C.kda_bwd_gate(dg, g_raw, A_log, dt_bias, -5.0, dg_raw, dA_part, dbias_part,
                       torch.tensor([0, 64], device="cuda", dtype=torch.int32), None)
