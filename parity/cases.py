"""The parity case grid and the random inputs of one case.

A :class:`Case` is a plain frozen dataclass: which op, the shapes, the dtype, which flags, and
for ``fused_recurrent_kda_fwd`` the state-pool layout. :func:`grid` builds the list per op;
:func:`make_inputs` draws fresh random inputs for a case (never zeros: nonzero initial states,
normalized keys so the delta rule stays well conditioned, as FLA's own tests draw them).

Grid design: vary one thing at a time around a small base shape per op, so that FLA's Triton
autotuning (per H, K, V, dtype and flag set) is paid for a bounded number of configurations.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# Run order: the kernel-routed decode ops first, then the prefill ops (FLA fallbacks today) whose
# Triton autotuning costs minutes per new flag combination on a fresh machine.
OPS = (
    "fused_recurrent_kda_fwd",
    "fused_recurrent_kda",
    "fused_recurrent_lightning_attn",
    "chunk_lightning_attn",
    "chunk_kda",
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# variable-length sets (sequence lengths; B == 1 and cu_seqlens when used)
VARLEN_PREFILL = {
    "uniform": (96, 96, 96, 96),
    "skewed": (7, 200, 33, 64),
    "many_short": (1, 2, 3, 5, 2, 1, 4, 3, 1, 2, 6, 1, 3, 2, 1, 4),
    "len1": (1, 65, 1, 30),
}
VARLEN_DECODE = {
    "uniform": (1,) * 8,
    "uniform_t4": (4,) * 8,
    "skewed": (1, 4, 2, 8),
    "many_short": (1, 2, 3) * 6,
    "len1": (1, 40, 1, 17),
}

GATES = ("pre", "softplus", "softplus_nobias", "lb", "lb_noA")

# Flag sets are named so ids stay readable.
_FLAG_NAMES = {
    "l2norm": "l2",
    "beta_sigmoid": "bsig",
    "neg_eig": "neg",
    "state_v_first": "vk",
    "safe_gate": "safe",
    "reverse": "rev",
}


@dataclass(frozen=True)
class Case:
    op: str
    B: int = 2
    T: int = 100
    H: int = 4
    HV: int = 4
    K: int = 128
    V: int = 128
    dtype: str = "bf16"
    varlen: str | None = None  # name of the length set
    seqlens: tuple[int, ...] | None = None
    h0: bool = True
    output_final_state: bool = True
    state_v_first: bool = False
    gate: str = "pre"  # KDA only: see GATES
    l2norm: bool = False
    beta_sigmoid: bool = False
    neg_eig: bool = False
    safe_gate: bool = False
    chunk_size: int | None = None  # chunk_kda kwarg; None = FLA default
    scale: float | None = None
    grad: bool = False
    # lightning
    layer_idx: int = 3
    num_layers: int = 24
    reverse: bool = False
    # fused_recurrent_kda_fwd
    pool: str | None = None  # None | "idx1d" | "idx1d_pad" | "idx2d" | "idx2d_spec" | "idx2d_spec_pad" | "noidx"
    inplace: bool = False
    out_given: bool = False
    tags: tuple[str, ...] = field(default=())

    @property
    def is_kda(self) -> bool:
        return "kda" in self.op

    @property
    def n_seqs(self) -> int:
        return len(self.seqlens) if self.seqlens is not None else self.B

    @property
    def lengths(self) -> tuple[int, ...]:
        return self.seqlens if self.seqlens is not None else (self.T,) * self.B

    @property
    def padded(self) -> bool:
        return self.pool is not None and self.pool.endswith("_pad")

    @property
    def id(self) -> str:
        shape = f"B{self.B}-T{self.T}" if self.seqlens is None else f"varlen={self.varlen}(N{self.n_seqs})"
        parts = [self.op, f"{shape}-H{self.H}-HV{self.HV}-K{self.K}-V{self.V}", self.dtype]
        parts.append("h0" if self.h0 else "noh0")
        if not self.output_final_state:
            parts.append("noht")
        if self.is_kda:
            parts.append(f"g={self.gate}")
        for f_, short in _FLAG_NAMES.items():
            if getattr(self, f_):
                parts.append(short)
        if self.chunk_size:
            parts.append(f"bt{self.chunk_size}")
        if self.scale is not None:
            parts.append(f"scale{self.scale:g}")
        if "lightning" in self.op:
            parts.append(f"layer{self.layer_idx}of{self.num_layers}")
        if self.pool:
            parts.append(f"pool={self.pool}" + ("+inplace" if self.inplace else ""))
        if self.out_given:
            parts.append("out=")
        parts.append("grad" if self.grad else "infer")
        return "/".join(parts)

    def with_(self, **kw) -> Case:
        return dataclasses.replace(self, **kw)


def _varlen(base: Case, name: str, table: dict[str, tuple[int, ...]]) -> Case:
    lens = table[name]
    return base.with_(varlen=name, seqlens=lens, B=1, T=sum(lens))


def _dedup(cases: list[Case]) -> list[Case]:
    seen: dict[str, Case] = {}
    for c in cases:
        seen.setdefault(c.id, c)
    return list(seen.values())


# ---------------------------------------------------------------------------------------------
# per-op grids
def _kda_flag_variants(base: Case) -> list[Case]:
    """Gate forms, each in-kernel flag, layouts, initial state: one change at a time."""
    out = [base]
    out += [base.with_(gate=g) for g in GATES if g != base.gate]
    out += [
        base.with_(l2norm=True),
        base.with_(beta_sigmoid=True),
        base.with_(beta_sigmoid=True, neg_eig=True),
        base.with_(state_v_first=True),
        base.with_(h0=False),
        base.with_(output_final_state=False),
        base.with_(scale=0.3),
        # everything a Kimi-Linear layer passes
        base.with_(gate="softplus", l2norm=True, beta_sigmoid=True, state_v_first=True),
        base.with_(gate="lb", l2norm=True, beta_sigmoid=True, neg_eig=True, state_v_first=True),
    ]
    return out


def grid_chunk_kda(quick: bool = False) -> list[Case]:
    base = Case(op="chunk_kda", B=2, T=100, H=4, HV=4, K=128, V=128, dtype="bf16")
    cases: list[Case] = []
    for grad in (False, True):
        b = base.with_(grad=grad)
        cases += _kda_flag_variants(b)
        cases.append(b.with_(gate="lb", safe_gate=True))
        cases.append(b.with_(chunk_size=32))
        cases += [b.with_(T=50), b.with_(T=64), b.with_(T=1, B=3)]
        cases += [b.with_(dtype="fp16"), b.with_(dtype="fp32")]
        cases += [b.with_(HV=8), b.with_(HV=16)]  # GVA 2H, 4H
        cases += [b.with_(K=64, V=64), b.with_(K=100, V=100)]  # odd dim: FLA supports, kernels fall back
        cases += [_varlen(b, n, VARLEN_PREFILL) for n in VARLEN_PREFILL]
        cases.append(_varlen(b, "skewed", VARLEN_PREFILL).with_(gate="softplus", l2norm=True, state_v_first=True))
        for H in (16, 32, 64):
            cases.append(b.with_(H=H, HV=H, B=1, T=64 if H == 64 else 100, K=64 if grad else 128,
                                 V=64 if grad else 128))
    cases.append(base.with_(H=16, HV=32, B=1, T=100))  # GVA at a serving shard size
    if quick:
        cases = [c for c in cases if _quick_keep(c)]
    return _dedup(cases)


def grid_fused_recurrent_kda(quick: bool = False) -> list[Case]:
    base = Case(op="fused_recurrent_kda", B=4, T=1, H=32, HV=32, K=128, V=128, dtype="bf16", gate="softplus",
                l2norm=True)
    cases: list[Case] = []
    cases += _kda_flag_variants(base)
    cases += [base.with_(T=t) for t in (4, 37, 100)]
    cases += [base.with_(B=1), base.with_(B=16)]
    cases += [base.with_(H=h, HV=h) for h in (4, 16, 64)]
    cases += [base.with_(H=16, HV=32), base.with_(H=8, HV=32), base.with_(H=8, HV=8)]  # GVA 2H / 4H, TP shard
    cases += [base.with_(K=64, V=64), base.with_(K=100, V=100)]
    cases += [base.with_(dtype="fp16"), base.with_(dtype="fp32")]
    cases += [_varlen(base, n, VARLEN_DECODE) for n in VARLEN_DECODE]
    cases.append(_varlen(base, "skewed", VARLEN_DECODE).with_(state_v_first=True, beta_sigmoid=True))
    cases.append(base.with_(grad=True))  # forward-only op: route must say so; output checked, no gradients
    cases.append(base.with_(T=4, grad=True))
    if quick:
        cases = [c for c in cases if _quick_keep(c)]
    return _dedup(cases)


def grid_fused_recurrent_kda_fwd(quick: bool = False) -> list[Case]:
    base = Case(op="fused_recurrent_kda_fwd", B=8, T=1, H=32, HV=32, K=128, V=128, dtype="bf16", gate="softplus",
                l2norm=True, beta_sigmoid=True, pool="idx1d", inplace=True, out_given=True)
    cases: list[Case] = []
    cases += [base, base.with_(out_given=False), base.with_(state_v_first=True)]
    cases += [base.with_(gate=g) for g in GATES if g != base.gate]
    cases += [base.with_(l2norm=False), base.with_(beta_sigmoid=False), base.with_(neg_eig=True)]
    cases += [base.with_(H=16, HV=32), base.with_(H=8, HV=8), base.with_(dtype="fp16"), base.with_(dtype="fp32")]
    cases += [base.with_(K=64, V=64), base.with_(K=100, V=100)]
    # multi-token with [N, Tmax] indices: per-token state writes; speculative decoding reads the accepted slot
    t4 = base.with_(T=4, pool="idx2d")
    cases += [t4, t4.with_(pool="idx2d_spec"), t4.with_(pool="idx2d_spec", state_v_first=True)]
    cases += [_varlen(base.with_(pool="idx2d_spec"), n, VARLEN_DECODE) for n in ("uniform_t4", "skewed")]
    cases.append(_varlen(base, "uniform", VARLEN_DECODE))  # cu_seqlens, T=1 each, 1-D indices
    # no pool: plain inplace update of initial_state, or a fresh final state
    cases += [base.with_(pool="noidx"), base.with_(pool="noidx", inplace=False), base.with_(pool="noidx", T=4)]
    # padding slots (negative indices) last: FLA 0.6.0 does not check them, so it is not run on them
    cases += [base.with_(pool="idx1d_pad"), t4.with_(pool="idx2d_spec_pad")]
    if quick:
        cases = [c for c in cases if _quick_keep(c)]
    return _dedup(cases)


def grid_chunk_lightning_attn(quick: bool = False) -> list[Case]:
    base = Case(op="chunk_lightning_attn", B=2, T=100, H=4, HV=4, K=128, V=128, dtype="bf16")
    cases: list[Case] = []
    for grad in (False, True):
        b = base.with_(grad=grad)
        cases += [b, b.with_(h0=False), b.with_(output_final_state=False), b.with_(scale=0.3)]
        cases += [b.with_(layer_idx=0), b.with_(layer_idx=23)]
        cases += [b.with_(T=50), b.with_(T=64), b.with_(dtype="fp16"), b.with_(dtype="fp32")]
        cases += [b.with_(K=64, V=64), b.with_(K=100, V=100)]
        cases += [_varlen(b, n, VARLEN_PREFILL) for n in VARLEN_PREFILL]
        cases += [b.with_(H=h, HV=h, B=1, T=64) for h in (16, 32, 64)]
    if quick:
        cases = [c for c in cases if _quick_keep(c)]
    return _dedup(cases)


def grid_fused_recurrent_lightning_attn(quick: bool = False) -> list[Case]:
    base = Case(op="fused_recurrent_lightning_attn", B=4, T=1, H=64, HV=64, K=128, V=128, dtype="bf16")
    cases: list[Case] = []
    cases += [base, base.with_(h0=False), base.with_(output_final_state=False), base.with_(scale=0.3)]
    cases += [base.with_(layer_idx=0), base.with_(layer_idx=23)]
    cases += [base.with_(T=t) for t in (4, 37, 100)]
    cases += [base.with_(B=1), base.with_(B=16)]
    cases += [base.with_(H=h, HV=h) for h in (4, 16, 32)]
    cases += [base.with_(K=64, V=64), base.with_(K=100, V=100)]
    cases += [base.with_(dtype="fp16"), base.with_(dtype="fp32")]
    cases += [base.with_(reverse=True, T=4)]
    cases += [_varlen(base, n, VARLEN_DECODE) for n in VARLEN_DECODE]
    cases += [base.with_(grad=True, T=4), base.with_(grad=True, T=37, H=4, HV=4)]
    if quick:
        cases = [c for c in cases if _quick_keep(c)]
    return _dedup(cases)


GRIDS = {
    "chunk_kda": grid_chunk_kda,
    "fused_recurrent_kda": grid_fused_recurrent_kda,
    "fused_recurrent_kda_fwd": grid_fused_recurrent_kda_fwd,
    "chunk_lightning_attn": grid_chunk_lightning_attn,
    "fused_recurrent_lightning_attn": grid_fused_recurrent_lightning_attn,
}


def _quick_keep(c: Case) -> bool:
    """The quick grid: the base case, a few flags, one varlen set, one dtype change, one odd dim."""
    keep_flags = c.gate in ("pre", "softplus", "lb") and not c.neg_eig and c.scale is None
    plain_shape = c.H in (4, 32, 64) and c.HV == c.H and c.K in (100, 128) and c.chunk_size is None
    return (keep_flags and plain_shape and c.varlen in (None, "skewed", "uniform_t4") and c.dtype in ("bf16", "fp32")
            and c.T in (1, 4, 100) or c.padded)


def grid(ops: list[str] | None = None, quick: bool = False) -> list[Case]:
    out: list[Case] = []
    for op in ops or OPS:
        out += GRIDS[op](quick)
    return out


# ---------------------------------------------------------------------------------------------
# inputs
def case_seed(case: Case, run_seed: int) -> int:
    return (zlib.crc32(case.id.encode()) ^ (run_seed * 0x9E3779B1)) & 0x7FFFFFFF


def cu_seqlens_of(lengths: tuple[int, ...], device) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.long, device=device)


def make_inputs(case: Case, device, seed: int) -> dict[str, torch.Tensor | float | None]:
    """Fresh random inputs (generated on the CPU for reproducibility, then moved)."""
    gen = torch.Generator().manual_seed(seed)
    dt = DTYPES[case.dtype]

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float32)

    N = case.n_seqs
    Bx, Tx = (1, sum(case.seqlens)) if case.seqlens is not None else (case.B, case.T)
    H, HV, K, V = case.H, case.HV, case.K, case.V
    x: dict[str, torch.Tensor | float | None] = {}
    q, k = randn(Bx, Tx, H, K), randn(Bx, Tx, H, K)
    if case.is_kda and not case.l2norm:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    x["q"], x["k"] = q.to(dt), k.to(dt)
    x["v"] = randn(Bx, Tx, HV, V, dtype=dt)
    x["cu_seqlens"] = cu_seqlens_of(case.seqlens, "cpu") if case.seqlens is not None else None
    if case.is_kda:
        x["A_log"] = x["dt_bias"] = None
        x["lower_bound"] = None
        if case.gate == "pre":
            x["g"] = F.logsigmoid(randn(Bx, Tx, HV, K))  # float32 log decay, as FLA's gate helpers return
        else:
            x["g"] = randn(Bx, Tx, HV, K, dtype=dt)
            if case.gate != "lb_noA":
                x["A_log"] = torch.log(1.0 + 15.0 * rand(HV))
            if case.gate != "softplus_nobias":
                x["dt_bias"] = 0.5 * randn(HV * K)
            if case.gate in ("lb", "lb_noA"):
                x["lower_bound"] = -5.0
        x["beta"] = randn(Bx, Tx, HV, dtype=dt) if case.beta_sigmoid else rand(Bx, Tx, HV).sigmoid().to(dt)
    state_shape = (HV, V, K) if case.state_v_first else (HV, K, V)
    x["h0"] = randn(N, *state_shape) if case.h0 else None
    if case.pool is not None and case.pool != "noidx":
        _make_pool(case, x, gen, state_shape)
    moved: dict[str, torch.Tensor | float | None] = {}
    for name, val in x.items():
        moved[name] = val.to(device) if isinstance(val, torch.Tensor) else val
    return moved


def _make_pool(case: Case, x: dict, gen: torch.Generator, state_shape: tuple[int, ...]) -> None:
    """State pool + ssm_state_indices (+ num_accepted_tokens) for fused_recurrent_kda_fwd."""
    N = case.n_seqs
    Tmax = max(case.lengths)
    two_d = case.pool.startswith("idx2d")
    n_slots_used = N * (Tmax if two_d else 1)
    P = 2 * n_slots_used + 3  # spare slots that must stay untouched
    x["h0"] = torch.randn(P, *state_shape, generator=gen)
    perm = torch.randperm(P, generator=gen)[:n_slots_used].to(torch.int32)
    idx = perm.view(N, Tmax) if two_d else perm
    if case.padded:  # padding entries: skip the sequence, touch nothing
        idx = idx.clone()
        pad_rows = [1, N - 1] if N > 2 else [N - 1]
        for r in pad_rows:
            idx[r] = -1
    x["ssm_state_indices"] = idx
    x["num_accepted_tokens"] = None
    if "spec" in case.pool:
        lens = torch.tensor(case.lengths)
        x["num_accepted_tokens"] = (torch.randint(0, 1 << 30, (N,), generator=gen) % lens + 1).to(torch.int32)


def written_slots(case: Case, inputs: dict) -> set[int]:
    """Pool slots the call may write (every other slot must stay bit-identical)."""
    idx = inputs.get("ssm_state_indices")
    if idx is None:
        return set()
    idx = idx.cpu()
    out: set[int] = set()
    if idx.ndim == 1:
        for s in idx.tolist():
            if s >= 0:
                out.add(s)
        return out
    for n, L in enumerate(case.lengths):
        for t in range(L):
            s = int(idx[n, t])
            if s >= 0:
                out.add(s)
    return out


def padded_token_mask(case: Case, inputs: dict) -> torch.Tensor | None:
    """[B, T] bool, True for tokens of padding sequences (negative slot): their outputs are unspecified."""
    if not case.padded:
        return None
    idx = inputs["ssm_state_indices"].cpu()
    first = idx if idx.ndim == 1 else idx[:, 0]
    lens = case.lengths
    if case.seqlens is None:
        m = torch.zeros(case.B, case.T, dtype=torch.bool)
        for n in range(case.B):
            m[n] = bool(first[n] < 0)
        return m
    m = torch.zeros(1, sum(lens), dtype=torch.bool)
    pos = 0
    for n, L in enumerate(lens):
        m[0, pos:pos + L] = bool(first[n] < 0)
        pos += L
    return m
