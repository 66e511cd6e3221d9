"""The lightning-attention backward as three runs of its own forward recurrence (CPU, fp64).

The design fact behind issue 17's backward plan (docs/lightning_prefill.md "A backward of our own"): for
S_t = gamma S_{t-1} + k_t v_t^T, o_t = scale S_t^T q_t (S_{-1} = h0, final state S_{T-1}), with upstream
gradients do and dht, and D_t = dL/dS_t = scale q_t do_t^T + gamma D_{t+1} (D_{T-1} = scale q do^T + dht):

    dq  = forward(q=do, k=v, v=k, h0=h0^T, scale)                      S' = S^T, o' = scale S do
    dk  = forward(q=v, k=do, v=scale q, h0=(dht / gamma)^T, reverse)   S' = D^T, o' = D v
    dv  = forward(q=k, k=scale q, v=do, h0=dht / gamma, reverse)       S' = D,   o' = D^T k
    dh0 = gamma x (final state of the dv run)                          = gamma D_0

so a backward kernel is the forward kernel run forwards once and backwards once (dk and dv share D). The
h0 = dht / gamma form makes the reversed run's first token see D_{T-1} = scale q do^T + dht under the
forward's convention S_0 = gamma h0 + k_0 v_0^T. This checks the identity against autograd through
parity.autograd_ref.lightning (fp64), with fla_cula.reference's recurrence as the forward runs, varlen included.
"""

import pytest
import torch

from fla_cula.reference.compare import rel_rms
from fla_cula.reference.lightning import lightning_g_gamma, simple_gla_recurrent
from parity import autograd_ref

F64 = torch.float64


def _backward_by_forward_runs(q, k, v, g_gamma, scale, h0, do, dht, cu_seqlens):
    gamma = torch.exp(g_gamma.to(F64))[None, :, None, None]          # [1, H, 1, 1]
    run = dict(g_gamma=g_gamma, cu_seqlens=cu_seqlens)
    dq, _ = simple_gla_recurrent(do, v, k, scale=scale, initial_state=h0.transpose(-1, -2), **run)
    d_init = dht / gamma
    dk, _ = simple_gla_recurrent(v, do, scale * q, scale=1.0, initial_state=d_init.transpose(-1, -2), reverse=True,
                                 **run)
    dv, D0 = simple_gla_recurrent(k, scale * q, do, scale=1.0, initial_state=d_init, reverse=True, **run)
    return dq, dk, dv, gamma * D0


@pytest.mark.parametrize("lens", [None, (0, 37, 100, 164)], ids=["dense", "varlen"])
@pytest.mark.parametrize("layer", [0, 5])
def test_backward_is_three_forward_runs(lens, layer):
    gen = torch.Generator().manual_seed(7 + layer)
    H, K, V = 4, 16, 8
    B, T = (2, 50) if lens is None else (1, lens[-1])
    cu = None if lens is None else torch.tensor(lens, dtype=torch.int64)
    N = B if cu is None else len(lens) - 1
    g_gamma = lightning_g_gamma(H, layer, 6)           # per-head log decay, down to -6 (gamma ~ 2.5e-3)
    x = {n: torch.randn(B, T, H, D, generator=gen, dtype=F64) for n, D in (("q", K), ("k", K), ("v", V), ("do", V))}
    h0 = torch.randn(N, H, K, V, generator=gen, dtype=F64)
    dht = torch.randn(N, H, K, V, generator=gen, dtype=F64)
    scale = K ** -0.5

    leaves = {n: t.clone().requires_grad_(True) for n, t in (("q", x["q"]), ("k", x["k"]), ("v", x["v"]), ("h0", h0))}
    o, ht = autograd_ref.lightning(leaves["q"], leaves["k"], leaves["v"], layer, 6, scale=scale,
                                   initial_state=leaves["h0"], reverse=False, cu_seqlens=cu)
    loss = (o * x["do"]).sum() + (ht * dht).sum()
    want = torch.autograd.grad(loss, [leaves[n] for n in ("q", "k", "v", "h0")])

    got = _backward_by_forward_runs(x["q"], x["k"], x["v"], g_gamma, scale, h0, x["do"], dht, cu)
    for name, w, g in zip(("dq", "dk", "dv", "dh0"), want, got, strict=True):
        assert rel_rms(w, g) < 1e-12, (name, rel_rms(w, g))
