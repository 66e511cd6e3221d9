"""GPU tests of the KDA / lightning decode kernels through the public ops, in strict mode.

Every case: fresh random inputs, outputs poisoned with NaN, fp64 reference (fla_cula.reference)
within relative RMS 0.002 for outputs and float32 states, and FLA's own result within FLA's test
tolerance (0.005) of the same reference where FLA's semantics are defined.

    pytest -m gpu tests/gpu/test_decode_kernels.py     (strict mode is set per test)
Timing lives in `python -m benchmarks`.
"""


import pytest
import torch

_HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _HAS_SM90, reason="needs a CUDA SM90 (Hopper) device")]


@pytest.fixture(autouse=True)
def _strict(monkeypatch):
    """A silent fallback to FLA fails these tests."""
    monkeypatch.setenv("FLA_CULA_STRICT", "1")

TOL = 0.002
DEV = "cuda"


def _rr(ref, x):
    from fla_cula.reference.compare import rel_rms
    return rel_rms(ref, x)


def _inputs(B, T, H, HV, dtype=torch.bfloat16, gate="none", seed=0):
    g_ = torch.Generator(device=DEV).manual_seed(seed)
    K = V = 128
    q = torch.randn(B, T, H, K, device=DEV, generator=g_).to(dtype)
    k = torch.randn(B, T, H, K, device=DEV, generator=g_).to(dtype)
    v = torch.randn(B, T, HV, V, device=DEV, generator=g_).to(dtype)
    if gate == "none":   # precomputed log decay
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, K, device=DEV, generator=g_) + 3).to(dtype)
    else:                # raw gate input
        g = torch.randn(B, T, HV, K, device=DEV, generator=g_).to(dtype)
    beta = torch.rand(B, T, HV, device=DEV, generator=g_).to(dtype)
    A_log = torch.rand(HV, device=DEV, generator=g_) * 0.5
    dt_bias = torch.randn(HV * K, device=DEV, generator=g_) * 0.1
    return q, k, v, g, beta, A_log, dt_bias


def _nan_like(x):
    return torch.full_like(x, float("nan"))


GATES = {
    "precomputed": dict(use_gate_in_kernel=False),
    "softplus": dict(use_gate_in_kernel=True, A_log=True, dt_bias=True),
    "softplus_nobias": dict(use_gate_in_kernel=True, A_log=True),
    "lb_A_bias": dict(use_gate_in_kernel=True, A_log=True, dt_bias=True, lower_bound=-5.0),
    "lb_noA": dict(use_gate_in_kernel=True, dt_bias=True, lower_bound=-3.0),
}


def _kw(gname, A_log, dt_bias):
    d = dict(GATES[gname])
    d["A_log"] = A_log if d.get("A_log") else None
    d["dt_bias"] = dt_bias if d.get("dt_bias") else None
    return d


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 2, 4, 8])
@pytest.mark.parametrize("vf", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("gname", list(GATES))
@pytest.mark.parametrize("flags", ["plain", "l2_sig", "l2_sig_neg"])
def test_kda_fused_recurrent(T, vf, gname, flags):
    from fla_cula.ops.kda import FLA_FUSED_RECURRENT_KDA, fused_recurrent_kda
    from fla_cula.reference import kda_recurrent
    B, H, HV = 3, 2, 4
    q, k, v, g, beta, A_log, dt_bias = _inputs(B, T, H, HV, gate="none" if gname == "precomputed" else "raw",
                                               seed=T * 7 + vf)
    f = dict(use_qk_l2norm_in_kernel=flags != "plain", use_beta_sigmoid_in_kernel=flags != "plain",
             allow_neg_eigval=flags == "l2_sig_neg")
    if flags == "plain":  # keep the unnormalized recurrence bounded
        k = (k.float() / k.float().norm(dim=-1, keepdim=True)).to(k.dtype)
    h0 = torch.randn(B, HV, 128, 128, device=DEV)
    kw = dict(_kw(gname, A_log, dt_bias), **f, state_v_first=vf)
    o, ht = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0.clone(), output_final_state=True, **kw)
    ro, rht = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    assert o.dtype == v.dtype and ht.dtype == torch.float32
    assert _rr(ro, o) <= TOL and _rr(rht, ht) <= TOL, (_rr(ro, o), _rr(rht, ht))
    fo, fht = FLA_FUSED_RECURRENT_KDA(q, k, v, g, beta, initial_state=h0.clone(), output_final_state=True, **kw)
    assert _rr(ro, fo) <= 0.005 and _rr(rht, fht) <= 0.005


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kda_dtypes_gva(dtype):
    from fla_cula.ops.kda import fused_recurrent_kda
    from fla_cula.reference import kda_recurrent
    q, k, v, g, beta, A_log, dt_bias = _inputs(2, 3, 2, 8, dtype=dtype, gate="raw")
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
              use_beta_sigmoid_in_kernel=True)
    h0 = torch.randn(2, 8, 128, 128, device=DEV)
    o, ht = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    ro, rht = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    assert _rr(ro, o) <= TOL and _rr(rht, ht) <= TOL


@pytest.mark.parametrize("vf", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("with_h0", [True, False])
def test_kda_varlen_empty_and_single(vf, with_h0):
    from fla_cula.ops.kda import fused_recurrent_kda
    from fla_cula.reference import kda_recurrent
    lens = [3, 1, 0, 4, 2]
    Tt = sum(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=DEV, dtype=torch.int32)
    q, k, v, g, beta, A_log, dt_bias = _inputs(1, Tt, 2, 4, gate="raw", seed=3)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
              lower_bound=-5.0, use_beta_sigmoid_in_kernel=True, state_v_first=vf)
    h0 = torch.randn(len(lens), 4, 128, 128, device=DEV) if with_h0 else None
    o, ht = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                cu_seqlens=cu, **kw)
    ro, rht = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                            cu_seqlens=cu.long(), **kw)
    assert _rr(ro, o) <= TOL and _rr(rht, ht) <= TOL
    if with_h0:  # the empty sequence passes its state through exactly
        assert torch.equal(ht[2], h0[2])


def _pool_case(vf, spec, idx_dtype, T=3, N=4, P=17):
    q, k, v, g, beta, A_log, dt_bias = _inputs(N, T, 2, 4, gate="raw", seed=11 + spec)
    pool = torch.randn(P, 4, 128, 128, device=DEV)
    perm = torch.randperm(P, device=DEV)[:N * T].reshape(N, T).to(idx_dtype)
    perm[2, :] = -1                      # a padding sequence: read slot negative
    perm[1, T - 1] = -1                  # a skipped write for one token
    na = torch.tensor([1, 2, 1, 3][:N], device=DEV, dtype=torch.int32) if spec else None
    if spec:
        perm[3, 2] = perm[3, 2].abs()    # read slot of seq 3 (num_accepted 3) is valid
    return q, k, v, g, beta, A_log, dt_bias, pool, perm, na


@pytest.mark.parametrize("vf", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("spec", [False, True], ids=["nospec", "spec"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_kda_pool_2d(vf, spec, idx_dtype):
    from fla_cula.ops.kda import fused_recurrent_kda_fwd
    from fla_cula.reference import kda_decode_pool
    q, k, v, g, beta, A_log, dt_bias, pool, idx, na = _pool_case(vf, spec, idx_dtype)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
              use_beta_sigmoid_in_kernel=True, state_v_first=vf, scale=0.1)
    before = pool.clone()
    out = _nan_like(v)
    o, fs = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, inplace_final_state=True,
                                    ssm_state_indices=idx, num_accepted_tokens=na, out=out, **kw)
    assert o is out and fs is pool
    ro, rpool = kda_decode_pool(q, k, v, g, beta, initial_state=before, inplace_final_state=True,
                                ssm_state_indices=idx, num_accepted_tokens=na, **kw)
    live = [0, 1, 3]
    assert _rr(ro[live], o[live]) <= TOL
    assert torch.all(o[2] == 0)          # padding sequence: zeros, no NaN
    written = set(int(s) for s in idx.flatten().tolist() if s >= 0)
    for s in range(pool.shape[0]):
        if s in written:
            assert _rr(rpool[s], pool[s]) <= TOL, s
        else:
            assert torch.equal(pool[s], before[s]), f"slot {s} not addressed but changed"


def test_kda_pool_1d_decode():
    from fla_cula.ops.kda import fused_recurrent_kda_fwd
    from fla_cula.reference import kda_decode_pool
    N, P = 6, 9
    q, k, v, g, beta, A_log, dt_bias = _inputs(N, 1, 2, 4, gate="raw", seed=5)
    pool = torch.randn(P, 4, 128, 128, device=DEV)
    idx = torch.tensor([3, -1, 0, 8, 5, -1], device=DEV, dtype=torch.int32)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, lower_bound=-5.0,
              use_beta_sigmoid_in_kernel=True)
    before = pool.clone()
    o, _ = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx, **kw)
    ro, rpool = kda_decode_pool(q, k, v, g, beta, initial_state=before, ssm_state_indices=idx, **kw)
    live = [0, 2, 3, 4]
    assert _rr(ro[live], o[live]) <= TOL
    for s in range(P):
        if s in (3, 0, 8, 5):
            assert _rr(rpool[s], pool[s]) <= TOL
        else:
            assert torch.equal(pool[s], before[s])


def test_kda_inplace_no_indices_and_graph():
    """fused_recurrent_kda_fwd default (inplace, no indices) + CUDA-graph capture/replay == eager."""
    from fla_cula.ops.kda import fused_recurrent_kda_fwd
    from fla_cula.reference import kda_recurrent
    B, T = 4, 2
    q, k, v, g, beta, A_log, dt_bias = _inputs(B, T, 4, 4, gate="raw", seed=9)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
              use_beta_sigmoid_in_kernel=True)
    h0 = torch.randn(B, 4, 128, 128, device=DEV)
    ref_o, ref_s = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    state = h0.clone()
    out = _nan_like(v)
    o, fs = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=state, out=out, **kw)
    assert fs is state and _rr(ref_o, o) <= TOL and _rr(ref_s, state) <= TOL
    eager_o, eager_s = o.clone(), state.clone()
    # graph
    state.copy_(h0)
    out.fill_(float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=state, out=out, **kw)  # warm
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=state, out=out, **kw)
    state.copy_(h0)
    out.fill_(float("nan"))
    gr.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_o) and torch.equal(state, eager_s)


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("vf", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("varlen", [False, True])
def test_lightning(T, vf, varlen):
    from fla_cula.ops.lightning_attn import fused_recurrent_lightning_attn, fused_recurrent_simple_gla
    from fla_cula.reference import lightning_recurrent, simple_gla_recurrent
    from fla_cula.reference.lightning import lightning_g_gamma
    B, H = 3, 4
    q, k, v, *_ = _inputs(B, T, H, H, seed=T)
    k = (k.float() / k.float().norm(dim=-1, keepdim=True)).to(k.dtype)
    cu = None
    h0 = torch.randn(B, H, 128, 128, device=DEV)
    if varlen:
        q, k, v = (x.reshape(1, B * T, H, 128) for x in (q, k, v))
        cu = torch.tensor([0, T, T, B * T - 1, B * T], device=DEV, dtype=torch.int64)
        h0 = torch.randn(4, H, 128, 128, device=DEV)
    if not vf:
        o, ht = fused_recurrent_lightning_attn(q, k, v, 3, 24, initial_state=h0, output_final_state=True,
                                               cu_seqlens=cu)
        ro, rht = lightning_recurrent(q, k, v, 3, 24, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    else:
        gg = lightning_g_gamma(H, 3, 24, device=DEV).float()
        o, ht = fused_recurrent_simple_gla(q, k, v, g_gamma=gg, initial_state=h0, output_final_state=True,
                                           state_v_first=True, cu_seqlens=cu)
        ro, rht = simple_gla_recurrent(q, k, v, gg, initial_state=h0, output_final_state=True,
                                       state_v_first=True, cu_seqlens=cu)
    assert o.dtype == q.dtype
    assert _rr(ro, o) <= TOL and _rr(rht, ht) <= TOL, (_rr(ro, o), _rr(rht, ht))


def test_lightning_no_initial_state():
    from fla_cula.ops.lightning_attn import fused_recurrent_lightning_attn
    from fla_cula.reference import lightning_recurrent
    q, k, v, *_ = _inputs(2, 2, 4, 4, seed=1)
    o, ht = fused_recurrent_lightning_attn(q, k, v, 0, 4, output_final_state=True)
    ro, rht = lightning_recurrent(q, k, v, 0, 4, output_final_state=True)
    assert _rr(ro, o) <= TOL and _rr(rht, ht) <= TOL


# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Tuning knobs away from the defaults (DecodeConfig fields benchmarks/variants.py compares on the
# H200): [K,V] with the warp-K mapping (v2), no L2 prefetch of later tokens, narrower / wider CTAs,
# KDA's per-token terms staged once per CTA in shared memory (tok_smem).
# The same checks as above with the knob set, so every mapping a sweep can pick is already tested.
TUNINGS = {"v2": {"kv_rows": False}, "no_l2_prefetch": {"l2_prefetch": False},
           "bv16": {"bv": 16, "kv_rows": False}, "bv64": {"bv": 64, "kv_rows": False},
           "bv64_kv_rows": {"bv": 64}, "no_tok_smem": {"tok_smem": False}}


@pytest.fixture(params=list(TUNINGS))
def tuned(request):
    from fla_cula.kernels import recurrent_decode, recurrent_decode_mma
    knobs = TUNINGS[request.param]
    recurrent_decode.set_tuning(**knobs)
    recurrent_decode_mma.set_enabled(False)  # multi-token steps too: the knobs are the token kernel's
    try:
        state = dict(knobs)
        yield state
        if not state.get("skipped"):
            ran = [c for c in recurrent_decode.compiled_configs() if all(getattr(c, k) == x for k, x in knobs.items())]
            assert ran, f"no kernel with {knobs} ran"
    finally:
        recurrent_decode.set_tuning()
        recurrent_decode_mma.set_enabled(True)


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("gname", ["precomputed", "softplus", "lb_A_bias"])
def test_tuned_kda(tuned, T, gname):
    test_kda_fused_recurrent(T, False, gname, "l2_sig")


def test_tuned_kda_vk(tuned):
    test_kda_fused_recurrent(4, True, "softplus", "l2_sig")


@pytest.mark.parametrize("vf", [False, True], ids=["kv", "vk"])
def test_tuned_kda_plain(tuned, vf):
    """No l2norm, no beta sigmoid: k.q is the only per-token scalar reduction."""
    test_kda_fused_recurrent(4, vf, "precomputed", "plain")


@pytest.mark.parametrize("spec", [False, True], ids=["nospec", "spec"])
def test_tuned_pool(tuned, spec):
    test_kda_pool_2d(False, spec, torch.int32)


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("varlen", [False, True])
def test_tuned_lightning(tuned, T, varlen):
    _skip_kda_only(tuned)
    test_lightning(T, False, varlen)


def test_tuned_lightning_no_h0(tuned):
    _skip_kda_only(tuned)
    test_lightning_no_initial_state()


def _skip_kda_only(tuned):
    if set(tuned) == {"tok_smem"}:
        tuned["skipped"] = True
        pytest.skip("tok_smem stages KDA's per-k gate; lightning configs never carry it")


@pytest.mark.parametrize("with_h0", [True, False])
def test_tuned_kda_varlen_empty(tuned, with_h0):
    test_kda_varlen_empty_and_single(False, with_h0)


@pytest.mark.parametrize("vf,knobs", [(False, {"kv_rows": True}), (False, {"kv_rows": False}),
                                      (True, {"state_v_first": True}), (False, {"tok_smem": False}),
                                      (True, {"state_v_first": True, "tok_smem": False}), (False, {"bv": 32})],
                         ids=["kv-kv_rows", "kv-v2", "vk", "kv-no_tok_smem", "vk-no_tok_smem", "kv-bv32"])
def test_tuned_full_grid(vf, knobs):
    """Each state mapping on a serving-size step: 48 sequences x 32 heads x 2-4 column blocks = 3072-
    6144 CTAs (several waves; [K,V] multi-token steps over >= 1024 states take 64-column CTAs unless a
    knob says otherwise), 2-D pool indices with speculative reads, padding sequences and skipped
    writes; untouched pool slots stay bit-identical."""
    from fla_cula.kernels import recurrent_decode
    from fla_cula.ops.kda import fused_recurrent_kda_fwd
    from fla_cula.reference import kda_decode_pool
    N, T, P, HV = 48, 2, 120, 32
    q, k, v, g, beta, A_log, dt_bias = _inputs(N, T, 16, HV, gate="raw", seed=21)
    pool = torch.randn(P, HV, 128, 128, device=DEV)
    idx = torch.randperm(P, device=DEV)[:N * T].reshape(N, T).to(torch.int32)
    idx[5::7, :] = -1                      # padding sequences
    idx[3::5, T - 1] = -1                  # skipped writes
    na = torch.randint(1, T + 1, (N,), device=DEV, dtype=torch.int32)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
              use_beta_sigmoid_in_kernel=True, state_v_first=vf)
    before = pool.clone()
    recurrent_decode.set_tuning(**knobs)
    try:
        out = _nan_like(v)
        o, _ = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, inplace_final_state=True,
                                       ssm_state_indices=idx, num_accepted_tokens=na, out=out, **kw)
        assert any(all(getattr(c, a) == x for a, x in knobs.items()) for c in recurrent_decode.compiled_configs())
    finally:
        recurrent_decode.set_tuning()
    ro, rpool = kda_decode_pool(q, k, v, g, beta, initial_state=before, inplace_final_state=True,
                                ssm_state_indices=idx, num_accepted_tokens=na, **kw)
    read = idx[torch.arange(N, device=DEV), (na - 1).long()]
    live = (read >= 0).nonzero().flatten().tolist()
    dead = (read < 0).nonzero().flatten().tolist()
    assert live and dead
    assert _rr(ro[live], o[live]) <= TOL
    assert torch.all(o[dead] == 0)
    written = set(int(s) for s in idx[live].flatten().tolist() if s >= 0)
    for s in range(P):
        if s in written:
            assert _rr(rpool[s], pool[s]) <= TOL, s
        else:
            assert torch.equal(pool[s], before[s]), f"slot {s} not addressed but changed"


@pytest.mark.parametrize("vf", [False, True], ids=["kv", "vk"])
def test_kda_bitwise_repeatable(vf):
    """No atomics, no races: the same call on the same inputs gives the same bits, 20 times (a moving
    error - once seen on an early kernel version - would show here)."""
    from fla_cula.ops.kda import fused_recurrent_kda
    q, k, v, g, beta, A_log, dt_bias = _inputs(8, 2, 4, 8, gate="raw", seed=5)
    h0 = torch.randn(8, 8, 128, 128, device=DEV)
    kw = dict(_kw("softplus", A_log, dt_bias), use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              state_v_first=vf)
    o0, s0 = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    for _ in range(20):
        o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
        assert torch.equal(o, o0) and torch.equal(s, s0)


def test_memoized_plans_follow_the_arguments(monkeypatch):
    """The host memoizes each call signature's decision (routing.route): a call that differs from a
    memoized one only in alignment, dtype, batch size, flags or grad mode gets its own decision, and
    every kernel-routed result matches the fp64 reference."""
    from fla_cula import routing
    from fla_cula.ops.kda import fused_recurrent_kda
    from fla_cula.reference import kda_recurrent
    monkeypatch.setenv("FLA_CULA_STRICT", "0")
    kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True)

    def call(q, k, v, g, beta, A_log, dt_bias, h0, expect, **extra):
        o, ht = fused_recurrent_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0.clone(),
                                    output_final_state=True, **kw, **extra)
        assert routing.last_route()[1] == expect
        if expect == "kernel":
            ro, rht = kda_recurrent(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0,
                                    output_final_state=True, **kw, **extra)
            assert _rr(ro, o) <= TOL and _rr(rht, ht) <= TOL

    for B in (3, 5, 3):
        q, k, v, g, beta, A_log, dt_bias = _inputs(B, 1, 2, 4, gate="raw", seed=B)
        h0 = torch.randn(B, 4, 128, 128, device=DEV)
        call(q, k, v, g, beta, A_log, dt_bias, h0, "kernel")
        call(q, k, v, g, beta, A_log, dt_bias, h0, "kernel", lower_bound=-4.0)
        # q at an address 2 bytes past a 16-byte boundary, same shape, strides and dtype
        buf = torch.empty(q.numel() + 8, dtype=q.dtype, device=DEV)
        q_off = buf[1:1 + q.numel()].view(q.shape).copy_(q)
        call(q_off, k, v, g, beta, A_log, dt_bias, h0, "fallback: q not 16-byte aligned")
        call(q, k, v, g, beta, A_log, dt_bias, h0, "kernel")
        call(q, k, v, g.float(), beta, A_log, dt_bias, h0, "kernel")
        qg = q.clone().requires_grad_()
        with torch.enable_grad():
            fused_recurrent_kda(qg, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0.clone(),
                                output_final_state=True, **kw)
        assert routing.last_route()[1] == "fallback: grad enabled: forward-only kernel"


# ---------------------------------------------------------------------------------------------
# The multi-token kernel (recurrent_decode_mma: chunks of 4 tokens in WY form on tensor cores).
# The tests above already run it for every multi-token call without a pool (T = 2, 4, 8, varlen,
# GVA, dtypes, graph capture); these add tails, long steps, extreme gates, and both kernels side by
# side on the same inputs, and check which kernel ran.
@pytest.fixture
def mma_calls(monkeypatch):
    """The MmaDecodeConfigs the host compiled or looked up during the test (plans are forgotten first,
    so every call signature of the test asks again)."""
    from fla_cula import routing
    from fla_cula.kernels import recurrent_decode_mma
    seen = []
    real = recurrent_decode_mma.get_kernel

    def spy(cfg):
        seen.append(cfg)
        return real(cfg)

    monkeypatch.setattr(recurrent_decode_mma, "get_kernel", spy)
    routing.clear_plans()
    yield seen
    routing.clear_plans()


def _kda_case(B, T, H, HV, vf, gname, seed, h0=True, flags="l2_sig"):
    q, k, v, g, beta, A_log, dt_bias = _inputs(B, T, H, HV, gate="none" if gname == "precomputed" else "raw",
                                               seed=seed)
    f = dict(use_qk_l2norm_in_kernel=flags != "plain", use_beta_sigmoid_in_kernel=flags != "plain",
             allow_neg_eigval=flags == "l2_sig_neg")
    if flags == "plain":
        k = (k.float() / k.float().norm(dim=-1, keepdim=True)).to(k.dtype)
    kw = dict(_kw(gname, A_log, dt_bias), **f, state_v_first=vf)
    shape = (B, HV, 128, 128)
    return (q, k, v, g, beta), kw, (torch.randn(*shape, device=DEV) if h0 else None)


@pytest.mark.parametrize("T", [3, 5, 7, 13, 64])
@pytest.mark.parametrize("vf", [False, True], ids=["kv", "vk"])
def test_mma_tails_and_long_steps(mma_calls, T, vf):
    """Chunk tails (T % 4 != 0) and many chunks (T = 64: FLA's layer runs fused_recurrent for T <= 64
    in inference): fp64 reference and FLA on the same inputs."""
    from fla_cula.ops.kda import FLA_FUSED_RECURRENT_KDA, fused_recurrent_kda
    from fla_cula.reference import kda_recurrent
    x, kw, h0 = _kda_case(2, T, 2, 4, vf, "softplus", seed=T)
    o, ht = fused_recurrent_kda(*x, initial_state=h0.clone(), output_final_state=True, **kw)
    assert mma_calls, "the multi-token kernel did not run"
    ro, rht = kda_recurrent(*x, initial_state=h0, output_final_state=True, **kw)
    assert _rr(ro, o) <= TOL and _rr(rht, ht) <= TOL, (_rr(ro, o), _rr(rht, ht))
    fo, fht = FLA_FUSED_RECURRENT_KDA(*x, initial_state=h0.clone(), output_final_state=True, **kw)
    assert _rr(ro, fo) <= 0.005 and _rr(rht, fht) <= 0.005


@pytest.mark.parametrize("vf", [False, True], ids=["kv", "vk"])
def test_mma_extreme_gates(mma_calls, vf):
    """Decays that underflow to 0 within a chunk (log decay down to -300 per token, and a softplus gate
    with exp(A_log) = 4 on inputs up to +30) and decays of exactly 1: products formed by multiplication
    stay finite where exp of a cumulative difference would overflow."""
    from fla_cula.ops.kda import fused_recurrent_kda
    from fla_cula.reference import kda_recurrent
    B, T, H, HV = 2, 8, 2, 4
    x, kw, h0 = _kda_case(B, T, H, HV, vf, "precomputed", seed=4)
    q, k, v, g, beta = x
    g = g.float()
    g[:, 1, :, :64] = -300.0    # token 1 forgets half of K completely
    g[:, 2] = 0.0               # token 2: no decay at all
    g[:, 5, :, ::3] = -90.0     # exp(-90) ~ 1e-39: float32 denormal range
    o, ht = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0.clone(), output_final_state=True, **kw)
    ro, rht = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert _rr(ro, o) <= TOL and _rr(rht, ht) <= TOL, (_rr(ro, o), _rr(rht, ht))
    # softplus gate, strong: a = -16 softplus(g + dt_bias) with g up to +30
    x, kw, h0 = _kda_case(B, T, H, HV, vf, "softplus", seed=5)
    q, k, v, g, beta = x
    kw["A_log"] = torch.full_like(kw["A_log"], 4.0).log()
    g = (g.float() * 10).to(g.dtype)
    o, ht = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0.clone(), output_final_state=True, **kw)
    ro, rht = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert _rr(ro, o) <= TOL and _rr(rht, ht) <= TOL, (_rr(ro, o), _rr(rht, ht))
    assert mma_calls


@pytest.mark.parametrize("T", [2, 4, 8])
@pytest.mark.parametrize("vf", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("gname", ["precomputed", "lb_noA", "softplus_nobias"])
@pytest.mark.parametrize("flags", ["plain", "l2_sig_neg"])
def test_mma_and_token_kernel_agree(mma_calls, T, vf, gname, flags):
    """Both kernels on the same multi-token inputs: each within the fp64 bar, and the tensor-core one
    no less accurate than the token-by-token one beyond float32 noise (3xTF32 is fp32-class)."""
    from fla_cula.kernels import recurrent_decode_mma
    from fla_cula.ops.kda import fused_recurrent_kda
    from fla_cula.reference import kda_recurrent
    x, kw, h0 = _kda_case(3, T, 2, 4, vf, gname, seed=T + 100, flags=flags)
    ro, rht = kda_recurrent(*x, initial_state=h0, output_final_state=True, **kw)
    errs = {}
    for on in (True, False):
        recurrent_decode_mma.set_enabled(on)
        try:
            o, ht = fused_recurrent_kda(*x, initial_state=h0.clone(), output_final_state=True, **kw)
        finally:
            recurrent_decode_mma.set_enabled(True)
        errs[on] = (_rr(ro, o), _rr(rht, ht))
        assert errs[on][0] <= TOL and errs[on][1] <= TOL, (on, errs[on])
    assert len(mma_calls) == 1  # the enabled call only
    # states: the bf16 output rounding does not mask them; allow float32-level slack (1e-6 relative)
    assert errs[True][1] <= errs[False][1] * 2 + 2e-6, errs


def test_mma_no_initial_state_no_final_state(mma_calls):
    """initial_state None (the state starts at zero) and no final state requested (nothing written)."""
    from fla_cula.ops.kda import fused_recurrent_kda
    from fla_cula.reference import kda_recurrent
    x, kw, _ = _kda_case(2, 6, 2, 4, True, "lb_A_bias", seed=8, h0=False)
    o, ht = fused_recurrent_kda(*x, output_final_state=False, **kw)
    assert ht is None
    ro, _ = kda_recurrent(*x, output_final_state=False, **kw)
    assert _rr(ro, o) <= TOL
    o2, ht2 = fused_recurrent_kda(*x, output_final_state=True, **kw)
    ro2, rht2 = kda_recurrent(*x, output_final_state=True, **kw)
    assert torch.equal(o, o2) and _rr(rht2, ht2) <= TOL
    assert mma_calls


def test_mma_fwd_preallocated_out_poisoned(mma_calls):
    """fused_recurrent_kda_fwd with a NaN-poisoned `out` and an in-place state (no indices), varlen with
    an empty sequence and lengths 1..9: every output row is written, the empty sequence's state is
    unchanged, and the call does not touch q/k/v/g/beta."""
    from fla_cula.ops.kda import fused_recurrent_kda_fwd
    from fla_cula.reference import kda_recurrent
    lens = [9, 1, 0, 4, 2, 5]
    Tt = sum(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=DEV, dtype=torch.int32)
    q, k, v, g, beta, A_log, dt_bias = _inputs(1, Tt, 2, 4, gate="raw", seed=13)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
              use_beta_sigmoid_in_kernel=True, state_v_first=True)
    h0 = torch.randn(len(lens), 4, 128, 128, device=DEV)
    ins = [x.clone() for x in (q, k, v, g, beta)]
    state = h0.clone()
    out = _nan_like(v)
    o, fs = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=state, cu_seqlens=cu, out=out, **kw)
    assert o is out and fs is state and not torch.isnan(out).any()
    ro, rht = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu.long(),
                            **kw)
    assert _rr(ro, out) <= TOL and _rr(rht, state) <= TOL
    assert torch.equal(state[2], h0[2])
    assert all(torch.equal(a, b) for a, b in zip(ins, (q, k, v, g, beta), strict=True))
    assert mma_calls


def test_mma_not_for_pools(mma_calls):
    """State pools keep FLA's per-token slot writes on the token-by-token kernel."""
    test_kda_pool_2d(False, True, torch.int32)
    assert not mma_calls


@pytest.mark.parametrize("vf", [False, True], ids=["kv", "vk"])
def test_mma_full_grid(mma_calls, vf):
    """A serving-size multi-token step (B=48, HV=32, T=4: 3072 CTAs, several waves) against fp64."""
    from fla_cula.ops.kda import fused_recurrent_kda
    from fla_cula.reference import kda_recurrent
    x, kw, h0 = _kda_case(48, 4, 16, 32, vf, "softplus", seed=31)
    o, ht = fused_recurrent_kda(*x, initial_state=h0.clone(), output_final_state=True, **kw)
    ro, rht = kda_recurrent(*x, initial_state=h0, output_final_state=True, **kw)
    assert _rr(ro, o) <= TOL and _rr(rht, ht) <= TOL, (_rr(ro, o), _rr(rht, ht))
    assert mma_calls
