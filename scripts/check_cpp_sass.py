"""Resources and required instructions of the C++ kernels in fla_cula._C (CPU only, no GPU needed).

    python scripts/check_cpp_sass.py                      # the built module, the manifest below
    python scripts/check_cpp_sass.py --so PATH --manifest '{"varlen_schedule_kernel": ["HGMMA"]}'

Prints one row per kernel in the module's SASS (``cuobjdump``, from triton's wheel or PATH):
registers, stack and local bytes (non-zero: spills or local arrays), static and dynamic shared
memory. Exits 1 when
  - a kernel is not compiled for sm_90a only,
  - a kernel matches no entry of the manifest (every kernel says what it must contain, [] for none),
  - a kernel lacks an opcode its manifest entry requires (e.g. a WGMMA/TMA kernel without HGMMA or
    UTMALDG: the compiler fell back to a slower path, or the arch lost its "a").
CI runs it after the install (.ci/run); a kernel author adds the kernel's entry to REQUIRED_SASS.
"""

import argparse
import json
import re
import sys
from pathlib import Path

# Kernel name pattern (regex, searched in the demangled name) -> SASS opcodes it must contain
# (an opcode matches with any modifiers: "HGMMA" matches "HGMMA.64x128x16.F32.BF16").
REQUIRED_SASS: dict[str, list[str]] = {
    r"varlen_schedule_kernel": [],  # CUB scans and a radix sort: no tensor cores, no TMA
    # KDA prefill v1: mma.sync products (HMMA), cp.async prefetch (LDGSTS); the wgmma instantiations (fourth
    # template argument, kWgmma, true) also HGMMA. UTMALDG becomes required with TMA loads.
    r"kda_fwd_kernel": ["HMMA", "LDGSTS"],
    r"kda_fwd_kernel<[^,]+, \w+, \d+, true\b": ["HGMMA"],
    # the two-kernel form: the prep (phases 1-6: mma.sync for Aqk / L, wgmma for -W, cp.async loads) and the state
    # kernel (wgmma products, cp.async record loads)
    r"kda_prep_kernel": ["HMMA", "HGMMA", "LDGSTS"],
    r"kda_state_kernel": ["HGMMA", "LDGSTS"],
    # the state passes with the state in registers: RS / MN-major wgmma, cp.async stages; pass 2's O through stmatrix
    r"kda_state_rs_kernel": ["HGMMA", "LDGSTS"],
    r"kda_state_rs_kernel<false,": ["STSM"],
    # the one-launch form: the prep's and pass 2's bodies (mma.sync and wgmma, cp.async, stmatrix) in one kernel
    r"kda_roles_kernel": ["HMMA", "HGMMA", "LDGSTS", "STSM"],
    r"kda_combine_kernel": ["LDGSTS"],  # the split's combine: fp32 FMAs on CUDA cores, the maps by cp.async
    # the backward's chunk-local gradients: mma.sync fed by ldmatrix (.trans for the transposed operands), cp.async
    r"kda_bwd_wy_kernel": ["HMMA", "LDSM", "LDGSTS"],
    r"kda_bwd_intra_kernel": ["HMMA", "LDGSTS"],  # bf16x3 block products on mma.sync, cp.async loads
    r"kda_bwd_dv_kernel": ["HMMA", "LDSM", "LDGSTS"],  # dv = M(Aqk)^T do: mma.sync, ldmatrix.trans, cp.async
    r"kda_bwd_gate_kernel": [],  # dg's reverse cumsum and the gate backward: scalar loads and stores, one pass
}
ARCH = "sm_90a"


def _has(ops: set[str], required: str) -> bool:
    return any(op == required or op.startswith(required + ".") for op in ops)


def _short(name: str, width: int = 64) -> str:
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"\(.*\)$", "", name)  # drop the parameter list
    name = re.sub(r"\b\w+::", "", name)   # and the namespaces
    return name if len(name) <= width else name[: width - 3] + "..."


def check(so: str, manifest: dict[str, list[str]], dynamic_smem: dict[str, int] | None = None) -> list[str]:
    """Print the table; return the failures (empty: all good)."""
    from fla_cula import _ext

    usage = {r["symbol"]: r for r in _ext.resource_usage(so)}
    sass = _ext.sass_opcodes(so)
    names = _ext.demangle(sorted(set(usage) | set(sass)))
    failures = []
    if not sass:
        failures.append(f"{so}: no kernels found in its SASS")
    header = f"{'kernel':64}  {'arch':7} {'regs':>4} {'stack':>5} {'local':>5} {'smem':>6} {'dyn smem':>8}  required"
    print(header)
    print("-" * len(header))
    for sym in sorted(sass, key=lambda s: names[s]):
        arch, ops = sass[sym]
        name = names[sym]
        r = usage.get(sym, {})
        dyn = next((v for k, v in (dynamic_smem or {}).items() if k in sym), None)
        patterns = [p for p in manifest if re.search(p, name) or re.search(p, sym)]
        required = sorted({op for p in patterns for op in manifest[p]})
        missing = [op for op in required if not _has(ops, op)]
        status = ", ".join(f"{op}:{'ok' if op not in missing else 'MISSING'}" for op in required) or "-"
        print(
            f"{_short(name):64}  {arch or '?':7} {r.get('registers', '?'):>4} {r.get('stack', '?'):>5} "
            f"{r.get('local', '?'):>5} {r.get('shared', '?'):>6} {'' if dyn is None else dyn:>8}  {status}"
        )
        name = _short(name, width=1 << 20)
        if arch != ARCH:
            failures.append(f"{name}: compiled for {arch}, expected {ARCH}")
        if not patterns:
            failures.append(f"{name}: not in the manifest (add its pattern to REQUIRED_SASS with the opcodes it needs)")
        for op in missing:
            failures.append(f"{name}: expected {op} in its SASS, found none ({len(ops)} distinct opcodes)")
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--so", help="the module or object to inspect (default: the built fla_cula._C)")
    ap.add_argument("--manifest", help="JSON (a string or a file): pattern -> required opcodes; default REQUIRED_SASS")
    args = ap.parse_args(argv)

    manifest = REQUIRED_SASS
    if args.manifest:
        text = Path(args.manifest).read_text() if Path(args.manifest).is_file() else args.manifest
        manifest = json.loads(text)
    dynamic_smem = None
    so = args.so
    if so is None:
        from fla_cula import _ext

        ok, why = _ext.available()
        if not ok:
            print(f"check_cpp_sass: {why}", file=sys.stderr)
            return 1
        so = _ext.require().__file__
        dynamic_smem = {
            s["symbol"]: s["smem_bytes"] for fam in _ext.cpp_kernels() for s in fam["specializations"]
        }
    from fla_cula import _ext

    if _ext.cuobjdump() is None:
        print("check_cpp_sass: cuobjdump not found (neither in triton's wheel nor on PATH)", file=sys.stderr)
        return 1
    print(f"C++ kernels in {so}")
    failures = check(so, manifest, dynamic_smem)
    if failures:
        print("\nFAILED:")
        for f in failures:
            print(f"  {f}")
        return 1
    print("\nOK: every kernel is sm_90a, in the manifest, with its required opcodes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
