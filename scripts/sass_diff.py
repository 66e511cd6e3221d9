"""Is the CuTe DSL kernels' machine code unchanged? ``python scripts/sass_diff.py REV [--extra] [--only NAME]``

Compiles every representative config of fla_cula/kernels/recurrent_decode.py,
recurrent_decode_mma.py and lightning_prefill.py (the union of REV's and the working tree's lists; with
--extra, a few more gate / dtype variants of the token kernel) for sm_90a on this CPU machine, once from git revision
REV and once from the working tree, and compares the SASS instruction by instruction (addresses
stripped). REV's kernel package is exported to a temporary directory (its modules import each
other, not the working tree's); both sides compile through the working tree's fla_cula.jit.
A config field that exists on one side only is compared at its default; a config that sets such a
field away from its default exists on one side only and is listed as skipped.
Use it to show that a refactor or a new off-by-default knob leaves the measured default path
untouched, so H200 results of REV still describe it. Needs cuobjdump (PATH or Triton's copy).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "fla_cula/kernels"
REV_PKG = "_sass_diff_rev_kernels"
# kernel module -> (kernel class, config class)
KERNELS = {"recurrent_decode": ("RecurrentDecode", "DecodeConfig"),
           "recurrent_decode_mma": ("RecurrentDecodeMma", "MmaDecodeConfig"),
           "lightning_prefill": ("LightningPrefill", "LightningPrefillConfig")}
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


def _rev_package(rev: str) -> str:
    """Export REV's fla_cula/kernels/*.py as the package REV_PKG (imports between kernel modules
    rewritten to it) under a temporary directory on sys.path; returns the directory."""
    d = tempfile.mkdtemp(prefix="sass_diff_rev_")
    os.makedirs(os.path.join(d, REV_PKG))
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{PKG}"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in names:
        if not name.endswith(".py"):
            continue
        src = "" if name == "__init__.py" else subprocess.run(
            ["git", "show", f"{rev}:{PKG}/{name}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        src = src.replace("from fla_cula.kernels import", f"from {REV_PKG} import")
        src = src.replace("fla_cula.kernels.", f"{REV_PKG}.")
        with open(os.path.join(d, REV_PKG, name), "w") as f:
            f.write(src)
    sys.path.insert(0, d)
    return d


def _module(pkg: str, name: str):
    try:
        return importlib.import_module(f"{pkg}.{name}")
    except ModuleNotFoundError:
        return None


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


def _sass(mod, kernel: str, kw: dict) -> list[str]:
    kcls, ccls = KERNELS[kernel]
    text, = cuobjdump_spec(getattr(mod, kcls)(getattr(mod, ccls)(**kw)).spec(), "-sass")
    return [re.sub(r"/\*[0-9a-f]{4}\*/", "", line.split(";")[0]).strip()
            for line in text.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]


def _configs(old, new, kernel: str, extra: list[dict]) -> tuple[list[dict], list[str]]:
    """(configs to compare as field dicts valid on both sides, descriptions of one-sided configs)."""
    ccls = KERNELS[kernel][1]
    old_c, new_c = getattr(old, ccls), getattr(new, ccls)
    old_d = {f.name: f.default for f in dataclasses.fields(old_c)}
    new_d = {f.name: f.default for f in dataclasses.fields(new_c)}
    both, skipped, seen = [], [], set()
    for kw in ([dataclasses.asdict(c) for c in old.representative_configs()] + extra
               + [dataclasses.asdict(c) for c in new.representative_configs()]):
        one_sided = {k: v for k, v in kw.items() if (k not in new_d and v != old_d.get(k, v))
                     or (k not in old_d and v != new_d.get(k, v))}
        kw = {k: v for k, v in kw.items() if k in old_d and k in new_d}
        key = tuple(sorted(kw.items()))
        if key in seen:
            continue
        seen.add(key)
        if one_sided:
            skipped.append(f"{kernel} {one_sided} (a field only one side has)")
        else:
            both.append(kw)
    return both, skipped


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="git revision to compare the working tree with")
    ap.add_argument("--extra", action="store_true", help="also compare a few more gate / dtype variants")
    ap.add_argument("--only", choices=sorted(KERNELS), help="compare this kernel module only")
    a = ap.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ.setdefault("FLA_CULA_CACHE_DIR", tempfile.mkdtemp(prefix="sass_diff_"))
    sys.path.insert(0, ROOT)
    _rev_package(a.rev)
    same = total = 0
    skipped: list[str] = []
    for kernel in [a.only] if a.only else KERNELS:
        old, new = _module(REV_PKG, kernel), _module("fla_cula.kernels", kernel)
        if old is None or new is None:
            skipped.append(f"{kernel}: only in {'the working tree' if old is None else a.rev}")
            continue
        cfgs, sk = _configs(old, new, kernel, EXTRA if a.extra and kernel == "recurrent_decode" else [])
        skipped += sk
        defaults = getattr(new, KERNELS[kernel][1])()
        for kw in cfgs:
            x, y = _sass(old, kernel, kw), _sass(new, kernel, kw)
            same += x == y
            total += 1
            diff = {k: v for k, v in kw.items() if getattr(defaults, k) != v}
            print(f"{'identical' if x == y else 'DIFFERENT'}  {kernel:20s} {len(x):5d} / {len(y):5d} instructions"
                  f"  {diff}", flush=True)
    for line in skipped:
        print(f"skipped    {line}")
    print(f"{same} of {total} configs compile to identical SASS ({a.rev} vs working tree)")
    return 0 if same == total else 1


if __name__ == "__main__":
    sys.exit(main())
