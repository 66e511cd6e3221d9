"""CPU tests of the measuring instruments' pure parts: parity grid, inputs, pass rule, reports,
runner plumbing (with reference-backed stand-ins for the ops), benchmark roofline and formatting."""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import registry as breg  # noqa: E402
from benchmarks import report as breport  # noqa: E402
from parity import autograd_ref, rules  # noqa: E402
from parity import report as preport  # noqa: E402
from parity.cases import OPS, Case, grid, make_inputs, padded_token_mask, written_slots  # noqa: E402


# ---------------------------------------------------------------------------------------------
# grid
def test_grid_ids_unique_and_every_op_present():
    cases = grid()
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids))
    assert {c.op for c in cases} == set(OPS)
    quick = grid(quick=True)
    assert set(c.id for c in quick) <= set(ids)
    assert {c.op for c in quick} == set(OPS)


def test_grid_covers_issue_3_dimensions():
    cases = grid()
    kda = [c for c in cases if c.is_kda]
    assert {c.varlen for c in cases} >= {None, "uniform", "skewed", "many_short", "len1"}
    assert {c.H for c in cases} >= {4, 16, 32, 64}
    assert any(c.HV == 2 * c.H for c in cases) and any(c.HV == 4 * c.H for c in cases)
    assert {c.K for c in cases} >= {64, 128, 100}
    assert {c.dtype for c in cases} == {"bf16", "fp16", "fp32"}
    assert {c.h0 for c in cases} == {True, False}
    assert {c.state_v_first for c in kda} == {True, False}
    assert {c.gate for c in kda} == {"pre", "softplus", "softplus_nobias", "lb", "lb_noA"}
    for flag in ("l2norm", "beta_sigmoid", "neg_eig", "safe_gate"):
        assert any(getattr(c, flag) for c in kda), flag
    assert {c.grad for c in cases if c.op == "chunk_kda"} == {True, False}
    assert {c.grad for c in cases if c.op == "chunk_lightning_attn"} == {True, False}
    assert any(c.T < 64 for c in cases) and any(c.T % 64 and c.T > 64 for c in cases)
    pools = {c.pool for c in cases if c.op == "fused_recurrent_kda_fwd"}
    assert pools >= {"idx1d", "idx1d_pad", "idx2d", "idx2d_spec", "idx2d_spec_pad", "noidx"}
    assert any(c.out_given for c in cases) and any(c.op == "fused_recurrent_kda_fwd" and not c.out_given
                                                   for c in cases)


@pytest.mark.parametrize("op", OPS)
def test_make_inputs_shapes_for_every_case(op):
    for c in grid([op]):
        x = make_inputs(c, "cpu", 1)
        N = c.n_seqs
        tokens = sum(c.lengths)
        assert x["q"].shape[-3:] == (tokens if c.seqlens else c.T, c.H, c.K)
        assert x["v"].shape[-2:] == (c.HV, c.V)
        assert x["q"].dtype == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[c.dtype]
        if c.h0 and c.pool in (None, "noidx"):
            want = (N, c.HV, c.V, c.K) if c.state_v_first else (N, c.HV, c.K, c.V)
            assert tuple(x["h0"].shape) == want and x["h0"].abs().sum() > 0
        if c.seqlens:
            assert x["cu_seqlens"][-1].item() == tokens and x["q"].shape[0] == 1
        if c.pool not in (None, "noidx"):
            idx = x["ssm_state_indices"]
            valid = idx[idx >= 0]
            assert len(set(valid.tolist())) == valid.numel() and valid.max() < x["h0"].shape[0]
            if x.get("num_accepted_tokens") is not None:
                acc = x["num_accepted_tokens"]
                assert (acc >= 1).all() and all(a <= L for a, L in zip(acc.tolist(), c.lengths, strict=True))


def test_fresh_inputs_per_seed_and_case():
    c = Case(op="chunk_kda", B=1, T=8, H=2, HV=2, K=8, V=8)
    a, b = make_inputs(c, "cpu", 1), make_inputs(c, "cpu", 2)
    assert not torch.equal(a["q"], b["q"])
    assert torch.equal(a["q"], make_inputs(c, "cpu", 1)["q"])


def test_pool_slots_and_padding_mask():
    c = Case(op="fused_recurrent_kda_fwd", B=4, T=3, H=2, HV=2, K=4, V=4, pool="idx2d_spec_pad", inplace=True)
    x = make_inputs(c, "cpu", 3)
    idx = x["ssm_state_indices"]
    assert (idx[1] < 0).all() and (idx[3] < 0).all()
    assert written_slots(c, x) == set(idx[0].tolist()) | set(idx[2].tolist())
    m = padded_token_mask(c, x)
    assert m.shape == (4, 3) and m[1].all() and not m[0].any()


# ---------------------------------------------------------------------------------------------
# pass rule
def test_rel_rms_matches_fla_definition():
    ref = torch.tensor([1.0, -2.0, 3.0])
    x = ref + torch.tensor([0.1, 0.0, -0.1])
    want = math.sqrt((0.01 + 0.01) / 3) / (math.sqrt(14 / 3) + 1e-8)
    assert rules.rel_rms(ref, x) == pytest.approx(want)


def test_judge():
    bf16 = torch.bfloat16
    assert rules.judge("o", 0.003, 0.0025, 0.1, bf16)[0]
    ok, note = rules.judge("o", 0.0055, 0.0045, 0.1, bf16)  # over tol, FLA under: fail
    assert not ok and "tol" in note
    assert not rules.judge("o", 0.004, 0.002, 0.1, bf16)[0]  # > 1.5x FLA + floor
    assert rules.judge("o", 0.0037, 0.002, 0.1, bf16)[0]  # within 1.5x + floor (7.8e-4)
    assert rules.judge("ht", 2e-6, 1e-7, 1e-5, torch.float32)[0]  # the floor absorbs near-exact noise
    assert not rules.judge("ht", 3e-5, 1e-7, 1e-4, torch.float32)[0]
    ok, note = rules.judge("dg", 0.03, 0.025, 0.1, torch.float32)  # FLA over tol: 1.5x leg decides
    assert ok and "FLA over tol" in note
    ok, note = rules.judge("o", 0.004, None, 0.1, bf16)
    assert ok and "FLA n/a" in note
    assert not rules.judge("o", float("nan"), 0.001, float("nan"), bf16)[0]
    assert rules.judge("o", 0.5, 0.0, 5e-7, bf16)[0] is False  # abs ok but 1.5x FLA leg fails
    assert rules.judge("dq", 0.0079, 0.006, 1.0, bf16)[0] and not rules.judge("dq", 0.0081, 0.006, 1.0, bf16)[0]


# ---------------------------------------------------------------------------------------------
# runner plumbing with reference-backed stand-ins (no GPU needed)
def _fake_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                    allow_neg_eigval=False, safe_gate=False, lower_bound=None, state_v_first=False, cu_seqlens=None,
                    **kw):
    o, S = autograd_ref.kda(q, k, v, g, beta, scale=scale or q.shape[-1] ** -0.5, initial_state=initial_state,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                            A_log=kw.get("A_log"), dt_bias=kw.get("dt_bias"), lower_bound=lower_bound,
                            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                            state_v_first=state_v_first, cu_seqlens=cu_seqlens)
    return o.to(q.dtype), (S.float() if output_final_state else None)


def _fake_kda_fwd(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None, output_final_state=False,
                  inplace_final_state=True, out=None, **kw):
    from fla_cula.reference import kda_decode_pool

    o, st = kda_decode_pool(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
                            scale=scale, output_final_state=output_final_state,
                            inplace_final_state=inplace_final_state, **kw)
    o = torch.nan_to_num(o)  # padded rows: FLA-like "unspecified" (written as zeros here)
    if out is None:
        out = torch.empty_like(v)
    out.copy_(o)
    if inplace_final_state:
        initial_state.copy_(st)
        return out, initial_state
    return out, (st.float() if st is not None else None)


def _fake_lightning(q, k, v, layer_idx, num_layers, scale=None, initial_state=None, output_final_state=False,
                    cu_seqlens=None, reverse=False, **kw):
    o, S = autograd_ref.lightning(q, k, v, layer_idx, num_layers, scale=scale or q.shape[-1] ** -0.5,
                                  initial_state=initial_state, reverse=reverse, cu_seqlens=cu_seqlens)
    return o.to(q.dtype), (S.float() if output_final_state else None)


FAKES = {"chunk_kda": _fake_chunk_kda, "fused_recurrent_kda": _fake_chunk_kda, "fused_recurrent_kda_fwd": _fake_kda_fwd,
         "chunk_lightning_attn": _fake_lightning, "fused_recurrent_lightning_attn": _fake_lightning}


@pytest.mark.parametrize("case", [
    Case(op="chunk_kda", B=2, T=5, H=2, HV=4, K=8, V=8, dtype="fp32", gate="softplus", l2norm=True, grad=True),
    Case(op="chunk_kda", B=1, T=7, H=2, HV=2, K=8, V=8, dtype="bf16", varlen="skewed", seqlens=(2, 5),
         state_v_first=True, gate="lb", grad=True),
    Case(op="fused_recurrent_kda_fwd", B=4, T=2, H=2, HV=2, K=8, V=8, dtype="fp32", gate="softplus", l2norm=True,
         beta_sigmoid=True, pool="idx2d_spec_pad", inplace=True, out_given=True),
    Case(op="fused_recurrent_kda_fwd", B=3, T=1, H=2, HV=2, K=8, V=8, dtype="fp32", pool="idx1d", inplace=True),
    Case(op="chunk_lightning_attn", B=2, T=6, H=2, HV=2, K=8, V=8, dtype="fp32", grad=True),
    Case(op="fused_recurrent_lightning_attn", B=2, T=3, H=2, HV=2, K=8, V=8, dtype="fp32", reverse=True),
], ids=lambda c: c.id)
def test_runner_plumbing_with_reference_backed_ops(case):
    from parity.runner import run_case

    rec = run_case(case, FAKES, FAKES, torch.device("cpu"), run_seed=7)
    assert rec["status"] == "pass", rec
    assert "o" in rec["errors"]
    if case.grad:
        assert {"dq", "dk", "dv"} <= set(rec["errors"])
    if case.pool:
        assert rec["untouched_slots_ok"] is True or case.pool == "noidx"
    if case.padded:
        assert rec["fla"].startswith("not run")


def test_runner_catches_a_wrong_implementation():
    from parity.runner import run_case

    def wrong(*a, **k):
        o, s = _fake_lightning(*a, **k)
        return o * 1.01, s

    case = Case(op="chunk_lightning_attn", B=1, T=4, H=2, HV=2, K=8, V=8, dtype="fp32")
    rec = run_case(case, {case.op: wrong}, FAKES, torch.device("cpu"), run_seed=1)
    assert rec["status"] == "FAIL"

    def unwritten(*a, **k):
        o, s = _fake_lightning(*a, **k)
        o = o.clone()
        o[0, -1] = float("nan")
        return o, s

    rec = run_case(case, {case.op: unwritten}, FAKES, torch.device("cpu"), run_seed=1)
    assert rec["status"] == "FAIL" and any("NaN" in n for n in rec["notes"])


def test_runner_fla_defect_only_on_a_faithful_fallback():
    """FLA's own NaN, reproduced bit for bit on a fallback route, is reported as an FLA defect (not a
    fla_cula failure); the same NaN on a kernel route, or a NaN FLA does not have, stays a failure."""
    from fla_cula import routing
    from parity.runner import run_case

    def fla_nan(*a, **k):  # an "FLA" whose final state has a NaN row, with or without poisoning
        o, s = _fake_lightning(*a, **k)
        s = s.clone()
        s[0, 0, 0] = float("nan")
        return o, s

    def fallback(*a, **k):
        routing.record_fallback("chunk_lightning_attn", "no kernel for this op yet")
        return fla_nan(*a, **k)

    def kernel_nan(*a, **k):
        routing.record_kernel("chunk_lightning_attn")
        return fla_nan(*a, **k)

    case = Case(op="chunk_lightning_attn", B=1, T=4, H=2, HV=2, K=8, V=8, dtype="fp32")
    fla = {case.op: fla_nan}
    rec = run_case(case, {case.op: fallback}, fla, torch.device("cpu"), run_seed=1)
    assert rec["status"] == "FLA-defect", rec
    assert any("also without poisoned memory" in n for n in rec["notes"])
    rec = run_case(case, {case.op: kernel_nan}, fla, torch.device("cpu"), run_seed=1)
    assert rec["status"] == "FAIL"
    rec = run_case(case, {case.op: fallback}, FAKES, torch.device("cpu"), run_seed=1)  # FLA has no NaN there
    assert rec["status"] == "FAIL"

    def fallback_off(*a, **k):  # FLA's NaN in the same place, but another element differs from FLA's
        o, s = fallback(*a, **k)
        s = s.clone()
        s[0, 0, 1] += 1.0
        return o, s

    rec = run_case(case, {case.op: fallback_off}, fla, torch.device("cpu"), run_seed=1)
    assert rec["status"] == "FAIL"
    s = preport.summarize([dict(rec, status="FLA-defect"), rec])
    assert s["failed"] == 1 and s["fla_defects"] == 1 and s["passed"] == 0


def test_parity_report_formatting(tmp_path):
    recs = [
        {"id": "a", "op": "chunk_kda", "route": "fallback: no kernel for this op yet", "fla": "ok", "status": "pass",
         "errors": {"o": {"cula": 1e-3, "fla": 1e-3}, "dq": {"cula": 2e-3, "fla": 2e-3}}, "notes": [],
         "max_abs_cula_minus_fla": 0.0},
        {"id": "b", "op": "fused_recurrent_kda", "route": "kernel", "fla": "not run: x", "status": "FAIL",
         "errors": {"o": {"cula": float("nan"), "fla": None}}, "notes": ["o: NaN/unwritten in fla_cula"],
         "max_abs_cula_minus_fla": None},
    ]
    s = preport.summarize(recs)
    assert s["cases"] == 2 and s["failed"] == 1 and s["kernel_routed"] == 1
    assert s["fallbacks_by_reason"] == {"no kernel for this op yet": 1}
    md, js = preport.write(recs, {"gpu": "test"}, str(tmp_path), "TEST")
    text = open(md).read()
    assert text.index("## Summary") < text.index("## Cases") and "NaN" in text and "`b`" in text
    import json

    assert json.load(open(js))["summary"]["failed"] == 1


# ---------------------------------------------------------------------------------------------
# benchmarks
def test_roofline_decode_bytes_match_baseline():
    s = breg.Shape(256, 1, 32, 32)
    assert breg.state_bytes(s, True, True) == 256 * 32 * 128 * 128 * 4 * 2  # 1.07 GB
    x = breg.kda_inputs(s, "cpu", False)
    nb = breg.io_bytes(s, x, "eager")
    assert 1.07e9 < nb < 1.09e9
    ms = breg.roofline_ms(nb, breg.recurrent_flops(8)(s), 4.27e12, 673e12)
    assert ms == pytest.approx(1e3 * nb / 4.27e12)
    assert 0.25 < ms < 0.26  # baseline-h200.md: ~0.25 ms


def test_roofline_prefill_flops_order_of_baseline():
    s = breg.Shape(2, 8192, 64, 64)
    f = breg.chunk_kda_flops(s)
    assert 1.5e11 < f < 2.5e11  # baseline-h200.md: ~170 GFLOP
    assert breg.chunk_kda_flops(s, "fwdbwd") == 3 * f
    assert breg.chunk_lightning_flops(breg.Shape(1, 64, 1, 1)) == 2 * (64 * 64 * 128 * 2 + 2 * 64 * 128 * 128)


def test_pool_bytes_counts_touched_rows_only():
    s = breg.Shape(8, 4, 32, 32)
    x = breg.kda_inputs(s, "cpu", False, pool=True, spec=True, state_v_first=True)
    per_state = 32 * 128 * 128 * 4
    assert x["ssm_state_indices"].shape == (8, 4)
    assert breg.pool_bytes(s, x, "eager") - (8 + 32) * per_state == breg.tensor_bytes(
        *(x[n] for n in ("q", "k", "v", "g", "beta"))) + 8 * 4 * 32 * 128 * 2


def test_registry_shapes_cover_the_brief():
    benches = {b.name: b for b in breg.registry()}
    dec = benches["fused_recurrent_kda decode"]
    assert {s.B for s in dec.shapes if s.T == 1 and s.H == 32 and not s.varlen} == {1, 8, 32, 128, 256}
    assert any(s.T == 4 for s in dec.shapes) and any(s.H == 16 and s.HV == 32 for s in dec.shapes)
    assert any(s.H == 8 for s in dec.shapes) and any(s.H == 16 and s.HV == 16 for s in dec.shapes)
    assert any(s.varlen for s in benches["chunk_kda prefill"].shapes)
    assert benches["chunk_kda train"].modes == ("fwdbwd",)
    assert {s.B for s in benches["fused_recurrent_lightning_attn decode"].shapes if s.T == 1} == {1, 8, 32, 128, 256}
    for b in benches.values():
        assert set(s.desc for s in b.quick) <= set(s.desc for s in b.shapes)


def test_benchmark_report():
    recs = []
    for impl, ms, route in (("fla", 0.2, "fla"), ("fla_cula", 0.1, "kernel")):
        recs.append({"bench": "fused_recurrent_kda decode", "op": "fused_recurrent_kda", "shape": "B=1 T=1 H=32",
                     "mode": "graph", "impl": impl, "ms": ms, "route": route, "roofline_ms": 0.05,
                     "peak_bytes": 2**20, "error": None})
    rows = breport.summary_rows(recs)
    assert rows[0]["speedup"] == pytest.approx(2.0) and rows[0]["pct_roofline"] == pytest.approx(50.0)
    md = breport.markdown(recs, {"gpu": "x"}, {"copy_bw": 4.27e12, "matmul_rate": 6.7e14},
                          {"fused_recurrent_kda decode": {"op": "fused_recurrent_kda", "flags": "f"}}, "T")
    assert "| B=1 T=1 H=32 | graph | 200.0 µs | 100.0 µs | 2.00 | kernel |" in md
    assert "2.00" in breport.short_table(recs)
    assert breport.speedup(None, 1.0) is None


def test_parity_serial_loop_budget_and_sticky_error(monkeypatch):
    """python -m parity's case loop: a sticky CUDA error stops further cases in that process, the
    budget stops new cases, and both are reported per case (never silently dropped)."""
    import time

    import parity.__main__ as pmain
    import parity.runner as prunner

    cases = grid(["fused_recurrent_lightning_attn"], quick=True)[:4]
    calls = []

    def fake_run_case(case, cula_fns, fla_fns, device, seed):
        calls.append(case.id)
        return {"id": case.id, "fatal": len(calls) == 2}

    monkeypatch.setattr(prunner, "run_case", fake_run_case)
    out = list(pmain._serial(cases, {}, {}, None, 0, None, time.perf_counter()))
    assert [i for i, _ in out] == [0, 1, 2, 3] and len(calls) == 2
    assert out[2][1] == out[3][1] == f"CUDA context broken by {cases[1].id}"
    calls.clear()
    out = list(pmain._serial(cases, {}, {}, None, 0, 0.0, time.perf_counter() - 1))
    assert calls == [] and all(r == "time budget reached" for _, r in out)



def test_parity_rejects_bad_jobs(capsys):
    import parity.__main__ as pmain

    with pytest.raises(SystemExit) as e:
        pmain.main(["--jobs", "0", "--list"])
    assert e.value.code == 2 and "--jobs must be >= 1, got 0" in capsys.readouterr().err


def test_parity_schedule_pilots_then_followers():
    """--jobs: one pilot per group of cases that compile the same FLA kernels, chunk-op backward
    groups first; every case is scheduled exactly once, a follower after its own group's pilot."""
    from parity.cases import grid
    from parity.pool import _schedule

    cases = grid(None)
    pilots, followers = _schedule(cases)
    scheduled = pilots + [f for p in pilots for f in followers[p]]
    assert sorted(scheduled) == list(range(len(cases)))
    key = lambda c: (c.op, c.grad, c.dtype, c.K, c.V, c.varlen is not None)  # noqa: E731
    assert len({key(cases[p]) for p in pilots}) == len(pilots)
    for p in pilots:
        assert all(key(cases[f]) == key(cases[p]) and f > p for f in followers[p])
    first = cases[pilots[0]]
    assert first.op.startswith("chunk") and first.grad
    chunk = [cases[p].op.startswith("chunk") for p in pilots]
    assert chunk == sorted(chunk, reverse=True)  # every chunk-op pilot before any recurrent one


def test_parity_report_says_incomplete_first(tmp_path):
    """A report of an unfinished run (partial write, or cases not run) says so at the top of its summary."""
    rec = {"id": "a", "op": "chunk_kda", "route": "fallback: no kernel for this op yet", "fla": "ok", "status": "pass",
           "errors": {"o": {"cula": 1e-3, "fla": 1e-3}}, "notes": [], "max_abs_cula_minus_fla": 0.0}
    md, _ = preport.write([rec], {"gpu": "x", "INCOMPLETE": "partial report: 1 of 9 cases"}, str(tmp_path))
    text = open(md).read()
    summary = text.split("## Summary")[1]
    assert summary.lstrip().startswith("- **INCOMPLETE**: partial report: 1 of 9 cases")


def test_parity_force_sets_the_route_override(monkeypatch, capsys):
    """python -m parity --force exports FLA_CULA_FORCE=1 (read per call by the routed ops, inherited by --jobs
    workers), so the grid's small shapes exercise the kernels."""
    from parity.__main__ import main
    monkeypatch.delenv("FLA_CULA_FORCE", raising=False)
    try:
        assert main(["--list", "--ops", "chunk_lightning_attn"]) == 0
        assert "FLA_CULA_FORCE" not in os.environ
        assert main(["--force", "--list", "--ops", "chunk_lightning_attn"]) == 0
        assert os.environ.get("FLA_CULA_FORCE") == "1"
    finally:
        os.environ.pop("FLA_CULA_FORCE", None)   # set by main, not by monkeypatch: nothing else would undo it


def test_ncu_phases_charges_each_instruction_to_its_outermost_body_line():
    """benchmarks.ncu_phases: profiled instructions are aligned to the -lineinfo build by opcode (an extra instruction
    on either side does not shift the rest), and each is charged to the phase of its outermost kda_fwd_body line, so a
    helper inlined from outside the body (cuda_bf16.hpp) counts where the body called it."""
    from benchmarks import ncu_phases

    def row(sass, n, stall):
        return {"Source": sass, "Instructions Executed": str(n), "Warp Stall Sampling (All Samples)": str(stall),
                "stall_barrier": str(stall)}

    body = (100, 200)
    marks = [(120, "2"), (150, "3")]
    kern = "kda_fwd_kernel.cuh"
    rows = [row("LDC R1, c[0x0][0x28]", 1, 1), row("FFMA R2, R3, R4, R5", 10, 4),
            row("@P0 MUFU.EX2 R6, R7", 20, 6), row("F2FP.BF16.F32.PACK_AB R8, R9, R10", 30, 2)]
    sass = [([(kern, 1500)], "LDC R1, c[0x0][0x28]"),
            ([(kern, 125), (kern, 1500)], "FFMA R2, R3, R4, R5"),
            ([(kern, 110), (kern, 155), (kern, 1500)], "MUFU.EX2 R6, R7"),   # a body lambda (110) called at 155
            ([(kern, 110), (kern, 155), (kern, 1500)], "IMAD.MOV R0, RZ, RZ, RZ"),   # only in the -lineinfo build
            ([("cuda_bf16.hpp", 572), (kern, 160), (kern, 1500)], "F2FP.BF16.F32.PACK_AB R8, R9, R10")]
    table, matched, total = ncu_phases.attribute(rows, sass, marks, body)
    assert (matched, total) == (4, 4)
    assert table["prologue / hoisted"]["instructions"] == 1
    assert table["2"]["instructions"] == 10 and table["2"]["barrier"] == 4
    assert table["3"]["instructions"] == 50 and table["3"]["samples"] == 8
