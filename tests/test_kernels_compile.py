"""CPU tests of the decode kernels: every registered recurrent_decode spec compiles for sm_90a and
its PTX holds the expected instructions; check() reasons on CPU / meta tensors (no GPU needed)."""

import os
import tempfile

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from fla_cula import jit  # noqa: E402
from fla_cula.kernels import kda_decode, lightning_decode  # noqa: E402
from fla_cula.kernels import recurrent_decode_mma as mma  # noqa: E402
from fla_cula.kernels.recurrent_decode import DecodeConfig, RecurrentDecode, representative_configs  # noqa: E402

CFGS = representative_configs()


def _id(c):
    layout = "vk" if c.state_v_first else "kv"
    tune = ("" if c.kv_rows or c.state_v_first else "-v2") + ("" if c.l2_prefetch else "-nol2pf") \
        + (f"-bv{c.bv}" if c.bv != 32 else "") \
        + ("-notoks" if c.mode == "kda" and not c.tok_smem else "")
    return f"{c.mode}-{layout}-pool{c.pool}-varlen{int(c.varlen)}-gate{int(c.gate_in_kernel)}{tune}"


@pytest.mark.parametrize("cfg", CFGS, ids=[_id(c) for c in CFGS])
def test_decode_state_stays_in_registers(cfg):
    """Beyond the registry-wide PTX check (tests/test_jit.py): no local memory anywhere."""
    spec = RecurrentDecode(cfg).spec()
    with tempfile.TemporaryDirectory() as d:
        ptx = jit.compile_spec(spec, keep_ptx_dir=d).__ptx__
    assert jit.missing_ptx(spec, ptx) == []
    assert "ld.local" not in ptx and "st.local" not in ptx   # the state fragment stays in registers


def test_registered_specs_include_decode():
    names = {s.name for s in jit.registered_specs()}
    assert "recurrent_decode" in names


def test_config_key_has_no_sizes():
    keys = dict(DecodeConfig().key())
    for size in ("B", "T", "N", "H", "HV", "pool_size"):
        assert size not in keys


def test_default_mapping_per_layout():
    """kv_rows (and the L2 prefetch) by default; kv_rows names a [K,V] mapping, so a [V,K] config
    never carries it in its compile key, whatever the caller or a tuning asks."""
    assert DecodeConfig().kv_rows and DecodeConfig().l2_prefetch
    assert not DecodeConfig(state_v_first=True).kv_rows
    assert DecodeConfig(state_v_first=True, kv_rows=True) == DecodeConfig(state_v_first=True)
    with pytest.raises(ValueError, match="bv must be 32"):
        RecurrentDecode(DecodeConfig(bv=16))
    RecurrentDecode(DecodeConfig(bv=16, kv_rows=False))
    RecurrentDecode(DecodeConfig(bv=16, state_v_first=True))
    assert DecodeConfig().tok_smem and not DecodeConfig(mode="lightning").tok_smem  # lightning: no per-k gate
    # tok_smem needs 128 threads (one K position each): dropped from 8-warp configs' compile keys
    assert not DecodeConfig(bv=64, kv_rows=False).tok_smem and not DecodeConfig(bv=16, state_v_first=True).tok_smem
    assert DecodeConfig(bv=64).tok_smem and DecodeConfig(bv=64).warps == 4 and DecodeConfig(bv=64).groups == 2
    with pytest.raises(ValueError, match="bv must be 32 or 64"):
        RecurrentDecode(DecodeConfig(bv=128))


# ---------------------------------------------------------------------------------------------
def _kda(B=2, T=1, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, dev="meta"):
    q = torch.empty(B, T, H, K, dtype=dtype, device=dev)
    k = torch.empty(B, T, H, K, dtype=dtype, device=dev)
    v = torch.empty(B, T, HV, V, dtype=dtype, device=dev)
    g = torch.empty(B, T, HV, K, dtype=dtype, device=dev)
    beta = torch.empty(B, T, HV, dtype=dtype, device=dev)
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=None, dt_bias=None, initial_state=None, scale=K ** -0.5,
                output_final_state=True, inplace_final_state=False, state_v_first=False, cu_seqlens=None,
                ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False,
                lower_bound=None, out=None)


def _state(N, HV=4, dev="meta"):
    return torch.empty(N, HV, 128, 128, dtype=torch.float32, device=dev)


def test_kda_check_accepts_plain():
    assert kda_decode.check(**_kda()) is None


@pytest.mark.parametrize("mutate,reason", [
    (lambda a: a.update(_kda(K=64)), "head dim 64: kernel supports 128"),
    (lambda a: a.update(_kda(V=64)), "value dim 64"),
    (lambda a: a.update(beta=torch.empty(2, 1, 4, 128, dtype=torch.bfloat16, device="meta")),
     "headwise beta [B,T,HV,V]: kernel supports scalar beta"),
    (lambda a: a.update(_kda(HV=3)), "not a multiple"),
    (lambda a: a.update(q=a["q"].to(torch.float64)), "q dtype"),
    (lambda a: a.update(k=a["k"].to(torch.float16)), "q dtype"),
    (lambda a: a.update(initial_state=_state(2).to(torch.bfloat16)), "initial_state dtype"),
    (lambda a: a.update(initial_state=_state(3)), "initial_state batch 3"),
    (lambda a: a.update(initial_state=_state(2).transpose(2, 3)), "initial_state strides"),
    (lambda a: a.update(inplace_final_state=True), "inplace_final_state=True without initial_state"),
    (lambda a: a.update(q=torch.empty(2, 1, 128, 2, dtype=torch.bfloat16, device="meta").transpose(2, 3)),
     "q not contiguous"),
    (lambda a: a.update(use_gate_in_kernel=True, lower_bound=1.0,
                        A_log=torch.empty(4, device="meta")), "lower_bound 1.0"),
    (lambda a: a.update(use_gate_in_kernel=True, lower_bound=float("-inf")), "lower_bound -inf"),
    (lambda a: a.update(use_gate_in_kernel=True, A_log=torch.empty(5, device="meta")), "A_log shape"),
    (lambda a: a.update(use_gate_in_kernel=True, A_log=torch.empty(4, device="meta"),
                        dt_bias=torch.empty(4, device="meta")), "dt_bias shape"),
    (lambda a: a.update(cu_seqlens=torch.zeros(3, dtype=torch.float32, device="meta")), "cu_seqlens"),
    (lambda a: a.update(cu_seqlens=torch.zeros(3, dtype=torch.int32, device="meta")),
     "cu_seqlens with batch 2"),
    (lambda a: a.update(initial_state=_state(8), inplace_final_state=True,
                        ssm_state_indices=torch.zeros(2, dtype=torch.int16, device="meta")),
     "ssm_state_indices: expected an int32/int64"),
    (lambda a: a.update(initial_state=_state(8), inplace_final_state=False,
                        ssm_state_indices=torch.zeros(2, dtype=torch.int32, device="meta")),
     "without inplace_final_state"),
    (lambda a: a.update(_kda(T=2), initial_state=_state(8), inplace_final_state=True,
                        ssm_state_indices=torch.zeros(2, dtype=torch.int32, device="meta")),
     "1-D ssm_state_indices with T>1 per sequence: FLA's per-token slot semantics kept on FLA"),
    (lambda a: a.update(_kda(T=3), initial_state=_state(8), inplace_final_state=True,
                        ssm_state_indices=torch.zeros(2, 2, dtype=torch.int32, device="meta")),
     "T=3 > ssm_state_indices width 2"),
    (lambda a: a.update(initial_state=_state(8), inplace_final_state=True,
                        ssm_state_indices=torch.zeros(2, 2, dtype=torch.int32, device="meta"),
                        num_accepted_tokens=torch.zeros(3, dtype=torch.int32, device="meta")),
     "num_accepted_tokens shape"),
    (lambda a: a.update(out=torch.empty(2, 1, 4, 64, dtype=torch.bfloat16, device="meta")), "out shape"),
])
def test_kda_check_reasons(mutate, reason):
    a = _kda()
    mutate(a)
    r = kda_decode.check(**a)
    assert r is not None and reason in r, r


def test_kda_check_accepts_pool_2d_spec():
    a = _kda(T=2)
    a.update(initial_state=_state(9), inplace_final_state=True,
             ssm_state_indices=torch.zeros(2, 4, dtype=torch.int64, device="meta"),
             num_accepted_tokens=torch.ones(2, dtype=torch.int32, device="meta"),
             use_gate_in_kernel=True, A_log=torch.empty(4, device="meta"),
             dt_bias=torch.empty(4 * 128, device="meta"), lower_bound=-5.0)
    assert kda_decode.check(**a) is None


def test_kda_check_misaligned_cpu():
    a = _kda(dev="cpu")
    buf = torch.empty(2 * 1 * 2 * 128 + 1, dtype=torch.bfloat16)
    a["q"] = buf[1:].view(2, 1, 2, 128)
    assert kda_decode.check(**a) == "q not 16-byte aligned"


def _lit(B=2, T=1, H=4, K=128, dev="meta"):
    q = torch.empty(B, T, H, K, dtype=torch.bfloat16, device=dev)
    return dict(q=q, k=q.clone(), v=torch.empty(B, T, H, 128, dtype=torch.bfloat16, device=dev),
                g_gamma=torch.empty(H, dtype=torch.float32, device=dev), scale=0.1, initial_state=None,
                output_final_state=True, reverse=False, state_v_first=False, cu_seqlens=None)


def test_lightning_check():
    assert lightning_decode.check(**_lit()) is None
    a = _lit()
    a["reverse"] = True
    assert lightning_decode.check(**a) == "reverse=True: kernel is forward-in-time only"
    assert lightning_decode.check(**_lit(K=64)) == "head dim 64: kernel supports 128"
    a = _lit()
    a["g_gamma"] = torch.empty(3, dtype=torch.float32, device="meta")
    assert "g_gamma shape" in lightning_decode.check(**a)
    a = _lit()
    a["initial_state"] = _state(2, HV=4).transpose(2, 3)
    assert "initial_state strides" in lightning_decode.check(**a)


def test_host_picks_wide_ctas_for_multi_token_steps_over_many_states():
    from fla_cula.kernels.recurrent_decode import WIDE_MIN_STATES, choose_bv
    assert choose_bv(False, True, WIDE_MIN_STATES) == 64
    assert choose_bv(False, True, WIDE_MIN_STATES - 1) == 32      # small grids keep 2x the CTAs
    assert choose_bv(False, False, 10 * WIDE_MIN_STATES) == 32    # single-token steps: 4 CTAs/SM
    assert choose_bv(True, True, 10 * WIDE_MIN_STATES) == 32      # [V,K]: one mapping


MMA_CFGS = mma.representative_configs()


@pytest.mark.parametrize("cfg", MMA_CFGS, ids=[f"{'vk' if c.state_v_first else 'kv'}-varlen{int(c.varlen)}"
                                                f"-h0{int(c.has_h0)}-gate{int(c.gate_in_kernel)}" for c in MMA_CFGS])
def test_mma_decode_compiles_without_local_memory(cfg):
    """The multi-token kernel: tensor-core MMAs in the PTX (m16n8k8 and m16n8k4 TF32), the 64-element
    state fragment in registers."""
    spec = mma.RecurrentDecodeMma(cfg).spec()
    with tempfile.TemporaryDirectory() as d:
        ptx = jit.compile_spec(spec, keep_ptx_dir=d).__ptx__
    assert jit.missing_ptx(spec, ptx) == []
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_mma_host_policy():
    """Multi-token KDA steps without a pool go to the tensor-core kernel; pools, single tokens,
    lightning stay on the token kernel; its compile key is the DecodeConfig's relevant part."""
    kda = DecodeConfig(l2norm=True, gate_in_kernel=True, has_A=True, bv=64)
    assert mma.serves(kda, True) and not mma.serves(kda, False)
    assert not mma.serves(DecodeConfig(pool=2, spec=True, has_ht=False), True)
    assert not mma.serves(DecodeConfig(mode="lightning"), True)
    m = mma.MmaDecodeConfig.from_decode(kda)
    assert m.l2norm and m.has_A and "bv" not in dict(m.key())
    assert m == mma.MmaDecodeConfig.from_decode(DecodeConfig(l2norm=True, gate_in_kernel=True, has_A=True))
    with pytest.raises(ValueError, match="without state pools"):
        mma.MmaDecodeConfig.from_decode(DecodeConfig(pool=1))
    try:
        mma.set_enabled(False)
        assert not mma.serves(kda, True)
    finally:
        mma.set_enabled(True)


def test_kda_plan_routes_multi_token_steps_to_mma(monkeypatch):
    """plan() on meta tensors picks the kernel without compiling (get_kernel stubbed)."""
    seen = []
    monkeypatch.setattr(mma, "get_kernel", lambda cfg: seen.append(("mma", cfg)) or (lambda *a: None))
    monkeypatch.setattr(kda_decode, "get_kernel", lambda cfg: seen.append(("token", cfg)) or (lambda *a: None))
    for T, expect in ((1, "token"), (4, "mma")):
        r, go = kda_decode.plan(*_kda(T=T).values())
        assert r is None and seen[-1][0] == expect
    a = _kda(T=2)
    a.update(initial_state=_state(9), inplace_final_state=True,
             ssm_state_indices=torch.zeros(2, 4, dtype=torch.int32, device="meta"))
    r, go = kda_decode.plan(*a.values())
    assert r is None and seen[-1][0] == "token"
