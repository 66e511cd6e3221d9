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
from fla_cula.reference.kda import bwd_wy_reference
from tests.test_kda_bwd_compile import bwd_wy_inputs, chunk_indices_of

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


def test_training_step_runs_the_kernel_strict(strict_mode, monkeypatch):
    """chunk_kda forward + backward with the KDA layer's flags: fla_cula's backward takes kda_bwd_wy (strict: a
    fallback raises), and the gradients agree with FLA's (relative RMS; test_kda_prefill's test_grad judges them
    against fp64)."""
    monkeypatch.setenv("FLA_CULA_FORCE", "1")  # the forward on the kernel whatever the routing policy says
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
            assert st.get(kda_bwd.OP_WY, {}).get("kernel", 0) == 1, st
    for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), grads["fla"], grads["cula"], strict=True):
        assert rel_rms(b.double(), a.double()) < 2e-2, f"{n}: rel RMS vs FLA {rel_rms(b.double(), a.double()):.2e}"
