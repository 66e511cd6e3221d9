"""The kernel registry: which kernel serves which op, in which language, under which grad policy.

A call reads in one direction: the op (FLA's signature, ``fla_cula.ops``) asks
``fla_cula.routing.route(op, ...)``; routing looks the op up in ``OPS`` and imports the kernel's
module through ``load`` (once, on the first call that needs it: CuTe DSL and the C++ extension are
never imported by a call that falls back for a device reason); the module's plan function checks the
call and returns the host wrapper that runs it. A module that fails to import disables only the ops
that use it, with the import error as their fallback reason (``python -m fla_cula info`` lists it).

Grad policy per op:
  ``forward_only``  the kernel has no backward: a call whose inputs require grad goes to FLA.
  ``fla_backward``  our forward inside an autograd Function whose backward is FLA 0.6.0's
                    (``fla_cula.ops.chunk_autograd``): training calls run our forward too.
  ``own_backward``  the same Function with a backward of ours where the kernel ran the forward
                    (lightning: three runs of the forward kernel, ``lightning_bwd_by_forward``);
                    FLA's backward where FLA's forward ran.

Stand-in: with ``FLA_CULA_STAND_IN=1`` a chunk op runs FLA's forward inside fla_cula's autograd Function in
place of its kernel, which tests the training path's plumbing (gradients bit-identical to FLA's). Calls that
take it are counted as ``stand_in``, never as ``kernel``.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from types import ModuleType

FORWARD_ONLY = "forward_only"
FLA_BACKWARD = "fla_backward"
OWN_BACKWARD = "own_backward"
GRAD_POLICY_TEXT = {FORWARD_ONLY: "forward only (grad -> FLA)", FLA_BACKWARD: "our forward + FLA's backward",
                    OWN_BACKWARD: "our forward + our backward (FLA's where FLA's forward ran)"}


@dataclass(frozen=True)
class KernelEntry:
    """A kernel: its host module (imported lazily), the function there that plans a call, and its language."""

    name: str
    module: str
    lang: str  # "CuTe DSL", "CUDA C++", or "FLA (stand-in)"
    plan: str = "plan"
    route: str = "kernel"  # how status() counts calls it serves: "kernel" or "stand_in"


@dataclass(frozen=True)
class OpSpec:
    """A public op: the kernel that serves it (None: no kernel yet), the stand-in, the grad policy, and
    how many leading dims of each planned argument are runtime sizes (None: the memo key holds every
    shape; a tuple: per plan argument, the leading dims left out of the key, see routing.size_free_signature)."""

    op: str
    kernel: str | None
    grad: str
    stand_in: str | None = None
    runtime_dims: tuple[int | None, ...] | None = None


KERNELS: dict[str, KernelEntry] = {e.name: e for e in (
    KernelEntry("kda_decode", "fla_cula.kernels.kda_decode", "CuTe DSL"),
    KernelEntry("lightning_decode", "fla_cula.kernels.lightning_decode", "CuTe DSL"),
    KernelEntry("lightning_prefill", "fla_cula.kernels.lightning_prefill", "CuTe DSL", plan="plan_chunk"),
    KernelEntry("varlen_schedule", "fla_cula.kernels.varlen_schedule", "CUDA C++", plan="chunk_schedule"),
    KernelEntry("kda_prefill", "fla_cula.kernels.kda_prefill", "CUDA C++"),
    KernelEntry("conv_update", "fla_cula.kernels.conv_update", "CuTe DSL"),
    KernelEntry("probe", "fla_cula.kernels.probe", "CuTe DSL", plan="scale_add_"),
    KernelEntry("stand_in_chunk_kda", "fla_cula.ops.stand_in", "FLA (stand-in)", plan="plan_chunk_kda",
                route="stand_in"),
    KernelEntry("stand_in_chunk_lightning_attn", "fla_cula.ops.stand_in", "FLA (stand-in)",
                plan="plan_chunk_lightning_attn", route="stand_in"),
)}

# chunk_kda plans (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, cfg):
# B and T of the activations, N of the state and the sequence tensors are runtime sizes.
_KDA_CHUNK_DIMS = (2, 2, 2, 2, 2, 0, 0, 1, 1, 1, None)
# chunk_lightning_attn plans (q, k, v, g_gamma, initial_state, cu_seqlens, cfg)
_LIGHTNING_CHUNK_DIMS = (2, 2, 2, 0, 1, 1, None)

OPS: dict[str, OpSpec] = {s.op: s for s in (
    OpSpec("fused_recurrent_kda", "kda_decode", FORWARD_ONLY),
    OpSpec("fused_recurrent_kda_fwd", "kda_decode", FORWARD_ONLY),
    OpSpec("fused_recurrent_lightning_attn", "lightning_decode", FORWARD_ONLY),
    OpSpec("fused_recurrent_simple_gla", "lightning_decode", FORWARD_ONLY),
    # causal_conv1d_update: ShortConvolution's decode step (FLA calls it without autograd), beside the recurrent
    # decode op in every KDA layer's step (docs/model_benchmark.md)
    OpSpec("causal_conv1d_update", "conv_update", FORWARD_ONLY),
    # chunk_kda: the KDA prefill forward (CUDA C++, csrc/kda_sm90/: the fused kernel, or the prep + state kernels with
    # the exact sequence split) wherever its measured cost model predicts a gain over FLA, with or without grad (FLA's
    # backward then runs on our forward's saved tensors); other calls go to FLA with the reason
    # (kda_prefill._route_reason; docs/kda_sm90.md "Session 21").
    OpSpec("chunk_kda", "kda_prefill", FLA_BACKWARD, "stand_in_chunk_kda", _KDA_CHUNK_DIMS),
    # chunk_lightning_attn: the lightning prefill kernel (CuTe DSL; wgmma by default, an exact two-pass sequence
    # split for grids that cannot fill the GPU; docs/lightning_prefill.md); its backward is three runs of the same
    # kernel (chunk_autograd.LIGHTNING_BACKWARD, session 14).
    OpSpec("chunk_lightning_attn", "lightning_prefill", OWN_BACKWARD, "stand_in_chunk_lightning_attn",
           _LIGHTNING_CHUNK_DIMS),
)}

_lock = threading.Lock()
_loaded: dict[str, tuple[ModuleType | None, str | None]] = {}


def load(name: str) -> tuple[ModuleType | None, str | None]:
    """(module, None), or (None, why it cannot be used). Imported once per process."""
    hit = _loaded.get(name)
    if hit is not None:
        return hit
    with _lock:
        hit = _loaded.get(name)
        if hit is None:
            entry = KERNELS[name]
            try:
                hit = importlib.import_module(entry.module), None
            except Exception as e:  # noqa: BLE001 - reported as the fallback reason
                hit = None, f"{name} kernel unavailable ({type(e).__name__}: {e})"
            _loaded[name] = hit
    return hit


def plan_function(name: str):
    """(the kernel's plan function, None) or (None, reason)."""
    mod, why = load(name)
    if mod is None:
        return None, why
    return getattr(mod, KERNELS[name].plan), None


def import_all() -> dict[str, str | None]:
    """Import every kernel module (CI's compile check, `info`): name -> None or the import error."""
    return {name: load(name)[1] for name in KERNELS}


def describe_kernels() -> list[dict]:
    """One row per kernel module: language, the ops it serves, whether it imports here (and why not)."""
    serves = {}
    for spec in OPS.values():
        for name in (spec.kernel, spec.stand_in):
            if name is not None:
                serves.setdefault(name, []).append(spec.op)
    return [{"kernel": e.name, "lang": e.lang, "ops": serves.get(e.name, []), "status": load(e.name)[1] or "importable"}
            for e in KERNELS.values()]


def describe() -> list[dict]:
    """One row per op: its kernel, language, grad policy and whether the kernel's module imports here."""
    rows = []
    for spec in OPS.values():
        row = {"op": spec.op, "grad": GRAD_POLICY_TEXT[spec.grad]}
        if spec.kernel is None:
            row.update(kernel=None, lang=None, status="no kernel yet (FLA; FLA_CULA_STAND_IN=1: FLA's forward "
                                                      "in fla_cula's autograd Function)" if spec.stand_in else
                       "no kernel yet (FLA)")
        else:
            entry = KERNELS[spec.kernel]
            why = load(spec.kernel)[1]
            row.update(kernel=entry.name, lang=entry.lang, status=why or "importable")
        rows.append(row)
    return rows
