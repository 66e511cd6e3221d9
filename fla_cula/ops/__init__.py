"""Public ops with FLA 0.6.0's signatures (see fla_cula.ops.kda, fla_cula.ops.lightning_attn,
fla_cula.ops.conv)."""

from fla_cula.ops.conv import causal_conv1d_update
from fla_cula.ops.kda import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_fwd
from fla_cula.ops.lightning_attn import (
    chunk_lightning_attn,
    fused_recurrent_lightning_attn,
    fused_recurrent_simple_gla,
)

__all__ = [
    "causal_conv1d_update",
    "chunk_kda",
    "chunk_lightning_attn",
    "fused_recurrent_kda",
    "fused_recurrent_kda_fwd",
    "fused_recurrent_lightning_attn",
    "fused_recurrent_simple_gla",
]
