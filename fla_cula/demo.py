"""The README's main job: a small FLA KDA model (fla.models), unpatched vs patched.

On an SM90 GPU: forward + backward (chunk_kda: training path) and greedy generation
(fused_recurrent_kda: the decode path), unpatched then patched on the same weights and inputs;
prints the routes fla_cula took, the max differences and the times.
Without a GPU: says what cannot run here, then compiles every registered kernel for sm_90a and
checks each PTX holds the instructions it is meant to use.
"""

from __future__ import annotations

import tempfile
import time


def _compile_all() -> int:
    from fla_cula import jit
    bad = 0
    specs = jit.registered_specs()
    with tempfile.TemporaryDirectory() as d:
        for s in specs:
            t0 = time.perf_counter()
            c = jit.compile_spec(s, keep_ptx_dir=d)
            missing = jit.missing_ptx(s, c.__ptx__)
            bad += bool(missing)
            print(f"  {s.name:<22} {str(dict(s.key)):<70.70} {time.perf_counter() - t0:6.2f}s "
                  f"{'ok' if not missing else 'MISSING ' + str(missing)}")
    print(f"compiled {len(specs)} specializations for {jit.ensure_target_arch()}; {bad} failed the PTX check")
    return bad


def main(steps: int = 8) -> int:
    import torch

    import fla_cula

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        why = "no CUDA device" if not torch.cuda.is_available() else "GPU is not SM90"
        print(f"{why}: the model demo needs an SM90 GPU (FLA's Triton kernels and ours run only there).")
        print("What works here: patch()/unpatch(), routing and its reasons, the fp64 references, and")
        print("compiling every CuTe DSL kernel for sm_90a:")
        return 1 if _compile_all() else 0

    from fla.models import KDAConfig, KDAForCausalLM

    torch.manual_seed(0)
    cfg = KDAConfig(hidden_size=512, num_heads=4, head_dim=128, num_hidden_layers=2, vocab_size=1000,
                    fuse_cross_entropy=False)
    model = KDAForCausalLM(cfg).cuda().to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (2, 256), device="cuda")
    prompt = ids[:, :32]

    def step():
        model.train()  # FLA's KDA layer: chunk_kda in train mode, fused_recurrent_kda decode in eval mode
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        model.eval()
        with torch.inference_mode():
            gen = model.generate(prompt, max_new_tokens=steps, do_sample=False, use_cache=True)
        torch.cuda.synchronize()
        grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        return out.logits.detach().float(), grads, gen, t1 - t0, time.perf_counter() - t1

    def phase(what):
        print(f"[{time.perf_counter() - t_start:7.1f} s] {what}", flush=True)

    t_start = time.perf_counter()
    fla_cula.unpatch()
    phase("unpatched warm-up (FLA's Triton kernels compile and autotune on a fresh machine)")
    step()
    phase("unpatched, twice (FLA against itself: its run-to-run spread)")
    lo_a, g_a, gen_a, tf_a, tg_a = step()
    lo_a2, g_a2, gen_a2, _, _ = step()  # backward atomics
    fla_cula.reset_status()
    with fla_cula.patched():
        phase("patched warm-up (fla_cula kernels compile or load from the cache)")
        step()
        fla_cula.reset_status()
        phase("patched")
        lo_b, g_b, gen_b, tf_b, tg_b = step()
    phase("done")
    st = fla_cula.status()
    print("routes (patched run):")
    for op, s in st.items():
        print(f"  {op:<28} kernel={s['kernel']:<4} fallbacks={s['fallback']}")

    def maxdiff(xs, ys):
        return max((x.float() - y.float()).abs().max().item() for x, y in zip(xs, ys, strict=True))

    dl, dl_fla = (lo_a - lo_b).abs().max().item(), (lo_a - lo_a2).abs().max().item()
    dg, dg_fla = maxdiff(g_a, g_b), maxdiff(g_a, g_a2)
    same_tokens = torch.equal(gen_a, gen_b)
    print(f"forward logits   max|unpatched - patched| = {dl:.3e}   (FLA vs FLA: {dl_fla:.3e})")
    print(f"gradients        max|unpatched - patched| = {dg:.3e}   (FLA vs FLA: {dg_fla:.3e}, {len(g_a)} tensors)")
    print(f"generation       {steps} greedy tokens identical: {same_tokens}")
    print(f"time fwd+bwd     unpatched {tf_a * 1e3:8.2f} ms   patched {tf_b * 1e3:8.2f} ms")
    print(f"time generate    unpatched {tg_a * 1e3:8.2f} ms   patched {tg_b * 1e3:8.2f} ms")
    calls = sum(s["calls"] for s in st.values())
    print(f"fla_cula accounted for {calls} calls")
    ok = dl <= dl_fla and dg <= dg_fla and same_tokens and calls > 0
    print("OK: patched run reproduces FLA" if ok else "MISMATCH: patched run differs from FLA beyond FLA's own spread")
    return 0 if ok else 1
