"""causal_conv1d_update (ShortConvolution's decode step) on the conv kernel, against FLA and an fp64 reference.

Every case: fresh random inputs, strict routing (a fallback fails the test), our output allocations NaN-poisoned
(parity.runner.nan_empty), the inputs other than the cache unchanged, the cache bit-identical to FLA's (the window
is a copy of stored values and x rounded to the cache's dtype), y correctly rounded (within half an ulp of the fp64
reference, plus the fp32 arithmetic's error) and no farther from FLA's y than FLA's own error plus one rounding.
"""

import pytest
import torch
import torch.nn.functional as F

from fla_cula import routing
from fla_cula.ops import conv as ops_conv
from parity.runner import nan_empty

FLA = ops_conv.FLA_CAUSAL_CONV1D_UPDATE


@pytest.fixture(autouse=True)
def _kernel_on(monkeypatch):
    """The op's speed-only fallbacks (unverified kernel, fewer than MIN_KERNEL_SEQS sequences) are off under
    FLA_CULA_FORCE=1, which changes no other routing decision of this op: every case here runs the kernel."""
    monkeypatch.setenv("FLA_CULA_FORCE", "1")
# half an ulp of the output dtype, relative (the rounding of the fp32 result); fp32 itself: ex2.approx, the division
# and the summation order, ~10 ulp. FLA sums the products in its own order (fp16 products in fp16), so its bits may
# differ from ours by a rounding: the bars are ours vs fp64 and ours vs FLA's own error, not bit equality.
MANT = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 16}
FP32_CALC = 2.0 ** -16


def _draw(N, D, W, dtype, cache_dtype, x_form, bias, residual, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, dt=dtype, s=1.0):
        return (s * torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32)).to(dt)

    shape = {"nd": (N, D), "n1d": (N, 1, D), "1nd": (1, N, D), "heads": (N, 1, D // 64, 64)}[x_form]
    x = rnd(*shape)
    cache = rnd(N, D, W, dt=cache_dtype)
    weight = rnd(D, W, s=0.5)
    b = rnd(D, s=0.2) if bias else None
    r = rnd(*shape) if residual else None
    return x, cache, weight, b, r


def _ref(x, cache, weight, bias, residual, silu):
    """fp64: window = [cache[:, :, 1:], x], y = act(window . weight + bias) + residual."""
    N, D, W = cache.shape
    xs = x.double().reshape(N, D)
    win = torch.cat([cache.double()[:, :, 1:], xs[:, :, None]], dim=2)
    y = (win * weight.double()[None]).sum(-1)
    if bias is not None:
        y = y + bias.double()
    if silu:
        y = F.silu(y)
    if residual is not None:
        y = y + residual.double().reshape(N, D)
    return y, win


CASES = [
    # (N, D, W, dtype, cache dtype, x form, bias, residual, activation)
    (1, 2048, 4, torch.bfloat16, torch.bfloat16, "n1d", False, False, "silu"),     # KDA layer, B=1
    (128, 2048, 4, torch.bfloat16, torch.bfloat16, "n1d", False, False, "silu"),   # KDA layer, B=128
    (3, 296, 4, torch.bfloat16, torch.bfloat16, "nd", True, True, "swish"),
    (5, 1024, 3, torch.bfloat16, torch.bfloat16, "1nd", False, True, None),
    (7, 512, 4, torch.bfloat16, torch.bfloat16, "heads", False, False, "silu"),
    (33, 4104, 2, torch.float16, torch.float16, "n1d", True, False, "silu"),
    (4, 520, 4, torch.float32, torch.float32, "nd", True, True, "silu"),
    (9, 256, 4, torch.bfloat16, torch.float32, "n1d", False, False, "silu"),       # fp32 cache, bf16 x
    (2, 64, 1, torch.bfloat16, torch.bfloat16, "n1d", False, False, "silu"),
    (2, 128, 8, torch.float32, torch.bfloat16, "nd", True, False, None),
]


def _id(c):
    N, D, W, dt, cdt, form, b, r, act = c
    return f"N{N}-D{D}-W{W}-{str(dt)[6:]}-c{str(cdt)[6:]}-{form}{'-bias' if b else ''}{'-res' if r else ''}-{act}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_matches_fla_and_fp64(case, strict_mode):
    N, D, W, dtype, cdt, form, bias, residual, act = case
    x, cache, weight, b, r = _draw(N, D, W, dtype, cdt, form, bias, residual, seed=N * 7 + D)
    keep = [t.clone() for t in (x, weight, b, r) if t is not None]
    y_ref, win = _ref(x, cache, weight, b, r, act in ("silu", "swish"))
    c_fla = cache.clone()
    y_fla, _ = FLA(x, c_fla, residual=r, weight=weight, bias=b, activation=act)
    routing.reset_status()
    with nan_empty():
        y, c_out = ops_conv.causal_conv1d_update(x, cache, residual=r, weight=weight, bias=b, activation=act)
    assert routing.status()["causal_conv1d_update"]["kernel"] == 1
    assert c_out is cache and y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(cache, c_fla)
    assert torch.equal(cache.double(), win.to(cdt).double())
    for a, k in zip([t for t in (x, weight, b, r) if t is not None], keep, strict=True):
        assert torch.equal(a, k)
    yf, ff, rf = y.double().reshape(N, D), y_fla.double().reshape(N, D), y_ref
    one = 2.0 ** -MANT[dtype] * rf.abs() + 1e-6
    assert torch.isfinite(yf).all()
    # correctly rounded: within half an ulp of fp64, plus the fp32 arithmetic's own error
    bar = one + FP32_CALC * rf.abs()
    assert ((yf - rf).abs() <= bar).all(), ((yf - rf).abs() / bar).max().item()
    # no farther from FLA than FLA is from fp64, plus one rounding
    assert ((yf - ff).abs() <= (ff - rf).abs() + one).all(), (yf - ff).abs().max().item()
    rel = ((yf - rf).pow(2).mean() / rf.pow(2).mean()).sqrt().item()
    assert rel <= 0.005, rel


def test_steps_follow_fla(strict_mode):
    """Eight consecutive decode steps from one cache: the cache stays equal to FLA's; every y is correctly rounded
    against fp64 and within one bf16 rounding of FLA's (an ulp is at most 2^-7 relative; both round fp32 sums taken
    in different orders)."""
    N, D, W = 16, 2048, 4
    x0, cache, weight, _, _ = _draw(N, D, W, torch.bfloat16, torch.bfloat16, "n1d", False, False, seed=1)
    c_fla = cache.clone()
    for step in range(8):
        x = torch.randn_like(x0, dtype=torch.float32).to(torch.bfloat16)
        y_ref, _ = _ref(x, cache, weight, None, None, True)
        y_fla, _ = FLA(x, c_fla, weight=weight, activation="silu")
        y, _ = ops_conv.causal_conv1d_update(x, cache, weight=weight, activation="silu")
        assert torch.equal(cache, c_fla), step
        d = (y.float() - y_fla.float()).abs()
        assert (d <= 2.0 ** -7 * y_fla.float().abs() + 1e-6).all(), (step, d.max().item())
        err = (y.double().reshape(N, D) - y_ref).abs()
        assert (err <= (2.0 ** -MANT[torch.bfloat16] + FP32_CALC) * y_ref.abs() + 1e-6).all(), step


def test_cuda_graph_replay(strict_mode):
    """Captured once, replayed on new tokens written into the static x: the same results as eager calls."""
    N, D, W = 32, 2048, 4
    x, cache, weight, _, _ = _draw(N, D, W, torch.bfloat16, torch.bfloat16, "n1d", False, False, seed=2)
    ops_conv.causal_conv1d_update(x, cache.clone(), weight=weight, activation="silu")   # load outside the capture
    c_eager = cache.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    c_graph = cache.clone()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        y_static, _ = ops_conv.causal_conv1d_update(x, c_graph, weight=weight, activation="silu")
    torch.cuda.current_stream().wait_stream(s)
    c_graph.copy_(cache)
    for step in range(3):
        x.copy_(torch.randn_like(x, dtype=torch.float32).to(torch.bfloat16))
        g.replay()
        y, _ = ops_conv.causal_conv1d_update(x, c_eager, weight=weight, activation="silu")
        torch.cuda.synchronize()
        assert torch.equal(y_static, y) and torch.equal(c_graph, c_eager), step


@pytest.mark.parametrize("what", ["channels", "cache_strided", "grad", "few_seqs"])
def test_fallbacks_say_why(what, monkeypatch):
    """Calls the kernel does not serve go to FLA with the reason (FLA's result), and raise in strict mode; few_seqs:
    4 sequences, where FLA's kernel is faster (a speed-only fallback: FLA_CULA_FORCE=1 runs ours)."""
    monkeypatch.delenv("FLA_CULA_STRICT", raising=False)
    if what == "few_seqs":
        monkeypatch.delenv("FLA_CULA_FORCE", raising=False)
    N, D, W = 4, 2048 if what != "channels" else 2044, 4
    x, cache, weight, _, _ = _draw(N, D, W, torch.bfloat16, torch.bfloat16, "n1d", False, False, seed=3)
    if what == "cache_strided":
        cache = torch.empty(N, W, D, device="cuda", dtype=torch.bfloat16).copy_(cache.transpose(1, 2)).transpose(1, 2)
    if what == "grad":
        weight.requires_grad_(True)
    c_fla = cache.clone()
    y_fla, _ = FLA(x, c_fla, weight=weight, activation="silu")
    routing.reset_status()
    y, _ = ops_conv.causal_conv1d_update(x, cache, weight=weight, activation="silu")
    fb = routing.status()["causal_conv1d_update"]["fallback"]
    assert len(fb) == 1, fb
    why = {"channels": "multiple of 8", "cache_strided": "cache not contiguous", "grad": "grad",
           "few_seqs": ops_conv.FEW_SEQS}[what]
    assert why in next(iter(fb))
    assert torch.equal(y, y_fla) and torch.equal(cache, c_fla)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLA_CULA_STRICT", "1")
        with pytest.raises(routing.FallbackError):
            ops_conv.causal_conv1d_update(x, cache, weight=weight, activation="silu")


def test_bad_shapes_raise():
    N, D, W = 4, 256, 4
    x, cache, weight, _, _ = _draw(N, D, W, torch.bfloat16, torch.bfloat16, "n1d", False, False, seed=4)
    with pytest.raises(ValueError, match=r"cache shape \(4, 256, 3\): expected \[4, 256, 4\]"):
        ops_conv.causal_conv1d_update(x, cache[:, :, :3].contiguous(), weight=weight, activation="silu")
    with pytest.raises(ValueError, match="residual shape"):
        ops_conv.causal_conv1d_update(x, cache, residual=x[:2], weight=weight, activation="silu")


def test_short_convolution_step_patched(strict_mode):
    """FLA's ShortConvolution decode step (what a KDA layer runs per token), plain and under fla_cula.patch()."""
    from fla.modules import ShortConvolution

    import fla_cula

    torch.manual_seed(5)
    conv = ShortConvolution(hidden_size=2048, kernel_size=4, activation="silu").to("cuda", torch.bfloat16)
    x = torch.randn(8, 1, 2048, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(8, 2048, 4, device="cuda", dtype=torch.bfloat16)
    c_plain = cache.clone()
    was = fla_cula.is_patched()
    fla_cula.unpatch()
    with torch.no_grad():
        y_plain, _ = conv(x, cache=c_plain, output_final_state=True)
        routing.reset_status()
        with fla_cula.patched():
            y, c = conv(x, cache=cache, output_final_state=True)
    if was:
        fla_cula.patch()
    assert routing.status()["causal_conv1d_update"]["kernel"] == 1
    assert torch.equal(c, c_plain)
    assert ((y.float() - y_plain.float()).abs() <= 2.0 ** -8 * y_plain.float().abs() + 1e-6).all()
