"""What one decode config compiles to: ``python scripts/sass_loop.py '{"bv": 64, "l2norm": true}'``
(``--mma``: an MmaDecodeConfig of the tensor-core multi-token kernel; its loop is one chunk of 4 tokens)

Compiles a DecodeConfig (JSON of fields over the defaults; mode "kda" by default) for sm_90a on this
CPU machine and prints its registers, spill instructions, total SASS and the token loop (the
largest backward branch's range): instructions per token and their opcode histogram. A multi-token
step is bound by instruction issue (docs/decode_kernels.md), so the loop's length per state
element is the number to predict a T > 1 change with before spending device time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from scripts.sass_diff import cuobjdump, cuobjdump_spec  # noqa: E402

_INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def compile_sass(kw: dict, mma: bool = False) -> tuple[str, str]:
    if mma:
        from fla_cula.kernels import recurrent_decode_mma as m

        return tuple(cuobjdump_spec(m.RecurrentDecodeMma(m.MmaDecodeConfig(**kw)).spec(), "-sass", "-res-usage"))
    from fla_cula.kernels import recurrent_decode

    return tuple(cuobjdump(recurrent_decode, kw, "-sass", "-res-usage"))


def token_loop(instrs: list[tuple[int, str, str]]) -> tuple[int, int]:
    """(start, end) addresses of the largest backward branch's range."""
    best = (0, 0)
    for addr, op, rest in instrs:
        m = re.search(r"0x([0-9a-f]+)", rest)
        if op.startswith("BRA") and m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            if addr - start > best[1] - best[0]:
                best = (start, addr)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default="{}", help="DecodeConfig (MmaDecodeConfig) fields as JSON")
    ap.add_argument("--mma", action="store_true", help="the tensor-core multi-token kernel")
    ap.add_argument("--top", type=int, default=16, help="opcodes to list")
    a = ap.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    sass, res = compile_sass(json.loads(a.config), a.mma)
    instrs = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(_INSTR.match, sass.splitlines()) if m]
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    spills = sum(op.startswith(("LDL", "STL")) for _, op, _ in instrs)
    lo, hi = token_loop(instrs)
    body = [op for addr, op, _ in instrs if lo <= addr <= hi]
    print(f"registers {regs.group(1) if regs else '?'}  stack {stack.group(1) if stack else '?'} B  "
          f"spill instructions {spills}  SASS {len(instrs)}")
    print(f"{'chunk' if a.mma else 'token'} loop 0x{lo:x}-0x{hi:x}: {len(body)} instructions per "
          f"{'chunk of 4 tokens' if a.mma else 'token'}")
    for op, n in collections.Counter(body).most_common(a.top):
        print(f"  {n:5d}  {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
