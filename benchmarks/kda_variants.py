"""KDA prefill forms side by side (H200): FLA's chunk_kda, the fused kernel and the two-kernel form (its split).

    python -m benchmarks.kda_variants                      # the default rows, random gates
    python -m benchmarks.kda_variants --rows '[[1, 8192, 8]]' --regime slow
    python -m benchmarks.kda_variants --variants '{"fused": {}, "P4": {"two_kernel": true, "segments": 4}}'
    python -m benchmarks.kda_variants --variants '{"pc":{"two_kernel":true},"pc4":{"two_kernel":true,"prep_chunks":4}}'

Each row: one shape (K = V = 128, bf16, FLA's layer flags: l2norm, the bounded gate with A_log / dt_bias, beta
sigmoid, h0 and the final state, the peers benchmark's inputs). FLA and every variant of ``--variants`` (name ->
``kda_prefill.set_tuning`` knobs) are captured in CUDA graphs once; ``--rounds`` rounds then time each replay in turn
(triton do_bench, median over the rounds in ms, the speedup over FLA, the spread when above 3%, ``!`` when o or the
final state differs from FLA's by more than rel-RMS 0.01). Below each row, for every two-kernel variant, the time of
each of its passes replayed alone (prep, maps, combine, pass 2) next to the cost model's prediction
(kda_prefill.two_kernel_plan), so the model's constants can be fitted. A measuring tool for docs/kda_sm90.md, not
part of the report.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

ROWS = ((1, 8192, 8), (1, 2048, 16), (1, 32768, 16), (1, 8192, 64), (2, 8192, 64), (8, 4096, 64))
DEFAULT_VARIANTS = ('{"fused": {"two_kernel": false}, "two": {"two_kernel": true}, '
                    '"two_P1": {"two_kernel": true, "segments": 1}}')


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kda_variants", description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="JSON: name -> kda_prefill.set_tuning knobs")
    p.add_argument("--rows", default=None, help="JSON list of [B, T, H] (default: six rows, small grids first)")
    p.add_argument("--regime", choices=("random", "slow", "fast"), default="random")
    p.add_argument("--rounds", type=int, default=3, help="timing rounds over all builds (median reported)")
    p.add_argument("--profile", action="store_true",
                   help="also run each two-kernel variant's prep and last pass instrumented (phase_cycles) and print "
                        "their cycles per chunk per CTA by phase")
    args = p.parse_args(argv)
    variants = json.loads(args.variants)
    rows = [tuple(r) for r in json.loads(args.rows)] if args.rows else ROWS

    import triton
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    from benchmarks.harness import capture_graph, variant_row
    from benchmarks.peers import kernel_args, make_inputs
    from benchmarks.registry import Shape
    from fla_cula.kernels import kda_prefill as kp
    from fla_cula.reference.compare import rel_rms

    dev = torch.device("cuda")
    sms = kp._sm_count(dev)  # the SMs the plan counts (an MPS limit included)
    print(f"{'B':>3} {'T':>6} {'H':>3} {'FLA':>14} " + " ".join(f"{name:>20}" for name in variants), flush=True)
    for B, T, H in rows:
        x = make_inputs(Shape(B, T, H, H), args.regime, dev)
        kargs = kernel_args(x)
        cfg = kargs[-1]

        fla = functools.partial(fla_chunk_kda, x["q"], x["k"], x["v"], x["g"], x["beta"], scale=cfg.scale,
                                initial_state=x["initial_state"], output_final_state=True,
                                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=x["A_log"],
                                dt_bias=x["dt_bias"], safe_gate=True, lower_bound=-5.0, state_v_first=True,
                                use_beta_sigmoid_in_kernel=cfg.use_beta_sigmoid_in_kernel)

        with torch.inference_mode():
            o_fla, ht_fla = fla()
            graphs, ok, passes = {None: capture_graph(fla)}, {}, {}
            for name, knobs in variants.items():
                kp.set_tuning(**knobs)
                try:
                    r = kp.run(*kargs)
                    o, ht = r.o, r.final_state
                    ok[name] = rel_rms(o_fla.float(), o.float()) < 0.01 and rel_rms(ht_fla, ht) < 0.01
                    graphs[name] = capture_graph(functools.partial(kp.run, *kargs))
                    if knobs.get("two_kernel"):
                        passes[name] = _pass_graphs(kp, kargs, B, T, H, sms, knobs, capture_graph, args.profile)
                finally:
                    kp.set_tuning()
            row = variant_row(graphs, args.rounds, ok)
        print(f"{B:>3} {T:>6} {H:>3} {row}", flush=True)
        for name, (plan, pgraphs, prof, _buffers) in passes.items():
            parts = ", ".join(f"{pn} {triton.testing.do_bench(g.replay, warmup=25, rep=100):.3f}"
                              for pn, g in pgraphs)
            print(f"      {name}: P={plan.segments} seg {plan.seg_chunks} block_v {plan.block_v} prep_chunks "
                  f"{plan.prep_chunks}{' roles (one launch)' if plan.roles else ''}: {parts} ms "
                  f"(model {plan.us / 1e3:.3f} ms in all)", flush=True)
            for pn, phases in prof.items():
                print(f"        {pn} cycles per chunk per CTA: " +
                      ", ".join(f"{ph} {c:.0f}" for ph, c in phases.items() if c) +
                      f"; sum {sum(phases.values()):.0f}", flush=True)
    return 0


def _pass_graphs(kp, kargs, B, T, H, sms, knobs, capture_graph, profile=False):
    """The two-kernel form's passes of this call, each captured alone on buffers a full run has filled; with
    `profile`, the prep and the last pass run once more instrumented: name -> {phase: cycles per chunk per CTA}."""
    q = kargs[0]
    lens = [T] * B
    state_rs = knobs.get("state_rs", kp.STATE_RS_VERIFIED)  # set_tuning's default when the variant does not set it
    plan = kp.two_kernel_plan(lens, H, sms, knobs.get("segments"), knobs.get("block_v"), state_rs,
                              knobs.get("prep_chunks"), knobs.get("roles"))
    calls = []
    launch = kp.launcher(*kargs)

    def recording(**kw):
        calls.append(kw)
        launch(**kw)

    o = torch.empty(B, T, H, 128, dtype=q.dtype, device=q.device)
    ht = torch.empty(B, H, 128, 128, dtype=torch.float32, device=q.device)
    kp.run_two_kernel(recording, B, H, kp.record_slots(B, T, B), q.device, plan, o, ht, None, None,
                      combine=kp._C.kda_combine, state_rs=state_rs)
    def name(kw):  # run_two_kernel's order: prep, [pass 2 of segment 0 beside maps | maps], pass 2
        if kw["pass_kind"] == 1:
            return "prep"
        return "maps" if kw["maps"] else "pass 2 seg 0" if kw.get("seg_hi") == 1 else "pass 2"

    # Each pass alone (pass 2 of segment 0 and the maps pass run side by side in the call). The graphs replay into
    # these buffers (records, segment states, o): `calls` (and the combine's copy of seg_H) go back with them, or the
    # buffers would be freed and reused while the graphs still write them.
    first, last = calls[0], calls[-1]
    if plan.roles:  # one launch whose pass 2 waits on flags the first run has set: not timed alone
        return plan, [], {}, calls
    out = [(name(kw), capture_graph(lambda kw=kw: launch(**kw))) for kw in calls]
    maps = [kw for kw in calls if kw["maps"]]
    if maps:
        seg_H, seg_M = maps[0]["seg_H"].clone(), maps[0]["seg_M"]
        out.insert(len(out) - 1, ("combine", capture_graph(lambda: kp._C.kda_combine(seg_H, seg_M))))
        calls.append({"seg_H": seg_H})
    prof = {}
    if profile:
        chunks = B * ((T + kp.CHUNK - 1) // kp.CHUNK)
        for pn, kw in (("prep", first), ("pass 2", last)):
            if kw.get("state_rs"):
                continue  # kda_state_rs_kernel has no phase_cycles instrumentation
            vblocks = 1 if kw["pass_kind"] == 1 else 128 // kw["block_v"]   # the prep runs once per pair
            cycles = torch.zeros(B * H * kw["units"] * vblocks, kp._C.KDA_FWD_PHASES, dtype=torch.int64,
                                 device=q.device)
            launch(**kw, phase_cycles=cycles)
            total = cycles.cpu().to(torch.float64).sum(0) / (chunks * H * vblocks)   # every CTA-chunk once
            prof[pn] = dict(zip(kp._C.KDA_FWD_PHASE_NAMES, total.tolist(), strict=True))
    return plan, out, prof, calls


if __name__ == "__main__":
    raise SystemExit(main())
