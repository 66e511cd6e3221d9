"""fp64 reference implementations of the ops fla_cula accelerates (pure torch, any device).

Each is a direct token-by-token recurrence, computed and returned in float64, that never modifies
its inputs. The math and the tensor layouts are documented in each module:

- :mod:`.kda`        ``kda_gate``, ``kda_recurrent`` (chunk_kda / fused_recurrent_kda) and
                     ``kda_decode_pool`` (fused_recurrent_kda_fwd with state pools).
- :mod:`.lightning`  ``lightning_g_gamma``, ``simple_gla_recurrent`` (fused_recurrent_simple_gla
                     with g_gamma) and ``lightning_recurrent`` (lightning attention).
- :mod:`.compare`    ``rel_rms`` and ``fla_close`` (FLA's assert_close rule).
"""

from .compare import fla_close, rel_rms
from .kda import kda_decode_pool, kda_forget_bound, kda_gate, kda_recurrent, softplus
from .lightning import lightning_g_gamma, lightning_recurrent, simple_gla_recurrent

__all__ = [
    "fla_close",
    "kda_decode_pool",
    "kda_forget_bound",
    "kda_gate",
    "kda_recurrent",
    "lightning_g_gamma",
    "lightning_recurrent",
    "rel_rms",
    "simple_gla_recurrent",
    "softplus",
]
