"""CPU tests of the conv kernel (causal_conv1d_update): its host checks and compile key; the registry-wide
compile for sm_90a and the PTX check (16-byte vector loads and stores) are tests/test_jit.py's."""

import pytest
import torch

from fla_cula import routing
from fla_cula.kernels import conv_update as cu
from fla_cula.ops import conv as ops_conv


def _args(N=4, D=256, W=4, dtype=torch.bfloat16, form=(None, 1)):
    shape = (N, D) if form[0] == 2 else ((N, 1, D) if form[1] == 1 else (1, N, D))
    return (torch.randn(*shape).to(dtype), torch.randn(N, D, W).to(dtype), None, torch.randn(D, W).to(dtype), None,
            "silu")


def test_check_accepts_fla_layer_call():
    r, cfg = cu.check(*_args())
    assert r is None and cfg == cu.ConvUpdateConfig()
    x, c, _, w, _, _ = _args()
    r, cfg = cu.check(x.view(1, 4, 256), c, None, w, None, "swish")
    assert r is None and (cfg.x_rank, cfg.n_dim, cfg.silu) == (3, 1, True)
    r, cfg = cu.check(x.view(4, 256), c, None, w, torch.randn(256), None)
    assert r is None and (cfg.x_rank, cfg.bias_dtype, cfg.silu) == (2, "float32", False)


@pytest.mark.parametrize("mutate, reason", [
    (lambda a: (a[0], a[1], a[2], None, a[4], a[5]), "weight is None"),
    (lambda a: (a[0], None, a[2], a[3], a[4], a[5]), "cache is None"),
    (lambda a: (a[0][..., :250], a[1][:, :250], a[2], a[3][:250], a[4], a[5]), "a multiple of 8"),
    (lambda a: (a[0], a[1].transpose(1, 2).contiguous().transpose(1, 2), a[2], a[3], a[4], a[5]),
     "cache not contiguous"),
    (lambda a: (a[0], a[1].int(), a[2], a[3], a[4], a[5]), "cache dtype torch.int32"),
    (lambda a: (a[0].view(2, 2, 256), a[1], a[2], a[3], a[4], a[5]), "kernel serves [N, D]"),
    (lambda a: (a[0], torch.randn(4, 256, 9), a[2], torch.randn(256, 9), a[4], a[5]), "kernel width 9"),
    (lambda a: (a[0], a[1], a[0][:2], a[3], a[4], a[5]), "residual shape"),
])
def test_check_reasons(mutate, reason):
    r, cfg = cu.check(*mutate(_args()))
    assert cfg is None and reason in r


def test_flat_x_follows_fla():
    x = torch.randn(3, 1, 4, 64)
    assert cu.flat_x(x, torch.randn(256, 4)).shape == (3, 1, 256)
    assert cu.flat_x(x, torch.randn(64, 4)) is x


def test_config_key_has_no_sizes():
    assert {k for k, _ in cu.ConvUpdateConfig().key()} == {
        "x_dtype", "cache_dtype", "w_dtype", "bias_dtype", "res_dtype", "silu", "W", "x_rank", "n_dim"}


def test_validate_names_expected_and_actual():
    x, c, _, w, _, _ = _args()
    with pytest.raises(ValueError, match=r"cache shape \(4, 256, 3\): expected \[4, 256, 4\]"):
        ops_conv.validate(x, c[:, :, :3], None, w, None, "silu")
    with pytest.raises(ValueError, match=r"bias shape \(255,\): expected \[256\]"):
        ops_conv.validate(x, c, None, w, torch.randn(255), "silu")
    ops_conv.validate(*_args())


@pytest.mark.parametrize("force", [False, True])
def test_cpu_call_goes_to_fla_with_reason(monkeypatch, force):
    """On the CPU: the pending-verification reason (until the GPU tests pass), or under FLA_CULA_FORCE=1 the
    device reason."""
    if force:
        monkeypatch.setenv("FLA_CULA_FORCE", "1")
    else:
        monkeypatch.delenv("FLA_CULA_FORCE", raising=False)
    routing.reset_status()
    x, c, _, w, _, _ = _args(dtype=torch.float32)
    try:
        ops_conv.causal_conv1d_update(x, c, weight=w, activation="silu")
    except Exception as e:  # FLA's Triton kernel needs a GPU: the route is what this test checks
        assert "fla_cula" not in type(e).__module__
    fb = list(routing.status()["causal_conv1d_update"]["fallback"])
    if not force and not ops_conv.KERNEL_VERIFIED:
        assert fb == [ops_conv.UNVERIFIED]
    else:
        assert fb in (["no CUDA device"], ["tensors on cpu, not CUDA"]), fb
