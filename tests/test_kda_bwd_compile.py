"""kda_bwd_wy (csrc/kda_sm90/kda_bwd_wy_kernel.cuh) on the CPU: its own source run by the emulator of
tests/test_kda_prefill_compile.py (one std::thread per CUDA thread; mma.sync and ldmatrix emulated from the PTX
fragment layouts), against the fp64 model of FLA's chunk_kda_bwd_wy_dqkg_fused
(fla_cula.reference.kda.bwd_wy_reference) on fresh random inputs: fixed length with a tail, GVA, both state
layouts, varlen with a short sequence. Shared memory is poisoned per CTA and the outputs start as NaN, so a value
read before it is written or a row left unwritten shows up. Storing the other state layout's reading gives O(1)
errors, so the comparison tells the layouts apart."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from fla_cula.reference.compare import rel_rms
from fla_cula.reference.kda import bwd_wy_reference
from tests.test_kda_prefill_compile import EMULATOR_CPP, build_emulator

# the forward's emulator prelude with its per-warp exchange arrays sized for the backward's 16 warps
_PRELUDE = EMULATOR_CPP.split("#define FLA_CULA_KDA_HOST_EMULATION 1")[0]
for _name in ("g_wbar", "g_x", "g_a", "g_b", "g_c", "g_sp", "g_sr", "g_lp", "g_any"):
    assert f"{_name}[8]" in _PRELUDE, _name
    _PRELUDE = _PRELUDE.replace(f"{_name}[8]", f"{_name}[16]")
# one emulated launch: CTA b = 0 .. blocks - 1 in turn, its threads as std::threads running kernel(), shared memory
# poisoned (0xff) before each CTA
_PRELUDE += r"""
template <class F>
void emu_grid(int blocks, int threads, F const& kernel) {
  std::barrier<> bar(threads);
  g_bar = &bar;
  for (int w = 0; w < threads / 32; ++w) g_wbar[w] = new std::barrier<>(32);
  for (int b = 0; b < blocks; ++b) {
    blockIdx.x = b;
    std::memset(smem_raw, 0xff, sizeof(smem_raw));
    std::vector<std::thread> th;
    for (int t = 0; t < threads; ++t)
      th.emplace_back([&kernel, t] {
        threadIdx.x = t;
        kernel();
      });
    for (auto& x : th) x.join();
  }
  for (int w = 0; w < threads / 32; ++w) delete g_wbar[w];
}
"""


EMULATOR_BWD_CPP = _PRELUDE + r"""
#include <atomic>
#include <vector_functions.h>
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

#define FLA_CULA_KDA_HOST_EMULATION 1
#include "kda_sm90/kda_bwd_wy_kernel.cuh"

using namespace fla_cula;

extern "C" void emu_bwd_wy(void const* q, void const* k, void const* v, void const* v_new, void const* dout,
                           void const* dv, float const* g, float const* beta, void const* A, void const* h,
                           void const* dh, float* dq, float* dk, void* dv2, float* dg, float* db, float* dA, int B,
                           int T, int H, int HV, int chunks, float scale, int svf, void const* cu, int cu64,
                           void const* ci, int ci64, int intra, float shift, float const* q_rstd,
                           float const* k_rstd, void* dqx, void* dkx) {
  KdaBwdWyParams p{};
  p.q = q; p.k = k; p.v = v; p.v_new = v_new; p.dout = dout; p.dv = dv; p.g = g; p.beta = beta; p.A = A;
  p.h = h; p.dh = dh; p.dq = dq; p.dk = dk; p.dv2 = dv2; p.dg = dg; p.db = db; p.dA = dA;
  p.B = B; p.T = T; p.H = H; p.HV = HV; p.chunks = chunks; p.scale = scale; p.state_v_first = svf;
  p.cu_seqlens = cu; p.cu_seqlens_int64 = cu64; p.chunk_indices = ci; p.chunk_indices_int64 = ci64;
  p.intra = intra; p.gate_shift = shift; p.q_rstd = q_rstd; p.k_rstd = k_rstd; p.dqx = dqx; p.dkx = dkx;
  static_assert(kda_sm90::kBwdWySmemBytes <= int(sizeof(smem_raw)));
  emu_grid(chunks * HV, kda_sm90::kBwdThreads, [&p, svf] {
    bool const wide = p.gate_shift == 0.f;
    if (p.q_rstd && wide) {
      svf ? kda_sm90::kda_bwd_wy_kernel<true, true, true, true>(p)
          : kda_sm90::kda_bwd_wy_kernel<false, true, true, true>(p);
    } else if (p.q_rstd) {
      svf ? kda_sm90::kda_bwd_wy_kernel<true, true, true>(p) : kda_sm90::kda_bwd_wy_kernel<false, true, true>(p);
    } else if (p.intra && wide) {
      svf ? kda_sm90::kda_bwd_wy_kernel<true, true, false, true>(p)
          : kda_sm90::kda_bwd_wy_kernel<false, true, false, true>(p);
    } else if (p.intra) {
      svf ? kda_sm90::kda_bwd_wy_kernel<true, true>(p) : kda_sm90::kda_bwd_wy_kernel<false, true>(p);
    } else {
      svf ? kda_sm90::kda_bwd_wy_kernel<true, false>(p) : kda_sm90::kda_bwd_wy_kernel<false, false>(p);
    }
  });
}
"""


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build_emulator(EMULATOR_BWD_CPP, tmp_path_factory, "kda_bwd_emu")


# (token, channel) places of the unbounded inputs' decays of 150 (log2): at block edges and inside
UNBOUNDED_DROPS = ((3, 7), (20, 33), (40, 64), (63, 100), (64, 5), (90, 77))


def bwd_wy_inputs(B, T, H, HV, lens=None, seed=0, state_v_first=True, unbounded=False):
    """Random inputs of FLA's chunk_kda_bwd_wy_dqkg_fused in FLA's layouts (Akk lower triangular per chunk, g a
    chunk-local cumsum of negative log2 decays). lens: varlen (B = 1, T = sum(lens)). unbounded: as
    bwd_intra_inputs's (steps up to 20 on a quarter of the channels, drops of 150 at a few places)."""
    gen = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16

    def rn(*s, std=1.0):
        return torch.randn(*s, generator=gen) * std

    q = torch.nn.functional.normalize(rn(B, T, H, 128), dim=-1).to(bf)
    k = torch.nn.functional.normalize(rn(B, T, H, 128), dim=-1).to(bf)
    v, v_new, do, dv = (rn(B, T, HV, 128).to(bf) for _ in range(4))
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seqs = ([(b, 0, T) for b in range(B)] if lens is None
            else [(0, int(cu[i]), int(cu[i + 1])) for i in range(len(lens))])
    a = -torch.rand(B, T, HV, 128, generator=gen) * 0.3
    if unbounded:
        a = torch.where(torch.arange(128) % 4 == 1, torch.rand(B, T, HV, 128, generator=gen) * -20.0, a)
        for t, c in UNBOUNDED_DROPS:
            if t < T:
                a[:, t, :, c] = -150.0
    g = torch.zeros(B, T, HV, 128)
    A = torch.zeros(B, T, HV, 64)
    n_chunks = 0
    for b, bos, eos in seqs:
        for t0 in range(bos, eos, 64):
            L = min(64, eos - t0)
            g[b, t0:t0 + L] = a[b, t0:t0 + L].cumsum(0)
            A[b, t0:t0 + L, :, :L] = torch.tril(rn(L, L, std=0.2)).unsqueeze(1).expand(L, HV, L)
            A[b, t0:t0 + L, :, :L] += rn(L, HV, L, std=0.05) * torch.tril(torch.ones(L, L)).unsqueeze(1)
            n_chunks += 1
    beta = torch.rand(B, T, HV, generator=gen)
    NT = n_chunks if lens is not None else B * ((T + 63) // 64)
    hb = 1 if lens is not None else B
    h = rn(hb, NT // hb, HV, 128, 128, std=0.3).to(bf)
    dh = rn(hb, NT // hb, HV, 128, 128, std=0.3).to(bf)
    return dict(q=q, k=k, v=v, v_new=v_new, g=g, beta=beta, A=A.to(bf), h=h, do=do, dh=dh, dv=dv,
                state_v_first=state_v_first, cu_seqlens=cu)


def chunk_indices_of(lens, chunk=64):
    return torch.tensor([[i, c] for i, n in enumerate(lens) for c in range((n + chunk - 1) // chunk)],
                        dtype=torch.int32).reshape(-1, 2)


def _emulate(lib, x, lens=None, intra=False, shift=0.0, rstd=None):
    q = x["q"]
    B, T, H, _ = q.shape
    HV = x["v"].shape[2]
    f = torch.float32
    out = {n: torch.full((B, T, HV, 128), float("nan"), dtype=f) for n in ("dq", "dk", "dg")}
    out["dv2"] = torch.full((B, T, HV, 128), float("nan"), dtype=torch.bfloat16)
    out["db"] = torch.full((B, T, HV), float("nan"), dtype=f)
    out["dA"] = torch.full((B, T, HV, 64), float("nan"), dtype=f)
    if rstd is not None:  # the fused l2norm backward's bf16 outputs, at the q heads
        out["dqx"], out["dkx"] = (torch.full((B, T, H, 128), float("nan"), dtype=torch.bfloat16) for _ in range(2))
    ci = None if lens is None else chunk_indices_of(lens)
    chunks = B * ((T + 63) // 64) if lens is None else ci.shape[0]

    def ptr(t):
        return ctypes.c_void_p(0 if t is None else t.data_ptr())

    lib.emu_bwd_wy(ptr(q), ptr(x["k"]), ptr(x["v"]), ptr(x["v_new"]), ptr(x["do"]), ptr(x["dv"]), ptr(x["g"]),
                   ptr(x["beta"]), ptr(x["A"]), ptr(x["h"]), ptr(x["dh"]), ptr(out["dq"]), ptr(out["dk"]),
                   ptr(out["dv2"]), ptr(out["dg"]), ptr(out["db"]), ptr(out["dA"]), B, T, H, HV, chunks,
                   ctypes.c_float(128 ** -0.5), int(x["state_v_first"]), ptr(x["cu_seqlens"]), 0, ptr(ci), 0,
                   int(intra), ctypes.c_float(shift), *(ptr(None if rstd is None else r) for r in rstd or (None, None)),
                   *(ptr(out.get(n)) for n in ("dqx", "dkx")))
    return out


CASES = {
    "fixed-tail-vfirst": dict(B=1, T=100, H=1, HV=1),
    "fixed-gva-kfirst": dict(B=2, T=64, H=1, HV=2, state_v_first=False),
    "varlen-short": dict(B=1, T=75, H=1, HV=1, lens=[70, 5]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bwd_wy_emulated_matches_fp64_model(emulator, case):
    kw = dict(CASES[case])
    lens = kw.get("lens")
    x = bwd_wy_inputs(**kw, seed=len(case))
    got = _emulate(emulator, x, lens)
    ref = bwd_wy_reference(x["q"], x["k"], x["v"], x["v_new"], x["g"], x["beta"], x["A"], x["h"], x["do"], x["dh"],
                           x["dv"], 128 ** -0.5, x["state_v_first"], x["cu_seqlens"])
    for n in ("dq", "dk", "dg", "dv2", "db", "dA"):
        o, r = got[n].double(), ref[n]
        assert not o.isnan().any(), f"{n}: {int(o.isnan().sum())} NaN entries (unwritten rows or poisoned reads)"
        err = rel_rms(o, r)
        tol = 4e-3 if n == "dv2" else 2e-5  # dv2 is stored in bf16 (one rounding); the rest fp32 (measured ~1e-7)
        assert err < tol, f"{n}: rel RMS {err:.2e} vs the fp64 model"


def test_sass_hmma_ldsm_no_spills():
    """The ten specializations of the built kernel (state layout x plain / intra fused / intra and l2norm backward
    fused, the fused ones with the bounded or the unbounded intra form): sm_90a, mma.sync
    (HMMA) fed by ldmatrix (LDSM, .trans among them), cp.async loads (LDGSTS), no spill; kda_bwd_intra_kernel:
    HMMA, LDGSTS, no spill, bounded and unbounded gate forms; kda_bwd_gate_kernel (fp32 and bf16 g_raw x lower_bound
    and softplus forms): sm_90a, no spill."""
    from fla_cula import _ext

    ok, why = _ext.available()
    if not ok:
        pytest.skip(why)
    if _ext.cuobjdump() is None:
        pytest.skip("cuobjdump not found")
    mod = _ext.require()
    sass = _ext.sass_opcodes(mod.__file__)
    usage = {r["symbol"]: r for r in _ext.resource_usage(mod.__file__)}
    names = _ext.demangle(list(sass))
    syms = [s for s in sass if "kda_bwd_wy_kernel" in names[s]]
    # state_v_first or not x (plain, kIntra, kIntra + kL2, and the last two with the unbounded intra form)
    assert len(syms) == 10, sorted(names.values())
    dv = [s for s in sass if "kda_bwd_dv_kernel" in names[s]]
    assert len(dv) == 1, sorted(names.values())
    intra = [s for s in sass if "kda_bwd_intra_kernel" in names[s]]
    assert len(intra) == 2, sorted(names.values())  # the bounded and the unbounded (kWide) gate forms
    gate = [s for s in sass if "kda_bwd_gate_kernel" in names[s]]
    assert len(gate) == 4, sorted(names.values())  # g_raw / dg_raw fp32 or bf16 x lower_bound / softplus form
    for s in gate:
        assert sass[s][0] == "sm_90a" and usage[s]["stack"] == 0 and usage[s]["local"] == 0, usage[s]
    for s in syms + intra + dv:
        arch, ops = sass[s]
        assert arch == "sm_90a"
        for op in ("HMMA", "LDGSTS") + (("LDSM", "LDSM.16.MT88") if s in syms + dv else ()):
            assert any(o.startswith(op) for o in ops), (op, sorted(ops))
        assert usage[s]["stack"] == 0 and usage[s]["local"] == 0, usage[s]


# ---------------------------------------------------------------------------------------------
# kda_bwd_intra (csrc/kda_sm90/kda_bwd_intra_kernel.cuh): 512 threads (the prelude's per-warp arrays hold 16 warps)
# ---------------------------------------------------------------------------------------------
EMULATOR_INTRA_CPP = _PRELUDE + r"""
#include <atomic>
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }

#define FLA_CULA_KDA_HOST_EMULATION 1
#include "kda_sm90/kda_bwd_intra_kernel.cuh"

using namespace fla_cula;

extern "C" void emu_bwd_intra(void const* q, void const* k, float const* g, float const* beta, float const* dAqk,
                              float const* dAkk, float const* dq, float const* dk, float const* dg, float const* db,
                              float* dq_out, float* dk_out, float* dg_out, float* db_out, int B, int T, int H, int HV,
                              int chunks, float shift, void const* cu, void const* ci) {
  KdaBwdIntraParams p{};
  p.q = q; p.k = k; p.g = g; p.beta = beta; p.dAqk = dAqk; p.dAkk = dAkk; p.dq = dq; p.dk = dk; p.dg = dg; p.db = db;
  p.dq_out = dq_out; p.dk_out = dk_out; p.dg_out = dg_out; p.db_out = db_out;
  p.B = B; p.T = T; p.H = H; p.HV = HV; p.chunks = chunks; p.gate_shift = shift;
  p.cu_seqlens = cu; p.chunk_indices = ci;
  static_assert(kda_sm90::kBwdIntraSmemBytes <= int(sizeof(smem_raw)));
  emu_grid(chunks * HV, kda_sm90::kIntraThreads, [&p] {
    p.gate_shift == 0.f ? kda_sm90::kda_bwd_intra_kernel<true>(p) : kda_sm90::kda_bwd_intra_kernel<false>(p);
  });
}
"""


@pytest.fixture(scope="module")
def intra_emulator(tmp_path_factory):
    return build_emulator(EMULATOR_INTRA_CPP, tmp_path_factory, "kda_bwd_intra_emu")


LOWER_BOUND = -5.0


def bwd_intra_inputs(B, T, H, HV, lens=None, seed=0, at_bound=False, unbounded=False):
    """Random inputs of FLA's chunk_kda_bwd_intra: g a chunk-local cumsum of per-token log2 decays in
    [lower_bound / ln 2, 0] (safe_gate's range, the whole range used; at_bound: every step at the bound, so a chunk
    spans 64 steps of it and most pairs' factors underflow), dAqk lower triangular with its diagonal, dAkk strictly
    lower, incoming dq, dk, dg, db. unbounded: softplus-like steps up to ~20 (log2) on a quarter of the channels
    (16-token spans of 60-300: both anchor kinds of the unbounded form) and drops of 150 at a few (token, channel)
    places, the rest as above; unbounded="heavy": those steps on three channels of four (most blocks wide)."""
    import math

    gen = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    q = torch.nn.functional.normalize(torch.randn(B, T, H, 128, generator=gen), dim=-1).to(bf)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, 128, generator=gen), dim=-1).to(bf)
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seqs = ([(b, 0, T) for b in range(B)] if lens is None
            else [(0, int(cu[i]), int(cu[i + 1])) for i in range(len(lens))])
    step = torch.rand(B, T, HV, 128, generator=gen) ** 3 * (LOWER_BOUND / math.log(2))  # many slow, some at the bound
    if at_bound:
        step = torch.full_like(step, LOWER_BOUND / math.log(2))
    if unbounded:
        fast = torch.rand(B, T, HV, 128, generator=gen) * -20.0
        step = torch.where(torch.arange(128) % 4 != 0 if unbounded == "heavy" else torch.arange(128) % 4 == 1,
                           fast, step)
        for t, c in UNBOUNDED_DROPS:
            if t < T:
                step[:, t, :, c] = -150.0
    g = torch.zeros(B, T, HV, 128)
    dAqk, dAkk = torch.zeros(B, T, HV, 64), torch.zeros(B, T, HV, 64)
    for b, bos, eos in seqs:
        for t0 in range(bos, eos, 64):
            L = min(64, eos - t0)
            g[b, t0:t0 + L] = step[b, t0:t0 + L].cumsum(0)
            m = torch.tril(torch.ones(L, L))
            dAqk[b, t0:t0 + L, :, :L] = torch.randn(L, HV, L, generator=gen) * m.unsqueeze(1)
            dAkk[b, t0:t0 + L, :, :L] = torch.randn(L, HV, L, generator=gen) * torch.tril(m, -1).unsqueeze(1)
    beta = torch.rand(B, T, HV, generator=gen)
    dq, dk, dg = (torch.randn(B, T, HV, 128, generator=gen) for _ in range(3))
    db = torch.randn(B, T, HV, generator=gen)
    return dict(q=q, k=k, g=g, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, dg=dg, db=db, cu_seqlens=cu)


BOUNDED_SHIFT = -LOWER_BOUND / math.log(2)


def _emulate_intra(lib, x, lens=None, shift=BOUNDED_SHIFT):
    """shift 0: the unbounded form"""

    B, T, H, _ = x["q"].shape
    HV = x["g"].shape[2]
    out = {n: torch.full((B, T, HV, 128), float("nan")) for n in ("dq", "dk", "dg")}
    out["db"] = torch.full((B, T, HV), float("nan"))
    ci = None if lens is None else chunk_indices_of(lens)
    chunks = B * ((T + 63) // 64) if lens is None else ci.shape[0]

    def ptr(t):
        return ctypes.c_void_p(0 if t is None else t.data_ptr())

    lib.emu_bwd_intra(ptr(x["q"]), ptr(x["k"]), ptr(x["g"]), ptr(x["beta"]), ptr(x["dAqk"]), ptr(x["dAkk"]),
                      ptr(x["dq"]), ptr(x["dk"]), ptr(x["dg"]), ptr(x["db"]), ptr(out["dq"]), ptr(out["dk"]),
                      ptr(out["dg"]), ptr(out["db"]), B, T, H, HV, chunks, ctypes.c_float(shift),
                      ptr(x["cu_seqlens"]), ptr(ci))
    return out


def _block_spans(g, cu_seqlens):
    """g's span over each 16-token block of each chunk (first row minus last row), per (block, head, channel)"""
    B, T = g.shape[:2]
    seqs = ([(b, 0, T) for b in range(B)] if cu_seqlens is None
            else [(0, int(cu_seqlens[i]), int(cu_seqlens[i + 1])) for i in range(len(cu_seqlens) - 1)])
    out = []
    for b, bos, eos in seqs:
        for t0 in range(bos, eos, 16):  # 64-token chunks start at multiples of 16 from bos too
            e = min(t0 + 16, eos) - 1
            out.append(g[b, t0] - g[b, e])
    return torch.stack(out)


INTRA_CASES = {
    "fixed-tail": dict(B=1, T=100, H=1, HV=1),
    "fixed-gva": dict(B=2, T=64, H=1, HV=2),
    "varlen-short": dict(B=1, T=86, H=1, HV=1, lens=[70, 1, 15]),
    "fixed-at-the-bound": dict(B=1, T=64, H=1, HV=1, at_bound=True),
    # the unbounded form (gate_shift 0): per-channel anchors, wide channels summed pairwise
    "unbounded-tail": dict(B=1, T=100, H=1, HV=1, unbounded=True),
    "unbounded-varlen-gva": dict(B=1, T=86, H=1, HV=2, lens=[70, 1, 15], unbounded=True),
    "unbounded-heavy": dict(B=1, T=100, H=1, HV=1, unbounded="heavy"),  # most lanes hold several wide channels
    "unbounded-slow": dict(B=1, T=64, H=1, HV=1),  # a bounded gate through the unbounded form
}


@pytest.mark.parametrize("case", sorted(INTRA_CASES))
def test_bwd_intra_emulated_matches_fp64_model(intra_emulator, case):
    from fla_cula.reference.kda import bwd_intra_reference

    kw = dict(INTRA_CASES[case])
    lens = kw.get("lens")
    x = bwd_intra_inputs(**kw, seed=len(case))
    unbounded = case.startswith("unbounded")
    if kw.get("unbounded"):  # both anchor kinds occur: 16-token spans past kSpanMax = 120 and within it past 60
        spans = _block_spans(x["g"], x["cu_seqlens"])
        assert int((spans > 120).sum()) >= 6 and int(((spans > 60) & (spans <= 120)).sum()) >= 6, spans.shape
        if kw["unbounded"] == "heavy":
            assert float((spans > 120).double().mean()) > 0.5, "the heavy case: most (block, channel) spans wide"
    got = _emulate_intra(intra_emulator, x, lens, shift=0.0 if unbounded else BOUNDED_SHIFT)
    ref = bwd_intra_reference(x["q"], x["k"], x["g"], x["beta"], x["dAqk"], x["dAkk"], x["dq"], x["dk"], x["db"],
                              x["dg"], x["cu_seqlens"])
    added = {n: ref[n] - x[n].double() for n in ("dq", "dk", "dg", "db")}
    # dg and db are sums whose terms can cancel (at the bound dg's sum is ~1e-3 of q dq'): their errors are measured
    # against the size of those terms, q dq' and sum_c |k dk'|, when that is the larger scale
    q, k = x["q"].double(), x["k"].double()
    if q.shape[2] != added["dq"].shape[2]:  # GVA: q, k at value heads
        q, k = (t.repeat_interleave(added["dq"].shape[2] // q.shape[2], dim=2) for t in (q, k))
    terms = {"dg": (q * added["dq"]).pow(2).mean().sqrt(), "db": (k * added["dk"]).abs().sum(-1).pow(2).mean().sqrt()}
    for n in ("dq", "dk", "dg", "db"):
        o = got[n].double()
        assert not o.isnan().any(), f"{n}: {int(o.isnan().sum())} NaN entries (unwritten rows or poisoned reads)"
        d = o - x[n].double() - added[n]  # the intra terms alone (the incoming gradient added exactly)
        scale = max(added[n].pow(2).mean().sqrt(), terms.get(n, 0.0))
        err = float(d.pow(2).mean().sqrt() / scale)
        assert err < 2e-5, f"{n}: RMS error of the added terms {err:.2e} (of their scale) vs the fp64 model"


@pytest.mark.parametrize("form", ["bounded", "unbounded"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bwd_wy_fused_intra_emulated_matches_fp64_model(emulator, case, form):
    """kda_bwd_wy with intra (the intra step fused in, its dAqk made in the kernel from do and v_new) against the
    fp64 intra model applied to the plain kernel's outputs on the same inputs, with the fp64 dAqk of FLA's
    chunk_kda_bwd_dAv (dq, dk, db, dg and dA as dAkk: FLA's composition of its kernels; the wy part's own errors are
    test_bwd_wy_emulated_matches_fp64_model's): the added terms within 2e-5 of their scale, dv2 equal to the plain
    kernel's, dA not written (stays NaN)."""
    import math

    from fla_cula.reference.kda import bwd_dAv_reference, bwd_intra_reference

    kw = dict(CASES[case])
    lens = kw.get("lens")
    unbounded = form == "unbounded"
    x = bwd_wy_inputs(**kw, seed=len(case) + 7, unbounded=unbounded)
    B, T, HV = x["v"].shape[:3]
    dAqk = bwd_dAv_reference(x["v_new"], x["do"], scale=128 ** -0.5, cu_seqlens=x["cu_seqlens"])["dAqk"]
    plain = _emulate(emulator, x, lens)
    got = _emulate(emulator, x, lens, intra=True, shift=0.0 if unbounded else -LOWER_BOUND / math.log(2))
    ref = bwd_intra_reference(x["q"], x["k"], x["g"], x["beta"], dAqk, plain["dA"], plain["dq"], plain["dk"],
                              plain["db"], plain["dg"], x["cu_seqlens"])
    assert got["dA"].isnan().all(), "dA written by the fused form"
    assert torch.equal(got["dv2"], plain["dv2"]), "dv2 differs from the plain kernel's"
    q, k = x["q"].double(), x["k"].double()
    if q.shape[2] != HV:  # GVA: q, k at value heads
        q, k = (t.repeat_interleave(HV // q.shape[2], dim=2) for t in (q, k))
    added = {n: ref[n] - plain[n].double() for n in ("dq", "dk", "dg", "db")}
    terms = {"dg": (q * added["dq"]).pow(2).mean().sqrt(), "db": (k * added["dk"]).abs().sum(-1).pow(2).mean().sqrt()}
    for n in ("dq", "dk", "dg", "db"):
        o = got[n].double()
        assert not o.isnan().any(), f"{n}: {int(o.isnan().sum())} NaN entries (unwritten rows or poisoned reads)"
        scale = max(added[n].pow(2).mean().sqrt(), terms.get(n, 0.0))
        err = float((o - ref[n]).pow(2).mean().sqrt() / scale)
        assert err < 2e-5, f"{n}: RMS error of the intra terms {err:.2e} (of their scale) vs the fp64 model"


@pytest.mark.parametrize("case", ["fixed-tail-vfirst", "varlen-short"])
def test_bwd_wy_same_bits_every_run(emulator, case):
    """dg and db are sums over warps (dgk over the 4 row blocks, db over the 4 channel quarters): kept in per-warp
    slots and summed in a fixed order, not by shared-memory atomics, so three runs of the plain, fused and fused +
    l2norm forms give the same bits (the emulator runs each CUDA thread as a thread: atomics' order varies there)."""
    import math

    kw = dict(CASES[case])
    lens = kw.get("lens")
    x = bwd_wy_inputs(**kw, seed=11)
    B, T, H, _ = x["q"].shape
    gen = torch.Generator().manual_seed(11)
    rstd = tuple(torch.rand(B, T, H, generator=gen) + 0.5 for _ in range(2))
    forms = {"plain": {}, "fused": dict(intra=True, shift=-LOWER_BOUND / math.log(2))}
    forms["fused+l2norm"] = dict(forms["fused"], rstd=rstd)
    for form, extra in forms.items():
        runs = [_emulate(emulator, x, lens, **extra) for _ in range(3)]
        for n, t in runs[0].items():
            for r in runs[1:]:
                assert torch.equal(t.nan_to_num(7.0), r[n].nan_to_num(7.0)), f"{form}: {n} differs between runs"


def test_intra_shift_bounded_or_unbounded_form(monkeypatch):
    """kda_bwd_intra's bounded form needs every per-token step of g within [lower_bound, 0] (the in-kernel gate with
    lower_bound has it by construction, a precomputed gate only with safe_gate) and lower_bound >= -11.5 (its
    anchors within fp32); every other gate takes the unbounded form (shift None), which the fused wy form does not
    have. intra_reason no longer looks at the gate: past the device checks this test's stub extension answers."""
    import math

    from fla_cula.ops import kda_bwd

    for args in ((False, -5.0, False), (True, None, True), (True, 0.0, True), (False, None, True), (True, -12.0, True),
                 (False, None, False)):
        assert kda_bwd.intra_shift(args[1], args[0], args[2]) is None, args
    for safe_gate, lb, gik in ((True, -5.0, False), (False, -5.0, True), (True, -11.5, True)):
        assert kda_bwd.intra_shift(lb, safe_gate, gik) == pytest.approx(-lb / math.log(2)), (safe_gate, lb, gik)
    monkeypatch.setattr(kda_bwd._ext, "available", lambda: (False, "stub extension"))
    assert kda_bwd.intra_reason(*([None] * 10), 64) == "stub extension"


@pytest.mark.parametrize("form", ["bounded", "unbounded"])
@pytest.mark.parametrize("case", sorted(n for n, c in CASES.items() if c.get("HV", 1) == c.get("H", 1)))
def test_bwd_wy_fused_l2norm_emulated(emulator, case, form):
    """kda_bwd_wy with intra, q_rstd and k_rstd (intra step and l2norm backward fused, H == HV): dqx, dkx equal FLA's
    l2norm_bwd formula, rstd (dy - y (y . dy)) in fp64 on the fused form's own final dq, dk (which it still writes),
    within bf16's rounding; dq, dk, dg, db, dv2 as without the l2norm backward; both intra forms."""
    import math

    kw = dict(CASES[case])
    lens = kw.get("lens")
    x = bwd_wy_inputs(**kw, seed=len(case) + 3, unbounded=form == "unbounded")
    B, T, HV = x["v"].shape[:3]
    gen = torch.Generator().manual_seed(len(case) + 1)
    rstd = tuple(torch.rand(B, T, HV, generator=gen) + 0.5 for _ in range(2))
    shift = 0.0 if form == "unbounded" else -LOWER_BOUND / math.log(2)
    base = _emulate(emulator, x, lens, intra=True, shift=shift)
    got = _emulate(emulator, x, lens, intra=True, shift=shift, rstd=rstd)
    for n in ("dq", "dk", "dg", "db", "dv2"):  # up to the order of the shared-memory atomics (dgk, db)
        assert rel_rms(got[n].double(), base[n].double()) < 1e-6, f"{n} differs with the l2norm backward fused"
    for n, y, r in (("q", x["q"], rstd[0]), ("k", x["k"], rstd[1])):
        y, dy = y.double(), got["d" + n].double()
        rows = ~dy.isnan().any(-1)  # rows past the sequences' ends are not written
        ref = r.double().unsqueeze(-1) * (dy - y * (y * dy).sum(-1, keepdim=True))
        o = got[f"d{n}x"].double()
        assert not o[rows].isnan().any(), f"d{n}x: unwritten rows"
        err = rel_rms(o[rows], ref[rows])
        assert err < 4e-3, f"d{n}x: rel RMS {err:.2e} vs the fp64 formula (bf16 output)"


# ---------------------------------------------------------------------------------------------
# kda_bwd_dv (csrc/kda_sm90/kda_bwd_dv_kernel.cuh): dv = M(Aqk)^T do, 256 threads
# ---------------------------------------------------------------------------------------------
EMULATOR_DV_CPP = _PRELUDE + r"""
#define FLA_CULA_KDA_HOST_EMULATION 1
#include "kda_sm90/kda_bwd_dv_kernel.cuh"

using namespace fla_cula;

extern "C" void emu_bwd_dv(void const* Aqk, void const* dout, void* dv, int B, int T, int HV, int chunks,
                           void const* cu, void const* ci) {
  KdaBwdDvParams p{};
  p.Aqk = Aqk; p.dout = dout; p.dv = dv; p.B = B; p.T = T; p.HV = HV; p.chunks = chunks;
  p.cu_seqlens = cu; p.chunk_indices = ci;
  static_assert(kda_sm90::kBwdDvSmemBytes <= int(sizeof(smem_raw)));
  emu_grid(chunks * HV, kda_sm90::kDvThreads, [&p] {
    kda_sm90::kda_bwd_dv_kernel(p);
  });
}
"""


@pytest.fixture(scope="module")
def dv_emulator(tmp_path_factory):
    return build_emulator(EMULATOR_DV_CPP, tmp_path_factory, "kda_bwd_dv_emu")


def bwd_dv_inputs(B, T, HV, lens=None, seed=0):
    """Aqk [B,T,HV,64] bf16 as the forward leaves it (row t of its chunk; NaN above the diagonal and past the chunk's
    length, which the kernel must not read) and do [B,T,HV,128]."""
    gen = torch.Generator().manual_seed(seed)
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seqs = ([(b, 0, T) for b in range(B)] if lens is None
            else [(0, int(cu[i]), int(cu[i + 1])) for i in range(len(lens))])
    Aqk = torch.full((B, T, HV, 64), float("nan"))
    for b, bos, eos in seqs:
        for t0 in range(bos, eos, 64):
            L = min(64, eos - t0)
            a = torch.randn(L, HV, L, generator=gen) * 0.3
            Aqk[b, t0:t0 + L, :, :L] = torch.where(torch.tril(torch.ones(L, L, dtype=torch.bool)).unsqueeze(1), a,
                                                  float("nan"))
    do = torch.randn(B, T, HV, 128, generator=gen).to(torch.bfloat16)
    return dict(Aqk=Aqk.to(torch.bfloat16), do=do, cu_seqlens=cu)


DV_CASES = {
    "fixed-tail": dict(B=1, T=100, HV=1),
    "fixed-heads": dict(B=2, T=64, HV=3),
    "varlen-short": dict(B=1, T=86, HV=2, lens=[70, 1, 15]),
}


@pytest.mark.parametrize("case", sorted(DV_CASES))
def test_bwd_dv_emulated_matches_fp64_model(dv_emulator, case):
    """kda_bwd_dv against the fp64 model of chunk_kda_bwd_dAv's dv (bf16 output: one rounding), every row written
    (the output starts as NaN), Aqk's entries above the diagonal (NaN here) not read."""
    from fla_cula.reference.kda import bwd_dAv_reference

    kw = dict(DV_CASES[case])
    lens = kw.get("lens")
    x = bwd_dv_inputs(**kw, seed=len(case))
    B, T, HV = kw["B"], kw["T"], kw["HV"]
    dv = torch.full((B, T, HV, 128), float("nan"), dtype=torch.bfloat16)
    ci = None if lens is None else chunk_indices_of(lens)
    chunks = B * ((T + 63) // 64) if lens is None else ci.shape[0]

    def ptr(t):
        return ctypes.c_void_p(0 if t is None else t.data_ptr())

    dv_emulator.emu_bwd_dv(ptr(x["Aqk"]), ptr(x["do"]), ptr(dv), B, T, HV, chunks, ptr(x["cu_seqlens"]), ptr(ci))
    ref = bwd_dAv_reference(x["do"], x["do"], x["Aqk"], cu_seqlens=x["cu_seqlens"])["dv"]  # v_new: dAqk only
    o = dv.double()
    assert not o.isnan().any(), f"dv: {int(o.isnan().sum())} NaN entries (unwritten rows or masked entries read)"
    err = rel_rms(o, ref)
    assert err < 4e-3, f"dv: rel RMS {err:.2e} vs the fp64 model (bf16 output)"


# ---------------------------------------------------------------------------------------------
# kda_bwd_gate (csrc/kda_sm90/kda_bwd_gate_kernel.cuh): dg's reverse chunk cumsum and the gate backward, 512 threads
# ---------------------------------------------------------------------------------------------
EMULATOR_GATE_CPP = _PRELUDE + r"""
#define FLA_CULA_KDA_HOST_EMULATION 1
#include "kda_sm90/kda_bwd_gate_kernel.cuh"

using namespace fla_cula;

extern "C" void emu_bwd_gate(float const* dg, void const* g_raw, int g_raw_fp32, void const* A_log, int A_fp32,
                             void const* dt_bias, int bias_fp32, int softplus, float lower_bound, void* dg_raw,
                             float* dA_part, float* dbias_part, int B, int T, int HV, int chunks, void const* cu,
                             void const* ci) {
  KdaBwdGateParams p{};
  p.dg = dg; p.g_raw = g_raw; p.g_raw_fp32 = g_raw_fp32; p.A_log = A_log; p.A_log_fp32 = A_fp32;
  p.dt_bias = dt_bias; p.dt_bias_fp32 = bias_fp32; p.softplus = softplus; p.lower_bound = lower_bound;
  p.dg_raw = dg_raw;
  p.dA_part = dA_part; p.dbias_part = dbias_part; p.B = B; p.T = T; p.HV = HV; p.chunks = chunks;
  p.cu_seqlens = cu; p.chunk_indices = ci;
  static_assert(kda_sm90::kBwdGateSmemBytes <= int(sizeof(smem_raw)));
  emu_grid(chunks * HV, kda_sm90::kGateThreads, [&p] {
    if (p.softplus) {
      p.g_raw_fp32 ? kda_sm90::kda_bwd_gate_kernel<true, true>(p) : kda_sm90::kda_bwd_gate_kernel<false, true>(p);
    } else {
      p.g_raw_fp32 ? kda_sm90::kda_bwd_gate_kernel<true, false>(p) : kda_sm90::kda_bwd_gate_kernel<false, false>(p);
    }
  });
}
"""


@pytest.fixture(scope="module")
def gate_emulator(tmp_path_factory):
    return build_emulator(EMULATOR_GATE_CPP, tmp_path_factory, "kda_bwd_gate_emu")


def gate_bwd_reference(dg, g_raw, A_log, dt_bias, lb, seqs):
    """FLA's chunk_local_cumsum(dg, reverse) then kda_gate_bwd in fp64 -> (dg_raw with NaN rows where no sequence is,
    per-chunk partial sums of dA_log [chunks, HV] and of dt_bias's gradient [chunks, HV * 128]). lb None: the
    softplus gate -exp(A_log) softplus(gp)."""
    dg = dg.double()
    HV = dg.shape[2]
    A = torch.ones(1, 1, HV, 1, dtype=torch.float64) if A_log is None else A_log.double().exp().view(1, 1, HV, 1)
    gp = g_raw.double() + (0.0 if dt_bias is None else dt_bias.double().view(1, 1, HV, 128))
    s = torch.sigmoid(A * gp) if lb is not None else torch.sigmoid(gp)
    ref = torch.full_like(dg, float("nan"))
    dA, dbias = [], []
    for b, bos, eos in seqs:
        for t0 in range(bos, eos, 64):
            rows = slice(t0, min(t0 + 64, eos))
            dyg = dg[b, rows].flip(0).cumsum(0).flip(0)
            if lb is None:
                d = -dyg * A[0] * s[b, rows]
                dA.append((-dyg * A[0] * torch.nn.functional.softplus(gp[b, rows])).sum((0, 2)))
            else:
                d = dyg * lb * s[b, rows] * (1 - s[b, rows]) * A[0]
                dA.append((d * gp[b, rows]).sum((0, 2)))
            ref[b, rows] = d
            dbias.append(d.sum(0).reshape(-1))
    return ref, torch.stack(dA), torch.stack(dbias)


GATE_CASES = {
    "fixed-tail": dict(B=1, T=100, HV=1),
    "fixed-batch-heads": dict(B=2, T=64, HV=2),
    "varlen-short": dict(B=1, T=86, HV=1, lens=[70, 1, 15]),
}
GATE_FORMS = {  # g_raw dtype, A_log dtype or None, dt_bias dtype or None, lower_bound (None: the softplus gate)
    "bf16-A-bias": (torch.bfloat16, torch.float32, torch.float32, LOWER_BOUND),
    "fp32-noA-bias": (torch.float32, None, torch.float32, LOWER_BOUND),
    "bf16-bf16A-nobias": (torch.bfloat16, torch.bfloat16, None, LOWER_BOUND),
    "softplus-bf16-A-bias": (torch.bfloat16, torch.float32, torch.float32, None),
    "softplus-fp32-bf16A-nobias": (torch.float32, torch.bfloat16, None, None),
}


@pytest.mark.parametrize("case", sorted(GATE_CASES))
@pytest.mark.parametrize("form", sorted(GATE_FORMS))
def test_bwd_gate_emulated_matches_fp64(gate_emulator, case, form):
    """kda_bwd_gate against FLA's chunk_local_cumsum(dg, reverse) + kda_gate_bwd in fp64 on fresh random inputs
    (chunk tails, a 1-token sequence, two heads): dg_raw within its dtype's rounding, the partial sums within fp32's;
    rows past the sequences untouched (NaN stays NaN), every sequence row written. A forward cumsum instead of the
    reverse one fails by O(1)."""
    kw = dict(GATE_CASES[case])
    lens = kw.pop("lens", None)
    B, T, HV = kw["B"], kw["T"], kw["HV"]
    g_dt, a_dt, b_dt, lb = GATE_FORMS[form]
    gen = torch.Generator().manual_seed(len(case) * 7 + len(form))
    dg = torch.randn(B, T, HV, 128, generator=gen)
    g_raw = (torch.randn(B, T, HV, 128, generator=gen) * 2).to(g_dt)
    A_log = None if a_dt is None else (torch.randn(HV, generator=gen) * 0.5).to(a_dt)
    dt_bias = None if b_dt is None else torch.randn(HV * 128, generator=gen).to(b_dt)
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    ci = None if lens is None else chunk_indices_of(lens)
    chunks = B * ((T + 63) // 64) if lens is None else ci.shape[0]
    seqs = ([(b, 0, T) for b in range(B)] if lens is None
            else [(0, int(cu[i]), int(cu[i + 1])) for i in range(len(lens))])
    if lens is not None:
        T = sum(lens)
    dg_raw = torch.full_like(g_raw, float("nan"))
    dA_part = None if A_log is None else torch.full((chunks, HV), float("nan"))
    dbias_part = None if dt_bias is None else torch.full((chunks, HV * 128), float("nan"))

    def ptr(t):
        return ctypes.c_void_p(0 if t is None else t.data_ptr())

    gate_emulator.emu_bwd_gate(ptr(dg), ptr(g_raw), int(g_dt == torch.float32), ptr(A_log),
                               int(a_dt == torch.float32), ptr(dt_bias), int(b_dt == torch.float32), int(lb is None),
                               ctypes.c_float(0.0 if lb is None else lb), ptr(dg_raw), ptr(dA_part), ptr(dbias_part),
                               B, T, HV, chunks, ptr(cu), ptr(ci))
    ref, dA_ref, dbias_ref = gate_bwd_reference(dg, g_raw, A_log, dt_bias, lb, seqs)
    o = dg_raw.double()
    written = ~ref.isnan()
    assert not o[written].isnan().any(), "dg_raw: unwritten entries"
    assert o[~written].isnan().all(), "dg_raw: rows past the sequences written"
    tol = 4e-3 if g_dt == torch.bfloat16 else 1e-6  # dg_raw leaves in g_raw's dtype
    err = rel_rms(o[written], ref[written])
    assert err < tol, f"dg_raw: rel RMS {err:.2e} vs fp64"
    fwd_ref = gate_bwd_reference(dg.flip(1), g_raw.flip(1), A_log, dt_bias, lb, [(b, T - e, T - s) for b, s, e in seqs])
    assert rel_rms(o[written], fwd_ref[0].flip(1)[written]) > 0.1, "the test cannot tell the cumsum's direction"
    for n, got, want in (("dA_part", dA_part, dA_ref), ("dbias_part", dbias_part, dbias_ref)):
        if got is not None:
            err = rel_rms(got.double(), want)
            assert err < 1e-5, f"{n}: rel RMS {err:.2e} vs fp64"


def test_gate_reason(monkeypatch):
    """kda_bwd_gate takes the lower_bound gate and the softplus gate with A_log, chunks of 64, fp32 dg beside a bf16 /
    fp32 gate input of its shape, fp32 / bf16 A_log and dt_bias; anything else names what it is. Past the checks
    this test's stub extension answers (on the CPU the device check comes first, so it is stubbed too)."""
    from fla_cula.ops import kda_bwd

    monkeypatch.setattr(kda_bwd._ext, "available", lambda: (True, ""))
    monkeypatch.setattr(kda_bwd.routing, "device_reason", lambda *t: None)
    dg, g = torch.zeros(1, 64, 2, 128), torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    A_log, dt_bias = torch.zeros(2), torch.zeros(256, dtype=torch.bfloat16)
    assert kda_bwd.gate_reason(dg, g, A_log, dt_bias, -5.0, 64) is None
    assert kda_bwd.gate_reason(dg, g.float(), None, None, -1.0, 64) is None
    assert kda_bwd.gate_reason(dg, g, A_log, dt_bias, None, 64) is None  # the softplus gate
    cases = {
        "without A_log": (dg, g, None, dt_bias, None, 64),
        "lower_bound=0.0": (dg, g, A_log, dt_bias, 0.0, 64),
        "chunk_size=32": (dg, g, A_log, dt_bias, -5.0, 32),
        "dg is torch.bfloat16": (dg.bfloat16(), g, A_log, dt_bias, -5.0, 64),
        "g is torch.float16": (dg, g.half(), A_log, dt_bias, -5.0, 64),
        "A_log is torch.float16": (dg, g, A_log.half(), dt_bias, -5.0, 64),
        "g of shape (1, 64, 2, 64)": (dg, g[..., :64], A_log, dt_bias, -5.0, 64),
        "dg is not contiguous": (dg.transpose(1, 2).contiguous().transpose(1, 2), g, A_log, dt_bias, -5.0, 64),
    }
    for want, args in cases.items():
        got = kda_bwd.gate_reason(*args)
        assert got is not None and want in got, (want, got)
