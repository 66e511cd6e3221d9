"""CPU tests of the peer and model benchmarks' pure parts: layouts, gate regimes, records (a missing
or declining peer is a record, not an exception), the JSON merge and the report's peer / model tables."""

import json
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import model as bmodel  # noqa: E402
from benchmarks import peers  # noqa: E402
from benchmarks import report as breport  # noqa: E402
from benchmarks.registry import _S  # noqa: E402


# ---------------------------------------------------------------------------------------------
# layouts
def test_thd_round_trip_is_a_view():
    x = torch.randn(3, 5, 4, 8)
    t = peers.to_thd(x)
    assert t.shape == (15, 4, 8) and t.data_ptr() == x.data_ptr()
    assert torch.equal(peers.from_thd(t, 3, 5), x)
    assert torch.equal(t[5 + 2], x[1, 2])  # token t of sequence b is row b*T + t


def test_thd_keeps_autograd():
    x = torch.randn(2, 3, 2, 4, requires_grad=True)
    peers.from_thd(peers.to_thd(x) * 2, 2, 3).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_state_transpose_round_trip_and_cu_seqlens():
    s = torch.randn(2, 3, 4, 5)
    vk = peers.state_kv_to_vk(s)
    assert vk.shape == (2, 3, 5, 4) and vk.is_contiguous() and torch.equal(vk[1, 2, 3, 1], s[1, 2, 1, 3])
    assert torch.equal(peers.state_kv_to_vk(vk), s)
    cu = peers.dense_cu_seqlens(3, 7, "cpu")
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 7, 14, 21]


# ---------------------------------------------------------------------------------------------
# gate regimes
def test_slow_regime_share_holds_and_random_has_none():
    s = _S(1, 2048, 4)
    x = peers.make_inputs(s, "slow", "cpu", seed=3)
    share = peers.slow_share(x["g"], x["A_log"], x["dt_bias"])
    assert share == pytest.approx(peers.SLOW_SHARE)  # exactly a quarter of the (head, channel) pairs
    # the claim behind it: with exp(A_log) >= 1 and dt_bias = -13, even an extreme g keeps 1 - exp(a) < 0.01
    from fla_cula.reference.kda import kda_gate

    g_max = torch.full((1, 1, 1, 1), 6.5)
    a = kda_gate(g_max, torch.zeros(1), torch.full((1,), peers.SLOW_DT_BIAS), peers.LOWER_BOUND)
    assert float(-torch.expm1(a)) < peers.SLOW_DECAY
    assert float(x["g"].abs().max()) < 6.5
    r = peers.make_inputs(s, "random", "cpu", seed=3)
    assert peers.slow_share(r["g"], r["A_log"], r["dt_bias"]) < 0.01
    assert torch.equal(r["A_log"], x["A_log"]) and torch.equal(r["q"], x["q"])  # same inputs but dt_bias
    assert (x["dt_bias"] == peers.SLOW_DT_BIAS).sum() == round(peers.SLOW_SHARE * 128) * 4


def test_fast_regime_decays_every_channel_and_the_others_keep_one():
    s = _S(1, 2048, 4)
    f = peers.make_inputs(s, "fast", "cpu", seed=3)
    assert peers.fast_decay(f["g"], f["A_log"], f["dt_bias"]) > 0.8  # a = -5 sigmoid(g): 1 - exp(a) ~ 0.9
    assert peers.slow_share(f["g"], f["A_log"], f["dt_bias"]) == 0.0
    for regime in ("random", "slow"):  # each has a channel that keeps the state far longer
        x = peers.make_inputs(s, regime, "cpu", seed=3)
        assert torch.equal(x["q"], f["q"]) and torch.equal(x["g"], f["g"])  # same inputs but the gate parameters
        assert peers.fast_decay(x["g"], x["A_log"], x["dt_bias"]) < 0.3


def test_gate_params_rejects_unknown_regime():
    with pytest.raises(ValueError, match="gate regime must be one of"):
        peers.gate_params("fastest", 2, 128, "cpu")


def test_reference_heads_respect_gva_groups():
    assert peers.ref_heads(_S(1, 8, 64)) == 8
    assert peers.ref_heads(_S(1, 8, 4)) == 4
    assert peers.ref_heads(_S(1, 8, 16, 32)) == 8  # groups of 2: q/k heads 0-3
    assert peers.ref_heads(_S(1, 8, 2, 32), limit=8) == 16  # group 16 > limit: one whole group


# ---------------------------------------------------------------------------------------------
# records: fakes for FLA (fp64-reference-backed), the timing, and missing / declining peers
def _fake_chunk_kda(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
                    A_log=None, dt_bias=None, lower_bound=None, state_v_first=False, **kw):
    from fla_cula import routing
    from fla_cula.reference import kda_recurrent

    routing.record_fallback("chunk_kda", "test stand-in")
    o, ht = kda_recurrent(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                          lower_bound=lower_bound, use_beta_sigmoid_in_kernel=True, state_v_first=state_v_first,
                          cu_seqlens=cu_seqlens)
    return o.to(q.dtype), ht.float()


@pytest.fixture
def cpu_peers(monkeypatch):
    """FLA / fla_cula -> the reference; time_call -> a fixed 1 ms; cudnn and flash_kda not importable."""
    import benchmarks.harness as harness

    monkeypatch.setattr(peers, "_fla_fns", lambda: (_fake_chunk_kda, _fake_chunk_kda))
    monkeypatch.setattr(harness, "time_call", lambda call, mode, **kw: (call(), {"ms": 1.0, "peak_bytes": 0,
                                                                                  "error": None})[1])
    real = peers.importlib.import_module

    def no_peers(name, *a):
        if name.split(".")[0] in ("cudnn", "flash_kda"):
            raise ModuleNotFoundError(f"No module named '{name}'")
        return real(name, *a)

    monkeypatch.setattr(peers.importlib, "import_module", no_peers)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a: None)


REQUIRED = {"op", "bench", "regime", "impl", "mode", "B", "T", "H", "HV", "K", "V", "varlen", "shape", "ms",
            "peak_bytes", "route", "status", "error", "err_o", "err_ht", "ref", "bytes", "flops", "wall_s"}


def test_row_records_schema_and_missing_peers_are_records(cpu_peers):
    row = peers.Row(_S(2, 24, 2), "slow", False)
    recs = peers.run_row(row, "cpu", peers.IMPLS, log=lambda m: None)
    assert len(recs) == 2 * len(peers.IMPLS)  # eager + graph, every impl, none dropped
    for r in recs:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        json.dumps(r)
    by = {(r["impl"], r["mode"]): r for r in recs}
    for mode in ("eager", "graph"):
        f, c = by[("fla", mode)], by[("fla_cula", mode)]
        assert f["status"] == "ok" and f["ms"] == 1.0 and f["route"] == "fla"
        assert f["err_o"] < 1e-2 and f["err_ht"] < 1e-2  # bf16 output of the fp64 recurrence itself
        assert c["route"] == "fallback: test stand-in"
        for impl in ("cudnn:kda_hopper_cuda", "cudnn:kda_hopper", "flash_kda"):
            p = by[(impl, mode)]
            assert p["status"] == "unavailable" and p["ms"] is None
            assert p["error"].startswith("peer unavailable: import ") and "No module named" in p["error"]
    assert recs[0]["ref"].startswith("fp64 recurrence on value heads 0-1 of 2")


def test_flash_kda_declines_gva_without_importing(cpu_peers):
    r = peers.run_impl("flash_kda", _S(1, 8, 2, 4), peers.make_inputs(_S(1, 8, 2, 4), "random", "cpu"), "graph", None)
    assert r["status"] == "declined" and "no GVA" in r["error"]


def test_a_failing_peer_call_is_recorded(cpu_peers, monkeypatch):
    """FlashKDA importable but every call raising (its device check under torch 2.11): 'unavailable'."""
    fk = types.ModuleType("flash_kda")

    def fwd(*a, **k):
        raise RuntimeError("all tensors must be on CUDA")

    fk.fwd = fwd
    monkeypatch.setitem(sys.modules, "flash_kda", fk)
    monkeypatch.setattr(peers, "_import", lambda name: sys.modules[name])
    s = _S(1, 8, 2)
    r = peers.run_impl("flash_kda", s, peers.make_inputs(s, "random", "cpu"), "eager", None)
    assert r["status"] == "unavailable" and r["error"] == "peer unavailable: RuntimeError: all tensors must be on CUDA"


def test_cudnn_decline_is_recorded_and_its_unpinned_graph_evicted(cpu_peers, monkeypatch):
    """cuDNN caches a graph before select_plan raises for a plan it does not offer; a second call would
    run the default plan under the pinned name. The decline is recorded and the entry evicted."""
    class cudnnGraphNotSupportedError(Exception):  # noqa: N801 - cuDNN's name
        pass

    kda_mod = types.ModuleType("cudnn.linear_attention.ops.kda")
    kda_mod.fprop_cache, kda_mod.bprop_cache = {"old": 1}, {}

    def kimi_delta_attention(q, k, v, g, beta, cu, plan_name=None, **kw):
        assert q.ndim == 3 and cu.dtype == torch.int32 and kw["dt_bias"].shape == (2, 128)
        kda_mod.fprop_cache[("fprop", plan_name)] = ("graph", {})
        raise cudnnGraphNotSupportedError(f"no {plan_name} plan for this graph (offered: ['kda_hopper_cuda'])")

    la = types.ModuleType("cudnn.linear_attention")
    la.kimi_delta_attention = kimi_delta_attention
    ops = types.ModuleType("cudnn.linear_attention.ops")
    ops.kda = kda_mod
    for name, mod in (("cudnn", types.ModuleType("cudnn")), ("cudnn.linear_attention", la),
                      ("cudnn.linear_attention.ops", ops), ("cudnn.linear_attention.ops.kda", kda_mod)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(peers, "_import", lambda name: sys.modules[name])
    s = _S(1, 16, 2)
    r = peers.run_impl("cudnn:kda_hopper", s, peers.make_inputs(s, "random", "cpu"), "graph", None)
    assert r["status"] == "declined" and "no kda_hopper plan" in r["error"], r
    assert kda_mod.fprop_cache == {"old": 1}


def test_plan_rows_cover_the_issue_and_select():
    rows = peers.plan_rows()
    descs = {r.shape.desc for r in rows if not r.train}
    for want in ("B=1 T=8192 H=64", "B=2 T=8192 H=64", "B=1 T=16384 H=64", "B=8 T=4096 H=64", "B=1 T=32768 H=16",
                 "B=1 T=8192 H=8", "B=1 T=2048 H=16", "B=2 T=8192 H=16 HV=32"):
        assert want in descs
    assert any(r.shape.varlen and max(r.shape.varlen) >= 8 * min(r.shape.varlen) for r in rows)
    assert any(r.shape.varlen == (256,) * 64 and r.shape.H == 32 for r in rows)
    assert {r.regime for r in rows if not r.train} == {"random", "slow", "fast"}
    assert {r.shape.desc for r in rows if r.train} == {"B=2 T=4096 H=32", "B=1 T=8192 H=32"}
    sel = peers.plan_rows(rows=["H=8 |"], regimes=("slow",))
    assert [r.desc for r in sel] == ["chunk_kda peers | B=1 T=8192 H=8 | slow"]


# ---------------------------------------------------------------------------------------------
# JSON merge and report
def test_merge_replaces_same_key_and_keeps_the_rest(tmp_path):
    a = {"bench": "b", "shape": "s", "mode": "eager", "impl": "fla", "regime": "random", "ms": 1.0}
    b = dict(a, impl="fla_cula", ms=2.0)
    a2 = dict(a, ms=0.5)
    c = dict(a, regime="slow")
    assert breport.merge_records([a, b], [a2, c]) == [a2, b, c]
    js, md = str(tmp_path / "x.json"), str(tmp_path / "x.md")
    breport.write_merged([a, b], {}, {}, {}, md, js, "T")
    breport.write_merged([a2], {}, {}, {}, md, js, "T")
    assert json.load(open(js)) == [a2, b]
    breport.write_merged([c], {}, {}, {}, md, js, "T", drop=lambda r: r["impl"] == "fla_cula")
    assert json.load(open(js)) == [a2, c]


def _peer_rec(impl, ms, status="ok", route=None, error=None, mode="graph", regime="random", err=1e-3):
    return {"op": "chunk_kda", "bench": peers.BENCH_PREFILL, "regime": regime, "impl": impl, "mode": mode,
            "shape": "B=1 T=8192 H=64", "ms": ms, "status": status, "error": error,
            "route": route or ("peer" if impl not in ("fla", "fla_cula") else impl),
            "err_o": err if ms else None, "err_ht": err / 2 if ms else None}


def test_report_peer_columns_from_synthetic_json(tmp_path):
    recs = [_peer_rec("fla", 2.30), _peer_rec("fla_cula", 2.31, route="fallback: no kernel for this op yet"),
            _peer_rec("cudnn:kda_hopper_cuda", 0.78, err=4.9e-3),
            _peer_rec("cudnn:kda_hopper", None, "declined", error="declined: no kda_hopper plan"),
            _peer_rec("flash_kda", None, "unavailable", error="peer unavailable: RuntimeError: all tensors"),
            _peer_rec("fla", 2.0, regime="slow"), _peer_rec("fla_cula", 0.5, route="kernel", regime="slow"),
            _peer_rec("cudnn:kda_hopper_cuda", 1.0, regime="slow")]
    p = tmp_path / "b.json"
    p.write_text(json.dumps(recs))
    md = breport.markdown(breport.load_records(str(p)), {"gpu": "x"}, {}, {}, "T")
    assert "### chunk_kda peers — gate regime `random`" in md and "gate regime `slow`" in md
    assert ("| B=1 T=8192 H=64 | graph | 2.300 ms | 2.310 ms (fallback) | 780.0 µs | declined [1] | n/a [2] | "
            "cuDNN kda_hopper_cuda | 0.34x (fallback) |") in md
    assert "| B=1 T=8192 H=64 | graph | 2.000 ms | 500.0 µs | 1.000 ms | - | - | cuDNN kda_hopper_cuda | 2.00x |" in md
    assert "1. cuDNN kda_hopper: declined: no kda_hopper plan" in md
    assert "2. FlashKDA: peer unavailable: RuntimeError: all tensors" in md
    assert "| B=1 T=8192 H=64 | 1.00e-03 / 5.00e-04 | 1.00e-03 / 5.00e-04 | 4.90e-03 / 2.45e-03 | - | - |" in md
    # peer records stay out of the generic FLA-vs-fla_cula tables
    assert "## chunk_kda peers\n" not in md and breport.short_table(recs).count("\n") == 0


def test_report_marks_a_peer_timed_in_another_run():
    """A peer record merged from an earlier run than the row's fla_cula record is footnoted, not shown as if timed
    in the same process."""
    recs = [dict(_peer_rec("fla", 2.0), commit="new"), dict(_peer_rec("fla_cula", 1.0, route="kernel"), commit="new"),
            dict(_peer_rec("cudnn:kda_hopper_cuda", 1.5), commit="old"),
            dict(_peer_rec("fla", 2.0, regime="slow"), commit="new"),
            dict(_peer_rec("fla_cula", 1.0, route="kernel", regime="slow"), commit="new"),
            dict(_peer_rec("cudnn:kda_hopper_cuda", 1.5, regime="slow"), commit="new")]
    md = breport.markdown(recs, {"gpu": "x"}, {}, {}, "T")
    assert "| 2.000 ms | 1.000 ms | 1.500 ms [1] | - | - |" in md
    assert "1. cuDNN kda_hopper_cuda: timed in an earlier run (commit old), not in the process of this row's " \
           "fla_cula cell (commit new)" in md
    assert "| 2.000 ms | 1.000 ms | 1.500 ms | - | - |" in md   # the slow regime's peer ran in the same run


def test_report_model_table():
    recs = []
    for impl, ms in (("plain", 20.0), ("patched", 18.0)):
        recs.append({"op": "kda_model_decode", "bench": "KDAForCausalLM 4 layers", "impl": impl, "mode": "graph",
                     "shape": "B=128 T=1 (cache of 64 tokens)", "ms": ms, "note": "graph step incl. copy-back",
                     "samples_ms": [ms, ms * 1.1, ms * 0.9] if impl == "plain" else [ms, ms, ms],
                     "logits_rel_rms": 2e-3 if impl == "patched" else None, "error": None,
                     "routes": {"fused_recurrent_kda": {"kernel": 24, "fallback": {"x y": 1}, "calls": 25}}
                     if impl == "patched" else None})
    md = breport.markdown(recs, {}, {}, {}, "T")
    assert "## FLA's KDAForCausalLM, plain vs fla_cula.patch()" in md
    assert ("| KDAForCausalLM 4 layers | decode | B=128 T=1 (cache of 64 tokens) | graph | 20.000 ms | 18.000 ms | "
            "1.111 | 1.000-1.222 | 2.00e-03 | fused_recurrent_kda: kernel 24, fallback 1 (x y) | - / - | - | "
            "graph step incl. copy-back |") in md


# ---------------------------------------------------------------------------------------------
# model benchmark plumbing
def test_model_plan_train_last_and_24_layer_subset():
    todo = bmodel.plan([4, 24], list(bmodel.ROWS))
    kinds4 = [k for n, k, _ in todo if n == 4]
    assert kinds4[-1] == "train" and kinds4.count("decode") == 3 and kinds4.count("graph") == 3
    assert {k for n, k, _ in todo if n == 24} == set(bmodel.LAYERS_24_ROWS)
    assert [p for n, k, p in todo if n == 4 and k == "generate"] == list(bmodel.GENERATE_B)


def test_model_alternates_abba(monkeypatch):
    seq = []
    monkeypatch.setattr(bmodel, "set_patched", lambda flag: seq.append("P" if flag else "p"))
    calls = []
    out = bmodel.alternate({"plain": lambda: calls.append("plain") or 1.0,
                            "patched": lambda: calls.append("patched") or 2.0}, 4)
    assert calls == ["plain", "patched", "patched", "plain"] * 2
    assert out == {"plain": [1.0] * 4, "patched": [2.0] * 4} and seq[-1] == "p"


def test_model_records():
    res = bmodel._pair({"plain": [0.002, 0.001, 0.003], "patched": [0.001]}, {"plain": 0.5}, {"logits_rel_rms": 1e-3},
                       "B=1 T=1", 1, 1, note="n")
    recs = bmodel.to_records(res, 4, "graph", {"hidden_size": 2048}, {"op": {"kernel": 1}}, {"disk_hits": 1},
                             {"gpu": "g", "fla_cula commit": "c"})
    pl, pa = recs
    assert pl["op"] == "kda_model_decode" and pl["mode"] == "graph" and pl["impl"] == "plain"
    assert pl["ms"] == pytest.approx(2.0) and pl["first_ms"] == pytest.approx(500.0) and "routes" not in pl
    assert pa["logits_rel_rms"] == 1e-3 and pa["routes"] == {"op": {"kernel": 1}} and pa["jit_row"] == {"disk_hits": 1}
    json.dumps(recs)


class _FakeKDAModel:
    """Stands in for KDAForCausalLM's cache handling: reads each layer's recurrent state, returns a
    new tensor (state + 1) as FLA's layer does, and updates the conv state in place."""

    class config:  # noqa: N801
        vocab_size = 11

    def __call__(self, input_ids, past_key_values, use_cache=True, **kw):
        for layer in past_key_values.layers:
            st = layer.state
            st["recurrent_state"] = st["recurrent_state"] + 1.0  # a new tensor
            for c in st["conv_state"]:
                c.add_(1.0)  # in place
        first = float(past_key_values.layers[0].state["recurrent_state"][0, 0, 0, 0])
        logits = torch.full((input_ids.shape[0], 1, 11), first)
        return types.SimpleNamespace(logits=logits, past_key_values=past_key_values)


def _cache(n_layers=2, B=2):
    from fla.models.utils import Cache

    states = [{"recurrent_state": torch.zeros(B, 2, 4, 4), "attn_state": None,
               "conv_state": (torch.zeros(B, 8, 4), torch.zeros(B, 8, 4), torch.zeros(B, 8, 4)), "ffn_state": None}
              for _ in range(n_layers)]
    return Cache.from_legacy_cache(tuple(states))


def test_model_snapshot_restore_and_graph_step_copy_back():
    cache = _cache()
    snap = bmodel.snapshot(cache)
    model = _FakeKDAModel()
    ids = torch.zeros(2, 1, dtype=torch.long)
    model(ids, cache)
    assert float(cache.layers[0].state["recurrent_state"].max()) == 1.0 and float(snap[0]["recurrent_state"].max()) == 0
    bmodel.restore(cache, snap, in_place=False)
    st1 = cache.layers[1].state
    assert float(st1["recurrent_state"].max()) == 0 and float(st1["conv_state"][2].max()) == 0
    step = bmodel.GraphStep(model, cache, ids)
    static, conv = list(step.static), list(step.conv)
    for _ in range(3):
        step.step()
    for layer, s, c in zip(cache.layers, static, conv, strict=True):
        assert layer.state["recurrent_state"] is s and float(s.min()) == 3.0  # copied back into the static buffer
        assert layer.state["conv_state"] is c and float(c[0].min()) == 3.0  # the layer's in-place update
    assert float(step.logits.max()) == 3.0
    bmodel.restore(cache, snap, in_place=True)
    assert cache.layers[0].state["recurrent_state"] is static[0] and float(static[0].max()) == 0.0


def test_report_command_merges_device_runs(tmp_path):
    """Two device calls write two JSONs ($OUT starts empty each time); `python -m benchmarks report --add`
    merges them into the repo's JSON (an op-grid run replaces the old records of the benches it ran) and rebuilds
    the report."""
    from benchmarks.__main__ import main

    base = tmp_path / "H200.json"
    old_grid = {"op": "fused_recurrent_kda", "bench": "fused_recurrent_kda decode", "impl": "fla", "mode": "graph",
                "shape": "B=1 T=1 H=32", "ms": 0.01, "route": "fla"}
    base.write_text(json.dumps([old_grid, _peer_rec("fla", 9.9)]))
    a, b = tmp_path / "a", tmp_path / "b"
    h = {"gpu": "H200", "date (UTC)": "2026-12-03 14:00", "fla_cula commit": "c1"}
    breport.write_merged([_peer_rec("fla", 2.3), _peer_rec("fla_cula", 2.2, route="kernel")],
                         dict(h, command="prefill --peers"), {"copy_bw": 4e12, "matmul_rate": 6e14}, {},
                         str(a / "BENCHMARK_H200.md"), str(a / "benchmark_H200.json"), "T")
    model_rec = {"op": "kda_model_train", "bench": "KDAForCausalLM 4 layers", "impl": "plain", "mode": "fwdbwd",
                 "shape": "B=1 T=4096", "ms": 100.0}
    breport.write_merged([model_rec, dict(model_rec, impl="patched", ms=99.0)], dict(h, command="model"), {}, {},
                         str(b / "BENCHMARK_H200.md"), str(b / "benchmark_H200.json"), "T")
    md = tmp_path / "B.md"
    assert main(["report", "--json", str(base), "--md", str(md), "--add", str(a / "benchmark_H200.json"),
                 str(b / "benchmark_H200.json")]) == 0
    recs = json.load(open(base))
    assert old_grid in recs and len(recs) == 5  # the peer record of the same key was replaced
    assert [r["ms"] for r in recs if r["impl"] == "fla" and "regime" in r] == [2.3]
    text = md.read_text()
    assert "`prefill --peers`" in text and "`model`" in text and "## FLA's KDAForCausalLM" in text
    assert "| KDAForCausalLM 4 layers | train | B=1 T=4096 | fwdbwd | 100.000 ms | 99.000 ms | 1.010 |" in text
    # an op-grid run of one bench (--only) replaces that bench's records, every shape, and keeps the other benches
    light = {"op": "chunk_lightning_attn", "bench": "chunk_lightning_attn prefill", "impl": "fla", "mode": "graph",
             "shape": "B=2 T=8192 H=64", "ms": 0.8, "route": "fla"}
    c = tmp_path / "c.json"
    c.write_text(json.dumps([light]))
    assert main(["report", "--json", str(base), "--md", str(md), "--add", str(c)]) == 0
    recs = json.load(open(base))
    assert old_grid in recs and light in recs and len(recs) == 6
    d = tmp_path / "d.json"
    d.write_text(json.dumps([dict(light, shape="B=1 T=8192 H=8", ms=0.1)]))
    assert main(["report", "--json", str(base), "--md", str(md), "--add", str(d)]) == 0
    recs = json.load(open(base))
    assert old_grid in recs and light not in recs and len(recs) == 6


def test_fla_flash_kda_switched_off(monkeypatch):
    monkeypatch.setenv("FLA_FLASH_KDA", "1")
    assert peers.disable_fla_flash_kda() is True and os.environ["FLA_FLASH_KDA"] == "0"


def test_model_paired_range():
    """The report's noise band: plain_i / patched_i over the pairs, None below two pairs."""
    from benchmarks import report
    assert report.paired_range({"samples_ms": [2.0, 3.0, 4.0]}, {"samples_ms": [1.0, 3.0, 5.0]}) == (0.8, 2.0)
    assert report.paired_range({"samples_ms": [2.0]}, {"samples_ms": [1.0]}) is None
    assert report.paired_range({}, {"samples_ms": [1.0, 2.0]}) is None
    assert bmodel.DEFAULT_REPS.keys() == set(bmodel.ROWS)


# ---------------------------------------------------------------------------------------------
# one GPU per report
def test_device_tag_names_the_card():
    assert breport.device_tag("NVIDIA H200") == "H200"
    assert breport.device_tag("NVIDIA H100 80GB HBM3") == "H100"
    assert breport.device_tag(None) == "H200"
    assert breport.device_tag("NVIDIA H20") == "H20" and breport.device_tag("NVIDIA GB200") == "GB200"
    assert breport.device_tag("NVIDIA A100-SXM4-80GB") == "NVIDIAA100SXM480GB"
    assert breport.resolve_tag("X1") == "X1"


def test_merge_refuses_records_of_another_gpu(tmp_path):
    js, md = str(tmp_path / "H200.json"), str(tmp_path / "B.md")
    h200 = [dict(_peer_rec("fla", 2.0), gpu="NVIDIA H200")]
    breport.write_merged(h200, {}, {}, {}, md, js, "t")
    with pytest.raises(ValueError, match="H100"):
        breport.write_merged([dict(_peer_rec("fla", 1.0), gpu="NVIDIA H100 80GB HBM3")], {}, {}, {}, md, js, "t")
    assert breport.load_records(js)[0]["ms"] == 2.0  # untouched
    breport.write_merged([dict(_peer_rec("fla", 1.5), gpu="NVIDIA H200 (SM 9.0, 132 SMs, 139 GiB)")], {}, {}, {}, md,
                         js, "t")  # the same card, another memory reading
    assert breport.load_records(js)[0]["ms"] == 1.5
