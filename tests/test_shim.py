"""The FLA-compatible shim on the CPU: signatures, patch/unpatch, routing reasons, env toggles."""

import inspect
import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import fla_cula
from fla_cula import patching, routing
from fla_cula.ops import conv as ops_conv
from fla_cula.ops import kda as ops_kda
from fla_cula.ops import lightning_attn as ops_la

FLA_ORIGINALS = {
    "causal_conv1d_update": ops_conv.FLA_CAUSAL_CONV1D_UPDATE,
    "chunk_kda": ops_kda.FLA_CHUNK_KDA,
    "fused_recurrent_kda": ops_kda.FLA_FUSED_RECURRENT_KDA,
    "fused_recurrent_kda_fwd": ops_kda.FLA_FUSED_RECURRENT_KDA_FWD,
    "chunk_lightning_attn": ops_la.FLA_CHUNK_LIGHTNING_ATTN,
    "fused_recurrent_lightning_attn": ops_la.FLA_FUSED_RECURRENT_LIGHTNING_ATTN,
    "fused_recurrent_simple_gla": ops_la.FLA_FUSED_RECURRENT_SIMPLE_GLA,
}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("FLA_CULA", raising=False)
    monkeypatch.delenv("FLA_CULA_STRICT", raising=False)
    fla_cula.unpatch()
    fla_cula.reset_status()
    yield
    fla_cula.unpatch()
    fla_cula.reset_status()


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", sorted(FLA_ORIGINALS))
def test_signature_matches_fla(name):
    """Names, order, kinds and defaults equal FLA 0.6.0's (annotations are not compared)."""
    ours = getattr(fla_cula, name)
    assert ours is getattr(fla_cula.ops, name)
    assert _params(ours) == _params(FLA_ORIGINALS[name])


def _all_fla_bindings():
    """(module, attr) -> value for every fla.* module attribute that is an FLA original or ours."""
    ids = {id(f) for f in FLA_ORIGINALS.values()} | {id(getattr(fla_cula, n)) for n in FLA_ORIGINALS}
    out = {}
    for name, mod in list(sys.modules.items()):
        if mod is not None and (name == "fla" or name.startswith("fla.")):
            for attr, val in list(vars(mod).items()):
                if id(val) in ids:
                    out[(name, attr)] = val
    return out


def test_patch_swaps_every_binding_and_unpatch_restores_identity():
    patching._import_targets()
    before = _all_fla_bindings()
    assert before and all(v is FLA_ORIGINALS[v.__name__] for v in before.values())
    fla_cula.patch()
    assert fla_cula.is_patched()
    during = _all_fla_bindings()
    assert during.keys() == before.keys()
    for key, val in during.items():
        assert val is getattr(fla_cula, before[key].__name__), key
    # the places fla-api.md lists explicitly
    import fla.ops
    import fla.ops.kda
    import fla.ops.kda.fused_recurrent
    import fla.ops.lightning_attn
    assert fla.ops.kda.chunk_kda is fla_cula.chunk_kda
    assert fla.ops.chunk_kda is fla_cula.chunk_kda
    assert fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd is fla_cula.fused_recurrent_kda_fwd
    assert fla.ops.lightning_attn.fused_recurrent_lightning_attn is fla_cula.fused_recurrent_lightning_attn
    import fla.modules.causal_conv1d.ops as conv_ops  # ShortConvolution.step's module global
    assert conv_ops.causal_conv1d_update is fla_cula.causal_conv1d_update
    fla_cula.unpatch()
    assert not fla_cula.is_patched()
    after = _all_fla_bindings()
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)


def test_layers_bound_when_installed():
    pytest.importorskip("fla.layers.kda")
    import fla.layers.kda as lk
    with fla_cula.patched():
        assert lk.chunk_kda is fla_cula.chunk_kda and lk.fused_recurrent_kda is fla_cula.fused_recurrent_kda
    assert lk.chunk_kda is ops_kda.FLA_CHUNK_KDA


def test_patch_idempotent_and_context_manager_nesting():
    fla_cula.patch()
    n = len(patching.swapped_bindings())
    fla_cula.patch()
    assert len(patching.swapped_bindings()) == n
    with fla_cula.patched():
        assert fla_cula.is_patched()
    assert fla_cula.is_patched(), "patched() must leave an earlier patch() in place"
    fla_cula.unpatch()
    fla_cula.unpatch()
    assert not fla_cula.is_patched()
    with fla_cula.patched():
        assert fla_cula.is_patched()
    assert not fla_cula.is_patched()


def test_patch_thread_safe():
    errors = []

    def worker(i):
        try:
            for _ in range(20):
                (fla_cula.patch if i % 2 else fla_cula.unpatch)()
        except Exception as e:  # pragma: no cover - the assertion below reports it
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    fla_cula.unpatch()
    import fla.ops.kda
    assert fla.ops.kda.chunk_kda is ops_kda.FLA_CHUNK_KDA
    assert not patching._swapped and not patching._registered


def test_backend_registered_with_fla_dispatch_and_removed():
    import fla.backends as fb
    reg = fb._get_operation_registry("kda")
    assert patching.BACKEND_TYPE not in reg._backends
    with fla_cula.patched():
        if fb._DISPATCH_DISABLED:
            pytest.skip("FLA_DISABLE_BACKEND_DISPATCH=1 in this environment")
        assert patching.BACKEND_TYPE in reg._backends
        chunk_reg = fb._function_registries[inspect.unwrap(ops_kda.FLA_CHUNK_KDA)]
        assert chunk_reg._get_sorted_backends()[0].backend_type == patching.BACKEND_TYPE
    assert patching.BACKEND_TYPE not in reg._backends
    assert patching.BACKEND_TYPE not in chunk_reg._backends


def _decode_inputs(B=1, T=3, H=2, HV=2, K=16, V=16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, K, generator=g)
    k = torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, HV, V, generator=g)
    gate = -torch.rand(B, T, HV, K, generator=g)
    beta = torch.rand(B, T, HV, generator=g)
    return q, k, v, gate, beta


def _run_expecting_fla_cpu_failure(fn, *args, **kwargs):
    """FLA's Triton kernels cannot run on CPU tensors: the call must reach FLA and fail there."""
    with pytest.raises(Exception) as ei:
        fn(*args, **kwargs)
    assert not isinstance(ei.value, routing.FallbackError)


def test_cpu_routes_to_fla_with_reason_and_counts(caplog):
    caplog.set_level(logging.INFO, logger="fla_cula")
    args = _decode_inputs()
    for _ in range(3):
        _run_expecting_fla_cpu_failure(fla_cula.fused_recurrent_kda, *args)
    st = fla_cula.status()["fused_recurrent_kda"]
    reason = "no CUDA device" if not torch.cuda.is_available() else "tensors on cpu, not CUDA"
    assert st == {"kernel": 0, "fallback": {reason: 3}, "calls": 3, "grad": "forward only (grad -> FLA)"}
    assert fla_cula.last_route() == ("fused_recurrent_kda", "fallback: " + reason)
    logged = [r for r in caplog.records if reason in r.getMessage()]
    assert len(logged) == 1, "each reason is logged once"


def test_env_off_reason(monkeypatch):
    monkeypatch.setenv("FLA_CULA", "0")
    _run_expecting_fla_cpu_failure(fla_cula.fused_recurrent_kda, *_decode_inputs())
    assert fla_cula.status()["fused_recurrent_kda"]["fallback"] == {"FLA_CULA=0": 1}


def test_strict_raises_with_reason(monkeypatch):
    monkeypatch.setenv("FLA_CULA_STRICT", "1")
    with pytest.raises(routing.FallbackError, match="no CUDA device|not CUDA"):
        fla_cula.fused_recurrent_kda(*_decode_inputs())
    q, k, v, _, _ = _decode_inputs()
    with pytest.raises(routing.FallbackError, match="chunk_lightning_attn"):
        fla_cula.chunk_lightning_attn(q, k, v, 0, 2)


def test_patched_fla_original_counts_once():
    """FLA's own fused_recurrent_kda (held from before patch) calls fused_recurrent_kda_fwd by
    module global: that reaches fla_cula, which must count the call once and not loop."""
    q, k, v, g, beta = _decode_inputs()
    with fla_cula.patched():
        _run_expecting_fla_cpu_failure(ops_kda.FLA_FUSED_RECURRENT_KDA, q, k, v, g, beta)
        _run_expecting_fla_cpu_failure(fla_cula.fused_recurrent_kda, q, k, v, g, beta)
    st = fla_cula.status()
    assert st["fused_recurrent_kda_fwd"]["calls"] == 1  # from FLA's original
    assert st["fused_recurrent_kda"]["calls"] == 1  # ours; its FLA fallback is not counted again


def test_dispatch_reaches_fla_cula_for_captured_functions():
    import fla.backends as fb
    if fb._DISPATCH_DISABLED:
        pytest.skip("FLA_DISABLE_BACKEND_DISPATCH=1")
    q, k, v, g, beta = _decode_inputs()
    with fla_cula.patched():
        _run_expecting_fla_cpu_failure(ops_kda.FLA_CHUNK_KDA, q, k, v, g, beta)
        _run_expecting_fla_cpu_failure(ops_kda.FLA_FUSED_RECURRENT_KDA_FWD, q, k, v, g, beta,
                                       initial_state=torch.zeros(1, 2, 16, 16))
    st = fla_cula.status()
    assert st["chunk_kda"]["calls"] == 1 and st["fused_recurrent_kda_fwd"]["calls"] == 1


def _fla_error(fn, *args, **kwargs):
    with pytest.raises(Exception) as ei:
        fn(*args, **kwargs)
    return type(ei.value), str(ei.value)


@pytest.mark.parametrize("case", ["varlen_batch", "varlen_state_count", "neg_eigval"])
def test_same_errors_as_fla(case):
    q, k, v, g, beta = _decode_inputs(B=2)
    kw = {}
    if case == "varlen_batch":
        kw = {"cu_seqlens": torch.tensor([0, 3, 6])}
    elif case == "varlen_state_count":
        q, k, v, g, beta = _decode_inputs(B=1, T=6)
        kw = {"cu_seqlens": torch.tensor([0, 3, 6]), "initial_state": torch.zeros(3, 2, 16, 16)}
    else:
        kw = {"allow_neg_eigval": True}
    assert _fla_error(fla_cula.fused_recurrent_kda, q, k, v, g, beta, **kw) == \
        _fla_error(ops_kda.FLA_FUSED_RECURRENT_KDA, q, k, v, g, beta, **kw)
    if case.startswith("varlen"):
        assert _fla_error(fla_cula.fused_recurrent_lightning_attn, q, k, v, 1, 4, initial_state=kw.get(
            "initial_state"), cu_seqlens=kw["cu_seqlens"]) == _fla_error(
            ops_la.FLA_FUSED_RECURRENT_LIGHTNING_ATTN, q, k, v, 1, 4, initial_state=kw.get("initial_state"),
            cu_seqlens=kw["cu_seqlens"])


def test_transpose_state_layout_alias_warns_like_fla():
    q, k, v, g, beta = _decode_inputs()
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        _run_expecting_fla_cpu_failure(fla_cula.fused_recurrent_kda, q, k, v, g, beta,
                                       transpose_state_layout=True)
    with pytest.raises(ValueError, match="Cannot pass both"):
        fla_cula.fused_recurrent_kda(q, k, v, g, beta, state_v_first=True, transpose_state_layout=True)


def test_simple_gla_gate_reason():
    q, k, v, _, _ = _decode_inputs()
    _run_expecting_fla_cpu_failure(fla_cula.fused_recurrent_simple_gla, q, k, v, g=-torch.rand(1, 3, 2))
    assert "per-token gate g" in next(iter(fla_cula.status()["fused_recurrent_simple_gla"]["fallback"]))


def _run_py(code, *args, env=None):
    e = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    return subprocess.run([sys.executable, *args] if not code else [sys.executable, "-c", code, *args],
                          capture_output=True, text=True, env=e, cwd=REPO, timeout=300)


def test_fla_core_alone_without_layers():
    """fla.layers unavailable (fla-core without flash-linear-attention): patch() still works."""
    r = _run_py(textwrap.dedent("""
        import sys
        sys.modules['fla.layers'] = None
        sys.modules['fla.layers.kda'] = None
        sys.modules['fla.models'] = None
        import fla_cula, fla.ops
        fla_cula.patch()
        assert fla.ops.chunk_kda is fla_cula.chunk_kda
        fla_cula.unpatch()
        print('ok')
    """))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_run_command_patches_before_the_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import sys, fla.ops, fla_cula\nassert fla.ops.chunk_kda is fla_cula.chunk_kda\n"
                      "print('patched', sys.argv[1:])\n")
    r = _run_py(None, "-m", "fla_cula", "run", str(script), "--lr", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "patched ['--lr', '3']" in r.stdout


def test_pytest_plugin_patches_before_collection(tmp_path):
    t = tmp_path / "test_uses_fla.py"
    t.write_text("from fla.ops.kda import chunk_kda\nimport fla_cula\n"
                 "def test_bound():\n    assert chunk_kda is fla_cula.chunk_kda\n")
    r = _run_py(None, "-m", "pytest", "-q", "-p", "fla_cula.testing.plugin", "-p", "no:cacheprovider", str(t))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "fla_cula routes" in r.stdout


def test_info_command():
    r = _run_py(None, "-m", "fla_cula", "info", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    import json
    rep = json.loads(r.stdout[r.stdout.index("{"):])
    assert rep["versions"]["fla-core"] == "0.6.0"
    assert rep["target_arch"] == "sm_90a"
    assert any(k["name"] == "probe_scale_add" for k in rep["kernels"])


def test_env_patch_hook():
    """FLA_CULA_PATCH=1: the start-up hook patches before the script runs; without it, nothing happens."""
    import site
    pth = [p for p in site.getsitepackages() if os.path.exists(os.path.join(p, "fla_cula_autopatch.pth"))]
    pre = "" if pth else "import fla_cula_autopatch\n"  # not installed here: exercise the hook module itself
    code = pre + "import sys, fla.ops, fla_cula\nprint(fla.ops.chunk_kda is fla_cula.chunk_kda)\n"
    assert _run_py(code, env={"FLA_CULA_PATCH": "1"}).stdout.strip().endswith("True")
    assert _run_py(code, env={"FLA_CULA_PATCH": "0"}).stdout.strip().endswith("False")
    quiet = _run_py("import sys; print('fla_cula' in sys.modules)", env={"FLA_CULA_PATCH": "0"})
    assert quiet.stdout.strip() == "False", "without the variable the hook imports nothing"


def _export_graph(inplace: bool, vf: bool):
    class Step(torch.nn.Module):
        def forward(self, q, k, v, g, beta, state, out):
            o, s = fla_cula.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=state, out=out,
                                                    inplace_final_state=inplace, output_final_state=True,
                                                    state_v_first=vf, use_qk_l2norm_in_kernel=True)
            return o * 2, s

    B, H, K = 2, 4, 128
    args = tuple(torch.randn(B, 1, H, K) for _ in range(4)) + (torch.randn(B, 1, H), torch.randn(B, H, K, K),
                                                               torch.empty(B, 1, H, K))
    return torch.export.export(Step(), args)


@pytest.mark.parametrize("inplace", [True, False], ids=["pool-inplace", "new-state"])
def test_fused_recurrent_kda_fwd_is_one_custom_op_under_export(inplace):
    """Under torch.compile / export the serving entry point is one opaque custom op with a fake
    implementation: no graph break, FLA's output structure and shapes, no routing at trace time."""
    ep = _export_graph(inplace, vf=False)
    calls = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert calls.count("fla_cula.fused_recurrent_kda_fwd.default") == 1
    outs = [n for n in ep.graph.nodes if n.op == "output"][0].args[0]
    shapes = [tuple(o.meta["val"].shape) for o in outs if hasattr(o, "meta") and "val" in o.meta]
    assert (2, 4, 128, 128) in shapes  # the final state (the pool itself, or a new [N, HV, K, V])
    assert fla_cula.status() == {}, "tracing must not route or count calls"


# ---------------------------------------------------------------------------------------------
# decisions memoized per call signature (routing.route)
def _native_signature_or_skip():
    fn = routing._native_signature()
    if fn is None:
        pytest.skip("fla_cula._C without call_signature (extension not built, or no DLPack exchange API)")
    return lambda args: fn(args, routing._tensor_signature)


@pytest.mark.parametrize("impl", ["native", "python"])
def test_signature_reads_every_fact_the_checks_use(impl):
    """Equal metadata -> equal signature (different tensors); dtype, shape, strides, alignment and
    device each change it; values inside tensors never enter it. Both implementations: C++ through
    torch's DLPack exchange API, and Python attribute reads."""
    a, b = torch.randn(2, 8), torch.randn(2, 8)
    sig = _native_signature_or_skip() if impl == "native" else routing.signature_py
    assert sig((a, 1.0, None, True)) == sig((b, 1.0, None, True))
    base = torch.zeros(40)
    assert sig((base[:32],)) != sig((base[1:33],))                      # address mod 16: 0 vs 4
    for other in (a.double(), torch.randn(2, 9), torch.randn(8, 2).t(), a.to("meta")):
        assert sig((a,)) != sig((other,))
    assert sig((a, 0.5)) != sig((a, 0.25)) and sig((a, None)) != sig((a, False))
    p = torch.nn.Parameter(torch.randn(2, 8))      # requires grad: same facts as a plain tensor
    assert sig((p,)) == sig((a.clone(),))          # in both: requires_grad is checked per call, not here
    assert sig((p,)) != sig((p.double(),))
    m = torch.empty(2, 8, device="meta")
    assert sig((m,)) == sig((torch.empty(2, 8, device="meta"),)) and sig((m,)) != sig((a,))


def test_native_signature_matches_python_decisions():
    """The C++ signature separates exactly the calls the Python one separates."""
    nat = _native_signature_or_skip()
    base = torch.zeros(64)
    xs = [torch.randn(2, 8), torch.randn(2, 8), torch.randn(8, 2).t(), torch.randn(2, 8).double(),
          base[:16].view(2, 8), base[1:17].view(2, 8), base[4:20].view(2, 8), torch.randn(16)[::2],
          torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(1, 8).expand(2, 8), torch.randn(0, 8)]
    for x in xs:
        for y in xs:
            same_py = routing.signature_py((x, 1)) == routing.signature_py((y, 1))
            assert (nat((x, 1)) == nat((y, 1))) == same_py, (x.shape, x.stride(), y.shape, y.stride())
