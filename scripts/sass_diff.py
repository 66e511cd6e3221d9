"""Is the decode kernel's machine code unchanged? ``python scripts/sass_diff.py REV [--extra]``

Compiles every representative config of fla_cula/kernels/recurrent_decode.py (plus, with --extra,
a few more gate / dtype variants) for sm_90a on this CPU machine, once from git revision REV and
once from the working tree, and compares the SASS instruction by instruction (addresses stripped).
Use it to show that a refactor or a new off-by-default knob leaves the measured default path
untouched, so H200 results of REV still describe it. Needs cuobjdump (PATH or Triton's copy).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = "fla_cula/kernels/recurrent_decode.py"
EXTRA = [
    dict(mode="kda", gate_in_kernel=True, has_A=False, has_bias=True, has_lower_bound=True),
    dict(mode="kda", gate_in_kernel=True, has_A=True, has_bias=False),
    dict(mode="kda", qk_dtype="float16", v_dtype="float16", g_dtype="float16", beta_dtype="float16",
         o_dtype="float16", varlen=True, cu_dtype="int64"),
    dict(mode="kda", qk_dtype="float32", v_dtype="float32", g_dtype="float32", beta_dtype="float32",
         o_dtype="float32", has_h0=False, state_v_first=True),
    dict(mode="lightning", qk_dtype="float16", v_dtype="float16", o_dtype="float16", g_dtype="float32",
         beta_dtype="float32", has_ht=False),
]


def _cuobjdump() -> str:
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def cuobjdump(mod, kw: dict, *flags: str) -> list[str]:
    """Compile DecodeConfig(**kw) of a recurrent_decode module for sm_90a; cuobjdump's output for each
    flag ("-sass", "-res-usage", ...)."""
    return cuobjdump_spec(mod.RecurrentDecode(mod.DecodeConfig(**kw)).spec(), *flags)


def cuobjdump_spec(spec, *flags: str) -> list[str]:
    """cuobjdump's output for each flag on any KernelSpec compiled for sm_90a."""
    from fla_cula.jit import compile_spec

    with tempfile.TemporaryDirectory() as d:
        compile_spec(spec, keep_ptx_dir=d)
        cubin = [p for p in glob.glob(d + "/**/*", recursive=True) if p.endswith((".cubin", ".o", ".elf"))][0]
        return [subprocess.run([_cuobjdump(), f, cubin], capture_output=True, text=True, check=True).stdout
                for f in flags]


def _sass(mod, kw: dict) -> list[str]:
    text, = cuobjdump(mod, kw, "-sass")
    return [re.sub(r"/\*[0-9a-f]{4}\*/", "", line.split(";")[0]).strip()
            for line in text.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="git revision to compare the working tree with")
    ap.add_argument("--extra", action="store_true", help="also compare a few more gate / dtype variants")
    a = ap.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ.setdefault("FLA_CULA_CACHE_DIR", tempfile.mkdtemp(prefix="sass_diff_"))
    sys.path.insert(0, ROOT)
    old_src = subprocess.run(["git", "show", f"{a.rev}:{SRC}"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(old_src)
    old, new = _load(f.name, "rd_rev"), _load(os.path.join(ROOT, SRC), "rd_tree")
    cfgs = [dataclasses.asdict(c) for c in old.representative_configs()] + (EXTRA if a.extra else [])
    same = 0
    new_fields = {f.name for f in dataclasses.fields(new.DecodeConfig)}
    for kw in cfgs:
        kw = {k: v for k, v in kw.items() if k in new_fields}  # knobs deleted since REV: at their default
        x, y = _sass(old, kw), _sass(new, kw)
        same += x == y
        diff = {k: v for k, v in kw.items() if getattr(old.DecodeConfig(), k) != v}
        print(f"{'identical' if x == y else 'DIFFERENT'}  {len(x):5d} / {len(y):5d} instructions  {diff}", flush=True)
    print(f"{same} of {len(cfgs)} configs compile to identical SASS ({a.rev} vs working tree)")
    return 0 if same == len(cfgs) else 1


if __name__ == "__main__":
    sys.exit(main())
