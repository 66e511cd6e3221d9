"""CPU tests of the lightning prefill kernel (fla_cula/kernels/lightning_prefill.py):

- every registered spec compiles for sm_90a, its PTX holds the instructions the design uses
  (mma.sync m16n8k16, ldmatrix plain and .trans, 16-byte cp.async, 128-bit stores, barriers), and its
  SASS keeps everything in registers (no local memory, no spill instructions); registers printed;
- check() reasons on meta / CPU tensors (no GPU needed);
- the chunk algorithm the kernel implements (same decay table, masks, clamped tail rows and bf16/fp16
  rounding points), modelled in torch on the CPU, is within the bar of the fp64 reference on long
  sequences with g = 0 and strong decay: the numerics argument of docs/lightning_prefill.md.

    python -m pytest -q -s tests/test_lightning_prefill_compile.py     (-s prints registers)
"""

import glob
import os
import re
import shutil
import subprocess
import tempfile

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from fla_cula import jit  # noqa: E402
from fla_cula.kernels import lightning_prefill as lp  # noqa: E402
from fla_cula.reference.compare import rel_rms  # noqa: E402
from fla_cula.reference.lightning import lightning_g_gamma, simple_gla_recurrent  # noqa: E402

CFGS = lp.representative_configs()


def _id(c):
    return (f"{c.dtype}-K{c.K}-h0{c.h0_dtype if c.has_h0 else 'none'}-ht{int(c.has_ht)}"
            f"-varlen{c.cu_dtype if c.varlen else 0}-kv{c.kv_stages}-bv{c.bv}-{c.mma}")


def _cuobjdump():
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    try:
        import triton
    except ImportError:
        return None
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return exe if os.path.exists(exe) else None


@pytest.fixture(scope="module")
def compiled():
    """spec -> (ptx, cubin bytes), compiled once per module run."""
    out = {}
    for c in CFGS:
        spec = lp.LightningPrefill(c).spec()
        with tempfile.TemporaryDirectory() as d:
            fn = jit.compile_spec(spec, keep_ptx_dir=d)
            cubins = [p for p in glob.glob(d + "/**/*", recursive=True) if p.endswith(".cubin")]
            out[c] = (fn.__ptx__, open(cubins[0], "rb").read() if cubins else None)
    return out


def test_registered():
    names = [s.name for s in jit.registered_specs()]
    assert names.count("lightning_prefill") == len(CFGS)


@pytest.mark.parametrize("cfg", CFGS, ids=[_id(c) for c in CFGS])
def test_compiles_with_expected_ptx(cfg, compiled):
    spec = lp.LightningPrefill(cfg).spec()
    ptx, _ = compiled[cfg]
    assert jit.missing_ptx(spec, ptx) == []
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize("cfg", CFGS, ids=[_id(c) for c in CFGS])
def test_sass_registers_no_spills(cfg, compiled):
    """The state (64 fp32 per thread) and the accumulators stay in registers (no local memory, no spill
    instructions); the MMA instructions per chunk are exactly the four GEMMs' (no duplicated or missing
    k-blocks). Registers are printed (-s): <= 255 x 128 threads lets two CTAs share an SM."""
    exe = _cuobjdump()
    _, cubin = compiled[cfg]
    if exe is None or cubin is None:
        pytest.skip("cuobjdump (PATH or the triton wheel) or the cubin is not available")
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.cubin")
        with open(p, "wb") as f:
            f.write(cubin)
        res = subprocess.run([exe, "-res-usage", p], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([exe, "-sass", p], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    local = int(re.search(r"LOCAL:(\d+)", res).group(1))
    spills = len(re.findall(r"\b(LDL|STL)\b", sass))
    # per chunk: QK^T (C x C x K), Q S0 (C x BV x K), P V (C x BV x C), K^T Vd (K x BV x C): m16n8k16 per
    # warp (mma.sync) or m64n64k16 per warpgroup (wgmma); the kernel has one chunk body
    C, BV, K = cfg.chunk, cfg.bv, cfg.K
    macs = C * C * K + C * BV * K + C * BV * C + K * BV * C
    if cfg.mma == "wgmma":
        mma, per_chunk = len(re.findall(r"\bHGMMA\.64x64x16\.F32", sass)), macs // (64 * 64 * 16)
    else:
        mma, per_chunk = len(re.findall(r"\bHMMA\.16816\.F32", sass)), macs // (16 * 8 * 16) // (lp.NTHR // 32)
    print(f"\n{_id(cfg)}: registers {regs}, local {local} B, spill instructions {spills}, MMA {mma}")
    assert local == 0 and spills == 0
    assert mma == per_chunk, (mma, per_chunk)


def test_config_key_has_no_sizes():
    keys = dict(lp.LightningPrefillConfig().key())
    for size in ("B", "T", "N", "H"):
        assert size not in keys
    assert set(keys) == {"dtype", "K", "V", "bv", "chunk", "has_h0", "h0_dtype", "has_ht", "varlen", "cu_dtype",
                         "kv_stages", "mma"}
    with pytest.raises(ValueError, match="bv=16"):
        lp.LightningPrefillConfig(bv=16)
    with pytest.raises(ValueError, match="bv=32 chunk=64 mma=wgmma"):
        lp.LightningPrefillConfig(bv=32, mma="wgmma")
    with pytest.raises(ValueError, match="head dims"):
        lp.LightningPrefillConfig(K=96)
    with pytest.raises(ValueError, match="kv_stages 3"):
        lp.LightningPrefillConfig(kv_stages=3)
    with pytest.raises(ValueError, match="mma 'wgmma' with kv_stages 2"):
        lp.LightningPrefillConfig(mma="wgmma", kv_stages=2)


def test_tuning_knob_reaches_the_config(monkeypatch):
    """set_tuning(kv_stages=2) changes the config every plan builds (compile stubbed: no GPU here)."""
    seen = []
    monkeypatch.setattr(lp.TUNING, "get", lambda name, cfg: seen.append(cfg) or (lambda *a: None))
    a = _args()
    assert lp.plan(*a.values())[0] is None and seen[-1] == lp.LightningPrefillConfig(has_h0=False)
    with pytest.raises(ValueError, match="unknown LightningPrefillConfig fields"):
        lp.set_tuning(stages=2)


# ---------------------------------------------------------------------------------------------
def _args(B=2, T=65, H=4, K=128, V=128, dtype=torch.bfloat16, dev="meta"):
    q = torch.empty(B, T, H, K, dtype=dtype, device=dev)
    return dict(q=q, k=torch.empty_like(q), v=torch.empty(B, T, H, V, dtype=dtype, device=dev),
                g_gamma=torch.empty(H, dtype=torch.float32, device=dev), scale=K ** -0.5,
                initial_state=None, output_final_state=True, cu_seqlens=None)


def test_check_accepts():
    assert lp.check(**_args()) is None
    assert lp.check(**_args(K=64, V=64, dtype=torch.float16)) is None
    a = _args()
    a["initial_state"] = torch.empty(2, 4, 128, 128, dtype=torch.bfloat16, device="meta")
    assert lp.check(**a) is None
    a = _args(B=1)
    a["cu_seqlens"] = torch.zeros(4, dtype=torch.int64, device="meta")
    a["initial_state"] = torch.empty(3, 4, 128, 128, device="meta")
    assert lp.check(**a) is None


@pytest.mark.parametrize("mutate,reason", [
    (lambda a: a.update(q=a["q"].float(), k=a["k"].float(), v=a["v"].float()), "q dtype torch.float32"),
    (lambda a: a.update(k=a["k"].half()), "q/k/v dtypes"),
    (lambda a: a.update(_args(K=96, V=96)), "head dims K=96 V=96"),
    (lambda a: a.update(_args(K=128, V=64)), "head dims K=128 V=64"),
    (lambda a: a.update(v=torch.empty(2, 64, 4, 128, dtype=torch.bfloat16, device="meta")), "v shape"),
    (lambda a: a.update(q=torch.empty(2, 4, 65, 128, dtype=torch.bfloat16, device="meta").transpose(1, 2)),
     "q not contiguous"),
    (lambda a: a.update(g_gamma=torch.empty(3, device="meta")), "g_gamma shape"),
    (lambda a: a.update(g_gamma=torch.empty(4, dtype=torch.float16, device="meta")), "g_gamma: expected a float32"),
    (lambda a: a.update(scale=float("nan")), "scale nan"),
    (lambda a: a.update(initial_state=torch.empty(3, 4, 128, 128, device="meta")), "initial_state batch 3"),
    (lambda a: a.update(initial_state=torch.empty(2, 3, 128, 128, device="meta")), "initial_state shape"),
    (lambda a: a.update(initial_state=torch.empty(2, 4, 128, 128, device="meta").transpose(2, 3)),
     "initial_state not contiguous"),
    (lambda a: a.update(initial_state=torch.empty(2, 4, 128, 128, dtype=torch.float64, device="meta")),
     "initial_state dtype"),
    (lambda a: a.update(cu_seqlens=torch.zeros(3, dtype=torch.int32, device="meta")), "cu_seqlens with batch 2"),
    (lambda a: a.update(cu_seqlens=torch.zeros(3, dtype=torch.float32, device="meta")), "cu_seqlens"),
    (lambda a: a.update(_args(T=0)), "empty input (T=0"),
])
def test_check_reasons(mutate, reason):
    a = _args()
    mutate(a)
    r = lp.check(**a)
    assert r is not None and reason in r, r


def test_check_misaligned_cpu():
    a = _args(dev="cpu")
    buf = torch.empty(2 * 65 * 4 * 128 + 1, dtype=torch.bfloat16)
    a["q"] = buf[1:].view(2, 65, 4, 128)
    assert lp.check(**a) == "q not 16-byte aligned"


def test_run_raises_value_error_with_reason():
    a = _args()
    a["g_gamma"] = torch.empty(3, device="meta")
    with pytest.raises(ValueError, match="lightning_prefill: g_gamma shape"):
        lp.run(*a.values())


# ---------------------------------------------------------------------------------------------
def _chunk_model(q, k, v, g_gamma, scale, h0, C=64):
    """The kernel's algorithm in torch (one sequence, [T, H, D] inputs): decay table exp(g d) in fp32,
    P = (Q K^T masked, decayed) rounded to the input dtype, S0 rounded for Q S0, Vd = decayed v rounded,
    fp32 accumulation and fp32 state; rows past the end hold a clamped (repeated) token."""
    T, H, K = q.shape
    V = v.shape[2]
    dt = q.dtype
    S = torch.zeros(H, K, V) if h0 is None else h0.float().clone()
    o = torch.full((T, H, V), float("nan"))
    d = torch.arange(C + 1, dtype=torch.float32)
    tab = torch.exp(g_gamma.float()[:, None] * d[None, :])           # [H, C + 1]
    ii = torch.arange(C)
    for t0 in range(0, T, C):
        L = min(C, T - t0)
        rows = t0 + torch.clamp(ii, max=L - 1)                         # clamped token index per tile row
        Q, Kc, Vc = (x[rows].float().transpose(0, 1) for x in (q, k, v))  # [H, C, D]
        A = Q @ Kc.transpose(1, 2)
        dd = (ii[:, None] - ii[None, :]).clamp(min=0)
        P = torch.where(ii[None, :] <= ii[:, None], A * tab[:, dd], torch.zeros(()))
        P = P.to(dt).float()
        Oc = (Q @ S.to(dt).float()) * tab[:, ii + 1][:, :, None] + P @ Vc
        fv = torch.where(ii < L, tab[:, (L - 1 - ii).clamp(min=0)], torch.zeros(()))   # [H, C]
        Vd = (Vc * fv[:, :, None]).to(dt).float()
        S = S * tab[:, L][:, None, None] + Kc.transpose(1, 2) @ Vd
        o[t0:t0 + L] = (Oc * scale).to(dt).float().transpose(0, 1)[:L]
    return o, S


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 63, 65, 3000])
def test_chunk_algorithm_numerics(dtype, T):
    """The chunked form with the kernel's rounding points meets relative RMS 0.005 against the fp64
    recurrence, g from 0 (no decay: the state grows over all T tokens) to -7.9, with an initial state."""
    torch.manual_seed(T)
    H, K = 4, 128
    g = lightning_g_gamma(64, 0, 24)[[0, 1, 8, 63]]      # 0, -0.125, -1, -7.875
    q, k, v = (torch.randn(T, H, K).to(dtype) for _ in range(3))
    h0 = torch.randn(H, K, K)
    o, S = _chunk_model(q, k, v, g, K ** -0.5, h0)
    ro, rS = simple_gla_recurrent(q[None], k[None], v[None], g, scale=K ** -0.5, initial_state=h0[None])
    for hh in range(H):
        eo, es = rel_rms(ro[0, :, hh], o[:, hh]), rel_rms(rS[0, hh], S[hh])
        assert eo < 0.005 and es < 0.005, (hh, float(g[hh]), eo, es)


def test_check_rejects_non_compact_size_one_dims():
    """is_contiguous() ignores the stride of a size-1 dim; the compiled signature assumes row-major strides
    for every dim, so such a view goes to FLA with a reason instead of failing at launch."""
    a = _args(B=1, T=1)
    big = torch.empty(1, 5, 4, 128, dtype=torch.bfloat16, device="meta")
    a.update(q=big[:, 2:3], k=big[:, 3:4], v=big[:, 4:5])
    assert a["q"].is_contiguous()
    r = lp.check(**a)
    assert r is not None and r.startswith("q not contiguous (strides"), r


def test_plan_chunk_adapter(monkeypatch):
    """plan_chunk: the ops layer's chunk_lightning_attn plan form (cfg carries scale and
    output_final_state); it plans the same config as plan() and passes reasons through."""
    from types import SimpleNamespace
    seen = []
    monkeypatch.setattr(lp.TUNING, "get", lambda name, cfg: seen.append(cfg) or (lambda *a: None))
    a = _args(B=1)
    a["cu_seqlens"] = torch.zeros(3, dtype=torch.int32, device="meta")
    cfg = SimpleNamespace(scale=0.1, output_final_state=False, chunk_size=64)
    r, fwd = lp.plan_chunk(a["q"], a["k"], a["v"], a["g_gamma"], None, a["cu_seqlens"], cfg)
    assert r is None and callable(fwd)
    assert seen[-1] == lp.LightningPrefillConfig(has_ht=False, varlen=True)
    r, fwd = lp.plan_chunk(a["q"], a["k"], a["v"], torch.empty(3, device="meta"), None, None, cfg)
    assert fwd is None and "g_gamma shape" in r
