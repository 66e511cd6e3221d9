"""Fused KDA prefill forward for SM90 (issue 18): host plan of the CUDA C++ kernel ``fla_cula._C.kda_fwd``.

Design: docs/kda_sm90.md; v1 as built: its "v1 as built" section and csrc/kda_sm90/. One launch per
call: one CTA per (sequence, value head, V block of 64 or 128 columns: block_v_for), chunks of 64 tokens,
the state on chip across chunks; l2norm, beta sigmoid and the bounded gate fused.

Scope of v1 (everything else returns a reason and runs FLA):
  - q, k, v, g bfloat16, K = V = 128, HV % H == 0 (GVA); beta bf16 or fp32 [B,T,HV];
  - use_gate_in_kernel with lower_bound in [-5, 0): a = lb * sigmoid(exp(A_log) * (g + dt_bias))
    (A_log / dt_bias fp32 or bf16, or None); safe_gate either way; and, on the two-kernel form, the unbounded
    gates: use_gate_in_kernel without lower_bound (a = -exp(A_log) * softplus(g + dt_bias)) and a precomputed log
    decay g (``gate_form``; under grad its chunk-local cumsum is FLA's chunk_local_cumsum, as FLA's forward makes it);
  - use_qk_l2norm_in_kernel and use_beta_sigmoid_in_kernel (allow_neg_eigval) on or off;
  - initial_state fp32 in either layout or None; output_final_state; return_intermediate_states (inference: the
    chunk-start states h, bf16); fixed length and varlen;
  - inference and grad. Under grad FLA's backward (fla_cula.ops.chunk_autograd) reads q^, k^, rstd
    (FLA's l2norm_fwd outputs, which the kernel writes beside its own in-kernel l2norm), the sigmoid beta
    (FLA's fused_beta_sigmoid_fwd; the kernel then runs on it) and Aqk / Akk, which the kernel writes
    (FLA's [B,T,HV,64] layout, Akk zero above the diagonal).
Per call (through ``fwd.size_reason``): chunk_size=32 and disable_recompute under grad (the kernel's scope),
then the op's routing policy (``_route_reason``: grad, small grids -> FLA; run() ignores it).

``plan`` is memoized per size-free signature (fla_cula.routing): it reads dtypes, head counts and
dims, devices, contiguity and alignment, never B, T, N or the varlen layout.
"""

import dataclasses
import functools
import math

import torch
from fla.ops.common.gate import fused_beta_sigmoid_fwd
from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices, prepare_chunk_offsets
from fla.ops.utils.constant import RCP_LN2

from fla_cula import _ext, routing
from fla_cula.ops.chunk_autograd import KDAChunkConfig, KDAForward, needs_grad

_ok, _why = _ext.available()
if not _ok:
    raise ImportError(_why)
_C = _ext.require()
if not hasattr(_C, "kda_fwd"):
    raise ImportError("fla_cula._C has no kda_fwd (stale build); rebuild it")

HEAD_DIM = 128
CHUNK = 64
UNBOUNDED_OFF_REASON = "unbounded gate (softplus / precomputed g): the two-kernel form only (turned off by set_tuning)"
# The unbounded gates take our kernels (forward, and under grad the backward's unbounded intra and softplus gate steps)
# while UNBOUNDED_ROUTED (on; a switch to send them to FLA). With half of the 16-token channel blocks wide (spans past
# kSpanMax: softplus with dt_bias ~ randn) the forward measured 1.6-1.8x FLA and the training step 1.7x (H100, session
# 43); with FLA's layer init (no wide blocks) 2.5-2.8x and 2.3x (docs/kda_sm90.md, docs/kda_bwd_sm90.md).
UNBOUNDED_ROUTED = True
UNBOUNDED_WAIT_REASON = ("unbounded gate (softplus / precomputed g): turned off (kda_prefill.UNBOUNDED_ROUTED = "
                         "False)")
_BF16 = torch.bfloat16
_PARAM_DTYPES = (torch.float32, torch.bfloat16)


# block_v None: block_v_for(); 64 or 128: forced (tests, benchmarks). wgmma: the state-side products (phases
# 6-8) on warpgroup MMA (docs/kda_sm90.md "v2.1": 20% faster per chunk than mma.sync at block_v 128);
# False: the same phases on mma.sync, kept for comparison. two_kernel: None = the cost model picks the fused kernel
# or the two-kernel form (the latter only once TWO_KERNEL_VERIFIED); True / False forces it. segments: None = the
# cost model's split of the two-kernel form; P >= 1 forces P segments (1: no split). state_rs: the two-kernel form's
# state passes (maps, pass 2) on kda_state_rs_kernel (the state transposed in wgmma registers, docs/kda_sm90.md "v4").
# STATE_RS_VERIFIED: on by default since session 28 (an H100, commit 251353f: the strict KDA GPU suite, 242 passed,
# with it forced on and with it the default; 4-16% faster than kda_state_kernel on every measured row).
STATE_RS_VERIFIED = True
_TUNING = {"block_v": None, "wgmma": True, "two_kernel": None, "segments": None, "state_rs": STATE_RS_VERIFIED,
           "prep_chunks": None, "roles": None}


def set_tuning(block_v: int | None = None, wgmma: bool = True, two_kernel: bool | None = None,
               segments: int | None = None, state_rs: bool = STATE_RS_VERIFIED, prep_chunks: int | None = None,
               roles: bool | None = None) -> None:
    """Force the V columns per CTA (64 or 128) for every call (None: chosen per call), pick the instruction of the
    state-side products (wgmma or mma.sync), force or forbid the two-kernel form and its number of segments, pick
    the two-kernel form's state-pass kernel (state_rs: the state in registers), force its chunks per prep CTA
    (None: the plan's choice) and force or forbid its one-launch form (roles; None: the plan's choice, True: wherever
    it applies); no argument: the defaults."""
    if block_v not in (None, 64, 128):
        raise ValueError(f"block_v={block_v!r}: expected None, 64 or 128")
    if not isinstance(wgmma, bool):
        raise TypeError(f"wgmma: expected a bool, got {type(wgmma).__name__}")
    if two_kernel not in (None, True, False):
        raise TypeError(f"two_kernel: expected None or a bool, got {two_kernel!r}")
    if segments is not None and (not isinstance(segments, int) or isinstance(segments, bool) or segments < 1):
        raise ValueError(f"segments={segments!r}: expected None or an int >= 1")
    if not isinstance(state_rs, bool):
        raise TypeError(f"state_rs: expected a bool, got {type(state_rs).__name__}")
    if prep_chunks is not None and (not isinstance(prep_chunks, int) or isinstance(prep_chunks, bool)
                                    or not 1 <= prep_chunks <= 16):
        raise ValueError(f"prep_chunks={prep_chunks!r}: expected None or an int in [1, 16]")
    if roles is not None and not isinstance(roles, bool):
        raise TypeError(f"roles: expected None or a bool, got {roles!r}")
    if two_kernel and not wgmma:
        raise ValueError("two_kernel=True needs wgmma=True (the records are wgmma tile images)")
    _TUNING.update(block_v=block_v, wgmma=wgmma, two_kernel=two_kernel, segments=segments, state_rs=state_rs,
                   prep_chunks=prep_chunks, roles=roles)


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    """SMs the plan may count on: the device's, lowered by an MPS execution-affinity limit (`_C.usable_sm_count`),
    so that the one-launch form's bound (roles_apply) is the binding's."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _C.usable_sm_count(index)


def block_v_for(N: int, HV: int, sms: int) -> int:
    """V columns per CTA for N sequences x HV value heads (one CTA per SM: 202-229 KB of shared memory).
    64 while the 2 * N * HV half-state CTAs fit one wave: each recomputes its pair's K-side prep, but a wave
    of them is as long as one CTA's chunks at the smaller state cost; 128 beyond: the prep (most of a chunk's
    time) is done once per pair, N * HV CTAs."""
    return 64 if 2 * N * HV <= sms else 128


def _block_v(N: int, HV: int, device: torch.device) -> int:
    bv = _TUNING["block_v"]
    return bv if bv is not None else block_v_for(N, HV, _sm_count(device))


def _aligned(x: torch.Tensor, n: int = 16) -> bool:
    """16-byte aligned data (vector loads), or a non-contiguous tensor, which go() copies (fresh storage)."""
    return not x.is_contiguous() or x.data_ptr() % n == 0


def gate_form(cfg: KDAChunkConfig) -> str:
    """The kernel's gate form of a call: 'sigmoid_lb' (use_gate_in_kernel with lower_bound: bounded, every form of
    the kernel), 'softplus' (use_gate_in_kernel without it) or 'precomputed' (g is the log decay); the last two are
    unbounded: the prep kernel only (the two-kernel form)."""
    if not cfg.use_gate_in_kernel:
        return "precomputed"
    return "softplus" if cfg.lower_bound is None else "sigmoid_lb"


def plan(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, cfg: KDAChunkConfig):
    """(reason, None) or (None, fwd) for routing.route; fwd(..., cfg, need_grad) -> KDAForward."""
    if cfg.cp:
        return "cp_context: context-parallel KDA stays on FLA", None
    if cfg.use_graph:
        return "use_graph: FLA's fixed-shape varlen path stays on FLA", None
    gate = gate_form(cfg)
    if gate == "sigmoid_lb" and not -5.0 <= cfg.lower_bound < 0.0:
        return f"lower_bound {cfg.lower_bound}: kernel needs -5 <= lower_bound < 0 (overflow-free gate anchors)", None
    if cfg.return_intermediate_states and cfg.chunk_size != CHUNK:
        return (f"return_intermediate_states with chunk_size={cfg.chunk_size}: the kernel's chunk starts are 64 "
                "tokens apart"), None
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if x.dtype != _BF16:
            return f"{name} dtype {x.dtype}: kernel supports bfloat16 q/k/v/g", None
    if q.dim() != 4 or v.dim() != 4:
        return f"q/v of rank {q.dim()}/{v.dim()}: expected [B, T, heads, dim]", None
    K, V, H, HV = q.shape[-1], v.shape[-1], q.shape[2], v.shape[2]
    if K != HEAD_DIM or V != HEAD_DIM:
        return f"head dims K={K} V={V}: kernel supports 128", None
    if HV % H != 0:
        return f"HV={HV} not a multiple of H={H}", None
    if beta.dtype not in _PARAM_DTYPES or beta.dim() != 3:
        return f"beta {beta.dtype} of rank {beta.dim()}: kernel supports bfloat16/float32 [B, T, HV]", None
    if gate == "precomputed":
        A_log = dt_bias = None  # read only with use_gate_in_kernel (as FLA)
    if A_log is not None and (A_log.dtype not in _PARAM_DTYPES or A_log.numel() != HV):
        return f"A_log {A_log.dtype} with {A_log.numel()} elements: kernel needs float32/bfloat16 with HV", None
    if dt_bias is not None and (dt_bias.dtype not in _PARAM_DTYPES or dt_bias.numel() != HV * K):
        return f"dt_bias {dt_bias.dtype} with {dt_bias.numel()} elements: kernel needs float32/bfloat16 with HV*K", None
    if initial_state is not None:
        if initial_state.dtype != torch.float32 or tuple(initial_state.shape[1:]) != (HV, HEAD_DIM, HEAD_DIM):
            return f"initial_state {initial_state.dtype} {tuple(initial_state.shape)}: kernel needs float32 " \
                   f"[N, {HV}, 128, 128]", None
    if cu_seqlens is not None and cu_seqlens.dtype not in (torch.int32, torch.int64):
        return f"cu_seqlens dtype {cu_seqlens.dtype}: kernel supports int32/int64", None
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if not _aligned(x):
            return f"{name} is not 16-byte aligned: kernel uses 16-byte loads", None
    return None, _forward


# Routing policy of the op (not the kernel's scope: run() ignores it). Under grad our forward + FLA's backward passes
# the gradient bars with both forms (tests/gpu/test_kda_prefill.py: test_grad over fused and two-kernel, and dA_log
# over 8 draws) and the training step is faster than FLA's (H200, session 21, FLA_CULA_FORCE=1: B2 T4096 H32 3.921
# vs 4.183 ms, B1 T8192 H32 4.136 vs 4.330), so ROUTE_GRAD routes grad calls by the same cost model (the forward's).
# Without grad the kernel serves a call when a cost model predicts it below ROUTE_GAIN x FLA's time. Measured on the
# H200 (graph replay, docs/kda_sm90.md "v2.1"): a CTA takes US_PER_CHUNK[block_v] per 64-token chunk
# whatever the grid (1 CTA per SM, latency-bound phases), so the kernel's time is waves x chunks per CTA; FLA's
# chunk-parallel kernels take fla_us (fixed + serial chain + per token and value head). The tests set
# ROUTE_GRAD and turn the model off. ROUTE_INTERMEDIATE: return_intermediate_states calls take the kernel (its h
# matched FLA's on the H200 in session 20: tests/gpu/test_kda_prefill.py test_return_intermediate_states).
ROUTE_GRAD = True
ROUTE_INTERMEDIATE = True
ROUTE_BY_COST = True
US_PER_CHUNK = {64: 14.0, 128: 15.4}   # B2 T8192 H64, 128 chunks per CTA: block_v 64 3.589 ms / 2 waves; 128: 1.970 ms
ROUTE_GAIN = 0.9

# FLA 0.6.0 (graph replay) = fixed + its serial state chain (per chunk of the longest sequence) + a per-token-head
# rate, fitted to the four rows measured in session 20 (docs/kda_sm90.md "Session 20"): B1 T8192 H8 0.414 ms,
# B1 T2048 H16 0.178, B1 T32768 H16 2.195, B2 T8192 H64 3.367; within 7% of each.
FLA_FIXED_US = 33.5
FLA_US_PER_SERIAL_CHUNK = 1.44
FLA_NS_PER_TOKEN_HEAD = 3.0


def _pass_us(chunks: list[int], copies: int, sms: int, us: float, per_sm: int = 1, us_alone: float = 0.0,
             fixed: float = 0.0) -> float:
    """One launch of CTAs with these chunk counts, each `copies` times (heads x V blocks), at `us` per chunk on `sms`
    SMs holding `per_sm` CTAs each (`us_alone` when no SM gets two), plus `fixed` per wave (a CTA's start: its
    first loads, its start state): full waves for equal counts, else the average load plus the longest CTA (a
    bound)."""
    if not chunks:
        return 0.0
    slots = sms * per_sm
    waves = -(-len(chunks) * copies // slots)
    if per_sm > 1 and us_alone and len(chunks) * copies <= sms:
        us = us_alone
    if len(set(chunks)) <= 1:
        return waves * (chunks[0] * us + fixed)
    if waves == 1:  # one wave: the longest CTA
        return max(chunks) * us + fixed
    return (sum(chunks) * copies / slots + max(chunks)) * us + waves * fixed


def fla_us(lens: list[int], HV: int) -> float:
    """FLA 0.6.0's predicted microseconds (graph replay): fixed + its serial chain + its per-token-head rate."""
    if not lens:
        return 0.0
    chunks = max(-(-L // CHUNK) for L in lens)
    return FLA_FIXED_US + chunks * FLA_US_PER_SERIAL_CHUNK + sum(lens) * HV * FLA_NS_PER_TOKEN_HEAD * 1e-3


def predicted_us(lens: list[int], HV: int, sms: int) -> tuple[float, float]:
    """(fused kernel, FLA) predicted microseconds for sequences of these lengths x HV value heads (pure). The kernel:
    CTAs of ceil(len / 64) chunks in launch order on `sms` SMs, bounded by full waves of the average work plus
    the longest sequence (equal lengths: exactly waves x chunks)."""
    bv = block_v_for(len(lens), HV, sms)
    chunks = [-(-L // CHUNK) for L in lens]
    return _pass_us(chunks, HV * (HEAD_DIM // bv), sms, US_PER_CHUNK[bv]), fla_us(lens, HV)


# ---- The two-kernel form (docs/kda_sm90.md "Two kernels and the exact sequence split"): kernel 1 runs the prep
# (phases 1-6, 75% of a fused chunk) chunk-parallel and writes each chunk's operand tiles to a record; kernel 2 runs
# the state phases from the records, over whole sequences or, split, over P segments: pass 1 (maps) gives each
# segment's end state from a zero start and its transition map (the same recurrence on v = 0 from the identity),
# the combine kernel chains them in order, pass 2 runs every segment from its true start state and writes o.
# The constants below are fitted to each pass replayed alone on the H200 (session 21, commit e03e5e9: six rows, P 1 to
# 8; docs/kda_sm90.md "Session 21"); with them the model predicts the six measured two-kernel rows within 6%.
# A prep CTA runs 4 chunks; two share an SM (v3.5: 14.8 us per chunk each, fitted on an H100 in session 29 to the
# prep pass of B2 T8192 H64; the model is then 7% over B8 T4096 H64's and 3% over 64 x 256 H32's, counting whole
# waves; alone: v3.4's 12 scaled by the same 0.81, not measured); the whole launch pays a one-time 17 us (the first
# loads), not one per wave. The state passes pay ~12-14 us per wave (start state, first record). Back-to-back
# launches in a graph overlap their edges: no per-launch term.
# TWO_KERNEL_VERIFIED: the form passed its GPU tests on the H200 at e03e5e9 (strict, NaN-poisoned: the two-kernel,
# split, combine, intermediate-state, graph-replay and grad cases, 85 passed).
TWO_KERNEL_VERIFIED = True
REC_BYTES = int(_C.KDA_REC_BYTES)
PREP_CHUNKS = 4                     # chunks per prep CTA: the next chunk's loads overlap the current one's phases
PREP_CHUNKS_UNDERFILLED = (2, 1)    # also priced where PREP_CHUNKS leaves SMs idle (fewer CTAs than SMs)
PREP_CTAS_PER_SM = 2                # PrepStorage: 109 KB of shared memory, 128 registers
PREP_US_PER_CHUNK = (9.7, 14.8)     # per chunk per CTA, alone / two per SM
PREP_START_US = 17.0                # once per launch
STATE_US_PER_CHUNK = {64: 3.3, 128: 4.39}  # pass 2 alone per chunk
STATE_CTAS_PER_SM = {64: 2, 128: 1}        # StateStorage: 97 / 129 KB of shared memory
STATE_SHARED = 1.42                        # a CTA's time per chunk with a second one on its SM (session 20)
STATE_WAVE_US = 12.0                       # a state CTA's start: its start state and first record
MAPS_US_PER_CHUNK = 2.5             # block_v 128 without O: V' and the state update
MAPS_WAVE_US = 14.0
# kda_state_rs_kernel (state_rs; docs/kda_sm90.md "v4"). A chunk takes the longer of its chain and its bytes' share
# of DRAM bandwidth with every concurrent CTA streaming (pass 2: record 66 KB, v 16 KB and o 16 KB; maps: ~45 KB, no
# Qg / Aqk / o); a wave's start is its first loads. Chain and wave start fitted to kda_variants' per-pass times on an
# H100 (session 28, eleven pass-2 and five maps times, rms error 7%, bandwidth fitted there at 2.85 TB/s); the
# bandwidth below is that fit scaled to the H200's peak (4.8 / 3.35 TB/s), not yet measured there.
RS_CHAIN_US = {"pass2": 2.4, "pass2_64": 1.6, "maps": 1.6}      # pass2_64: one warpgroup, 64 columns, per CTA
RS_BYTES = {"pass2": 98e3, "pass2_64": 49e3, "maps": 45e3}        # pass2_64: a pair's two CTAs share the record
RS_DRAM_BYTES_PER_US = 4.0e6
RS_WAVE_US = 13.0
COMBINE_US = (5.5, 2.5)             # the combine kernel: fixed, and per serial segment step and wave of SMs (the
                                    # fixed part refitted to the quartered sums, session 45, H100: 20-23 us at 6-7)
COMBINE_CTAS_PER_PAIR = 16          # kda_combine_kernel: 8 of the 128 columns per CTA
# The one-launch form (kda_roles_kernel; docs/kda_sm90.md "The one-launch form"): the prep alone per SM at 12 us a
# chunk (fitted to B1 T4096 H16 on an H100, session 46; PREP_US_PER_CHUNK[0]'s 9.7 is scaled, not measured), pass 2
# at the pass2_64 chain. The two launches' model overstates the small grids by 15-30% (session 46, H100: B1 T1024 H4
# 65 vs 44 us, B1 T2048 H8 91 vs 66, B1 T2048 H16 111 vs 93) while this one is within -5 / +15%, so the one launch
# is taken only where it prices ROLES_MARGIN_US under them. Several sequences measured (session 47, H100, prep units
# chunk block by chunk block across the sequences): B2 T2048 H8 86 us against the two launches' 93 (model 91 / 111),
# B4 T1024 H8 112 against 75 (model 115 / 85: left to the two launches).
# Against split plans (H100, sessions 46 and 49; model one / two, measured one / two, us): B3 T4096 H4 0.81, 129 / 144
# (taken); B1 T2048 H8 0.88, 77 / 66; B3 T8192 H4 0.91, 239 / 228; B1 T4096 H16 0.92, 149 / 157; B1 T4096 H8 1.11,
# 126 / 100. The price ratio does not separate 0.88-0.92, so the one launch is taken only below 0.85.
ROLES_PREP_US_PER_CHUNK = 12.0
ROLES_MARGIN_US = 15.0
ROLES_SPLIT_SHARE = 0.85
MAX_SEGMENTS = 16


def _pass2_us(chunks: list[int], HV: int, sms: int, bv: int, state_rs: bool) -> float:
    """Pass 2 of the two-kernel form over these chunk counts: kda_state_rs_kernel, or kda_state_kernel<bv>."""
    if state_rs:
        return _rs_pass_us(chunks, HV * (HEAD_DIM // bv), sms, "pass2" if bv == 128 else "pass2_64")
    us = STATE_US_PER_CHUNK[bv]
    return _pass_us(chunks, HV * (HEAD_DIM // bv), sms, us * (STATE_SHARED if STATE_CTAS_PER_SM[bv] > 1 else 1.0),
                    STATE_CTAS_PER_SM[bv], us, STATE_WAVE_US)


def _rs_pass_us(chunks: list[int], copies: int, sms: int, kind: str) -> float:
    """A pass of kda_state_rs_kernel (one CTA per SM) over these chunk counts, `copies` CTAs each."""
    return _rs_passes_us([(chunks, copies, kind)], sms)


def _rs_passes_us(jobs: list[tuple[list[int], int, str]], sms: int) -> float:
    """Passes of kda_state_rs_kernel running side by side (one CTA per SM), each (chunk counts, copies, kind): a
    chunk step takes the longest chain of the kinds, or the bytes of the CTAs in flight at the DRAM rate."""
    ctas = [len(c) * n for c, n, _ in jobs]
    if not sum(ctas):
        return 0.0
    concurrent = min(sum(ctas), sms)
    step_bytes = sum(RS_BYTES[k] * m for (_, _, k), m in zip(jobs, ctas, strict=True)) * concurrent / sum(ctas)
    us = max(max(RS_CHAIN_US[k] for _, _, k in jobs), step_bytes / RS_DRAM_BYTES_PER_US)
    return _pass_us([c for chunks, n, _ in jobs for c in chunks for _ in range(n)], 1, sms, us, fixed=RS_WAVE_US)


@dataclasses.dataclass(frozen=True)
class TwoKernelPlan:
    segments: int     # P (1: kernel 2 over whole sequences)
    seg_chunks: int   # chunks per segment (0 when P = 1); segment P - 1 also takes what lies beyond
    block_v: int      # pass 2's V columns per CTA
    prep_units: int   # prep CTAs per (sequence, value head), prep_chunks chunks each
    us: float         # predicted microseconds
    prep_chunks: int = PREP_CHUNKS  # chunks per prep CTA
    roles: bool = False  # the prep and pass 2 (P = 1, block_v 64) in one launch (kda_roles_kernel)


def two_kernel_plan(lens: list[int], HV: int, sms: int, segments: int | None = None,
                    block_v: int | None = None, state_rs: bool = False,
                    prep_chunks: int | None = None, roles: bool | None = None) -> TwoKernelPlan:
    """The cheapest (segments, block_v) of the two-kernel form for these lengths (pure, memoized per lengths);
    `segments` / `block_v` / `prep_chunks` (chunks per prep CTA) force them; state_rs: the state passes on
    kda_state_rs_kernel. Splits are considered only for grids of fewer (sequence, value head) pairs than SMs: a grid
    that fills the GPU gains nothing from them, and the search stays small on the routing path. Chunks per prep CTA:
    PREP_CHUNKS, or fewer where its CTAs leave SMs idle and the model prices fewer faster (ties keep the larger).
    The one-launch form (roles) is priced with state_rs where its pass-2 CTAs take at most half of the SMs
    (roles_apply) and taken where it prices ROLES_MARGIN_US under an unsplit two-launch plan; roles True takes it
    wherever it applies, False never."""
    return _two_kernel_plan(tuple(lens), HV, sms, segments, block_v, state_rs, prep_chunks, roles)


def _prep_us(chunks: list[int], HV: int, sms: int, pc: int) -> float:
    """The prep pass: each sequence's chunks in CTAs of `pc`, two CTAs per SM (alone where no SM gets two)."""
    blocks = [min(pc, c - pc * u) for c in chunks for u in range(-(-c // pc))]
    return PREP_START_US + _pass_us(blocks, HV, sms, PREP_US_PER_CHUNK[1], PREP_CTAS_PER_SM, PREP_US_PER_CHUNK[0])


def roles_apply(N: int, HV: int, sms: int) -> bool:
    """Whether the one-launch form can run N sequences x HV value heads: its 2 N HV pass-2 CTAs (one per SM) wait
    for prep CTAs on the other SMs, so they may take half of the SMs at most (kda_roles.cu requires it)."""
    return 0 < 4 * N * HV <= sms


def _roles_us(chunks: list[int], HV: int, sms: int, pc: int) -> float:
    """The one-launch form: the prep alone per SM (ROLES_PREP_US_PER_CHUNK) on the SMs the 2 N HV pass-2 CTAs leave,
    pass 2 (one warpgroup per SM: the pass2_64 chain) following the records; it ends a chunk after the prep, or a
    whole chain after the first records landed, whichever is later."""
    blocks = [min(pc, c - pc * u) for c in chunks for u in range(-(-c // pc))]
    free = sms - 2 * len(chunks) * HV
    prep = PREP_START_US + _pass_us(blocks, HV, free, ROLES_PREP_US_PER_CHUNK)
    chain = RS_CHAIN_US["pass2_64"]
    first = PREP_START_US + min(pc, max(chunks)) * ROLES_PREP_US_PER_CHUNK
    return max(prep + pc * chain, first + max(chunks) * chain)


def _prep_chunks_choice(chunks: list[int], HV: int, sms: int) -> int:
    """PREP_CHUNKS, unless its CTAs number no more than the SMs (each runs alone at 4 chunks in series) and fewer
    chunks per CTA price faster by the model (B1 T2048 H16: 4 -> 2 chunks, prep 51 -> 41 us measured on an H100,
    session 44). On fuller grids the choice would rest on wave quantization alone, which the model does not price
    well (no per-CTA start term), so they keep PREP_CHUNKS."""
    if sum(-(-c // PREP_CHUNKS) for c in chunks) * HV > sms:
        return PREP_CHUNKS
    return min((PREP_CHUNKS, *PREP_CHUNKS_UNDERFILLED), key=lambda pc: _prep_us(chunks, HV, sms, pc))  # first wins ties


@functools.lru_cache(maxsize=256)
def _two_kernel_plan(lens: tuple[int, ...], HV: int, sms: int, segments: int | None,
                     block_v: int | None, state_rs: bool = False, pc: int | None = None,
                     roles: bool | None = None) -> TwoKernelPlan:
    chunks = [-(-L // CHUNK) for L in lens]
    maxc = max(chunks, default=0)
    one = None  # the one-launch form: P = 1, pass 2 at 64 columns
    if (roles is not False and state_rs and segments in (None, 1)
            and block_v in (None, 64) and maxc and roles_apply(len(lens), HV, sms)):
        one = min((TwoKernelPlan(1, 0, 64, -(-maxc // c), _roles_us(chunks, HV, sms, c), c, True)
                   for c in ([pc] if pc else (PREP_CHUNKS, *PREP_CHUNKS_UNDERFILLED))), key=lambda t: t.us)
        if roles:
            return one
    pc = pc or _prep_chunks_choice(chunks, HV, sms)
    prep_units = max(1, -(-maxc // pc))
    prep = _prep_us(chunks, HV, sms, pc)
    combine_waves = -(-len(lens) * HV * COMBINE_CTAS_PER_PAIR // sms)
    best = None
    search = range(1, MAX_SEGMENTS + 1) if len(lens) * HV < sms else (1,)
    for P in ([segments] if segments else search):
        seg = -(-maxc // P) if P > 1 else 0
        if P > 1 and (seg == 0 or -(-maxc // seg) < P):
            continue  # fewer non-empty segments than P: a smaller P does the same
        for bv in ([block_v] if block_v else (64, 128)):
            if P == 1:
                t = _pass2_us(chunks, HV, sms, bv, state_rs)
            elif state_rs:
                # pass 2 of segment 0 beside the maps of segments 1 .. P - 2, then segments 1 .. P - 1 after the
                # combine (run_two_kernel)
                first = [min(seg, c) for c in chunks if c]
                later = [min(seg, c - seg * s) for c in chunks for s in range(1, -(-c // seg))]
                maps = [min(seg, c - seg * s) for c in chunks for s in range(1, min(P - 1, -(-c // seg)))]
                kind = "pass2" if bv == 128 else "pass2_64"
                t = (_rs_passes_us([(first, HV * (HEAD_DIM // bv), kind), (maps, HV * 2, "maps")], sms)
                     + COMBINE_US[0] + COMBINE_US[1] * (P - 2) * combine_waves + _pass2_us(later, HV, sms, bv, True))
            else:
                parts = [min(seg, c - seg * s) for c in chunks for s in range(-(-c // seg))]
                maps = [min(seg, c - seg * s) for c in chunks for s in range(min(P - 1, -(-c // seg)))]
                t = (_pass_us(maps, HV * 2, sms, MAPS_US_PER_CHUNK, fixed=MAPS_WAVE_US)
                     + COMBINE_US[0] + COMBINE_US[1] * (P - 2) * combine_waves + _pass2_us(parts, HV, sms, bv, False))
            plan = TwoKernelPlan(P, seg, bv, prep_units, prep + t, pc)
            if best is None or plan.us < best.us:
                best = plan
    if best is None:  # forced segments beyond the chunks: P segments of one chunk, the last taking the rest
        best = TwoKernelPlan(segments, 1, block_v or 64, prep_units, math.inf, pc)
    if one is None:
        return best
    # against a split plan the one launch must price under ROLES_SPLIT_SHARE of it: there the split's chains are
    # shorter than the one launch's and the two launches' model overstates them most (B1 T2048 H8 P 8: 91 priced, 66
    # measured)
    if best.segments > 1:
        return one if one.us < ROLES_SPLIT_SHARE * best.us else best
    return one if one.us + ROLES_MARGIN_US < best.us else best


def record_slots(B: int, T: int, N: int) -> int:
    """Record slots per value head: chunk c of sequence n is slot floor(bos_n / 64) + n + c, below this."""
    return B * T // CHUNK + N


def combine_segments(seg_H: torch.Tensor, seg_M: torch.Tensor) -> None:
    """The split's combine in torch (the reference of the kernel `_C.kda_combine`, which the forward uses), in place.
    seg_H [P-1, N, HV, K, V] fp32: segment s's end state from its own start (h0 for s = 0, else 0); seg_M
    [P-2, N, HV, K, K]: the transition maps of segments 1 .. P-2 (end = M start + H). Afterwards seg_H[s] is the
    true state at the end of segment s, the start of segment s + 1. Products in fp64 (exact for these fp32 factors up
    to fp64 rounding, whatever torch's fp32 matmul precision is set to)."""
    if seg_H.shape[0] < 2:
        return
    K, V = seg_H.shape[-2:]
    Hd, Md = seg_H.double(), seg_M.double()
    for s in range(1, Hd.shape[0]):
        Hd[s].view(-1, K, V).baddbmm_(Md[s - 1].view(-1, K, K), Hd[s - 1].view(-1, K, V))
    seg_H[1:].copy_(Hd[1:])


def run_two_kernel(launch, N: int, HV: int, slots: int, device, plan: TwoKernelPlan, o, ht, Aqk, Akk,
                   out_kw: dict | None = None, combine=combine_segments, state_rs: bool = False,
                   qk_kw: dict | None = None) -> None:
    """The two-kernel form: `launch(**kw)` runs one pass of the kernel (the extension's kda_fwd with this call's
    inputs bound; the CPU emulator in tests) with the keywords pass_kind, rec, chunks_per_cta, units, maps, seg_H,
    seg_M, block_v, o, ht, Aqk, Akk (seg_lo, seg_hi, state_rs where set), and out_kw (h_inter, chunk_offsets) for the
    pass that writes o; `combine(seg_H, seg_M)` is the split's combine (the forward passes `_C.kda_combine`). qk_kw
    (q_hat, k_hat, q_rstd, k_rstd) go to the prep pass with Aqk and Akk. state_rs: the maps pass and pass 2 on
    kda_state_rs_kernel, and a split's pass 2 of segment 0 runs beside the maps of the later segments (`beside`), the
    rest after the combine; pass 2 with h_inter keeps kda_state_kernel and the maps pass before it. Allocates the
    records (64.5 KB per chunk and value head) and the segment states (64 KB per (sequence, value head) and segment,
    2 P - 3 of them). plan.roles (state_rs, no h_inter): one launch (pass_kind 3) with the records' ready flags."""
    rec = torch.empty(HV, slots, REC_BYTES, dtype=torch.uint8, device=device)
    out_kw = out_kw or {}
    if plan.roles and state_rs and out_kw.get("h_inter") is None:
        # one launch: pass 2 (64 columns, whole sequences) waits on each record's flag, zero until the prep stores it
        ready = torch.zeros(HV, slots, dtype=torch.int32, device=device)
        launch(pass_kind=3, rec=rec, rec_ready=ready, chunks_per_cta=plan.prep_chunks, units=plan.prep_units,
               maps=False, seg_H=None, seg_M=None, block_v=64, o=o, ht=ht, Aqk=Aqk, Akk=Akk, **(qk_kw or {}))
        return
    launch(pass_kind=1, rec=rec, chunks_per_cta=plan.prep_chunks, units=plan.prep_units, maps=False, seg_H=None,
           seg_M=None, block_v=64, o=None, ht=None, Aqk=Aqk, Akk=Akk, **(qk_kw or {}))
    P, seg_H = plan.segments, None
    rs = {"state_rs": True} if state_rs and out_kw.get("h_inter") is None else {}
    state = dict(pass_kind=2, rec=rec, chunks_per_cta=plan.seg_chunks, Aqk=None, Akk=None)
    pass2 = dict(state, units=P, maps=False, seg_M=None, block_v=plan.block_v, o=o, ht=ht)
    if P > 1:
        seg_H = torch.empty(P - 1, N, HV, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=device)
        seg_M = torch.empty(P - 2, N, HV, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=device)
        maps = dict(state, units=2 * P - 3, maps=True, seg_H=seg_H, seg_M=seg_M, block_v=128, o=None, ht=None,
                    **({"state_rs": True} if state_rs else {}))
        if rs:
            # pass 2 of segment 0, its end state to seg_H[0], beside the maps of segments 1 .. P - 2
            beside(device, lambda: launch(**pass2, seg_H=seg_H, seg_hi=1, **rs),
                   (lambda: launch(**maps, seg_lo=1)) if P > 2 else None)
        else:
            launch(**maps)
        combine(seg_H, seg_M)
    launch(**pass2, seg_H=seg_H, **({"seg_lo": 1} if rs and P > 1 else {}), **rs, **out_kw)


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def beside(device, first, second=None) -> None:
    """first() on the current stream and second() on a side stream of `device`, both after the work queued before and
    before the work queued after (a fork and a join, which CUDA graph capture records as two branches); in order on
    the CPU (the emulator), and during a capture that comes before any eager call has made the side stream."""
    index = None
    if second is not None and torch.device(device).type == "cuda":
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        if index not in _SIDE_STREAMS and not torch.cuda.is_current_stream_capturing():
            _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    side = _SIDE_STREAMS.get(index)
    if side is None:
        first()
        if second is not None:
            second()
        return
    cur = torch.cuda.current_stream(index)
    side.wait_stream(cur)
    first()
    with torch.cuda.stream(side):
        second()
    cur.wait_stream(side)


def _route_reason(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
                  cfg: KDAChunkConfig) -> str | None:
    """Why the routed op sends this call to FLA although the kernel could run it, or None (always None under
    FLA_CULA_FORCE=1)."""
    if routing.force():
        return None
    if not ROUTE_GRAD and needs_grad(q, k, v, g, beta, A_log, dt_bias, initial_state):
        return "grad -> FLA (ROUTE_GRAD is off)"
    if not ROUTE_INTERMEDIATE and cfg.return_intermediate_states:
        return "return_intermediate_states -> FLA (the kernel's h has not yet been checked against FLA's on the H200)"
    if not ROUTE_BY_COST:
        return None
    if cu_seqlens is None:
        lens = [q.shape[1]] * q.shape[0]
    elif cu_seqlens_cpu is not None:
        lens = (cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]).tolist()
    else:
        return "v1: varlen without cu_seqlens_cpu (no host lengths to predict the kernel's time with)"
    sms = _sm_count(q.device) if q.is_cuda else 132
    ours, fla = predicted_us(lens, v.shape[2], sms)
    wide = gate_form(cfg) != "sigmoid_lb"
    two = two_kernel_choice(lens, v.shape[2], sms, wide)
    if wide and two is None:
        return UNBOUNDED_OFF_REASON
    if wide and two.us >= ROUTE_GAIN * fla:
        return (f"predicted {two.us / 1e3:.2f} ms (the two-kernel form; an unbounded gate) vs FLA {fla / 1e3:.2f} ms: "
                "does not pay on this grid")
    ours = min(ours, two.us) if two is not None else ours
    if not wide and ours >= ROUTE_GAIN * fla:
        return (f"predicted {ours / 1e3:.2f} ms vs FLA {fla / 1e3:.2f} ms: the fused kernel's serial chunk chain "
                f"per CTA does not pay on this grid" + ("" if TWO_KERNEL_VERIFIED else
                                                        " (the two-kernel split is not yet verified on the H200)"))
    return None


def _size_reason(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
                 cfg: KDAChunkConfig) -> str | None:
    """Per-call checks that depend on grad (the memo key does not hold requires_grad) or on set_tuning."""
    unbounded = gate_form(cfg) != "sigmoid_lb"
    if unbounded and not UNBOUNDED_ROUTED:
        return UNBOUNDED_WAIT_REASON
    if unbounded and (_TUNING["two_kernel"] is False or not _TUNING["wgmma"]):
        return UNBOUNDED_OFF_REASON
    if needs_grad(q, k, v, g, beta, A_log, dt_bias, initial_state):
        if cfg.chunk_size != CHUNK:
            return f"v1: chunk_size={cfg.chunk_size} under grad (Aqk/Akk are written for chunk 64)"
        if cfg.disable_recompute:
            return "v1: disable_recompute under grad (w, u, qg, kg, v_new, h are not written)"
    return None


def _lens(q, cu_seqlens, cu_seqlens_cpu) -> list[int]:
    """Host sequence lengths (varlen without cu_seqlens_cpu: read from the device, a sync; the routing policy never
    gets here that way, forced tuning may)."""
    if cu_seqlens is None:
        return [q.shape[1]] * q.shape[0]
    cu = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()
    return (cu[1:] - cu[:-1]).tolist()


def two_kernel_choice(lens: list[int], HV: int, sms: int, wide: bool = False) -> TwoKernelPlan | None:
    """The two-kernel plan this call takes, or None for the fused kernel: forced by set_tuning(two_kernel=...), else
    (once TWO_KERNEL_VERIFIED) where it predicts faster than the fused kernel; always with an unbounded gate (`wide`:
    the fused kernel takes the bounded one only) unless set_tuning turned the form off."""
    forced = _TUNING["two_kernel"]
    if forced is False or not _TUNING["wgmma"] or (forced is None and not TWO_KERNEL_VERIFIED and not wide):
        return None
    plan = two_kernel_plan(lens, HV, sms, _TUNING["segments"], _TUNING["block_v"], _TUNING["state_rs"],
                           _TUNING["prep_chunks"], _TUNING["roles"])
    if forced is None and not wide and plan.us >= predicted_us(lens, HV, sms)[0]:
        return None
    return plan


def _launcher(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cfg: KDAChunkConfig, l2: bool, bsig: bool,
              beta_scale: float):
    """launch(o=, ht=, Aqk=, Akk=, **kw): one kda_fwd launch on these (contiguous) inputs; kw: block_v, wgmma and
    the two-kernel pass keywords. An unbounded gate goes to the prep pass (the one that reads g; lower_bound unused)."""
    gate = gate_form(cfg)
    lb = cfg.lower_bound if gate == "sigmoid_lb" else -5.0
    if gate == "precomputed":
        A_log = dt_bias = None

    def launch(*, o, ht, Aqk, Akk, **kw):
        if gate != "sigmoid_lb" and kw.get("pass_kind") in (1, 3):  # the passes that read g
            kw["gate"] = gate
        _C.kda_fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, o, ht, Aqk, Akk, cfg.scale, lb, l2,
                   bsig, beta_scale, cfg.state_v_first, **kw)
    return launch


def launcher(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, cfg: KDAChunkConfig):
    """The inference form's pass launcher for run_two_kernel over these inputs (contiguous ones; benchmarks time the
    passes one by one with it)."""
    return functools.partial(_launcher(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cfg,
                                       cfg.use_qk_l2norm_in_kernel, cfg.use_beta_sigmoid_in_kernel,
                                       2.0 if cfg.allow_neg_eigval else 1.0), wgmma=True)


def _forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, cfg: KDAChunkConfig,
             need_grad: bool) -> KDAForward:
    """Run the kernel(s) on the current stream; allocates only outputs (and, under grad, what FLA's backward
    reads; the two-kernel form's records and segment states). Inputs are made contiguous as FLA's input_guard does
    (no copy when they already are)."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if A_log is not None:
        A_log = A_log.contiguous()
    if dt_bias is not None:
        dt_bias = dt_bias.contiguous()
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    B, T, H, K = q.shape
    HV = v.shape[2]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dev = q.device
    o = torch.empty(B, T, HV, HEAD_DIM, dtype=q.dtype, device=dev)
    ht = torch.empty(N, HV, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=dev) if cfg.output_final_state else None
    beta_scale = 2.0 if cfg.allow_neg_eigval else 1.0
    l2, bsig = cfg.use_qk_l2norm_in_kernel, cfg.use_beta_sigmoid_in_kernel
    q_rstd = k_rstd = Aqk = Akk = None
    qk_kw = {}
    if need_grad:
        # What FLA's backward reads: the kernel writes q^ = bf16(q rstd), k^ and their rstd (FLA's l2norm_fwd
        # outputs) beside Aqk / Akk; the sigmoid beta is FLA's own fused_beta_sigmoid_fwd (the kernel then runs on it).
        if bsig:
            beta = fused_beta_sigmoid_fwd(beta, beta_scale)
        bsig, beta_scale = False, 1.0
        Aqk = torch.empty(B, T, HV, CHUNK, dtype=k.dtype, device=dev)
        Akk = torch.empty(B, T, HV, CHUNK, dtype=k.dtype, device=dev)
        if l2:
            q_rstd, k_rstd = (torch.empty(B, T, H, dtype=torch.float32, device=dev) for _ in range(2))
            qk_kw = dict(q_hat=torch.empty_like(q), k_hat=torch.empty_like(k), q_rstd=q_rstd, k_rstd=k_rstd)

    launch = _launcher(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cfg, l2, bsig, beta_scale)
    out_kw, h = {}, None
    if cfg.return_intermediate_states:  # FLA's h: bf16 [B, NT, HV, K, V] (V, K state_v_first), k.dtype
        if cu_seqlens is None:
            NT = -(-T // CHUNK)
        else:
            NT = sum(-(-L // CHUNK) for L in _lens(q, cu_seqlens, cu_seqlens_cpu))
            out_kw["chunk_offsets"] = prepare_chunk_offsets(cu_seqlens, CHUNK)
        h = out_kw["h_inter"] = torch.empty(B, NT, HV, HEAD_DIM, HEAD_DIM, dtype=k.dtype, device=dev)
    two, wide = None, gate_form(cfg) != "sigmoid_lb"
    if _TUNING["two_kernel"] or (_TUNING["two_kernel"] is None and TWO_KERNEL_VERIFIED) or wide:
        two = two_kernel_choice(_lens(q, cu_seqlens, cu_seqlens_cpu), HV, _sm_count(dev), wide)
    if two is None and wide:
        raise ValueError(f"kda_prefill: {UNBOUNDED_OFF_REASON}")
    if two is not None:
        run_two_kernel(functools.partial(launch, wgmma=True), N, HV, record_slots(B, T, N), dev, two, o, ht, Aqk,
                       Akk, out_kw, _C.kda_combine, state_rs=_TUNING["state_rs"], qk_kw=qk_kw)
    else:
        launch(o=o, ht=ht, Aqk=Aqk, Akk=Akk, block_v=_block_v(N, HV, dev), wgmma=_TUNING["wgmma"], **out_kw,
               **qk_kw)
    if not need_grad:
        return KDAForward(o, ht, h=h)
    chunk_indices = None
    if cu_seqlens is not None:
        chunk_indices = prepare_chunk_indices(cu_seqlens=cu_seqlens, chunk_size=CHUNK, cu_seqlens_cpu=cu_seqlens_cpu)
    if qk_kw:
        q, k = qk_kw["q_hat"], qk_kw["k_hat"]
    g_cumsum = None  # the in-kernel gate's backward recomputes it from g; a precomputed g's is FLA's, as FLA saves it
    if not cfg.use_gate_in_kernel:
        g_cumsum = chunk_local_cumsum(g, chunk_size=CHUNK, scale=RCP_LN2, cu_seqlens=cu_seqlens,
                                      chunk_indices=chunk_indices)
    return KDAForward(o, ht, q=q, q_rstd=q_rstd, k=k, k_rstd=k_rstd, beta=beta, g_cumsum=g_cumsum, Aqk=Aqk, Akk=Akk,
                      initial_state=initial_state, chunk_indices=chunk_indices, chunk_offsets=None)


def _call_reason(*args) -> str | None:
    return _size_reason(*args) or _route_reason(*args)


_forward.size_reason = _call_reason


def run(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, cfg: KDAChunkConfig,
        need_grad: bool = False) -> KDAForward:
    """plan + forward in one call (tests and tools): ValueError with the reason outside the scope."""
    args = (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, cfg)
    r, fwd = plan(*args)
    r = r or (_size_reason(*args) if need_grad else None)
    if r:
        raise ValueError(f"kda_prefill: {r}")
    return fwd(*args, need_grad)


def phase_profile(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
                  cfg: KDAChunkConfig) -> dict[str, float]:
    """Run the instrumented kernel (clock64 at each phase's CTA barrier, thread 0) once in inference form and
    return the mean cycles per chunk of each phase over the CTAs that had chunks (synchronizes; a
    measuring tool, not a call path), with the block_v the forward would take. Phases:
    ``_C.KDA_FWD_PHASE_NAMES``."""
    args = (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, cfg)
    r, _ = plan(*args)
    if r or gate_form(cfg) != "sigmoid_lb":
        raise ValueError(f"kda_prefill: {r or 'phase_profile runs the fused kernel: the bounded gate only'}")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    B, T = q.shape[:2]
    HV = v.shape[2]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    o = torch.empty(B, T, HV, HEAD_DIM, dtype=q.dtype, device=q.device)
    bv = _block_v(N, HV, q.device)
    cycles = torch.zeros(N * HV * (HEAD_DIM // bv), _C.KDA_FWD_PHASES, dtype=torch.int64, device=q.device)
    _C.kda_fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, o, None, None, None, cfg.scale,
               cfg.lower_bound, cfg.use_qk_l2norm_in_kernel, cfg.use_beta_sigmoid_in_kernel,
               2.0 if cfg.allow_neg_eigval else 1.0, cfg.state_v_first, block_v=bv, phase_cycles=cycles,
               wgmma=_TUNING["wgmma"])
    lens = torch.full((N,), T, dtype=torch.int64) if cu_seqlens is None else (cu_seqlens[1:] - cu_seqlens[:-1]).cpu()
    chunks = ((lens + CHUNK - 1) // CHUNK).repeat_interleave(HV * (HEAD_DIM // bv)).to(torch.float64)
    busy = chunks > 0
    per_chunk = cycles.cpu().to(torch.float64)[busy].sum(0) / chunks[busy].sum().clamp(min=1)
    return dict(zip(_C.KDA_FWD_PHASE_NAMES, per_chunk.tolist(), strict=True))


def cpp_kernels_info() -> list[dict]:
    """This kernel's entry of ``fla_cula._ext.cpp_kernels()`` (CTA size, dynamic smem, registers, spills)."""
    return [k for k in _ext.cpp_kernels() if k["name"] == "kda_prefill"]
