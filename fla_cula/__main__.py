"""Command line: `python -m fla_cula info` | `python -m fla_cula run script.py [args...]` |
`python -m fla_cula demo` (the README's main job: a small FLA KDA model, patched vs unpatched)."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for pkg in ("torch", "triton", "fla-core", "flash-linear-attention", "nvidia-cutlass-dsl", "apache-tvm-ffi",
                "nvidia-cutlass"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def info(as_json: bool = False) -> dict:
    import torch

    import fla_cula
    from fla_cula import jit, patching, routing

    rep: dict = {"fla_cula": fla_cula.__version__, "versions": _versions(), "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        rep["gpus"] = [{"index": i, "name": torch.cuda.get_device_name(i),
                        "capability": ".".join(map(str, torch.cuda.get_device_capability(i)))}
                       for i in range(torch.cuda.device_count())]
        rep["kernels_usable_here"] = routing._device_reason(0) or "yes"
    else:
        rep["gpus"] = []
        rep["kernels_usable_here"] = "no CUDA device: every call routes to FLA; kernels still compile for sm_90a"
    rep["dsl"] = jit.dsl_available_reason() or "ok"
    rep["target_arch"] = jit.ensure_target_arch()
    rep["cache_dir"] = str(jit.cache_dir())
    from fla_cula.kernels import registry
    rep["ops"] = registry.describe()
    rep["kernel_modules"] = registry.describe_kernels()
    try:
        specs = jit.registered_specs(strict=False)
        rep["kernels"] = [{"name": s.name, "key": dict(s.key), "cached_on_disk": jit.is_cached_on_disk(s),
                           "compiled_in_process": jit.is_cached_in_process(s)} for s in specs]
    except Exception as e:  # a kernel module failed to import: say so, do not hide it
        rep["kernels"] = f"error importing kernels: {type(e).__name__}: {e}"
    try:
        from fla_cula import _ext
        ok, why = _ext.available()
        rep["cpp_extension"] = "ok" if ok else why
    except Exception as e:
        rep["cpp_extension"] = f"unavailable ({e})"
    rep["patched"] = patching.is_patched()
    rep["env"] = {k: os.environ.get(k) for k in ("FLA_CULA", "FLA_CULA_STRICT", "FLA_CULA_STAND_IN", "FLA_CULA_PATCH",
                                                 "FLA_CULA_CACHE_DIR", "CUTE_DSL_ARCH",
                                                 "FLA_DISABLE_BACKEND_DISPATCH")}
    rep["status"] = routing.status()
    if as_json:
        print(json.dumps(rep, indent=2))
    else:
        for k, v in rep.items():
            if k == "ops":
                print("ops (kernel, language, grad policy, status):")
                for r in v:
                    kern, lang = r["kernel"] or "-", r["lang"] or "-"
                    print(f"  {r['op']:<31} {kern:<18} {lang:<9} {r['grad']:<28} {r['status']}")
            elif k == "kernel_modules":
                print("kernel modules (language, ops served, status):")
                for r in v:
                    print(f"  {r['kernel']:<30} {r['lang']:<15} {','.join(r['ops']) or '-':<45} {r['status']}")
            elif k == "kernels" and isinstance(v, list):
                print(f"kernels ({len(v)} registered specializations; fields that vary between them):")
                for s in v:
                    same = [o for o in v if o["name"] == s["name"]]
                    vary = {f: x for f, x in s["key"].items() if len({str(o["key"].get(f)) for o in same}) > 1}
                    print(f"  {s['name']:<18} {vary}  disk-cached={s['cached_on_disk']}")
            else:
                print(f"{k}: {v}")
    return rep


def run(argv: list[str]) -> None:
    """Patch FLA, then run a script or module as __main__ (like `python script.py` / `python -m mod`)."""
    import fla_cula
    fla_cula.patch()
    if argv and argv[0] == "-m":
        mod, rest = argv[1], argv[2:]
        sys.argv = [mod, *rest]
        runpy.run_module(mod, run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m fla_cula")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("info", help="GPU, versions, kernels, cache, patch and env state")
    pi.add_argument("--json", action="store_true")
    pr = sub.add_parser("run", help="patch FLA, then run a script: run train.py [args] | run -m module [args]")
    pr.add_argument("argv", nargs=argparse.REMAINDER)
    pd = sub.add_parser("demo", help="a small FLA KDA model, patched vs unpatched (GPU), or compile-only (CPU)")
    pd.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    if a.cmd == "info":
        info(a.json)
    elif a.cmd == "run":
        if not a.argv:
            p.error("run needs a script (or -m module)")
        run(a.argv)
    else:
        from fla_cula import demo
        sys.exit(demo.main(steps=a.steps))


if __name__ == "__main__":
    main()
