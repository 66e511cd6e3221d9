"""The lightning-attention backward as three runs of its own forward recurrence (CPU, fp64).

fla_cula.ops.chunk_autograd.lightning_bwd_by_forward (its docstring holds the identity; docs/lightning_prefill.md
"A backward of our own") with fla_cula.reference's fp64 recurrence as the forward, against autograd through
parity.autograd_ref.lightning: the function alone (dense, varlen, K != V) and ChunkLightningFunction end to end
with LIGHTNING_BACKWARD = "forward_runs" (with and without h0 / ht).
"""

import pytest
import torch

from fla_cula.ops.chunk_autograd import lightning_bwd_by_forward
from fla_cula.reference.compare import rel_rms
from fla_cula.reference.lightning import lightning_g_gamma, simple_gla_recurrent
from parity import autograd_ref

F64 = torch.float64


def _reference_run(q, k, v, g_gamma, scale, initial_state, output_final_state, cu_seqlens, reverse=False):
    """The forward as lightning_bwd_by_forward calls it, in fp64 (fla_cula.reference)."""
    return simple_gla_recurrent(q, k, v, g_gamma, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state, reverse=reverse, cu_seqlens=cu_seqlens)


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

    got = lightning_bwd_by_forward(_reference_run, x["q"], x["k"], x["v"], g_gamma, scale, h0, x["do"], dht, cu)
    for name, w, g in zip(("dq", "dk", "dv", "dh0"), want, got, strict=True):
        assert rel_rms(w, g) < 1e-12, (name, rel_rms(w, g))


@pytest.mark.parametrize("with_states", [True, False, "h0"], ids=["h0-ht", "no-states", "h0-only"])
def test_chunk_function_takes_forward_runs(monkeypatch, with_states):
    """ChunkLightningFunction with LIGHTNING_BACKWARD = "forward_runs" and a forward that carries ``run``: its
    gradients are autograd's (fp64 forward on the CPU as the kernel's stand-in), with and without h0 / ht, and
    with h0 but no final state (dh0 from the dv run's state with no dht term)."""
    from fla_cula.ops import chunk_autograd as ca

    monkeypatch.setattr(ca, "LIGHTNING_BACKWARD", "forward_runs")
    gen = torch.Generator().manual_seed(11)
    B, T, H, D = 2, 40, 3, 8
    g_gamma = lightning_g_gamma(H, 1, 4)
    x = {n: torch.randn(B, T, H, D, generator=gen, dtype=F64) for n in ("q", "k", "v", "do")}
    h0 = torch.randn(B, H, D, D, generator=gen, dtype=F64) if with_states else None
    dht = torch.randn(B, H, D, D, generator=gen, dtype=F64) if with_states is True else None
    cfg = ca.LightningChunkConfig(scale=D ** -0.5, output_final_state=with_states is True, chunk_size=64)

    def fwd(q, k, v, g, initial_state, cu_seqlens, cfg, chunk_indices=None):
        return _reference_run(q, k, v, g, cfg.scale, initial_state, cfg.output_final_state, cu_seqlens)
    fwd.run = _reference_run

    def grads(apply):
        leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v")}
        if h0 is not None:
            leaves["h0"] = h0.clone().requires_grad_(True)
        o, ht = apply(leaves)
        loss = (o * x["do"]).sum() + (0 if dht is None else (ht * dht).sum())
        return torch.autograd.grad(loss, list(leaves.values()))

    ours = grads(lambda lv: ca.ChunkLightningFunction.apply(fwd, cfg, None, lv["q"], lv["k"], lv["v"], g_gamma,
                                                             lv.get("h0")))
    want = grads(lambda lv: autograd_ref.lightning(lv["q"], lv["k"], lv["v"], 1, 4, scale=cfg.scale,
                                                   initial_state=lv.get("h0"), reverse=False, cu_seqlens=None))
    for w, g in zip(want, ours, strict=True):
        assert rel_rms(w, g) < 1e-12, rel_rms(w, g)
