"""fla_cula.ops.bounds (CPU): every argument combination whose shapes make FLA's recurrent KDA kernel
(or ours) address memory outside a tensor raises ValueError naming expected and actual; every valid
serving call of the GPU tests and the parity grid passes.

The check reads metadata only, so small head dims and CPU (or meta) tensors stand for any call.
"""

import os

import pytest
import torch

from fla_cula.ops.bounds import check_recurrent_kda_bounds

K = V = 16
H = HV = 2


def _acts(B, T, H=H, HV=HV, dev="cpu"):
    q = torch.zeros(B, T, H, K, device=dev)
    return dict(q=q, k=q.clone(), v=torch.zeros(B, T, HV, V, device=dev), g=torch.zeros(B, T, HV, K, device=dev),
                beta=torch.zeros(B, T, HV, device=dev))


def _pool(P, HV=HV, vf=False):
    return torch.zeros(P, HV, V, K) if vf else torch.zeros(P, HV, K, V)


def _check(**kw):
    check_recurrent_kda_bounds(**kw)


def _serve(B, T, idx, P=8, cu=None, na=None, **kw):
    """A serving call: state pool updated in place through ssm_state_indices."""
    return dict(_acts(B, T), initial_state=_pool(P), inplace_final_state=True, cu_seqlens=cu,
                ssm_state_indices=idx, num_accepted_tokens=na, **kw)


# ---------------------------------------------------------------------------------------------
# the issue's case and the other index-table layouts
def test_issue_case_1d_indices_varlen_multi_token():
    """cu_seqlens [0, 2, 4, 6], a pool of 8, 1-D indices [5, 1, 7]: FLA reads indices[n + t] up to [3]."""
    kw = _serve(1, 6, torch.tensor([5, 1, 7], dtype=torch.int32), P=8, cu=torch.tensor([0, 2, 4, 6]))
    with pytest.raises(ValueError, match=r"1-D ssm_state_indices: .*3 sequences, 6 tokens in all.*expected a table "
                                         r"spanning at least 6 elements, got shape \(3,\)"):
        _check(**kw)


def test_1d_indices_fixed_length_multi_token():
    with pytest.raises(ValueError, match=r"1-D ssm_state_indices: .*3 sequences x T=2 tokens.*spanning at least 4 "
                                         r"elements, got shape \(3,\)"):
        _check(**_serve(3, 2, torch.tensor([5, 1, 7])))


def test_1d_indices_fewer_than_sequences():
    with pytest.raises(ValueError, match=r"1-D ssm_state_indices: expected one slot per sequence, at least 4 "
                                         r"entries, got shape \(3,\)"):
        _check(**_serve(4, 1, torch.tensor([5, 1, 7])))


def test_1d_indices_expanded_view():
    """A stride-0 table: FLA reads entry n * 0 + t, past the one element for t >= 1."""
    with pytest.raises(ValueError, match=r"spanning at least 2 elements, got shape \(3,\) stride \(0,\) spanning 1"):
        _check(**_serve(3, 2, torch.tensor([1]).expand(3)))


def test_1d_indices_in_bounds_multi_token_layouts_pass():
    """FLA's per-token slot layout indices[n + t] where it stays inside the table."""
    _check(**_serve(1, 4, torch.tensor([0, 1, 2, 3])))                        # one sequence, a slot per token
    _check(**_serve(3, 2, torch.tensor([0, 1, 2, 3])))                        # N + T - 1 entries
    _check(**_serve(1, 4, torch.tensor([0, 1, 2, 3]), cu=torch.tensor([0, 4])))
    _check(**_serve(4, 1, torch.tensor([0, 1, 2, 3]), cu=torch.tensor([0, 1, 2, 3, 4])))


def test_1d_indices_only_read_without_inplace():
    """inplace_final_state=False, one token per sequence: only the read slot indices[n] is used."""
    kw = _serve(3, 1, torch.tensor([5, 1, 7]))
    _check(**dict(kw, inplace_final_state=False, output_final_state=True))


def test_2d_indices_narrower_than_T():
    with pytest.raises(ValueError, match=r"2-D ssm_state_indices: expected a slot per token, \[N=2, Tmax >= T=4\], "
                                         r"got shape \(2, 3\)"):
        _check(**_serve(2, 4, torch.zeros(2, 3, dtype=torch.int32)))


def test_2d_indices_fewer_rows_than_sequences():
    with pytest.raises(ValueError, match=r"2-D ssm_state_indices: expected \[N=3, Tmax\].*got shape \(2, 4\)"):
        _check(**_serve(1, 6, torch.zeros(2, 4, dtype=torch.int32), cu=torch.tensor([0, 2, 4, 6])))


def test_2d_indices_no_columns():
    with pytest.raises(ValueError, match=r"expected at least one column, got shape \(2, 0\)"):
        _check(**_serve(1, 2, torch.zeros(2, 0, dtype=torch.int32), cu=torch.tensor([0, 1, 2])))


def test_2d_indices_token_stride():
    """FLA steps tokens by one element: a transposed table addresses other rows' entries and past the end."""
    with pytest.raises(ValueError, match=r"expected stride\(1\) == 1, got shape \(2, 4\) stride \(1, 2\)"):
        _check(**_serve(2, 4, torch.zeros(4, 2, dtype=torch.int32).t()))


def test_indices_3d():
    with pytest.raises(ValueError, match=r"ssm_state_indices: expected \[N\] or \[N, Tmax\], got shape \(2, 2, 1\)"):
        _check(**_serve(2, 2, torch.zeros(2, 2, 1, dtype=torch.int32)))


def test_num_accepted_tokens_shorter_than_sequences():
    kw = _serve(3, 2, torch.zeros(3, 2, dtype=torch.int32), na=torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"num_accepted_tokens: expected one entry per sequence, \[3\], "
                                         r"got shape \(2,\)"):
        _check(**kw)


def test_num_accepted_tokens_expanded():
    kw = _serve(3, 2, torch.zeros(3, 2, dtype=torch.int32), na=torch.ones(1, dtype=torch.int32).expand(3))
    with pytest.raises(ValueError, match=r"num_accepted_tokens: the kernel addresses 3 elements .* spanning 1"):
        _check(**kw)


def test_pool_without_slots():
    kw = dict(_serve(2, 1, torch.tensor([0, 1])), initial_state=_pool(0))
    with pytest.raises(ValueError, match=r"needs at least one slot, got shape \(0, 2, 16, 16\)"):
        _check(**kw)


def test_pool_heads_overlap():
    """Heads closer than K * V apart: FLA still reads head hv at hv * K * V, past the last slot's end."""
    pool = torch.zeros(8 * HV * K * V).as_strided((8, HV, K, V), (HV * K * V, K * V // 2, V, 1))
    kw = dict(_serve(2, 1, torch.tensor([0, 1])), initial_state=pool)
    with pytest.raises(ValueError, match=r"initial_state: the kernel addresses 4096 elements \(slot \* stride\(0\) "
                                         r"\+ 512 for each of its 8 slots\) .*spanning 3968"):
        _check(**kw)


def test_pool_not_inplace_multi_token():
    """FLA writes token t's state to final_state[bos + t] of an [N, ...] buffer."""
    kw = dict(_serve(2, 3, torch.zeros(2, 3, dtype=torch.int32)), inplace_final_state=False, output_final_state=True)
    with pytest.raises(ValueError, match=r"expected at most 2 tokens, got B \* T = 6"):
        _check(**kw)


def test_pool_not_inplace_without_final_state():
    kw = dict(_serve(2, 1, torch.tensor([0, 1])), inplace_final_state=False, output_final_state=False)
    with pytest.raises(ValueError, match=r"expected output_final_state=True, got False"):
        _check(**kw)


# ---------------------------------------------------------------------------------------------
# sequences vs states (no pool)
def test_cu_seqlens_more_sequences_than_states():
    kw = dict(_acts(1, 6), initial_state=_pool(2), inplace_final_state=True, cu_seqlens=torch.tensor([0, 2, 4, 6]))
    with pytest.raises(ValueError, match=r"initial_state: expected 3 states \(cu_seqlens has 4 entries\), "
                                         r"got shape \(2, 2, 16, 16\)"):
        _check(**kw)


def test_batch_more_sequences_than_states():
    kw = dict(_acts(4, 1), initial_state=_pool(2), inplace_final_state=False, output_final_state=True)
    with pytest.raises(ValueError, match=r"initial_state: expected 4 states \(batch B=4\), got shape \(2, 2, 16, 16\)"):
        _check(**kw)


def test_states_expanded():
    """FLA reads state n at n * HV * K * V, whatever the stride."""
    kw = dict(_acts(3, 1), initial_state=_pool(1).expand(3, HV, K, V), inplace_final_state=False)
    with pytest.raises(ValueError, match=r"initial_state: the kernel addresses 1536 elements"):
        _check(**kw)


@pytest.mark.parametrize("vf", [False, True], ids=["kv", "vk"])
def test_state_inner_shape(vf):
    kw = dict(_acts(2, 1), v=torch.zeros(2, 1, HV, 2 * V), initial_state=torch.zeros(2, HV, K, V),
              state_v_first=vf, inplace_final_state=False)
    want = r"\[2, 2, 32, 16\]" if vf else r"\[2, 2, 16, 32\]"
    with pytest.raises(ValueError, match=rf"initial_state: expected {want} .*got shape \(2, 2, 16, 16\)"):
        _check(**kw)


def test_cu_seqlens_shapes():
    base = dict(_acts(1, 2), initial_state=None, inplace_final_state=False)
    with pytest.raises(ValueError, match=r"cu_seqlens: expected \[N \+ 1\] with N >= 0, got shape \(1, 3\)"):
        _check(**base, cu_seqlens=torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match=r"cu_seqlens: expected \[N \+ 1\] with N >= 0, got shape \(0,\)"):
        _check(**base, cu_seqlens=torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"cu_seqlens: the kernel addresses 3 elements .*spanning 1"):
        _check(**base, cu_seqlens=torch.zeros(1, dtype=torch.long).expand(3))


# ---------------------------------------------------------------------------------------------
# activations and gate parameters
@pytest.mark.parametrize("name, bad, match", [
    ("q", torch.zeros(2, 1, H, 2 * K), r"q: expected shape \(2, 1, 2, 16\) \(that of k\), got \(2, 1, 2, 32\)"),
    ("v", torch.zeros(2, 2, HV, V), r"v: expected \[2, 1, HV, V\], got shape \(2, 2, 2, 16\)"),
    ("v", torch.zeros(2, 1, 3, V), r"v heads: expected a multiple of the 2 q/k heads \(GVA\), got HV=3"),
    ("g", torch.zeros(2, 1, HV, K // 2), r"g: expected shape \(2, 1, 2, 16\), got \(2, 1, 2, 8\)"),
    ("beta", torch.zeros(2, 1, HV, 1), r"beta: expected shape \(2, 1, 2\) \(or headwise \(2, 1, 2, 16\)\), "
                                       r"got \(2, 1, 2, 1\)"),
    ("beta", torch.zeros(1, 1, 1).expand(2, 1, HV), r"beta: the kernel addresses 4 elements .* spanning 1"),
    ("k", torch.zeros(2, 1, H * K), r"k: expected \[B, T, H, K\], got shape \(2, 1, 32\)"),
], ids=["q_shape", "v_tokens", "v_heads", "g_shape", "beta_shape", "beta_expanded", "k_3d"])
def test_activation_shapes(name, bad, match):
    kw = dict(_acts(2, 1), initial_state=None, inplace_final_state=False)
    kw[name] = bad
    with pytest.raises(ValueError, match=match):
        _check(**kw)


def test_out_expanded():
    kw = dict(_acts(2, 1), initial_state=None, inplace_final_state=False,
              out=torch.zeros(1, 1, 1, V).expand(2, 1, HV, V))
    with pytest.raises(ValueError, match=r"out: the kernel addresses 64 elements .* spanning 16"):
        _check(**kw)


def test_out_of_another_shape_is_left_to_fla_assertion():
    """FLA asserts out.shape == v.shape before launching: the same AssertionError as FLA's (under
    python -O, where the assertion is gone, the check raises ValueError instead)."""
    _check(**dict(_acts(2, 1), initial_state=None, inplace_final_state=False, out=torch.zeros(2, 1, HV, V + 1)))


def test_gate_parameters():
    kw = dict(_acts(2, 1), initial_state=None, inplace_final_state=False, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match=r"A_log: the kernel addresses 2 elements \(one per value head, HV=2\)"):
        _check(**kw, A_log=torch.zeros(1))
    with pytest.raises(ValueError, match=r"dt_bias: the kernel addresses 32 elements \(HV \* K = 2 x 16\) .*"
                                         r"got shape \(2,\)"):
        _check(**kw, A_log=torch.zeros(HV), dt_bias=torch.zeros(HV))   # FLA's docstring says [HV]; it reads HV*K
    _check(**kw, A_log=torch.zeros(HV), dt_bias=torch.zeros(HV, K))
    kw["use_gate_in_kernel"] = False                                     # not read without the in-kernel gate
    _check(**kw, A_log=torch.zeros(1), dt_bias=torch.zeros(1))


def test_devices_and_types():
    kw = _serve(2, 1, torch.tensor([0, 1], device="meta"))
    with pytest.raises(ValueError, match=r"ssm_state_indices: expected on cpu \(the device of k\), got meta"):
        _check(**kw)
    kw = _serve(2, 1, [0, 1])
    with pytest.raises(TypeError, match=r"ssm_state_indices: expected a tensor, got list"):
        _check(**kw)


def test_inplace_without_state_is_left_to_fla_assertion():
    _check(**dict(_acts(2, 1), initial_state=None, inplace_final_state=True))


def test_the_op_raises_on_every_call_before_routing_or_fla():
    """fused_recurrent_kda_fwd runs the check through routing.route (once per signature for calls that
    pass): the issue's case raises ValueError on every call, whatever the route, FLA_CULA=0 included."""
    import fla_cula
    from fla_cula.ops import kda as ops_kda

    kw = _serve(3, 2, torch.tensor([5, 1, 7]))
    fla_cula.reset_status()
    for env in ("1", "0"):
        os.environ["FLA_CULA"] = env
        try:
            for _ in range(2):
                with pytest.raises(ValueError, match="1-D ssm_state_indices"):
                    fla_cula.fused_recurrent_kda_fwd(**kw)
        finally:
            os.environ.pop("FLA_CULA")
    assert fla_cula.status().get("fused_recurrent_kda_fwd") is None, "raised before any route was counted"
    assert ops_kda.FLA_FUSED_RECURRENT_KDA_FWD is not fla_cula.fused_recurrent_kda_fwd


# ---------------------------------------------------------------------------------------------
# valid serving calls must pass (a false positive would break serving)
def _decode_shapes():
    """The argument shapes of tests/gpu/test_decode_kernels.py and test_integration_gpu.py (meta tensors)."""
    m = "meta"
    i32 = dict(dtype=torch.int32, device=m)

    def acts(B, T, H, HV, Kd=128):
        q = torch.empty(B, T, H, Kd, device=m)
        return dict(q=q, k=q, v=torch.empty(B, T, HV, Kd, device=m), g=torch.empty(B, T, HV, Kd, device=m),
                    beta=torch.empty(B, T, HV, device=m), A_log=torch.empty(HV, device=m),
                    dt_bias=torch.empty(HV * Kd, device=m), use_gate_in_kernel=True)

    def pool(P, HV):
        return torch.empty(P, HV, 128, 128, device=m)

    out = []
    for vf in (False, True):
        for T in (1, 2, 4, 8):                   # fused_recurrent_kda: no pool, new final state
            out.append(dict(acts(3, T, 2, 4), initial_state=pool(3, 4), inplace_final_state=False,
                            output_final_state=True, state_v_first=vf))
        lens = [3, 1, 0, 4, 2]                   # varlen with an empty sequence, with and without h0
        for h0 in (pool(5, 4), None):
            out.append(dict(acts(1, sum(lens), 2, 4), initial_state=h0, inplace_final_state=False,
                            output_final_state=True, cu_seqlens=torch.empty(6, **i32), state_v_first=vf))
        for spec in (False, True):               # 2-D pool, T=3, N=4, P=17 (+ num_accepted_tokens)
            out.append(dict(acts(4, 3, 2, 4), initial_state=pool(17, 4), inplace_final_state=True,
                            ssm_state_indices=torch.empty(4, 3, **i32),
                            num_accepted_tokens=torch.empty(4, **i32) if spec else None,
                            out=torch.empty(4, 3, 4, 128, device=m), state_v_first=vf))
        out.append(dict(acts(48, 2, 16, 32), initial_state=pool(120, 32), inplace_final_state=True,  # full grid
                        ssm_state_indices=torch.empty(48, 2, **i32), num_accepted_tokens=torch.empty(48, **i32),
                        out=torch.empty(48, 2, 32, 128, device=m), state_v_first=vf))
        lens = [9, 1, 0, 4, 2, 5]                # varlen in-place state, out= given (tensor-core kernel)
        out.append(dict(acts(1, sum(lens), 2, 4), initial_state=pool(6, 4), inplace_final_state=True,
                        cu_seqlens=torch.empty(7, **i32), out=torch.empty(1, sum(lens), 4, 128, device=m),
                        state_v_first=vf))
        out.append(dict(acts(8, 1, 4, 4), initial_state=pool(16, 4), inplace_final_state=True,   # integration
                        ssm_state_indices=torch.empty(8, **i32), out=torch.empty(8, 1, 4, 128, device=m),
                        state_v_first=vf))
    out.append(dict(acts(6, 1, 2, 4), initial_state=pool(9, 4), ssm_state_indices=torch.empty(6, **i32)))  # 1-D
    out.append(dict(acts(4, 2, 4, 4), initial_state=pool(4, 4), out=torch.empty(4, 2, 4, 128, device=m)))  # in place
    out.append(dict(acts(48, 4, 16, 32), initial_state=pool(48, 32), output_final_state=False))          # mma grid
    return out


@pytest.mark.parametrize("i", range(len(_decode_shapes())))
def test_gpu_test_shapes_pass(i):
    check_recurrent_kda_bounds(**_decode_shapes()[i])


def _parity_calls():
    from parity.cases import grid
    return grid(["fused_recurrent_kda_fwd", "fused_recurrent_kda"])


@pytest.mark.parametrize("case", _parity_calls(), ids=lambda c: c.id)
def test_parity_cases_pass(case):
    """Every fused_recurrent_kda(_fwd) case of the parity grid, with the arguments parity passes (for
    fused_recurrent_kda: the fwd call fla_cula and FLA make from it: no pool, not in place)."""
    from parity.cases import make_inputs
    from parity.runner import call_op

    x = make_inputs(case, "meta", seed=0)   # drawn on the CPU, then metadata only
    out = torch.empty_like(x["v"]) if case.out_given else None
    calls = []

    def fwd(q, k, v, g, beta, **kw):
        calls.append(kw)
        check_recurrent_kda_bounds(q, k, v, g, beta, **kw)
        return None, None

    def fr(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None, output_final_state=False,
           use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
           allow_neg_eigval=False, lower_bound=None, state_v_first=False, cu_seqlens=None):
        return fwd(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
                   output_final_state=output_final_state, inplace_final_state=False, state_v_first=state_v_first,
                   cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                   use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                   allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound)

    call_op(case, fwd if case.op == "fused_recurrent_kda_fwd" else fr, x, out)
    assert len(calls) == 1
