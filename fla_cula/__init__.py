"""fla_cula: FLA-compatible CUDA kernels for Hopper, dropped in under flash-linear-attention 0.6.0.

    import fla_cula
    fla_cula.patch()          # FLA's chunk_kda, fused_recurrent_kda(_fwd), lightning ops, the short
                              # convolution's decode step (causal_conv1d_update) -> fla_cula
    ...
    fla_cula.status()         # per op: kernel calls and fallbacks by reason

Env: FLA_CULA=0 (everything to FLA), FLA_CULA_STRICT=1 (a fallback raises),
FLA_CULA_PATCH=1 (patch at start-up through the installed .pth hook; or `python -m fla_cula run`).
"""

from fla_cula.ops import (
    causal_conv1d_update,
    chunk_kda,
    chunk_lightning_attn,
    fused_recurrent_kda,
    fused_recurrent_kda_fwd,
    fused_recurrent_lightning_attn,
    fused_recurrent_simple_gla,
)
from fla_cula.patching import is_patched, patch, patched, unpatch
from fla_cula.routing import FallbackError, last_route, reset_status, status

__version__ = "0.1.0"

__all__ = [
    "FallbackError",
    "__version__",
    "causal_conv1d_update",
    "chunk_kda",
    "chunk_lightning_attn",
    "fused_recurrent_kda",
    "fused_recurrent_kda_fwd",
    "fused_recurrent_lightning_attn",
    "fused_recurrent_simple_gla",
    "is_patched",
    "last_route",
    "patch",
    "patched",
    "reset_status",
    "status",
    "unpatch",
]
