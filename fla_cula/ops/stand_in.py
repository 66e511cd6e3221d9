"""Stand-in forwards: FLA 0.6.0's own chunk forwards behind the plan interface of a prefill kernel.

Registered in ``fla_cula.kernels.registry`` for the chunk ops that have no kernel yet and taken only
with ``FLA_CULA_STAND_IN=1``: the call then runs through fla_cula's routing, its autograd Function
and FLA's backward, with FLA's forward computing exactly what FLA's Function computes (same
functions, same order), so gradients must be bit-identical to plain FLA's. Calls are counted as
``stand_in``. Context parallelism and FLA's graph-capture varlen path stay on FLA.
"""

from __future__ import annotations

from fla.modules.norm.l2norm import l2norm_fwd
from fla.ops.common.gate import fused_beta_sigmoid
from fla.ops.kda.chunk_fwd import chunk_kda_fwd
from fla.ops.simple_gla.chunk import chunk_simple_gla_fwd
from fla.ops.utils import prepare_chunk_indices
from fla.ops.utils.constant import RCP_LN2
from fla.utils import input_guard

from fla_cula.ops.chunk_autograd import KDAChunkConfig, KDAForward, LightningChunkConfig


@input_guard  # as FLA's Function: contiguous inputs, the inputs' device current
def _kda_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
                 cfg: KDAChunkConfig, need_grad: bool) -> KDAForward:
    """FLA's ChunkKDAFunction.forward body (l2norm, beta sigmoid, chunk indices, chunk_kda_fwd)."""
    q_rstd = k_rstd = None
    if cfg.use_qk_l2norm_in_kernel:
        q, q_rstd = l2norm_fwd(q)
        k, k_rstd = l2norm_fwd(k)
    if cfg.use_beta_sigmoid_in_kernel:
        beta = fused_beta_sigmoid(x=beta, scale=2.0 if cfg.allow_neg_eigval else 1.0)
    chunk_indices = None
    if cu_seqlens is not None:
        chunk_indices = prepare_chunk_indices(cu_seqlens=cu_seqlens, chunk_size=cfg.chunk_size,
                                              cu_seqlens_cpu=cu_seqlens_cpu)
    (o, final_state, g_cumsum, Aqk, Akk, w, u, qg, kg, v_new, h, initial_state) = chunk_kda_fwd(
        q=q, k=k, v=v, g=g, beta=beta, scale=cfg.scale, initial_state=initial_state,
        output_final_state=cfg.output_final_state, state_v_first=cfg.state_v_first, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices, chunk_size=cfg.chunk_size,
        safe_gate=cfg.safe_gate, lower_bound=cfg.lower_bound, use_gate_in_kernel=cfg.use_gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, disable_recompute=cfg.disable_recompute,
        return_intermediate_states=cfg.return_intermediate_states, cp_context=None, use_graph=False,
        chunk_offsets=None)
    return KDAForward(o, final_state, q, q_rstd, k, k_rstd, beta, g_cumsum, Aqk, Akk, w, u, qg, kg, v_new, h,
                      initial_state, chunk_indices, None)


def plan_chunk_kda(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
                   cfg: KDAChunkConfig):
    """(reason, None) or (None, forward) for routing.route."""
    if cfg.cp:
        return "cp_context: context-parallel KDA stays on FLA", None
    if cfg.use_graph:
        return "use_graph: FLA's fixed-shape varlen path stays on FLA", None
    return None, _kda_forward


@input_guard
def _lightning_forward(q, k, v, g_gamma, initial_state, cu_seqlens, cfg: LightningChunkConfig, chunk_indices):
    """FLA's ChunkSimpleGLAFunction.forward body for g=None (lightning's case)."""
    if cu_seqlens is not None and chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, cfg.chunk_size)
    return chunk_simple_gla_fwd(q=q, k=k, v=v, g=None, g_gamma=g_gamma * RCP_LN2, scale=cfg.scale,
                                initial_state=initial_state, output_final_state=cfg.output_final_state,
                                cu_seqlens=cu_seqlens, chunk_size=cfg.chunk_size, chunk_indices=chunk_indices,
                                state_v_first=False)


def plan_chunk_lightning_attn(q, k, v, g_gamma, initial_state, cu_seqlens, cfg: LightningChunkConfig):
    return None, _lightning_forward
