"""Run one parity case on the GPU: fla_cula, FLA (unpatched originals) and the fp64 reference."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import torch

from parity import rules
from parity.cases import DTYPES, Case, case_seed, make_inputs, padded_token_mask, written_slots

GRAD_NAMES = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "h0": "dh0", "A_log": "dA_log",
              "dt_bias": "ddt_bias"}
HAS_AUTOGRAD = {"chunk_kda", "chunk_lightning_attn", "fused_recurrent_lightning_attn"}


# ---------------------------------------------------------------------------------------------
# the three implementations
def fla_functions() -> dict[str, Callable]:
    """FLA 0.6.0's own functions, taken while fla_cula is not patched."""
    import fla_cula

    if getattr(fla_cula, "is_patched", lambda: False)():
        fla_cula.unpatch()
    from fla.modules.causal_conv1d.ops import causal_conv1d_update
    from fla.ops.kda.chunk import chunk_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda, fused_recurrent_kda_fwd
    from fla.ops.lightning_attn.chunk import chunk_lightning_attn
    from fla.ops.lightning_attn.fused_recurrent import fused_recurrent_lightning_attn
    from fla.ops.utils import index as fla_index

    def chunk_schedule(cu_seqlens, total_tokens, chunk_size=64):  # what FLA does per new cu_seqlens (uncached)
        return (fla_index.prepare_chunk_indices.__wrapped__(cu_seqlens, chunk_size),
                fla_index.prepare_chunk_offsets.__wrapped__(cu_seqlens, chunk_size))

    fns = {
        "causal_conv1d_update": causal_conv1d_update,
        "chunk_schedule": chunk_schedule,
        "chunk_kda": chunk_kda,
        "fused_recurrent_kda": fused_recurrent_kda,
        "fused_recurrent_kda_fwd": fused_recurrent_kda_fwd,
        "chunk_lightning_attn": chunk_lightning_attn,
        "fused_recurrent_lightning_attn": fused_recurrent_lightning_attn,
    }
    for name, fn in fns.items():
        if getattr(fn, "__module__", "").startswith("fla_cula"):
            raise RuntimeError(f"FLA's {name} is fla_cula's ({fn.__module__}): unpatch before running parity")
    return fns


def cula_functions() -> dict[str, Callable]:
    from fla_cula.ops.conv import causal_conv1d_update
    from fla_cula.ops.kda import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_fwd
    from fla_cula.ops.lightning_attn import chunk_lightning_attn, fused_recurrent_lightning_attn

    def chunk_schedule(cu_seqlens, total_tokens, chunk_size=64):
        from fla_cula.kernels.varlen_schedule import chunk_schedule as schedule
        return schedule(cu_seqlens, total_tokens, chunk_size)

    return {
        "causal_conv1d_update": causal_conv1d_update,
        "chunk_schedule": chunk_schedule,
        "chunk_kda": chunk_kda,
        "fused_recurrent_kda": fused_recurrent_kda,
        "fused_recurrent_kda_fwd": fused_recurrent_kda_fwd,
        "chunk_lightning_attn": chunk_lightning_attn,
        "fused_recurrent_lightning_attn": fused_recurrent_lightning_attn,
    }


@contextlib.contextmanager
def nan_empty():
    """torch.empty / empty_like / Tensor.new_empty return NaN-filled floating tensors (as FLA's conftest
    does), so any output element a kernel forgets to write shows up as NaN."""
    orig_empty, orig_like, orig_new = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def _fill(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta":
            t.fill_(float("nan"))
        return t

    torch.empty = lambda *a, **k: _fill(orig_empty(*a, **k))
    torch.empty_like = lambda *a, **k: _fill(orig_like(*a, **k))
    torch.Tensor.new_empty = lambda self, *a, **k: _fill(orig_new(self, *a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = orig_empty, orig_like, orig_new


def _scale(case: Case) -> float:
    return case.scale if case.scale is not None else case.K ** -0.5


def call_op(case: Case, fn: Callable, x: dict, out: torch.Tensor | None = None):
    """Call an op (fla_cula's or FLA's: same signature) on the case's inputs; returns (o, state)."""
    op = case.op
    if op == "chunk_kda":
        kw = {"chunk_size": case.chunk_size} if case.chunk_size else {}
        if case.gate != "pre":
            kw.update(A_log=x["A_log"], dt_bias=x["dt_bias"])
        o, ht = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=case.scale, initial_state=x["h0"],
                   output_final_state=case.output_final_state, use_qk_l2norm_in_kernel=case.l2norm,
                   use_gate_in_kernel=case.gate != "pre", use_beta_sigmoid_in_kernel=case.beta_sigmoid,
                   allow_neg_eigval=case.neg_eig, safe_gate=case.safe_gate, lower_bound=x["lower_bound"],
                   state_v_first=case.state_v_first, cu_seqlens=x["cu_seqlens"], **kw)
        return o, ht
    if op == "fused_recurrent_kda":
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                  scale=case.scale, initial_state=x["h0"], output_final_state=case.output_final_state,
                  use_qk_l2norm_in_kernel=case.l2norm, use_gate_in_kernel=case.gate != "pre",
                  use_beta_sigmoid_in_kernel=case.beta_sigmoid, allow_neg_eigval=case.neg_eig,
                  lower_bound=x["lower_bound"], state_v_first=case.state_v_first, cu_seqlens=x["cu_seqlens"])
    if op == "fused_recurrent_kda_fwd":
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                  initial_state=x["h0"], scale=case.scale, output_final_state=case.output_final_state,
                  inplace_final_state=case.inplace, state_v_first=case.state_v_first, cu_seqlens=x["cu_seqlens"],
                  ssm_state_indices=x.get("ssm_state_indices"), num_accepted_tokens=x.get("num_accepted_tokens"),
                  use_qk_l2norm_in_kernel=case.l2norm, use_gate_in_kernel=case.gate != "pre",
                  use_beta_sigmoid_in_kernel=case.beta_sigmoid, allow_neg_eigval=case.neg_eig,
                  lower_bound=x["lower_bound"], out=out)
    if op == "chunk_lightning_attn":
        return fn(x["q"], x["k"], x["v"], case.layer_idx, case.num_layers, scale=case.scale, initial_state=x["h0"],
                  output_final_state=case.output_final_state, cu_seqlens=x["cu_seqlens"])
    if op == "fused_recurrent_lightning_attn":
        return fn(x["q"], x["k"], x["v"], case.layer_idx, case.num_layers, scale=case.scale, initial_state=x["h0"],
                  output_final_state=case.output_final_state, reverse=case.reverse, cu_seqlens=x["cu_seqlens"])
    raise ValueError(f"unknown op {op}")


def _kda_ref(ref, case: Case, x: dict, q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens):
    return ref.kda_recurrent(q, k, v, g, beta, scale=_scale(case), initial_state=h0, output_final_state=True,
                             use_qk_l2norm_in_kernel=case.l2norm, use_gate_in_kernel=case.gate != "pre",
                             A_log=A_log, dt_bias=dt_bias, lower_bound=x["lower_bound"],
                             use_beta_sigmoid_in_kernel=case.beta_sigmoid, allow_neg_eigval=case.neg_eig,
                             state_v_first=case.state_v_first, cu_seqlens=cu_seqlens)


def pool_reference(ref, case: Case, x: dict):
    """Cross-check of ``reference.kda_decode_pool`` (used by ``--cpu``): the fp64 result of
    fused_recurrent_kda_fwd with a state pool, composed from kda_recurrent:
    sequence n reads slot idx[n, num_accepted[n]-1] (idx[n, 0] without speculative decoding; idx[n]
    for 1-D indices), the state after its token t goes to slot idx[n, t] (1-D: idx[n], T=1),
    negative slots are padding (sequence skipped). Returns (o fp64, new pool fp64)."""
    idx = x["ssm_state_indices"].cpu()
    acc = x["num_accepted_tokens"].cpu() if x.get("num_accepted_tokens") is not None else None
    pool = x["h0"].double().clone()
    o = torch.zeros(x["v"].shape, dtype=torch.float64, device=x["v"].device)
    lens = case.lengths
    starts = [0]
    for L in lens:
        starts.append(starts[-1] + L)
    for n, L in enumerate(lens):
        if case.seqlens is None:
            sl = (slice(n, n + 1), slice(0, L))
        else:
            sl = (slice(0, 1), slice(starts[n], starts[n] + L))
        read = int(idx[n]) if idx.ndim == 1 else int(idx[n, (int(acc[n]) - 1) if acc is not None else 0])
        if read < 0 or L == 0:
            continue
        init = x["h0"][read:read + 1]
        cur = {name: (x[name][sl] if x[name] is not None else None) for name in ("q", "k", "v", "g", "beta")}
        on, _ = _kda_ref(ref, case, x, cur["q"], cur["k"], cur["v"], cur["g"], cur["beta"], init, x["A_log"],
                         x["dt_bias"], None)
        o[sl] = on.double()
        for t in range(L):
            slot = int(idx[n]) if idx.ndim == 1 else int(idx[n, t])
            if slot < 0:
                continue
            pre = {name: val[:, : t + 1] for name, val in cur.items()}
            _, st = _kda_ref(ref, case, x, pre["q"], pre["k"], pre["v"], pre["g"], pre["beta"], init, x["A_log"],
                             x["dt_bias"], None)
            pool[slot] = st[0].double()
    return o, pool


def reference(case: Case, x: dict, leaves: dict[str, torch.Tensor] | None = None):
    """fp64 (o, state) from fla_cula.reference; ``leaves`` replaces inputs by fp64 leaves for autograd."""
    from fla_cula import reference as ref

    y = dict(x)
    if leaves:
        y.update(leaves)
    if case.op == "fused_recurrent_kda_fwd" and case.pool not in (None, "noidx"):
        return ref.kda_decode_pool(
            y["q"], y["k"], y["v"], y["g"], y["beta"], A_log=y["A_log"], dt_bias=y["dt_bias"], initial_state=y["h0"],
            scale=_scale(case), output_final_state=case.output_final_state, inplace_final_state=case.inplace,
            state_v_first=case.state_v_first, cu_seqlens=y["cu_seqlens"], ssm_state_indices=y["ssm_state_indices"],
            num_accepted_tokens=y.get("num_accepted_tokens"), use_qk_l2norm_in_kernel=case.l2norm,
            use_gate_in_kernel=case.gate != "pre", use_beta_sigmoid_in_kernel=case.beta_sigmoid,
            allow_neg_eigval=case.neg_eig, lower_bound=y["lower_bound"])
    if case.is_kda:
        return _kda_ref(ref, case, y, y["q"], y["k"], y["v"], y["g"], y["beta"], y["h0"], y["A_log"],
                        y["dt_bias"], y["cu_seqlens"])
    return ref.lightning_recurrent(y["q"], y["k"], y["v"], case.layer_idx, case.num_layers, scale=_scale(case),
                                   initial_state=y["h0"], output_final_state=True, reverse=case.reverse,
                                   cu_seqlens=y["cu_seqlens"])


# ---------------------------------------------------------------------------------------------
def grad_leaf_names(case: Case, x: dict) -> list[str]:
    if not case.grad:
        return []
    names = ["q", "k", "v"]
    if case.is_kda:
        names += ["g", "beta"]
        if case.gate != "pre":
            names += [n for n in ("A_log", "dt_bias") if x.get(n) is not None]
    if x.get("h0") is not None:
        names.append("h0")
    return names


def _clone_inputs(x: dict) -> dict:
    return {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in x.items()}


def run_impl(case: Case, fn: Callable, x: dict, grad_out: dict, poison: bool = True) -> dict:
    """One implementation on a private copy of the inputs. Returns {"o", "state", grads...} or raises.
    poison: fresh float allocations inside the call are NaN-filled (see nan_empty)."""
    poisoned = nan_empty if poison else contextlib.nullcontext
    x = _clone_inputs(x)
    out = torch.full_like(x["v"], float("nan")) if case.out_given else None
    names = grad_leaf_names(case, x) if case.op in HAS_AUTOGRAD or case.grad else []
    res: dict = {}
    if case.grad:
        for n in names:
            x[n] = x[n].detach().requires_grad_(True)
        with torch.enable_grad(), poisoned():
            o, st = call_op(case, fn, x, out)
            if case.op in HAS_AUTOGRAD:
                outs, gos = [o], [grad_out["do"]]
                if st is not None and "dht" in grad_out:
                    outs.append(st)
                    gos.append(grad_out["dht"])
                grads = torch.autograd.grad(outs, [x[n] for n in names], gos, allow_unused=True)
                for n, gr in zip(names, grads, strict=True):
                    res[GRAD_NAMES[n]] = gr
    else:
        with torch.inference_mode(), poisoned():
            o, st = call_op(case, fn, x, out)
    res["o"] = o.detach()
    res["state"] = st.detach() if st is not None else None
    res["out_is_o"] = out is not None and o.data_ptr() == out.data_ptr()
    res["pool_after"] = x["h0"].detach() if case.inplace and x.get("h0") is not None else None
    return res


def differentiable_reference(case: Case, x: dict, leaves: dict[str, torch.Tensor]):
    """fp64 (o, final state) through parity.autograd_ref (out of place, so autograd works)."""
    from parity import autograd_ref

    y = dict(x)
    y.update(leaves)
    if case.is_kda:
        return autograd_ref.kda(y["q"], y["k"], y["v"], y["g"], y["beta"], scale=_scale(case), initial_state=y["h0"],
                                use_qk_l2norm_in_kernel=case.l2norm, use_gate_in_kernel=case.gate != "pre",
                                A_log=y["A_log"], dt_bias=y["dt_bias"], lower_bound=y["lower_bound"],
                                use_beta_sigmoid_in_kernel=case.beta_sigmoid, allow_neg_eigval=case.neg_eig,
                                state_v_first=case.state_v_first, cu_seqlens=y["cu_seqlens"])
    return autograd_ref.lightning(y["q"], y["k"], y["v"], case.layer_idx, case.num_layers, scale=_scale(case),
                                  initial_state=y["h0"], reverse=case.reverse, cu_seqlens=y["cu_seqlens"])


def run_reference(case: Case, x: dict, grad_out: dict) -> dict:
    """Forward from fla_cula.reference; gradients by autograd through parity.autograd_ref, whose forward
    must agree with fla_cula.reference to 1e-10 on the same inputs."""
    names = grad_leaf_names(case, x) if case.op in HAS_AUTOGRAD else []
    res: dict = {}
    with torch.no_grad():
        o, st = reference(case, x)
    if names:
        leaves = {n: x[n].detach().double().requires_grad_(True) for n in names}
        with torch.enable_grad():
            o2, st2 = differentiable_reference(case, x, leaves)
            agree = max(rules.rel_rms(o, o2), rules.rel_rms(st, st2) if st is not None else 0.0)
            if not agree < 1e-10:
                raise AssertionError(f"parity.autograd_ref disagrees with fla_cula.reference: {agree:.2e}")
            loss = (o2 * grad_out["do"].double()).sum()
            if case.output_final_state and "dht" in grad_out:
                loss = loss + (st2 * grad_out["dht"].double()).sum()
            grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
        for n, gr in zip(names, grads, strict=True):
            res[GRAD_NAMES[n]] = gr if gr is not None else torch.zeros_like(leaves[n])
    res["o"] = o.detach().double()
    res["state"] = st.detach().double() if st is not None else None
    return res


def fla_skip_reason(case: Case) -> str | None:
    """Inputs FLA 0.6.0 is known to mishandle: it is not run on them (recorded as such)."""
    if case.padded:
        return "FLA 0.6.0 does not skip negative ssm_state_indices (reads/writes outside the pool)"
    return None


def _state_name(case: Case) -> str:
    return "pool" if case.pool not in (None, "noidx") else "ht"


def compare(case: Case, x: dict, ref: dict, cula: dict, fla: dict | None) -> dict:
    """Per-tensor errors and the verdict."""
    dt = DTYPES[case.dtype]
    mask = padded_token_mask(case, x)
    tensors: list[tuple[str, torch.dtype]] = [("o", dt)]
    sname = _state_name(case)
    if case.output_final_state or case.inplace:
        tensors.append((sname, torch.float32))
    for n in grad_leaf_names(case, x) if case.op in HAS_AUTOGRAD else []:
        tensors.append((GRAD_NAMES[n], x[n].dtype))
    errs: dict[str, dict] = {}
    ok, notes = True, []
    bad: list[tuple[str, bool]] = []  # (tensor judged bad, its NaN pattern equals FLA's)
    for name, tdt in tensors:
        key = "state" if name in ("ht", "pool") else name
        r, c = ref.get(key), cula.get(key)
        f = fla.get(key) if fla is not None else None
        if name == "pool" and cula.get("pool_after") is not None:
            c = cula["pool_after"]
            f = fla["pool_after"] if fla is not None else None
        if r is None:
            continue
        if c is None:
            errs[name] = {"cula": float("nan")}
            ok = False
            notes.append(f"{name}: missing from fla_cula's result")
            bad.append((name, False))
            continue
        if name == "o" and mask is not None:
            keep = ~mask.to(r.device)
            r, c = r[keep], c[keep]
            f = f[keep] if f is not None else None
        if r.shape != c.shape:
            notes.append(f"{name}: shape {tuple(c.shape)} != reference {tuple(r.shape)}")
            bad.append((name, False))
            ok = False
            continue
        has_nan = bool(torch.isnan(c).any())
        e_c = float("nan") if has_nan else rules.rel_rms(r, c)
        a_c = rules.max_abs(r, c) if not has_nan else float("nan")
        e_f = rules.rel_rms(r, f) if f is not None else None
        d = rules.max_abs(c, f) if f is not None and not has_nan else None
        good, note = rules.judge(name, e_c, e_f, a_c, tdt)
        errs[name] = {"cula": e_c, "fla": e_f, "abs_cula": a_c, "maxdiff": d}
        ok &= good
        if not good:
            # NaN where FLA (same inputs, same poisoned allocations) has NaN in exactly the same places,
            # and every other element equal to FLA's bit for bit
            nan_c = torch.isnan(c)
            same_nan = (has_nan and f is not None and f.shape == c.shape and torch.equal(nan_c, torch.isnan(f))
                        and torch.equal(c[~nan_c], f[~nan_c]))
            bad.append((name, same_nan))
        if note:
            notes.append(note)
    untouched = None
    if case.pool not in (None, "noidx") and cula.get("pool_after") is not None:
        touched = written_slots(case, x)
        keep = [s for s in range(x["h0"].shape[0]) if s not in touched]
        if keep:
            ki = torch.tensor(keep, device=x["h0"].device)
            untouched = bool(torch.equal(cula["pool_after"][ki], x["h0"][ki]))
            if not untouched:
                ok = False
                notes.append("pool slots not addressed were modified")
                bad.append(("pool slots", False))
    if case.out_given and not cula.get("out_is_o", False):
        notes.append("out= given but the returned o is another tensor")
        bad.append(("out", False))
        ok = False
    maxdiff = [v["maxdiff"] for v in errs.values() if v.get("maxdiff") is not None]
    return {"errors": errs, "ok": ok, "notes": notes, "untouched_slots_ok": untouched,
            "max_abs_cula_minus_fla": max(maxdiff) if maxdiff else None,
            "only_fla_nan": (not ok) and bool(bad) and all(same for _, same in bad)}


def _route_now() -> tuple[str, str] | None:
    from fla_cula import routing

    return routing.last_route()


def _clear_route() -> None:
    from fla_cula import routing

    tls = getattr(routing, "_tls", None)
    if tls is not None:
        tls.last = None


def run_case(case: Case, cula_fns: dict, fla_fns: dict, device, run_seed: int) -> dict:
    t0 = time.perf_counter()
    seed = case_seed(case, run_seed)
    x = make_inputs(case, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    grad_out: dict = {}
    if case.grad and case.op in HAS_AUTOGRAD:
        grad_out["do"] = torch.randn(x["v"].shape, generator=gen).to(device, DTYPES[case.dtype])
        if case.output_final_state:
            N, HV, K, V = case.n_seqs, case.HV, case.K, case.V
            shape = (N, HV, V, K) if case.state_v_first else (N, HV, K, V)
            grad_out["dht"] = torch.randn(shape, generator=gen).to(device)
    rec: dict = {"id": case.id, "op": case.op, "seed": seed, "case": _case_dict(case)}

    _clear_route()
    cula_exc = fla_exc = None
    try:
        cula = run_impl(case, cula_fns[case.op], x, grad_out)
    except Exception as e:  # noqa: BLE001 - recorded, judged below
        cula, cula_exc = None, e
    route = _route_now()
    rec["route"] = route[1] if route else "no route recorded"
    rec["route_op"] = route[0] if route else None

    skip = fla_skip_reason(case)
    fla = None
    if skip:
        rec["fla"] = "not run: " + skip
    else:
        try:
            fla = run_impl(case, fla_fns[case.op], x, grad_out)
            rec["fla"] = "ok"
        except Exception as e:  # noqa: BLE001
            fla_exc = e
            rec["fla"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"

    if cula_exc is not None:
        rec["errors"], rec["max_abs_cula_minus_fla"] = {}, None
        msg = f"{type(cula_exc).__name__}: {str(cula_exc).splitlines()[0][:200] if str(cula_exc) else ''}"
        if fla_exc is not None and type(fla_exc) is type(cula_exc):
            rec.update(status="pass", notes=[f"both reject the inputs: {msg}"])
        else:
            rec.update(status="FAIL", notes=[f"fla_cula raised {msg}"])
        rec["fatal"] = _is_fatal(cula_exc)
    else:
        only_fla_nan = False
        try:
            ref = run_reference(case, x, grad_out)
            cmp = compare(case, x, ref, cula, fla)
            rec.update(errors=cmp["errors"], max_abs_cula_minus_fla=cmp["max_abs_cula_minus_fla"],
                       untouched_slots_ok=cmp["untouched_slots_ok"], notes=cmp["notes"],
                       status="pass" if cmp["ok"] else "FAIL")
            only_fla_nan = cmp["only_fla_nan"]
        except Exception as e:  # noqa: BLE001
            rec.update(errors={}, max_abs_cula_minus_fla=None, status="FAIL",
                       notes=[f"reference/compare raised {type(e).__name__}: {str(e)[:200]}"])
            rec["fatal"] = _is_fatal(e)
        if fla_exc is not None:
            rec["notes"].append("FLA cannot handle these inputs")
        if rec["status"] == "FAIL" and rec["route"].startswith("fallback") and only_fla_nan:
            rec["status"] = "FLA-defect"
            rec["notes"].append(_fla_nan_cause(case, fla_fns[case.op], x, grad_out))
    rec["seconds"] = round(time.perf_counter() - t0, 3)
    return rec


def _fla_nan_cause(case: Case, fla_fn: Callable, x: dict, grad_out: dict) -> str:
    """Run FLA once more without poisoned allocations, to say which kind of defect it is."""
    try:
        clean = run_impl(case, fla_fn, x, grad_out, poison=False)
    except Exception as e:  # noqa: BLE001
        return f"FLA defect (fallback route reproduces it bit for bit); FLA re-run raised {type(e).__name__}"
    nan = [k for k, v in clean.items() if isinstance(v, torch.Tensor) and v.is_floating_point()
           and bool(torch.isnan(v).any())]
    if nan:
        return (f"FLA 0.6.0 returns NaN in {', '.join(nan)} on these inputs, also without poisoned memory "
                "(fallback route reproduces it bit for bit)")
    return ("FLA 0.6.0 reads memory it never wrote: NaN only when fresh allocations are NaN-poisoned "
            "(fallback route reproduces it bit for bit)")


def _is_fatal(e: Exception) -> bool:
    s = str(e)
    return "illegal memory access" in s or "CUDA error" in s or "device-side assert" in s


def _case_dict(case: Case) -> dict:
    import dataclasses

    d = dataclasses.asdict(case)
    d["seqlens"] = list(case.seqlens) if case.seqlens else None
    d.pop("tags", None)
    return {k: v for k, v in d.items() if not (isinstance(v, float) and math.isnan(v))}
