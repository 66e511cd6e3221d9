"""KDA ops with FLA 0.6.0's exact signatures.

Each call validates as FLA does (same exceptions, same messages), decides kernel or FLA
(`fla_cula.routing`), and runs one of them. The FLA functions called on a fallback are the
originals captured when this module was first imported, so patching never loops back here.

- chunk_kda:               our forward + FLA's backward (fla_cula.ops.chunk_autograd) where a forward
                           serves the call: the fused prefill kernel (fla_cula.kernels.kda_prefill) for
                           inference calls on large grids, else FLA with the reason; FLA's forward in our
                           Function with FLA_CULA_STAND_IN=1.
- fused_recurrent_kda:     decode kernel (fla_cula.kernels.kda_decode) where it applies.
- fused_recurrent_kda_fwd: the serving entry point (state pools, indices); same kernel.
"""

from __future__ import annotations

import warnings

import torch
from fla.ops.kda import chunk as _fla_chunk
from fla.ops.kda import fused_recurrent as _fla_fr

from fla_cula import routing
from fla_cula.ops.bounds import check_recurrent_kda_bounds
from fla_cula.ops.chunk_autograd import ChunkKDAFunction, KDAChunkConfig, needs_grad

# FLA's originals (dispatch wrappers included), captured before any patching.
FLA_CHUNK_KDA = _fla_chunk.chunk_kda
FLA_FUSED_RECURRENT_KDA = _fla_fr.fused_recurrent_kda
FLA_FUSED_RECURRENT_KDA_FWD = _fla_fr.fused_recurrent_kda_fwd



def _pop_transpose_state_layout(kwargs: dict, state_v_first: bool) -> bool:
    """FLA's handling of the deprecated alias, with FLA's messages."""
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        warnings.warn(
            "`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
            DeprecationWarning,
            stacklevel=3,
        )
        state_v_first = kwargs.pop("transpose_state_layout")
    return state_v_first


def _check_varlen(q: torch.Tensor, initial_state, cu_seqlens, sep: str = "") -> None:
    """FLA's varlen argument checks with FLA's messages (lightning's has a space after the period: sep=" ")."""
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(
                f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`.{sep}"
                f"Please flatten variable-length inputs before processing.",
            )
        if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
            raise ValueError(
                f"The number of initial states is expected to be equal to the number of input sequences, "
                f"i.e., {len(cu_seqlens) - 1} rather than {initial_state.shape[0]}.",
            )


def _validate_chunk_kda(q, k, v, g, beta, initial_state, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                        allow_neg_eigval, safe_gate, lower_bound, cu_seqlens, kwargs) -> tuple:
    """FLA's chunk_kda argument checks, in FLA's order with FLA's exceptions and messages.
    Returns (A_log, dt_bias, chunk_size) as FLA reads them from kwargs."""
    _check_varlen(q, initial_state, cu_seqlens)
    if initial_state is not None:
        assert initial_state.dtype == torch.float32, "initial_state must be in float32."
    A_log = dt_bias = None
    if use_gate_in_kernel:
        A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
        if A_log is None and lower_bound is None:
            raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set.")
    chunk_size = kwargs.get("chunk_size", 64)
    if chunk_size not in (32, 64):
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError("`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`.")
        if not (-5 <= lower_bound < 0):
            raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}.")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    B, T, H, K, HV = *q.shape, v.shape[2]
    assert q.shape == k.shape, f"q and k must have the same shape, got q={q.shape} vs k={k.shape}"
    assert K <= 256, f"Currently we only support key headdim <=256 for KDA, got {K}."
    assert HV % H == 0, (
        f"For GVA, num_v_heads (HV={HV}) must be evenly divisible by num_qk_heads (H={H}), "
        f"but got HV % H = {HV % H}"
    )
    assert g.shape == (B, T, HV, K), f"g must have shape [B, T, HV, K]={[B, T, HV, K]}, got {list(g.shape)}"
    assert beta.shape == (B, T, HV), f"beta must have shape [B, T, HV]={[B, T, HV]}, got {list(beta.shape)}"
    return A_log, dt_bias, chunk_size


@torch.compiler.disable
def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs,
):
    """FLA's chunk_kda (prefill and training): FLA's checks, then fla_cula's forward with FLA's backward
    (fla_cula.ops.chunk_autograd) where a forward serves the call, else FLA with the reason."""
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
            disable_recompute, return_intermediate_states, state_v_first, cu_seqlens, cu_seqlens_cpu,
            cp_context, use_graph, max_num_seqs)
    if routing.in_fallback():
        return routing.call_fla(FLA_CHUNK_KDA, *args, **kwargs)
    state_v_first = _pop_transpose_state_layout(kwargs, state_v_first)
    args = args[:16] + (state_v_first,) + args[17:]
    if cp_context is not None or not isinstance(q, torch.Tensor):  # FLA's own checks and overrides apply
        routing.record_fallback("chunk_kda", "cp_context: context-parallel KDA stays on FLA"
                                if cp_context is not None else f"q is {type(q).__name__}, not a tensor")
        return routing.call_fla(FLA_CHUNK_KDA, *args, **kwargs)
    A_log, dt_bias, chunk_size = _validate_chunk_kda(
        q, k, v, g, beta, initial_state, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        safe_gate, lower_bound, cu_seqlens, kwargs)
    cfg = KDAChunkConfig(
        scale=float(k.shape[-1] ** -0.5 if scale is None else scale), output_final_state=bool(output_final_state),
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel), use_gate_in_kernel=bool(use_gate_in_kernel),
        use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid_in_kernel), allow_neg_eigval=bool(allow_neg_eigval),
        safe_gate=bool(safe_gate), lower_bound=None if lower_bound is None else float(lower_bound),
        state_v_first=bool(state_v_first), chunk_size=chunk_size, disable_recompute=bool(disable_recompute),
        return_intermediate_states=bool(return_intermediate_states), cp=False, use_graph=bool(use_graph))
    plan_args = (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, cfg)
    fwd = routing.route("chunk_kda", plan_args, (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens))
    if fwd is None:
        return routing.call_fla(FLA_CHUNK_KDA, *args, **kwargs)
    if return_intermediate_states:
        assert torch.is_inference_mode_enabled(), "return_intermediate_states is only allowed in inference mode"
        assert disable_recompute is False, "return_intermediate_states must be used with disable_recompute=False"
        r = fwd(*plan_args, False)
        return r.o.type_as(q), r.final_state, r.h
    if needs_grad(q, k, v, g, beta, A_log, dt_bias, initial_state):
        return ChunkKDAFunction.apply(fwd, cfg, cu_seqlens, cu_seqlens_cpu, q, k, v, g, beta, A_log, dt_bias,
                                      initial_state)
    r = fwd(*plan_args, False)
    return r.o.type_as(q), r.final_state


def fused_recurrent_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    output_final_state: bool = False,
    inplace_final_state: bool = True,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    out: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's fused_recurrent_kda_fwd (what serving engines call), on the decode kernel when it applies.

    Under torch.compile the call is the custom op ``torch.ops.fla_cula.fused_recurrent_kda_fwd``
    (no graph break; routing happens when the op runs), otherwise a plain Python call."""
    args = (q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state, inplace_final_state,
            state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, out)
    if torch.compiler.is_compiling():
        return _fwd_traced(*args)
    return _fwd_eager(args, kwargs)


def _fwd_traced(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state, inplace_final_state,
                state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens, use_qk_l2norm_in_kernel,
                use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, out):
    """What torch.compile sees: FLA's output conventions around one opaque custom op (argument errors
    surface when the op runs, exactly as in eager mode)."""
    if out is None:
        out = torch.zeros_like(v)  # as FLA allocates it
    fs = torch.ops.fla_cula.fused_recurrent_kda_fwd(
        q, k, v, g, beta, A_log, dt_bias, initial_state, k.shape[-1] ** -0.5 if scale is None else float(scale),
        output_final_state, inplace_final_state, state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        None if lower_bound is None else float(lower_bound), out)
    if inplace_final_state:
        return out, initial_state
    return out, (fs if output_final_state else None)


@torch.library.custom_op("fla_cula::fused_recurrent_kda_fwd", mutates_args=("initial_state", "out"))
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, initial_state: torch.Tensor | None,
            scale: float, output_final_state: bool, inplace_final_state: bool, state_v_first: bool,
            cu_seqlens: torch.Tensor | None, ssm_state_indices: torch.Tensor | None,
            num_accepted_tokens: torch.Tensor | None, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
            use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, lower_bound: float | None,
            out: torch.Tensor) -> torch.Tensor:
    """The routed call (kernel or FLA), writing `out` (and the pool when in place). Returns the new final
    state, or an empty tensor when FLA returns none or the pool itself (a custom op may not return an alias)."""
    _, fs = _fwd_eager((q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state,
                        inplace_final_state, state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                        lower_bound, out), {})
    return q.new_empty(0) if fs is None or inplace_final_state else fs


@_fwd_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state, inplace_final_state,
      state_v_first, cu_seqlens, ssm_state_indices, num_accepted_tokens, use_qk_l2norm_in_kernel, use_gate_in_kernel,
      use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, out):
    if inplace_final_state or not output_final_state:
        return q.new_empty(0)
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    HV, K, V = v.shape[2], k.shape[3], v.shape[3]
    return q.new_empty((N, HV, V, K) if state_v_first else (N, HV, K, V), dtype=torch.float32)


def _route_decode(op: str, kargs: tuple):
    """The kernel's (out, final_state), or None after recording the fallback. `kargs`: the decode
    kernel's plan arguments, fused_recurrent_kda_fwd's 21 in order with scale resolved. Arguments with
    which FLA's kernel or ours would address memory outside a tensor raise ValueError first
    (fla_cula.ops.bounds), whichever way the call then goes."""
    go = routing.route(op, kargs, kargs[:5] + (kargs[7], kargs[20]),
                       validate=check_recurrent_kda_bounds)
    return None if go is None else go(kargs)


def _fwd_eager(args: tuple, kwargs: dict):
    """The routed eager call; `args` are fused_recurrent_kda_fwd's 21 named arguments in order."""
    if routing.in_fallback():  # FLA's own fused_recurrent_kda calling its fwd by module global
        return routing.call_fla(FLA_FUSED_RECURRENT_KDA_FWD, *args, **kwargs)
    if args[8] is None:
        args = args[:8] + (args[1].shape[-1] ** -0.5,) + args[9:]
    res = _route_decode("fused_recurrent_kda_fwd", args)
    if res is not None:
        return res
    return routing.call_fla(FLA_FUSED_RECURRENT_KDA_FWD, *args, **kwargs)


@torch.compiler.disable
def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's fused_recurrent_kda (inference recurrence, no autograd), on the decode kernel when it applies."""
    if routing.in_fallback():
        return routing.call_fla(
            FLA_FUSED_RECURRENT_KDA, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
            use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
            lower_bound, state_v_first, cu_seqlens, **kwargs)
    state_v_first = _pop_transpose_state_layout(kwargs, state_v_first)
    _check_varlen(q, initial_state, cu_seqlens)
    if scale is None:
        scale = k.shape[-1] ** -0.5
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    res = _route_decode("fused_recurrent_kda", (
        q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state, False, state_v_first,
        cu_seqlens, None, None, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
        allow_neg_eigval, lower_bound, None))
    if res is not None:
        return res
    return routing.call_fla(
        FLA_FUSED_RECURRENT_KDA, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
        state_v_first, cu_seqlens, **kwargs)
