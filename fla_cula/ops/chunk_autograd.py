"""Training path of the chunk ops: fla_cula's forward, FLA 0.6.0's backward.

Each Function takes the forward to run (a plan from ``fla_cula.routing.route``: our kernel, or FLA's
own forward as the stand-in) and saves exactly what FLA's backward reads, so that the backward is
FLA's (``chunk_simple_gla_bwd`` for lightning; for KDA ``fla_cula.ops.kda_bwd.chunk_kda_bwd``: FLA's
chunk_kda_bwd step for step, its chunk-local gradient step on fla_cula's kernel where it applies).
Both Functions keep FLA's decorators (``input_guard``: contiguous inputs and the
inputs' device; ``autocast_custom_fwd/bwd``), so autocast and device handling match FLA's.

What FLA's backward reads (fla/ops/kda/chunk.py ChunkKDAFunction, chunk_bwd.py), per op:

chunk_kda (``KDAForward``; with ``disable_recompute=False``, FLA's default, w/u/qg/kg/v_new/h are None
and recomputed in backward, and g_cumsum is None when the gate is computed in kernel):
  q, k          [B,T,H,K] input dtype, l2-normalized when use_qk_l2norm_in_kernel
  q_rstd, k_rstd [B,T,H] fp32, 1/sqrt(sum x^2 + 1e-6), for l2norm_bwd (None without in-kernel l2norm)
  beta          [B,T,HV] fp32 after the sigmoid (x2 with allow_neg_eigval); the raw beta is the input
  g_cumsum      [B,T,HV,K] fp32 chunk-local cumsum in log2 units; None when the gate is in kernel
  Aqk           [B,T,HV,BT] k dtype, scale * q_i exp2(g_i - g_j) k_j for j <= i (upper triangle unread)
  Akk           [B,T,HV,BT] k dtype, (I + strict-lower beta_i k_i exp2(g_i - g_j) k_j)^-1, zero above
  initial_state as returned by FLA's forward; chunk_indices / chunk_offsets for varlen
  plus the inputs v, g (raw), beta (raw), A_log, dt_bias, cu_seqlens.
chunk_lightning_attn: q, k, v, g_gamma * (1/ln2) (fp32 [H]), initial_state, chunk_indices (varlen);
  h is recomputed in backward, so a forward writes only o and the final state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from fla.ops.common.gate import fused_beta_sigmoid_bwd
from fla.ops.simple_gla.chunk import chunk_simple_gla_bwd
from fla.ops.utils import prepare_chunk_indices
from fla.ops.utils.constant import RCP_LN2
from fla.utils import autocast_custom_bwd, autocast_custom_fwd, input_guard

from fla_cula.ops.kda_bwd import chunk_kda_bwd


@dataclass(frozen=True)
class KDAChunkConfig:
    """chunk_kda's non-tensor arguments (scale resolved); part of the routing memo key."""

    scale: float
    output_final_state: bool
    use_qk_l2norm_in_kernel: bool
    use_gate_in_kernel: bool
    use_beta_sigmoid_in_kernel: bool
    allow_neg_eigval: bool
    safe_gate: bool
    lower_bound: float | None
    state_v_first: bool
    chunk_size: int
    disable_recompute: bool
    return_intermediate_states: bool
    cp: bool          # a cp_context was given (context-parallel training)
    use_graph: bool   # FLA's fixed-shape varlen chunk list for graph capture


class KDAForward(NamedTuple):
    """What a chunk_kda forward returns: the outputs, then what FLA's backward reads (None where the
    backward recomputes it or where no grad is needed)."""

    o: torch.Tensor
    final_state: torch.Tensor | None
    q: torch.Tensor | None = None
    q_rstd: torch.Tensor | None = None
    k: torch.Tensor | None = None
    k_rstd: torch.Tensor | None = None
    beta: torch.Tensor | None = None
    g_cumsum: torch.Tensor | None = None
    Aqk: torch.Tensor | None = None
    Akk: torch.Tensor | None = None
    w: torch.Tensor | None = None
    u: torch.Tensor | None = None
    qg: torch.Tensor | None = None
    kg: torch.Tensor | None = None
    v_new: torch.Tensor | None = None
    h: torch.Tensor | None = None  # chunk-start states: saved (disable_recompute) or returned (intermediate)
    initial_state: torch.Tensor | None = None
    chunk_indices: torch.Tensor | None = None
    chunk_offsets: torch.Tensor | None = None


class ChunkKDAFunction(torch.autograd.Function):
    """forward: ``fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, cfg,
    need_grad=True) -> KDAForward``; backward: FLA 0.6.0's ChunkKDAFunction.backward, step for step."""

    @staticmethod
    @input_guard
    @autocast_custom_fwd
    def forward(ctx, fwd, cfg: KDAChunkConfig, cu_seqlens, cu_seqlens_cpu, q, k, v, g, beta, A_log, dt_bias,
                initial_state):
        r = fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, cfg, True)
        ctx.save_for_backward(r.q, r.q_rstd, r.k, r.k_rstd, v, r.g_cumsum, g, beta, r.beta, A_log, dt_bias,
                              r.Aqk, r.Akk, r.w, r.u, r.qg, r.kg, r.v_new, r.h, r.initial_state, cu_seqlens,
                              r.chunk_indices, r.chunk_offsets)
        ctx.cfg = cfg
        return r.o.type_as(r.q), r.final_state

    @staticmethod
    @input_guard
    @autocast_custom_bwd
    def backward(ctx, do, dht):
        (q, q_rstd, k, k_rstd, v, g_cumsum, g_input, beta_raw, beta, A_log, dt_bias, Aqk, Akk, w, u, qg, kg,
         v_new, h, initial_state, cu_seqlens, chunk_indices, chunk_offsets) = ctx.saved_tensors
        cfg: KDAChunkConfig = ctx.cfg
        dq, dk, dv, db, dg, dh0, dA, dbias = chunk_kda_bwd(
            q=q, k=k, v=v, beta=beta, Aqk=Aqk, Akk=Akk, scale=cfg.scale, initial_state=initial_state, do=do,
            dht=dht, g=g_cumsum, g_org=g_input if cfg.use_gate_in_kernel else None,
            state_v_first=cfg.state_v_first, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
            chunk_size=cfg.chunk_size, safe_gate=cfg.safe_gate, lower_bound=cfg.lower_bound,
            use_gate_in_kernel=cfg.use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
            disable_recompute=cfg.disable_recompute, w=w, u=u, qg=qg, kg=kg, v_new=v_new, h=h,
            chunk_offsets=chunk_offsets, q_rstd=q_rstd, k_rstd=k_rstd)  # with the rstds: dq, dk w.r.t. raw q, k
        if cfg.use_beta_sigmoid_in_kernel:
            db = fused_beta_sigmoid_bwd(x=beta_raw, dy=db, scale=2.0 if cfg.allow_neg_eigval else 1.0)
        return (None, None, None, None, dq.to(q), dk.to(k), dv.to(v), dg.to(g_input), db.to(beta_raw), dA, dbias,
                dh0)


@dataclass(frozen=True)
class LightningChunkConfig:
    """chunk_lightning_attn's non-tensor arguments (scale resolved; chunk_size as FLA's backward uses it)."""

    scale: float
    output_final_state: bool
    chunk_size: int


# The lightning backward: "forward_runs" (the default), the recurrence run forwards once and backwards twice by
# our forward kernel (lightning_bwd_by_forward), or "fla", FLA's chunk_simple_gla_bwd. H200, session 14
# (docs/lightning_prefill.md): fwd+bwd B2 T8192 H64 1.584 ms vs FLA 3.716 (with FLA's backward 3.293), peak
# 1,056 MiB vs 3,088; B8 T4096 3.265 vs 7.233 ms; gradients within parity's rules vs fp64 autograd
# (tests/gpu/test_lightning_prefill.py::test_backward_by_forward_runs).
LIGHTNING_BACKWARD = "forward_runs"


def lightning_bwd_by_forward(run, q, k, v, g_gamma, scale, h0, do, dht, cu_seqlens):
    """(dq, dk, dv, dh0) of S_t = gamma S_{t-1} + k_t v_t^T, o_t = scale S_t^T q_t from three forward runs
    (docs/lightning_prefill.md "A backward of our own"). run(q, k, v, g_gamma, scale, initial_state,
    output_final_state, cu_seqlens, reverse=False) -> (o, final_state or None) is the forward, g_gamma its
    natural-log decay [H]; reverse=True runs each sequence last token to first (FLA's reverse). With
    D_t = dL/dS_t = scale q_t do_t^T + gamma D_{t+1} (D_{T-1} = scale q do^T + dht):
        dq = forward(do, v, k; h0^T)                      its state is S^T: o = scale S do
        dk = forward(v, do, q; E^T), reversed             scale x its state is D^T: o = D v
        dv = forward(k, q, do; E), reversed               scale x its state is D: o = D^T k
        dh0 = gamma scale x the dv run's final state      (= gamma D_0)
    with E = dht / (gamma scale), which the reversed run's first token decays to dht / scale."""
    wdt = torch.promote_types(do.dtype if dht is None else dht.dtype, torch.float32)   # fp32 (fp64 in tests)
    gamma = torch.exp(g_gamma.to(wdt)).view(1, -1, 1, 1)
    dq, _ = run(do, v, k, g_gamma, scale, None if h0 is None else h0.transpose(-1, -2).contiguous(), False,
                cu_seqlens)
    e = None if dht is None else dht.to(wdt) / (gamma * scale)
    dk, _ = run(v, do, q, g_gamma, scale, None if e is None else e.transpose(-1, -2).contiguous(), False, cu_seqlens,
                reverse=True)
    dv, d0 = run(k, q, do, g_gamma, scale, e, h0 is not None, cu_seqlens, reverse=True)
    return dq, dk, dv, None if h0 is None else d0 * (gamma * scale)


class ChunkLightningFunction(torch.autograd.Function):
    """forward: ``fwd(q, k, v, g_gamma, initial_state, cu_seqlens, cfg, chunk_indices) -> (o, final_state)``
    with g_gamma the natural-log decay [H]; backward: FLA 0.6.0's ChunkSimpleGLAFunction.backward for
    g=None (lightning's case), with g_gamma in log2 units as FLA saves it, or (LIGHTNING_BACKWARD
    "forward_runs", for a forward that carries its kernel's ``run``, K = V: the runs swap the roles of q, k and
    v) lightning_bwd_by_forward."""

    @staticmethod
    @input_guard
    @autocast_custom_fwd
    def forward(ctx, fwd, cfg: LightningChunkConfig, cu_seqlens, q, k, v, g_gamma, initial_state):
        chunk_indices = None if cu_seqlens is None else prepare_chunk_indices(cu_seqlens, cfg.chunk_size)
        o, ht = fwd(q, k, v, g_gamma, initial_state, cu_seqlens, cfg, chunk_indices)
        ctx.save_for_backward(q, k, v, g_gamma * RCP_LN2, initial_state, chunk_indices, g_gamma)
        ctx.cfg, ctx.cu_seqlens, ctx.run = cfg, cu_seqlens, getattr(fwd, "run", None)
        return o.to(q.dtype), ht

    @staticmethod
    @input_guard
    @autocast_custom_bwd
    def backward(ctx, do, dht):
        cfg: LightningChunkConfig = ctx.cfg
        q, k, v, g_gamma_log2, initial_state, chunk_indices, g_gamma = ctx.saved_tensors
        if LIGHTNING_BACKWARD == "forward_runs" and ctx.run is not None and q.shape[-1] == v.shape[-1]:
            dq, dk, dv, dh0 = lightning_bwd_by_forward(ctx.run, q, k, v, g_gamma, cfg.scale, initial_state, do, dht,
                                                       ctx.cu_seqlens)
        else:
            dq, dk, dv, _, dh0 = chunk_simple_gla_bwd(
                q=q, k=k, v=v, g=None, g_gamma=g_gamma_log2, initial_state=initial_state, do=do, dht=dht,
                scale=cfg.scale, cu_seqlens=ctx.cu_seqlens, chunk_size=cfg.chunk_size, chunk_indices=chunk_indices,
                state_v_first=False)
        return None, None, None, dq.to(q), dk.to(k), dv.to(v), None, dh0


def needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
