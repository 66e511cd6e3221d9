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
            f"-varlen{c.cu_dtype if c.varlen else 0}-kv{c.kv_stages}-bv{c.bv}-{c.mma}{'-ws' if c.ws else ''}"
            + ("" if c.has_o else "-stateonly") + ("-seg" if c.seg else "") + ("-rev" if c.reverse else "")
            + ("-pregs" if c.p_regs else "") + ("-odirect" if c.o_direct else "") + ("-mcast" if c.mcast else "")
            + ("-persistent" if c.persistent else "") + ("-opipe" if c.o_pipe else ""))


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
    assert names.count("lightning_prefill_combine") == len(lp.combine_configs())


@pytest.mark.parametrize("ccfg", lp.combine_configs(), ids=lambda c: "-".join(f"{k}={v}" for k, v in c.key()))
def test_combine_compiles(ccfg):
    """The split's combine kernel: 16-byte fp32 loads and stores, registers only (printed with -s)."""
    spec = lp.LightningCombine(ccfg).spec()
    with tempfile.TemporaryDirectory() as d:
        fn = jit.compile_spec(spec, keep_ptx_dir=d)
        assert jit.missing_ptx(spec, fn.__ptx__) == []
        assert "ld.local" not in fn.__ptx__ and "st.local" not in fn.__ptx__
        exe = _cuobjdump()
        cubins = [p for p in glob.glob(d + "/**/*", recursive=True) if p.endswith(".cubin")]
        if exe and cubins:
            res = subprocess.run([exe, "-res-usage", cubins[0]], capture_output=True, text=True, check=True).stdout
            regs = re.search(r"REG:(\d+)", res).group(1)
            print(f"\ncombine {ccfg}: registers {regs}")


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
    macs = C * C * K + C * BV * K + C * BV * C + K * BV * C if cfg.has_o else K * BV * C   # state pass: K^T Vd
    if cfg.ws:   # m64nNk16 with N = C (Q K^T) or BV: the MACs of the HGMMA in the code, one chunk body per warpgroup
        mma = sum(64 * int(n) * 16 for n in re.findall(r"\bHGMMA\.64x(\d+)x16\.F32", sass))
        per_chunk = macs + (K * BV * C if cfg.seg else 0)   # the fused split's first pass: K^T Vd
        per_chunk += C * C * K + C * BV * K if cfg.o_pipe else 0   # o_pipe: Q K^T, Q S_0 issued before the loop too
    elif cfg.mma == "wgmma":
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
                         "kv_stages", "mma", "has_o", "seg", "reverse", "p_regs", "o_direct", "ws", "ws_stages",
                         "o_tma", "persistent", "mcast", "o_pipe"}
    with pytest.raises(ValueError, match="bv=16"):
        lp.LightningPrefillConfig(bv=16)
    with pytest.raises(ValueError, match="bv=32 chunk=64 mma=wgmma"):
        lp.LightningPrefillConfig(bv=32, mma="wgmma")
    with pytest.raises(ValueError, match="bv=128 chunk=64 mma=wgmma ws=False"):
        lp.LightningPrefillConfig(bv=128, ws=False)
    with pytest.raises(ValueError, match="head dims"):
        lp.LightningPrefillConfig(K=96)
    with pytest.raises(ValueError, match="kv_stages 3"):
        lp.LightningPrefillConfig(kv_stages=3)
    with pytest.raises(ValueError, match="mma 'tf32'"):
        lp.LightningPrefillConfig(mma="tf32")


def test_instruction_defaults():
    """The defaults are the measured choice: wgmma, P from registers, Q, K, V double-buffered. p_regs and o_direct
    are wgmma variants: mma.sync (and the state pass, which always runs it) normalizes them off, so a tuning knob
    that selects mma.sync needs no others."""
    c = lp.LightningPrefillConfig()
    assert (c.mma, c.p_regs, c.o_direct, c.kv_stages, c.ws, c.bv) == ("wgmma", True, False, 2, True, 64)
    # the deepest Q/K/V ring that fits: 4 stages at bv 64, 3 at bv 128 (one bf16 S_c slot, two o slots)
    from fla_cula.kernels.lightning_prefill_ws import smem_plan
    assert (c.ws_stages, c.o_tma, smem_plan(c)[:3]) == (0, True, (4, 2, 2))
    assert smem_plan(lp.LightningPrefillConfig(bv=128))[:3] == (3, 1, 2)
    assert smem_plan(lp.LightningPrefillConfig(bv=128, ws_stages=2))[:3] == (2, 2, 2)
    assert smem_plan(lp.LightningPrefillConfig(bv=128, o_tma=False))[:3] == (3, 1, 1)
    with pytest.raises(ValueError, match="ws_stages 4 at K=128 bv=128"):
        lp.LightningPrefillConfig(bv=128, ws_stages=4)
    # ws: the one-warpgroup kernel's knobs normalize to their defaults; runs it cannot serve normalize it off
    # (and bv 128 to 64), so a knob set for the unsplit forward leaves the split's and reverse runs' kernels valid
    assert lp.LightningPrefillConfig(kv_stages=1, p_regs=False, o_direct=True).key() == c.key()
    assert lp.LightningPrefillConfig(bv=128, V=64, K=64).bv == 64
    for kw in ({"reverse": True}, {"has_o": False}, {"mma": "sync"}):
        c = lp.LightningPrefillConfig(bv=128, **kw)
        assert (c.ws, c.bv) == (False, 64), kw
    # mcast: only the unsplit ws kernel with two V blocks per head (a cluster of 2 CTAs)
    assert lp.LightningPrefillConfig(mcast=True).mcast
    for kw in (dict(bv=128), dict(seg=True), dict(persistent=True), dict(ws=False), dict(K=64, V=64)):
        assert not lp.LightningPrefillConfig(mcast=True, **kw).mcast, kw
    # seg with ws: the fused split (one launch, one tile per CTA: never persistent)
    c = lp.LightningPrefillConfig(bv=128, seg=True, persistent=True)
    assert (c.ws, c.bv, c.persistent) == (True, 128, False)
    assert lp.LightningPrefillConfig(seg=True, ws=False).ws is False
    assert lp.LightningPrefillConfig(ws=False, kv_stages=1).kv_stages == 1
    c = lp.LightningPrefillConfig(mma="sync", o_direct=True)
    assert (c.p_regs, c.o_direct, c.kv_stages) == (False, False, 2)
    assert lp.LightningPrefillConfig(mma="sync").key() == lp.LightningPrefillConfig(mma="sync", p_regs=False).key()
    assert (lp.LightningPrefillConfig(ws=False, kv_stages=1, p_regs=False).key()
            != lp.LightningPrefillConfig(ws=False).key())


def test_tuning_knob_reaches_the_config(monkeypatch):
    """set_tuning(kv_stages=2) changes the config every plan builds (compile stubbed: no GPU here)."""
    seen = []
    monkeypatch.setattr(lp.TUNING, "get", lambda name, cfg: seen.append(cfg) or (lambda *a: None))
    a = _args()
    assert lp.plan(*a.values())[0] is None
    assert seen == [lp.LightningPrefillConfig(has_h0=False, bv=b) for b in (64, 128)]   # ws at both bv
    seen.clear()
    lp.set_tuning(kv_stages=1, ws=False)
    try:
        # one build: the knobs themselves apply inside TUNING.get (stubbed here)
        assert lp.plan(*a.values())[0] is None and seen == [lp.LightningPrefillConfig(has_h0=False)]
    finally:
        lp.set_tuning()
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
    assert seen == [lp.LightningPrefillConfig(has_ht=False, varlen=True, bv=b) for b in (64, 128)]
    r, fwd = lp.plan_chunk(a["q"], a["k"], a["v"], torch.empty(3, device="meta"), None, None, cfg)
    assert fwd is None and "g_gamma shape" in r


# ---------------------------------------------------------------------------------------------
# the sequence split (lightning_prefill._run_split): pass 1 local states, the combine, pass 2, in the torch model
def _split_model(q, k, v, g_gamma, scale, h0, nseg, seg_len):
    """The split forward as the three kernels compute it (one sequence, [T, H, D] inputs): pass 1 = the chunk
    model on each segment from zero (its state; has_o=False runs the same state update), the combine in fp32
    as LightningCombine (S = h0; per segment: S_in = S, S = exp(g L) S + S_loc, exp of the fp32 product),
    pass 2 = the chunk model on each segment from S_in. Segment p = tokens [p seg_len, (p + 1) seg_len)."""
    T, H, _ = q.shape
    bounds = [(min(p * seg_len, T), min((p + 1) * seg_len, T)) for p in range(nseg)]
    locs = [_chunk_model(q[a:b], k[a:b], v[a:b], g_gamma, scale, None)[1] if b > a
            else torch.zeros(H, q.shape[2], v.shape[2]) for a, b in bounds]
    S = torch.zeros(H, q.shape[2], v.shape[2]) if h0 is None else h0.float().clone()
    s_in = []
    for (a, b), x in zip(bounds, locs, strict=True):
        s_in.append(S)
        f = torch.exp(g_gamma.float() * torch.tensor(float(b - a))) if b > a else torch.ones(H)
        S = S * f[:, None, None] + x
    o = torch.cat([_chunk_model(q[a:b], k[a:b], v[a:b], g_gamma, scale, s)[0]
                   for (a, b), s in zip(bounds, s_in, strict=True) if b > a])
    return o, S


SPLIT_CASES = [(torch.bfloat16, 3000, 8), (torch.bfloat16, 1000, 4), (torch.bfloat16, 65, 2), (torch.float16, 3000, 4),
               (torch.float32, 3000, 8), (torch.float32, 700, 2)]


@pytest.mark.parametrize("dtype,T,P", SPLIT_CASES, ids=[f"{str(d)[6:]}-T{T}-P{P}" for d, T, P in SPLIT_CASES])
def test_split_numerics(dtype, T, P):
    """The split (forced P, segments as the host wrapper chooses them) against the fp64 recurrence (the 0.005 bar)
    and against the unsplit chunk model: the final state agrees to fp32 rounding; o agrees to a few flips of the
    S0 operand's rounding (bf16/fp16: S_in differs from the unsplit state in the last fp32 bits, and a rare element
    rounds the other way); with fp32 operands (no rounding points) both agree to fp32 rounding: the combine is
    exact algebra. Errors printed with -s (docs/lightning_prefill.md, the numerics table)."""
    torch.manual_seed(T + P)
    H, K = 4, 128
    # 0, -0.0052 (layer 23 of 24: the state carries across segments), -0.125, -7.875
    g = torch.cat([lightning_g_gamma(64, 23, 24)[[0, 1]], lightning_g_gamma(64, 0, 24)[[1, 63]]])
    q, k, v = (torch.randn(T, H, K).to(dtype) for _ in range(3))
    h0 = torch.randn(H, K, K)
    nseg, seg_len = lp._split_for(P, False, T, 1, H, K, K, 64)
    o, S = _split_model(q, k, v, g, K ** -0.5, h0, nseg, seg_len)
    uo, uS = _chunk_model(q, k, v, g, K ** -0.5, h0)
    ro, rS = simple_gla_recurrent(q[None].double(), k[None].double(), v[None].double(), g, scale=K ** -0.5,
                                  initial_state=h0[None])
    rows = []
    for hh in range(H):
        eo, es = rel_rms(ro[0, :, hh], o[:, hh]), rel_rms(rS[0, hh], S[hh])
        uo_, us_ = rel_rms(uo[:, hh], o[:, hh]), rel_rms(uS[hh], S[hh])
        rows.append(f"g={float(g[hh]):+.3f} o {eo:.1e} ht {es:.1e} | vs unsplit o {uo_:.1e} ht {us_:.1e}")
        assert eo < 0.005 and es < 0.005, rows[-1]
        assert us_ < 1e-5, rows[-1]
        assert uo_ < (1e-5 if dtype == torch.float32 else 2e-4), rows[-1]
    print(f"\n{str(dtype)[6:]} T={T} P={P} (nseg {nseg}, seg_len {seg_len}):\n  " + "\n  ".join(rows))


def test_split_segments_heuristic():
    """The heuristic's decisions at the issue's shapes (K = V = 128, bv 64: 2 CTAs per sequence-head, 2 per SM)."""
    def p_of(B, T, H):
        return lp.split_segments(2 * H, B, -(-T // 64), H * 128 * 128 * 4, 2)[0]
    assert p_of(2, 8192, 64) == 1 and p_of(8, 4096, 64) == 1 and p_of(16, 2048, 64) == 1   # the grid fills
    assert p_of(1, 16384, 64) == 1        # 128 CTAs: predicted not worth it (see the docs; force split= to measure)
    assert p_of(1, 16384, 16) == 8 and p_of(1, 8192, 8) == 8 and p_of(1, 16384, 32) == 4
    assert p_of(1, 1024, 8) == 1          # segments would be shorter than 8 chunks
    for B, T, H in ((1, 16384, 16), (1, 8192, 8), (1, 2048, 8), (4, 8192, 8)):
        P, ls = lp.split_segments(2 * H, B, -(-T // 64), H * 128 * 128 * 4, 2)
        assert ls >= lp.SPLIT_MIN_CHUNKS and P * ls >= -(-T // 64) > (P - 1) * ls


def test_split_for_knob_and_bounds():
    f = lp._split_for
    assert f(0, False, 16384, 1, 16, 128, 128, 64) is None and f(1, False, 16384, 1, 16, 128, 128, 64) is None
    assert f(None, False, 8192, 2, 64, 128, 128, 64) is None                  # heuristic: fills the GPU
    assert f(None, False, 16384, 1, 16, 128, 128, 64) == (8, 2048)
    assert f(4, False, 1000, 3, 8, 128, 128, 64) == (4, 256)                   # last segment 232 tokens
    assert f(4, False, 100, 1, 8, 128, 128, 64) == (2, 64)                    # 2 chunks: 2 segments (64 + 36)
    assert f(8, False, 60, 1, 8, 128, 128, 64) is None                       # one chunk: nothing to split
    assert f(4, True, 4000, 1, 8, 128, 128, 64) == (4, 1024)                  # varlen: plans for the mean length
    assert f(4, True, 4000, 4, 8, 128, 128, 64) == (16, 256)                  # ... and bounds by the token count
    assert f(None, True, 8192, 8, 8, 128, 128, 64) is None                    # varlen, N > SPLIT_VARLEN_MAX_N
    assert f(None, True, 16384, 1, 16, 128, 128, 64) == (8, 2048)
    assert f(2, False, 2 ** 20, 40000, 1, 128, 128, 64) is None               # grid z > 65535
    # the fused split (ws): the most segments of >= 4 chunks whose grid fits the 132 SMs, at bv 64
    assert f(None, False, 8192, 1, 8, 128, 128, 64, True) == (8, 1024)        # 16 CTAs x 8
    assert f(None, False, 16384, 1, 16, 128, 128, 64, True) == (4, 4096)      # 32 x 4
    assert f(None, False, 2048, 1, 16, 128, 128, 64, True) == (4, 512)        # 8 chunks per segment
    assert f(None, False, 8192, 1, 8, 128, 128, 128, True) == (16, 512)       # bv 128: 8 CTAs x 16
    assert f(None, False, 16384, 1, 64, 128, 128, 64, True) is None           # 128 CTAs fill the GPU
    assert f(None, False, 16384, 1, 48, 128, 128, 64, True) is None           # 96 CTAs: two would not fit
    assert f(None, False, 448, 1, 8, 128, 128, 64, True) is None              # 7 chunks: segments < 4 chunks
    assert f(None, False, 512, 1, 8, 128, 128, 64, True) == (2, 256)
    assert f(None, True, 8192, 8, 8, 128, 128, 64, True) is None              # varlen, N > SPLIT_VARLEN_MAX_N
    assert f(3, False, 1000, 2, 4, 128, 128, 64, True) == (3, 384)            # forced: as the three-launch split


def test_split_tuning_knob(monkeypatch):
    """set_tuning(split=...) reaches the plan; the split's three configs compile only on first use (stubbed)."""
    seen = []
    monkeypatch.setattr(lp.TUNING, "get", lambda name, cfg: seen.append(cfg) or (lambda *a: None))
    with pytest.raises(ValueError, match="split="):
        lp.set_tuning(split=-1)
    try:
        lp.set_tuning(split=4, mma="sync")
        assert lp._SPLIT["split"] == 4
        a = _args(B=1, T=4096)
        r, go = lp.plan(*a.values())
        assert r is None and seen[-1].mma == "wgmma"       # the stub records the config before knobs (default)
    finally:
        lp.set_tuning()
    assert lp.SPLIT_DEFAULT == "auto" and lp._SPLIT["split"] is None   # the heuristic by default
    lp.set_tuning(split=0)
    assert lp._SPLIT["split"] == 0                           # off
    lp.set_tuning()
    c = lp.LightningPrefillConfig(has_o=False, mma="wgmma", kv_stages=2)
    assert c.mma == "sync"                                # the state pass always runs the mma.sync body
    with pytest.raises(ValueError, match="has_o=False needs has_ht=True"):
        lp.LightningPrefillConfig(has_o=False, has_ht=False)


def _fake_kernels(monkeypatch):
    """Stand-ins with the compiled kernels' calling conventions, computing with the torch chunk model, so the
    split's host code (_split_for, _run_split: buffers, views, argument order, segment slots) runs on the CPU."""
    def main(cfg):
        def fn(q, k, v, g, h0, ht, o, cu, scale, seg_len=0, nseg=1):
            N = k.shape[0] if cu is None else cu.numel() - 1
            Tt = k.shape[1]
            for z in range(N * nseg):
                n, p = (z // nseg, z % nseg) if cfg.seg else (z, 0)
                b, bos, Tn = n, 0, Tt
                if cu is not None:
                    s0 = max(min(int(cu[n]), Tt), 0)
                    b, bos, Tn = 0, s0, max(min(int(cu[n + 1]), Tt), s0) - s0
                if cfg.seg:
                    s0 = min(p * seg_len, Tn)
                    bos, Tn = bos + s0, min(seg_len, Tn - s0)
                S0 = h0[z].float() if cfg.has_h0 else None
                if Tn == 0:
                    S = S0.clone() if S0 is not None else torch.zeros(k.shape[2], k.shape[3], v.shape[3])
                else:
                    sl = slice(bos, bos + Tn)
                    oo, S = _chunk_model((q if cfg.has_o else k)[b, sl], k[b, sl], v[b, sl], g, scale, S0)
                    if cfg.has_o:
                        o[b, sl] = oo.to(o.dtype)
                if cfg.has_ht:
                    ht[z] = S
        return fn

    calls = []

    def fused(q, k, v, g, h0, ht, o, cu, X, flags, scale, seg_len, nseg):
        """The fused split as the ws kernel computes it: segment p's local state X[z] from zero, then its initial
        state by Horner over the earlier segments' X (exp of the fp32 product g seg_len), then its o."""
        calls.append(("fused", tuple(X.shape), tuple(flags.shape), seg_len, nseg))
        N = k.shape[0] if cu is None else cu.numel() - 1
        Tt, H = k.shape[1], k.shape[2]
        assert flags.shape == (2 + N * nseg * H * (v.shape[3] // 64),) and not flags.any()   # [ticket, done, flags]
        for n in range(N):
            b, bos, Ln = n, 0, Tt
            if cu is not None:
                s0 = max(min(int(cu[n]), Tt), 0)
                b, bos, Ln = 0, s0, max(min(int(cu[n + 1]), Tt), s0) - s0
            S = h0[n].float().clone() if h0 is not None else torch.zeros(H, k.shape[3], v.shape[3])
            for p in range(nseg):
                a = min(p * seg_len, Ln)
                e = min(a + seg_len, Ln)
                if e == a and p > 0:
                    break
                sl = slice(bos + a, bos + e)
                if e > a:
                    oo, Sn = _chunk_model(q[b, sl], k[b, sl], v[b, sl], g, scale, S)
                    o[b, sl] = oo.to(o.dtype)
                    X[n * nseg + p] = _chunk_model(k[b, sl], k[b, sl], v[b, sl], g, scale, None)[1]
                    S = S * torch.exp(g.float() * torch.tensor(float(seg_len)))[:, None, None] + X[n * nseg + p] \
                        if e < Ln else Sn
                if ht is not None and e == Ln:
                    ht[n] = S

    def combine(X, g, h0, ht, cu, Tt, seg_len, nseg, nseq):
        calls.append((tuple(X.shape), seg_len, nseg, nseq))
        for n in range(nseq):
            Tn = Tt if cu is None else max(min(int(cu[n + 1]), Tt), max(min(int(cu[n]), Tt), 0)) - \
                max(min(int(cu[n]), Tt), 0)
            S = h0[n].float().clone() if h0 is not None else torch.zeros_like(X[0])
            for p in range(nseg):
                z = n * nseg + p
                L = min(seg_len, Tn - min(p * seg_len, Tn))
                x = X[z].clone()
                X[z] = S
                f = torch.exp(g.float() * torch.tensor(float(L))) if L > 0 else torch.ones_like(g)
                S = S * f[:, None] + x
            if ht is not None:
                ht[n] = S

    monkeypatch.setattr(lp.TUNING, "get", lambda name, cfg: fused if cfg.ws and cfg.seg else main(cfg))
    monkeypatch.setattr(lp, "get_combine", lambda cfg: combine)
    monkeypatch.setattr(lp, "launch", lambda fn, dev, *a: fn(*a))
    return calls


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "three-launch"])
@pytest.mark.parametrize("case", ["fixed-h0-ht", "fixed-noh0-noht", "fixed-h0bf16-B2", "varlen-h0", "varlen-empty"])
def test_split_host_path_cpu(case, fused, monkeypatch):
    """The split's host path end to end on the CPU with stand-in kernels (same arguments as the compiled ones):
    forced split=3 against the unsplit path (same stand-ins) and against the fp64 recurrence. fused: the ws
    kernel's one-launch split (the default); else ws=False, the three launches (pass 1, combine, pass 2)."""
    calls = _fake_kernels(monkeypatch)
    torch.manual_seed(len(case))
    H, K = 3, 64
    g = torch.cat([lightning_g_gamma(64, 23, 24)[[0, 1]], lightning_g_gamma(64, 0, 24)[[8]]])
    varlen = case.startswith("varlen")
    lens = [700, 0, 300, 1] if case == "varlen-empty" else [900, 450]
    B, T = (1, sum(lens)) if varlen else ((2, 650) if "B2" in case else (1, 1000))
    q, k, v = (torch.randn(B, T, H, K).bfloat16() for _ in range(3))
    N = len(lens) if varlen else B
    h0 = None if "noh0" in case else torch.randn(N, H, K, K).to(torch.bfloat16 if "bf16" in case else torch.float32)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32) if varlen else None
    ht_on = "noht" not in case
    args = (q, k, v, g, K ** -0.5, h0, ht_on, cu)
    try:
        knobs = {} if fused else {"ws": False}
        lp.set_tuning(split=3, **knobs)
        o, ht = lp.run(*args)
        assert len(calls) == 1      # the split ran: X [N nseg, H, K V] (combine), [N nseg, H, K, V] (fused)
        if fused:
            assert calls[0][0] == "fused" and calls[0][1] == (N * calls[0][4], H, K, K)
        else:
            assert calls[0][0] == (N * calls[0][2], H, K * K)
        lp.set_tuning(split=0, **knobs)
        uo, uht = lp.run(*args)
    finally:
        lp.set_tuning()
    assert lp._split_for(3, varlen, T, N, H, K, K, 64) is not None
    ro, rs = simple_gla_recurrent(q.double(), k.double(), v.double(), g, scale=K ** -0.5, initial_state=h0,
                                  cu_seqlens=cu)
    assert rel_rms(ro, o) < 0.005 and rel_rms(uo.double(), o.double()) < 2e-4
    if ht_on:
        assert rel_rms(rs, ht) < 0.005 and rel_rms(uht, ht) < 1e-5
        for n, L in enumerate(lens if varlen else []):
            if L == 0:
                assert torch.equal(ht[n], h0[n].float() if h0 is not None else torch.zeros_like(ht[n]))
    else:
        assert ht is None and uht is None


def test_small_grid_reason():
    """The routed op sends grids below MIN_CTAS CTAs to FLA unless the sequence split serves the call."""
    def qv(B, T, H, D=128):
        q = torch.empty(B, T, H, D, dtype=torch.bfloat16, device="meta")
        return q, torch.empty_like(q)
    q, v = qv(1, 8192, 8)
    r = lp.small_grid_reason(q, v, None, 0, 64)
    assert r is not None and "16 CTAs" in r and "< 128" in r
    assert lp.small_grid_reason(q, v, None, None, 64) is None            # the heuristic splits it
    assert lp.small_grid_reason(q, v, None, 8, 64) is None               # a forced split
    assert lp.small_grid_reason(q, v, None, None, 64, True) is None      # the fused split serves it
    # the ws kernel unsplit from WS_MIN_CTAS (96 CTAs: no fused split, the kernel itself); 64 CTAs, 7 chunks: FLA
    assert lp.small_grid_reason(*qv(1, 16384, 48), None, None, 64, True) is None
    assert lp.small_grid_reason(*qv(1, 16384, 48), None, None, 64) is not None   # the one-warpgroup kernels: FLA
    assert "< 67" in lp.small_grid_reason(*qv(1, 448, 32), None, None, 64, True)
    assert lp.small_grid_reason(*qv(1, 448, 34), None, None, 64, True) is None       # 68 CTAs: the ws kernel
    assert lp.small_grid_reason(*qv(1, 16384, 64), None, 0, 64) is None  # 128 CTAs
    assert lp.small_grid_reason(*qv(2, 8192, 64), None, 0, 64) is None
    cu = torch.empty(5, dtype=torch.int32, device="meta")                # varlen: N = 4 sequences
    q, v = qv(1, 4000, 16)
    assert lp.small_grid_reason(q, v, cu, 0, 64) is None                 # 4 x 16 x 2 = 128
    assert "64 CTAs" in lp.small_grid_reason(*qv(1, 4000, 16, D=64), cu, 0, 64)


def test_force_takes_small_grids(monkeypatch):
    """FLA_CULA_FORCE=1 (coverage runs: FLA's own tests on small shapes) drops the speed-only small-grid reason."""
    q = torch.empty(1, 64, 2, 64, dtype=torch.bfloat16, device="meta")
    assert "2 CTAs" in lp.small_grid_reason(q, q, None, 0, 64)
    monkeypatch.setenv("FLA_CULA_FORCE", "1")
    assert lp.small_grid_reason(q, q, None, 0, 64) is None
    monkeypatch.setenv("FLA_CULA_FORCE", "0")
    assert lp.small_grid_reason(q, q, None, 0, 64) is not None


def test_routed_plan_sends_small_grids_to_fla(monkeypatch):
    """plan_chunk's per-call size check (what routing runs on every call) carries the small-grid reason."""
    from fla_cula.ops.chunk_autograd import LightningChunkConfig
    monkeypatch.setattr(lp.TUNING, "get", lambda name, cfg: (lambda *a: None))
    cfg = LightningChunkConfig(scale=128 ** -0.5, output_final_state=True, chunk_size=64)
    small, short, big = _args(B=1, T=8192, H=8), _args(B=1, T=448, H=8), _args(B=2, T=8192, H=64)

    def reason(x):
        r, fwd = lp.plan_chunk(x["q"], x["k"], x["v"], x["g_gamma"], None, None, cfg)
        assert r is None
        return fwd.size_reason(x["q"], x["k"], x["v"], x["g_gamma"], None, None, cfg)
    assert reason(small) is None                      # the default heuristic splits it (16 CTAs, 128 chunks)
    assert "16 CTAs" in reason(short)                 # 7 chunks: too short to split (segments >= 4 chunks)
    assert reason(big) is None
    try:
        lp.set_tuning(split=0)
        assert "16 CTAs" in reason(small)             # split off: FLA
        lp.set_tuning(ws=False)
        assert "16 CTAs" in reason(_args(B=1, T=512, H=8))   # the three-launch split needs segments of 8 chunks
    finally:
        lp.set_tuning()
