"""Start-up hook: with FLA_CULA_PATCH=1, patch FLA with fla_cula when the interpreter starts.

Installed next to the package as `fla_cula_autopatch.pth` (one line: `import fla_cula_autopatch`),
so `FLA_CULA_PATCH=1 python train.py` runs an unmodified script on fla_cula. Without the variable
this module does nothing and imports nothing beyond `os`.
"""

import os


def _hook() -> None:
    if os.environ.get("FLA_CULA_PATCH", "0") in ("", "0"):
        return
    try:
        import fla_cula
        fla_cula.patch()
    except Exception as e:  # never break interpreter start-up; say why fla_cula is not active
        import sys
        print(f"fla_cula: FLA_CULA_PATCH=1 but patching failed: {type(e).__name__}: {e}", file=sys.stderr)


_hook()
