"""routing.route and the kernel registry on the CPU: memo per signature, size-free keys for prefill
ops, grad policies, the stand-in, env toggles, import failures as reasons."""

import types

import pytest
import torch

import fla_cula
from fla_cula import routing
from fla_cula.kernels import registry
from fla_cula.kernels.registry import FLA_BACKWARD, FORWARD_ONLY, KernelEntry, OpSpec


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for var in ("FLA_CULA", "FLA_CULA_STRICT", "FLA_CULA_STAND_IN"):
        monkeypatch.delenv(var, raising=False)
    fla_cula.reset_status()
    routing.clear_plans()
    yield
    fla_cula.reset_status()
    routing.clear_plans()


class FakeKernel:
    """A kernel module whose plan function records its calls and declines float64 inputs."""

    def __init__(self):
        self.calls = 0

    def plan(self, x, *rest):
        self.calls += 1
        if x.dtype == torch.float64:
            return "x: float64", None
        return None, ("plan", x.dtype)


@pytest.fixture
def fake(monkeypatch):
    """Ops 'op_fwd' (forward only, full signature), 'op_train' (FLA backward, size-free key) and
    'op_none' (no kernel, stand-in) on a fake kernel; device checks pass on the CPU."""
    kern = FakeKernel()
    mod = types.SimpleNamespace(plan=kern.plan)
    monkeypatch.setitem(registry.KERNELS, "fake", KernelEntry("fake", "fake.module", "CuTe DSL"))
    monkeypatch.setitem(registry.KERNELS, "fake_stand_in",
                        KernelEntry("fake_stand_in", "fake.module", "FLA (stand-in)", route="stand_in"))
    monkeypatch.setitem(registry._loaded, "fake", (mod, None))
    monkeypatch.setitem(registry._loaded, "fake_stand_in", (mod, None))
    monkeypatch.setitem(registry.OPS, "op_fwd", OpSpec("op_fwd", "fake", FORWARD_ONLY))
    monkeypatch.setitem(registry.OPS, "op_train", OpSpec("op_train", "fake", FLA_BACKWARD, None, (2, None)))
    monkeypatch.setitem(registry.OPS, "op_none", OpSpec("op_none", None, FLA_BACKWARD, "fake_stand_in", (2, None)))
    monkeypatch.setattr(routing, "device_reason", lambda *t: None)
    return kern


def test_route_memoizes_decisions_per_signature(fake):
    x = torch.randn(4, 4)
    for _ in range(3):
        assert routing.route("op_fwd", (x, 1), (x,)) == ("plan", torch.float32)
    assert fake.calls == 1 and fla_cula.status()["op_fwd"]["kernel"] == 3
    y = torch.randn(4, 4, dtype=torch.float64)
    for _ in range(2):
        assert routing.route("op_fwd", (y, 1), (y,)) is None
    assert fake.calls == 2 and fla_cula.status()["op_fwd"]["fallback"] == {"x: float64": 2}
    assert routing.route("op_fwd", (torch.randn(5, 4), 1), (x,)) is not None  # a new shape: a new decision
    assert fake.calls == 3 and routing.memo_size("op_fwd") == 3
    for _ in range(2):  # unhashable argument: decided every call, never stored
        routing.route("op_fwd", (x, [1]), (x,))
    assert fake.calls == 5 and routing.memo_size("op_fwd") == 3
    routing.clear_plans()
    assert routing.memo_size("op_fwd") == 0


def test_size_free_key_one_decision_for_every_length(fake):
    """Prefill ops: B and T are runtime values, so 1,000 lengths are one decision and one memo entry."""
    for t in range(1, 1001):
        x = torch.empty(2, t, 8)
        assert routing.route("op_train", (x, "cfg"), (x,)) is not None
    assert fake.calls == 1 and routing.memo_size("op_train") == 1
    # what the key does hold: dtype, the dims after the runtime ones, contiguity, the other arguments
    for other in (torch.empty(2, 3, 8, dtype=torch.float64), torch.empty(2, 3, 16), torch.empty(2, 8, 3).mT):
        routing.route("op_train", (other, "cfg"), (other,))
    routing.route("op_train", (torch.empty(2, 3, 8), "cfg2"), (x,))
    assert fake.calls == 5


def test_size_reason_per_call_on_size_free_ops(fake):
    small, huge = torch.empty(1, 4, 8, device="meta"), torch.empty(1, 2 ** 28, 8, device="meta")
    assert routing.route("op_train", (small, 0), (small,)) is not None
    assert routing.route("op_train", (huge, 0), (huge,)) is None  # same key, caught per call
    assert "2^31" in fla_cula.last_route()[1]


def test_grad_policy_per_op(fake):
    x = torch.randn(2, 3, 8, requires_grad=True)
    assert routing.route("op_fwd", (x,), (x,)) is None
    assert fla_cula.last_route() == ("op_fwd", "fallback: grad enabled: forward-only kernel")
    assert routing.route("op_train", (x, 0), (x,)) is not None  # our forward + FLA's backward
    assert fla_cula.status()["op_train"]["grad"] == "our forward + FLA's backward"
    assert fla_cula.status()["op_fwd"]["grad"] == "forward only (grad -> FLA)"


def test_route_grad_env_and_strict_are_per_call(fake, monkeypatch):
    """The memo holds what the signature decides; grad mode, FLA_CULA and strict mode are read on every
    call, in the unmemoized order (device reason, then grad, then the kernel's checks)."""
    y = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert routing.route("op_fwd", (y,), (y,)) is None
    assert fla_cula.last_route() == ("op_fwd", "fallback: grad enabled: forward-only kernel")
    with torch.no_grad():
        routing.route("op_fwd", (y,), (y,))
    assert fla_cula.last_route() == ("op_fwd", "fallback: x: float64") and fake.calls == 1
    monkeypatch.setenv("FLA_CULA", "0")
    routing.route("op_fwd", (y,), (y,))
    assert fla_cula.last_route() == ("op_fwd", "fallback: FLA_CULA=0")
    monkeypatch.delenv("FLA_CULA")
    monkeypatch.setenv("FLA_CULA_STRICT", "1")
    with torch.no_grad(), pytest.raises(routing.FallbackError, match="float64"):
        routing.route("op_fwd", (y,), (y,))


def test_stand_in_only_when_asked_and_counted_apart(fake, monkeypatch):
    x = torch.randn(1, 4, 8)
    assert routing.route("op_none", (x, 0), (x,)) is None
    assert fla_cula.last_route() == ("op_none", "fallback: " + routing.NO_KERNEL_YET)
    monkeypatch.setenv("FLA_CULA_STAND_IN", "1")
    monkeypatch.setenv("FLA_CULA_STRICT", "1")  # the stand-in is fla_cula's path, not a fallback
    assert routing.route("op_none", (x, 0), (x,)) == ("plan", torch.float32)
    st = fla_cula.status()["op_none"]
    assert st["stand_in"] == 1 and st["kernel"] == 0 and st["calls"] == 2
    monkeypatch.delenv("FLA_CULA_STAND_IN")
    with pytest.raises(routing.FallbackError, match="no kernel for this op yet"):
        routing.route("op_none", (x, 0), (x,))


def test_route_memo_is_bounded(fake, monkeypatch):
    monkeypatch.setattr(routing, "MAX_PLANS", 4)
    for n in range(10):
        x = torch.empty(n + 1)
        routing.route("op_fwd", (x,), (x,))
        assert routing.memo_size("op_fwd") <= 4


def test_set_tuning_forgets_plans():
    from fla_cula.kernels import recurrent_decode
    routing._memo["fused_recurrent_kda"]["k"] = (None, None, ("plan", "kernel"))
    recurrent_decode.set_tuning()
    assert routing.memo_size("fused_recurrent_kda") == 0


def test_import_failure_is_the_reason_for_its_ops_only(monkeypatch):
    monkeypatch.setitem(registry.KERNELS, "broken",
                        KernelEntry("broken", "fla_cula.kernels.no_such_module", "CuTe DSL"))
    monkeypatch.setitem(registry.OPS, "op_broken", OpSpec("op_broken", "broken", FORWARD_ONLY))
    monkeypatch.delitem(registry._loaded, "broken", raising=False)
    monkeypatch.setattr(routing, "device_reason", lambda *t: None)
    x = torch.randn(2)
    assert routing.route("op_broken", (x,), (x,)) is None
    reason = fla_cula.last_route()[1]
    assert reason.startswith("fallback: broken kernel unavailable (ModuleNotFoundError")
    assert registry.load("kda_decode")[1] is None  # the others still import
    rows = {r["op"]: r for r in registry.describe()}
    assert rows["op_broken"]["status"].startswith("broken kernel unavailable")
    assert rows["fused_recurrent_kda_fwd"]["lang"] == "CuTe DSL"


def test_registry_names_every_public_op():
    assert set(fla_cula.ops.__all__) == set(registry.OPS)
    for spec in registry.OPS.values():
        for name in (spec.kernel, spec.stand_in):
            assert name is None or name in registry.KERNELS


def test_importing_the_package_imports_no_kernel():
    import subprocess
    import sys
    code = ("import sys, fla_cula, fla_cula.kernels; print(sorted(m for m in sys.modules "
            "if m.startswith('fla_cula.kernels.') and m != 'fla_cula.kernels.registry'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# the chunk ops on the CPU: FLA's checks, then one memoized decision for every length
def _kda_inputs(T, B=1, H=2, K=16):
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    return q, k, torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.rand(B, T, H)


def test_chunk_ops_memo_does_not_grow_with_length(monkeypatch):
    from fla_cula.ops import kda as ops_kda
    from fla_cula.ops import lightning_attn as ops_la
    sentinel = object()
    monkeypatch.setattr(ops_kda, "FLA_CHUNK_KDA", lambda *a, **k: sentinel)
    monkeypatch.setattr(ops_la, "FLA_CHUNK_LIGHTNING_ATTN", lambda *a, **k: sentinel)
    for t in range(1, 1001):
        assert fla_cula.chunk_kda(*_kda_inputs(t)) is sentinel
        q = torch.randn(1, t, 2, 16)
        assert fla_cula.chunk_lightning_attn(q, q, q, 0, 2) is sentinel
    assert routing.memo_size("chunk_kda") == 1 and routing.memo_size("chunk_lightning_attn") == 1
    assert fla_cula.status()["chunk_kda"]["fallback"] == {"no CUDA device": 1000}


@pytest.mark.parametrize("case", ["chunk_size", "lower_bound", "neg_eigval", "state_dtype", "g_shape"])
def test_chunk_kda_same_errors_as_fla(case):
    """FLA's checks run before routing, with FLA's exception types and messages."""
    from fla_cula.ops import kda as ops_kda
    q, k, v, g, beta = _kda_inputs(8)
    kw = {}
    if case == "chunk_size":
        kw = dict(chunk_size=16)
    elif case == "lower_bound":
        kw = dict(safe_gate=True, use_gate_in_kernel=True, lower_bound=-6.0, A_log=torch.zeros(2))
    elif case == "neg_eigval":
        kw = dict(allow_neg_eigval=True)
    elif case == "state_dtype":
        kw = dict(initial_state=torch.zeros(1, 2, 16, 16, dtype=torch.bfloat16))
    else:
        g = g[..., :8]
    errors = []
    for fn in (ops_kda.FLA_CHUNK_KDA, fla_cula.chunk_kda):
        with pytest.raises((ValueError, AssertionError)) as ei:
            fn(q, k, v, g, beta, **kw)
        errors.append((type(ei.value), str(ei.value)))
    assert errors[0] == errors[1]


def test_lightning_g_gamma_cache_is_not_an_inference_tensor():
    """The cached lightning decay is made outside inference mode: a first call under torch.inference_mode()
    must not leave an inference tensor that a later training call fails to save for backward (H200, session 14:
    test_chunk_lightning_grads_bit_identical_to_fla failed so after an inference test in the same process)."""
    from fla_cula.ops.lightning_attn import _g_gamma_cache, g_gamma_for
    key = (3, 1, 7, torch.device("cpu"))
    _g_gamma_cache.pop(key, None)
    with torch.inference_mode():
        t = g_gamma_for(*key)
    assert not t.is_inference() and g_gamma_for(*key) is t
