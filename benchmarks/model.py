"""FLA's KDA model, plain vs fla_cula.patch(): ``python -m benchmarks model [--rows ...] [--layers 4 24]``.

One random-init ``fla.models.KDAForCausalLM`` (hidden 2048, 16 heads x 128, bf16, safe_gate,
lower_bound=-5, or with --gate softplus the layer's default softplus gate; no hub download), the same weights
and inputs for both sides. Plain and patched
runs alternate (plain, patched, patched, plain, ...) and each side keeps its median, so machine
noise does not decide a row; every shape is warmed up in both before timing (Triton autotune,
fla_cula kernel loads). FLA_FLASH_KDA=0: FLA's chunk_kda runs its Triton kernels on both sides.

Rows (op names of the JSON records):
  kda_model_prefill   forward of B=2 T=8192 with use_cache (the states a server keeps), logits of
                      the last token only (logits_to_keep=1); ms per forward.
  kda_model_decode    one decode step (one token per sequence, cache from a 64-token prompt),
                      B = 1, 32, 128. eager: ms per step over back-to-back steps. graph: the step
                      captured in a CUDA graph with static cache buffers: the conv states are
                      updated in place by FLA's layer; the recurrent state FLA's layer returns
                      is a new tensor, so the step copies it back into the static state buffer
                      (an SM copy kernel; its time alone is in the note); replayed under
                      triton.testing.do_bench (L2 flushed). Beside each decode row: the relative
                      RMS of patched vs plain logits, max over DECODE_CHECK_STEPS steps from the
                      same cache with the same fed tokens.
                      graph_inplace: the same step as a serving engine calls the kernel (vLLM,
                      SGLang): FLA's layer reaches ``fused_recurrent_kda_fwd(...,
                      inplace_final_state=True)`` (plain: FLA's; patched: fla_cula's), so the state
                      is updated in its static buffer and no copy-back runs. Both graph rows carry
                      `kernels`: GPU time per kernel name over profiled replays of each side's
                      graph (torch.profiler), to split a row's ratio into the KDA op and the rest.
  kda_model_generate  greedy generate of 64 new tokens after a 64-token prompt, B = 1, 32
                      (HF generate with its attention mask, as a user calls it); ms per generate.
  kda_model_train     one training step B=1 T=4096: forward + loss + backward + AdamW step.

Every patched record carries `routes` (fla_cula.status() over the row's patched runs: kernel
calls and fallbacks by reason), `jit_row` / `jit_timed` (fla_cula.jit disk loads and compiles
over the whole row / inside the timed runs only) and `first_ms` (each side's warm-up run), so a
run shows whether the model's KDA calls hit the kernel and whether a kernel was loaded or compiled
inside the timed region.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

BASE_CONFIG = dict(hidden_size=2048, num_heads=16, head_dim=128, safe_gate=True, lower_bound=-5.0,
                   attn_mode="chunk", vocab_size=32000)
# --gate: the bounded gate above, or FLA's KDA layer default (Kimi Linear's): softplus, no safe_gate, no lower_bound
GATES = {"bounded": {}, "softplus": dict(safe_gate=False, lower_bound=None)}
PROMPT = 64
NEW_TOKENS = 64
DECODE_B = (1, 32, 128)
GENERATE_B = (1, 32)
PREFILL = (2, 8192)
TRAIN = (1, 4096)
DECODE_CHECK_STEPS = 4
ROWS = ("prefill", "decode", "graph", "graph_inplace", "generate", "train")
LAYERS_24_ROWS = ("prefill", "decode", "graph", "graph_inplace")  # the 24-layer model: no generate / train (time)


def build_model(layers: int, device, gate: str = "bounded"):
    from fla.models import KDAConfig, KDAForCausalLM

    cfg = KDAConfig(**{**BASE_CONFIG, **GATES[gate]}, num_hidden_layers=layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = KDAForCausalLM(cfg)
    return model.to(torch.bfloat16).eval(), cfg


def set_patched(flag: bool) -> None:
    import fla_cula

    if flag:
        fla_cula.patch()
    else:
        fla_cula.unpatch()


def rel_rms(ref: torch.Tensor, x: torch.Tensor) -> float:
    from parity.rules import rel_rms as r

    return r(ref.float(), x.float())


TIMED_JIT: dict = {}  # fla_cula.jit loads / compiles during the last alternate() (the timed runs)


def alternate(fns: dict, reps: int) -> dict[str, list[float]]:
    """fns: {"plain": f, "patched": f}, each returning seconds for one measurement; runs them in
    ABBA order `reps` times each, patching before every patched run; returns all samples."""
    out: dict[str, list[float]] = {k: [] for k in fns}
    order = ["plain", "patched"]
    j0 = _jit_stats()
    for i in range(reps):
        for side in (order if i % 2 == 0 else order[::-1]):
            set_patched(side == "patched")
            out[side].append(fns[side]())
    set_patched(False)
    TIMED_JIT.clear()
    TIMED_JIT.update(_delta(j0, _jit_stats()))
    return out


def _sync_time(fn, n: int = 1) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def _jit_stats() -> dict:
    from fla_cula import jit

    return dict(jit.stats)


def _delta(a: dict, b: dict) -> dict:
    return {k: b.get(k, 0) - a.get(k, 0) for k in b if b.get(k, 0) != a.get(k, 0)}


# ---------------------------------------------------------------------------------------------
# caches
def prompt_cache(model, B: int, device, seed: int = 1):
    """A cache after a PROMPT-token prompt (plain FLA), the prompt ids and the next token ids."""
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (B, PROMPT), device=device, generator=g)
    set_patched(False)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    nxt = torch.randint(3, model.config.vocab_size, (B, 1), device=device, generator=g)
    return out.past_key_values, ids, nxt


def snapshot(cache) -> list[dict]:
    """Deep copy of every layer's recurrent and conv states."""
    out = []
    for layer in cache.layers:
        st = layer.state
        out.append({"recurrent_state": st["recurrent_state"].clone(),
                    "conv_state": tuple(c.clone() for c in st["conv_state"]) if st["conv_state"] else None})
    return out


def restore(cache, snap: list[dict], in_place: bool) -> None:
    """Put a snapshot's states into `cache`: copied into the existing tensors (static buffers,
    in_place) or as fresh clones."""
    for layer, s in zip(cache.layers, snap, strict=True):
        st = layer.state
        if in_place:
            st["recurrent_state"].copy_(s["recurrent_state"])
            for dst, src in zip(st["conv_state"] or (), s["conv_state"] or (), strict=True):
                dst.copy_(src)
        else:
            st["recurrent_state"] = s["recurrent_state"].clone()
            st["conv_state"] = tuple(c.clone() for c in s["conv_state"]) if s["conv_state"] else None


# ---------------------------------------------------------------------------------------------
# rows: each returns {"plain": rec-fields, "patched": rec-fields} (ms, reps, ...)
def row_prefill(model, device, reps: int) -> dict:
    B, T = PREFILL
    g = torch.Generator(device=device).manual_seed(2)
    ids = torch.randint(3, model.config.vocab_size, (B, T), device=device, generator=g)
    logits = {}

    def fwd(side):
        def f():
            with torch.inference_mode():
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            logits[side] = out.logits
            del out
        return f

    first = {}
    for side in ("plain", "patched"):  # warm-up both (autotune, kernel loads)
        set_patched(side == "patched")
        first[side] = _sync_time(fwd(side))
    set_patched(False)
    samples = alternate({s: (lambda s=s: _sync_time(fwd(s))) for s in ("plain", "patched")}, reps)
    err = rel_rms(logits["plain"], logits["patched"])
    return _pair(samples, first, {"logits_rel_rms": err},
                 f"B={B} T={T}", B, T, note="use_cache=True, logits_to_keep=1")


def row_decode_eager(model, device, B: int, reps: int, steps: int = 16) -> dict:
    cache, _, nxt = prompt_cache(model, B, device)
    snap = snapshot(cache)

    def run(n):
        def f():
            with torch.inference_mode():
                for _ in range(n):
                    out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            del out
        return f

    first = {}
    for side in ("plain", "patched"):
        set_patched(side == "patched")
        restore(cache, snap, in_place=False)
        first[side] = _sync_time(run(2)) / 2

    def timed(side):
        restore(cache, snap, in_place=False)
        return _sync_time(run(steps)) / steps

    samples = alternate({s: (lambda s=s: timed(s)) for s in ("plain", "patched")}, reps)
    err = decode_logits_error(model, cache, snap, nxt)
    return _pair(samples, first, {"logits_rel_rms": err}, f"B={B} T=1 (cache of {PROMPT} tokens)", B, 1,
                 note=f"{steps} back-to-back steps per sample")


def decode_logits_error(model, cache, snap, nxt) -> float:
    """max over DECODE_CHECK_STEPS steps of rel RMS(patched logits vs plain), same start, same tokens."""
    logits = {}
    for side in ("plain", "patched"):
        set_patched(side == "patched")
        restore(cache, snap, in_place=False)
        seq = []
        with torch.inference_mode():
            for _ in range(DECODE_CHECK_STEPS):
                seq.append(model(input_ids=nxt, past_key_values=cache, use_cache=True).logits.clone())
        logits[side] = seq
    set_patched(False)
    return max(rel_rms(a, b) for a, b in zip(logits["plain"], logits["patched"], strict=True))


class GraphStep:
    """One decode step captured in a CUDA graph with static cache buffers (see module docstring)."""

    def __init__(self, model, cache, nxt):
        self.model, self.cache = model, cache
        self.ids = nxt.clone()
        self.static = [layer.state["recurrent_state"].clone() for layer in cache.layers]
        self.conv = [layer.state["conv_state"] for layer in cache.layers]  # updated in place by the layer
        for layer, s in zip(cache.layers, self.static, strict=True):
            layer.state["recurrent_state"] = s
        self.logits = None
        self.graph = None
        self.copy_graph = None

    def step(self):
        for layer, s, c in zip(self.cache.layers, self.static, self.conv, strict=True):
            layer.state["recurrent_state"] = s  # Python-side binding: the graph reads these buffers
            layer.state["conv_state"] = c
        with torch.inference_mode():
            out = self.model(input_ids=self.ids, past_key_values=self.cache, use_cache=True)
            for layer, s in zip(self.cache.layers, self.static, strict=True):
                new = layer.state["recurrent_state"]
                if new is not s:
                    torch.mul(new, 1.0, out=s)  # an SM copy (a captured copy_ runs on a copy engine)
                layer.state["recurrent_state"] = s
            if self.logits is None:
                self.logits = out.logits.clone()
            else:
                self.logits.copy_(out.logits)

    def capture(self):
        from benchmarks.harness import capture_graph

        self.step()  # allocates self.logits outside the graph
        self.graph = capture_graph(self.step)
        return self

    def copy_back_ms(self) -> float:
        """The copy-back alone, captured and timed as the step is."""
        from benchmarks.harness import _do_bench, capture_graph

        src = [s.clone() for s in self.static]
        dst = [s.clone() for s in self.static]

        def cp():
            for a, b in zip(src, dst, strict=True):
                torch.mul(a, 1.0, out=b)

        g = capture_graph(cp)
        return _do_bench(g.replay)


@contextlib.contextmanager
def serving_state_in_place():
    """FLA's KDA layer calls ``fused_recurrent_kda`` (a new final-state tensor per step); inside this
    context it calls ``fused_recurrent_kda_fwd(..., inplace_final_state=True)`` as serving engines do,
    looked up at call time in FLA's module, so plain runs FLA's and patched runs fla_cula's."""
    import fla.layers.kda as layer_mod
    from fla.ops.kda import fused_recurrent as fr

    original = layer_mod.fused_recurrent_kda

    def in_place(q, k, v, g, beta, *, initial_state=None, output_final_state=False, scale=None, **kw):
        if initial_state is None or not output_final_state:
            return original(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                            scale=scale, **kw)
        return fr.fused_recurrent_kda_fwd(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, scale=scale,
                                          output_final_state=True, inplace_final_state=True, **kw)

    layer_mod.fused_recurrent_kda = in_place
    try:
        yield
    finally:
        layer_mod.fused_recurrent_kda = original


def kernel_times(fn, n: int = 10) -> dict[str, float]:
    """µs of GPU time per call of `fn`, per kernel name (torch.profiler over n calls after one warm call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0.0)
        if t:
            out[e.key] = out.get(e.key, 0.0) + t / n
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def op_shares(kernels: dict[str, float], other: dict[str, float]) -> tuple[float, float, float]:
    """(µs of the KDA decode kernels, µs of the short-convolution steps, µs of everything) in one side's profile.
    The convolutions by name (FLA's causal_conv1d_update_kernel, fla_cula's conv1d_update_kernel); the KDA kernel:
    FLA's by name, fla_cula's as the other kernel names the other side's profile does not have."""
    total = sum(kernels.values())
    conv = sum(t for k, t in kernels.items() if "conv1d_update" in k)
    kda = sum(t for k, t in kernels.items()
              if "conv1d_update" not in k and ("fused_recurrent_kda" in k or k not in other))
    return kda, conv, total


def row_decode_graph(model, device, B: int, reps: int, inplace: bool = False) -> dict:
    from benchmarks.harness import _do_bench

    cache, _, nxt = prompt_cache(model, B, device)
    snap = snapshot(cache)
    steps = {}
    errors = {}
    for side in ("plain", "patched"):
        set_patched(side == "patched")
        try:
            restore(cache, snap, in_place=False)
            with serving_state_in_place() if inplace else contextlib.nullcontext():
                steps[side] = GraphStep(model, cache, nxt).capture()
        except Exception as e:  # noqa: BLE001 - recorded
            errors[side] = f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
    set_patched(False)
    if errors:
        msg = "; ".join(f"{k}: {v}" for k, v in errors.items())
        return {"error": msg, "shape": f"B={B} T=1 (cache of {PROMPT} tokens)", "B": B, "T": 1}
    samples = alternate({s: (lambda s=s: 1e-3 * _do_bench(steps[s].graph.replay)) for s in steps}, reps)
    # logits: both graphs from the same snapshot, same fed token, DECODE_CHECK_STEPS replays each
    seq = {}
    for side, st in steps.items():
        for s, conv, src in zip(st.static, st.conv, snap, strict=True):  # each graph's own buffers
            s.copy_(src["recurrent_state"])
            for dst, c in zip(conv or (), src["conv_state"] or (), strict=True):
                dst.copy_(c)
        out = []
        for _ in range(DECODE_CHECK_STEPS):
            st.graph.replay()
            out.append(st.logits.clone())
        seq[side] = out
    err = max(rel_rms(a, b) for a, b in zip(seq["plain"], seq["patched"], strict=True))
    kern = {side: kernel_times(st.graph.replay) for side, st in steps.items()}
    share = {side: op_shares(kern[side], kern["patched" if side == "plain" else "plain"]) for side in kern}
    split = (f"KDA kernel {share['plain'][0]:.1f} / {share['patched'][0]:.1f} µs, short convolutions "
             f"{share['plain'][1]:.1f} / {share['patched'][1]:.1f} µs of {share['plain'][2]:.1f} / "
             f"{share['patched'][2]:.1f} µs GPU time (plain / patched, profiled replays)")
    side_extra = {side: {"kernels_us": {k: round(t, 2) for k, t in kern[side].items()},
                         "kda_us": share[side][0], "conv_us": share[side][1], "gpu_us": share[side][2]}
                  for side in kern}
    if inplace:
        note = f"graph step, state updated in place (fused_recurrent_kda_fwd inplace_final_state=True); {split}"
        return _pair(samples, {}, {"logits_rel_rms": err}, f"B={B} T=1 (cache of {PROMPT} tokens)", B, 1,
                     note=note, side_extra=side_extra)
    copy_ms = steps["plain"].copy_back_ms()
    note = f"graph step incl. the state copy-back into the static buffers ({copy_ms * 1e3:.1f} µs alone); {split}"
    return _pair(samples, {}, {"logits_rel_rms": err}, f"B={B} T=1 (cache of {PROMPT} tokens)", B, 1,
                 note=note, extra={"copy_back_ms": copy_ms}, side_extra=side_extra)


def row_generate(model, device, B: int, reps: int) -> dict:
    g = torch.Generator(device=device).manual_seed(3)
    ids = torch.randint(3, model.config.vocab_size, (B, PROMPT), device=device, generator=g)
    mask = torch.ones_like(ids)
    seqs = {}

    def gen(side):
        def f():
            with torch.inference_mode():
                seqs[side] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                            min_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True,
                                            pad_token_id=0)
        return f

    first = {}
    for side in ("plain", "patched"):
        set_patched(side == "patched")
        first[side] = _sync_time(gen(side))
    set_patched(False)
    samples = alternate({s: (lambda s=s: _sync_time(gen(s))) for s in ("plain", "patched")}, reps)
    a, b = seqs["plain"][:, PROMPT:], seqs["patched"][:, PROMPT:]
    same = float((a == b).double().mean()) if a.shape == b.shape else None
    note = "greedy; HF generate with attention_mask"
    if same is not None:
        note += f"; {100 * same:.0f}% of new tokens equal (random init: near-ties flip)"
    return _pair(samples, first, {"tokens_equal": same}, f"B={B} prompt {PROMPT} + {NEW_TOKENS} new", B,
                 PROMPT + NEW_TOKENS, note=note)


def row_train(model, device, reps: int) -> dict:
    B, T = TRAIN
    g = torch.Generator(device=device).manual_seed(4)
    ids = torch.randint(3, model.config.vocab_size, (B, T), device=device, generator=g)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    first = {}
    try:
        for side in ("plain", "patched"):
            set_patched(side == "patched")
            first[side] = _sync_time(step)
        set_patched(False)
        samples = alternate({s: (lambda: _sync_time(step)) for s in ("plain", "patched")}, reps)
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)
    return _pair(samples, first, {}, f"B={B} T={T}", B, T, note="forward + loss + backward + AdamW step")


def _pair(samples, first, patched_extra, shape, B, T, note="", extra=None, side_extra=None) -> dict:
    out = {"shape": shape, "B": B, "T": T}
    for side in ("plain", "patched"):
        xs = samples.get(side, [])
        d = {"ms": 1e3 * statistics.median(xs) if xs else None, "samples_ms": [round(1e3 * x, 4) for x in xs],
             "first_ms": 1e3 * first[side] if side in first else None, "note": note}
        if side == "patched":
            d.update(patched_extra)
        d.update(extra or {})
        d.update((side_extra or {}).get(side, {}))
        out[side] = d
    return out


# ---------------------------------------------------------------------------------------------
def plan(layers: list[int], rows: list[str]) -> list[tuple[int, str, object]]:
    """(layers, row kind, parameter) in run order; train last (it changes the weights)."""
    out = []
    for n in layers:
        kinds = [r for r in ROWS if r in rows and (n <= 4 or r in LAYERS_24_ROWS)]
        for k in kinds:
            params = {"prefill": [None], "decode": list(DECODE_B), "graph": list(DECODE_B),
                      "graph_inplace": list(DECODE_B), "generate": list(GENERATE_B), "train": [None]}[k]
            out += [(n, k, p) for p in params]
    return out


OPS = {"prefill": ("kda_model_prefill", "eager"), "decode": ("kda_model_decode", "eager"),
       "graph": ("kda_model_decode", "graph"), "graph_inplace": ("kda_model_decode", "graph_inplace"),
       "generate": ("kda_model_generate", "eager"),
       "train": ("kda_model_train", "fwdbwd")}


# Timed runs per side by row kind when --reps is not given. Graph replays repeat within 0.1%; the eager rows are
# host-bound or allocator-bound and spread by 5-20% between runs on the H200 (session 12: 4L prefill 16.3-17.8 ms
# with both sides on FLA's kernels), so they get more ABBA pairs before their median decides a row.
DEFAULT_REPS = {"prefill": 11, "decode": 11, "graph": 5, "graph_inplace": 5, "generate": 9, "train": 7}


def run_one(model, device, kind: str, param, reps: int | None = None) -> dict:
    reps = DEFAULT_REPS[kind] if reps is None else reps
    if kind == "prefill":
        return row_prefill(model, device, reps)
    if kind == "decode":
        return row_decode_eager(model, device, param, reps)
    if kind in ("graph", "graph_inplace"):
        return row_decode_graph(model, device, param, reps, inplace=kind == "graph_inplace")
    if kind == "generate":
        return row_generate(model, device, param, max(3, reps // 2 + 1))
    if kind == "train":
        return row_train(model, device, reps)
    raise ValueError(f"row kind must be one of {ROWS}, got {kind!r}")


def to_records(res: dict, n_layers: int, kind: str, cfg: dict, routes: dict, jit: dict, header: dict,
               jit_timed: dict | None = None, gate: str = "bounded") -> list[dict]:
    op, mode = OPS[kind]
    recs = []
    bench = f"KDAForCausalLM {n_layers} layers" + ("" if gate == "bounded" else f", {gate} gate")
    for side in ("plain", "patched"):
        d = res.get(side, {})
        rec = {"op": op, "bench": bench, "impl": side, "mode": mode,
               "shape": res["shape"], "B": res["B"], "T": res["T"], "layers": n_layers, "config": cfg,
               "error": res.get("error"), "commit": header.get("fla_cula commit"), "gpu": header.get("gpu")}
        rec.update({k: v for k, v in d.items()})
        rec.setdefault("ms", None)
        if side == "patched":
            rec["routes"], rec["jit_row"], rec["jit_timed"] = routes, jit, jit_timed or {}
        recs.append(rec)
    return recs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    p.add_argument("--layers", nargs="+", type=int, default=[4], help="model depths (24: prefill and decode rows)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed runs per side (default: DEFAULT_REPS per row kind; generate: half + 1, at least 3)")
    p.add_argument("--out", help="directory for BENCHMARK_<tag>.md and benchmark_<tag>.json (merged into)")
    p.add_argument("--tag", default=None, help="report suffix (default: the GPU's, e.g. H200)")
    p.add_argument("--budget", type=float, default=None, help="seconds: start no new row after this")
    p.add_argument("--gate", choices=sorted(GATES), default="bounded",
                   help="bounded: safe_gate, lower_bound=-5 (default); softplus: the KDA layer's default gate")
    p.add_argument("--list", action="store_true")
    a = p.parse_args(argv)
    todo = plan(a.layers, a.rows)
    if a.list:
        for n, k, prm in todo:
            print(f"{n:>3} layers  {OPS[k][0]:<20} {OPS[k][1]:<7} {prm if prm is not None else ''}")
        print(f"{len(todo)} rows")
        return 0
    if not torch.cuda.is_available():
        print("benchmarks model: no CUDA device; nothing to time (use --list).", file=sys.stderr)
        return 2
    from benchmarks import report
    from benchmarks.peers import output_paths, run_header
    from fla_cula import routing

    device = torch.device("cuda", torch.cuda.current_device())
    header = run_header("python -m benchmarks model", argv)
    a.tag = report.resolve_tag(a.tag)
    md, js = output_paths(a.out, a.tag)
    t_start = time.perf_counter()
    models: dict[int, tuple] = {}
    print(f"benchmarks model: {len(todo)} rows on {header['gpu']}", flush=True)
    for i, (n, kind, prm) in enumerate(todo):
        if a.budget is not None and time.perf_counter() - t_start > a.budget:
            left = [f"{m}L {k} {q if q is not None else ''}".strip() for m, k, q in todo[i:]]
            header["INCOMPLETE"] = f"time budget {a.budget:.0f} s reached; not run: " + "; ".join(left)
            report.write_merged([], header, {}, {}, md, js, f"fla_cula vs FLA 0.6.0 benchmarks ({a.tag})")
            print(f"benchmarks model: budget reached, not run: {left}", flush=True)
            break
        if n not in models:
            models.clear()
            torch.cuda.empty_cache()
            models[n] = build_model(n, device, a.gate)
        model, cfg = models[n]
        cfg_d = {k: getattr(cfg, k) for k in (*BASE_CONFIG, "num_hidden_layers")}
        routing.reset_status()
        TIMED_JIT.clear()
        j0 = _jit_stats()
        t0 = time.perf_counter()
        try:
            res = run_one(model, device, kind, prm, a.reps)
        except Exception as e:  # noqa: BLE001 - recorded per row
            set_patched(False)
            res = {"shape": f"{kind} {prm}", "B": prm, "T": None,
                   "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
        recs = to_records(res, n, kind, cfg_d, routing.status(), _delta(j0, _jit_stats()), header, dict(TIMED_JIT),
                          a.gate)
        for r in recs:
            r["wall_s"] = round(time.perf_counter() - t0, 1)
        header["wall time"] = f"{time.perf_counter() - t_start:.0f} s ({i + 1} of {len(todo)} rows)"
        report.write_merged(recs, header, {}, {}, md, js, f"fla_cula vs FLA 0.6.0 benchmarks ({a.tag})")
        pl, pa = recs
        sp = report.speedup(pl["ms"], pa["ms"])
        print(f"  {n:>2}L {OPS[kind][0]:<20} {OPS[kind][1]:<6} {res['shape']:<34} plain {_fmt(pl['ms'])} "
              f"patched {_fmt(pa['ms'])} x{'-' if sp is None else f'{sp:.3f}'}  logits {pa.get('logits_rel_rms')}  "
              f"routes {report._routes_txt(pa.get('routes'))[:160]}  "
              f"jit row {pa.get('jit_row')} timed {pa.get('jit_timed')}"
              + (f"  ERROR {res['error']}" if res.get("error") else "") + f"  ({time.perf_counter() - t0:.1f} s)",
              flush=True)
    print(f"benchmarks model: wrote {md} and {js} ({time.perf_counter() - t_start:.0f} s)", flush=True)
    return 0


def _fmt(ms) -> str:
    return "-" if ms is None else f"{ms:.3f} ms"


if __name__ == "__main__":
    os.environ["FLA_FLASH_KDA"] = "0"
    sys.exit(main())
