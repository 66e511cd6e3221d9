"""Benchmark op registry: what is timed, on which shapes, and the roofline of each row.

Each :class:`Bench` names a public op, its modes ("eager", "graph", "fwdbwd"), its shapes (full and
quick), how to draw inputs, how to call the op, and the bytes / flops formulas below.

Roofline (the floor no implementation beats), per row:
    floor_ms = max(bytes / copy_bw, flops / matmul_rate), both ceilings measured in the same run.
bytes (forward): every input read once and every output written once, in their real dtypes:
    q, k [T_tot, H, K]; v, o [T_tot, HV, V]; g [T_tot, HV, K] (KDA); beta [T_tot, HV] (KDA);
    the float32 state [N, HV, K, V] read when an initial state is given and written when a final
    state is returned (or updated in place). For decode that is the whole story: 2 x 64 KiB per
    (sequence, head) per step at K=V=128, plus the small per-token inputs/outputs.
flops (forward, matmul-class work; decode is bandwidth-bound and its flops barely matter):
    chunk_kda, per (sequence, value head, 64-token chunk C) with C=64:
        2 * (4*C*C*K + 2*C*C*V + 3*C*K*V)  (Akk, Aqk, w = A k, solve ~ C^3/3 ignored, u = A v, Aqk v,
                                            w S, q S, k^T v state update)
    chunk_lightning_attn / simple_gla: 2 * (C*C*K + C*C*V + 2*C*K*V) per (sequence, head, chunk)
    recurrent (decode): 8*K*V per (token, value head) for KDA, 6*K*V for lightning.
fwd+bwd: flops = 3 x forward; bytes = forward bytes + inputs read again + do read + one gradient
    written per differentiable input (= forward bytes + 2 x input bytes + o bytes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

CHUNK = 64


@dataclass(frozen=True)
class Shape:
    B: int
    T: int
    H: int
    HV: int
    K: int = 128
    V: int = 128
    varlen: tuple[int, ...] | None = None  # sequence lengths (B == 1 then)
    label: str = ""

    @property
    def n_seqs(self) -> int:
        return len(self.varlen) if self.varlen else self.B

    @property
    def tokens(self) -> int:
        return sum(self.varlen) if self.varlen else self.B * self.T

    @property
    def varlen_desc(self) -> str:
        if not self.varlen:
            return ""
        lens = self.varlen
        return f"{self.label or 'varlen'}: N={len(lens)}, tokens={sum(lens)}, min={min(lens)}, max={max(lens)}"

    @property
    def desc(self) -> str:
        if self.varlen:
            return f"{self.varlen_desc} H={self.H} HV={self.HV}"
        return f"B={self.B} T={self.T} H={self.H}" + (f" HV={self.HV}" if self.HV != self.H else "")


@dataclass
class Bench:
    name: str  # row group, e.g. "fused_recurrent_kda decode"
    op: str  # public op name
    modes: tuple[str, ...]
    shapes: list[Shape]
    quick: list[Shape]
    make_inputs: Callable[[Shape, torch.device, bool], dict]
    call: Callable[[Callable, dict], tuple]
    nbytes: Callable[[Shape, dict, str], float]
    flops: Callable[[Shape, str], float]
    grad_inputs: tuple[str, ...] = ()
    flags: str = ""
    tags: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# roofline formulas (pure: unit-tested)
def tensor_bytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def state_bytes(s: Shape, read: bool, write: bool) -> int:
    return s.n_seqs * s.HV * s.K * s.V * 4 * (int(read) + int(write))


def chunk_kda_flops(s: Shape, mode: str = "fwd") -> float:
    C = CHUNK
    chunks = sum(math.ceil(L / C) for L in (s.varlen or (s.T,) * s.B))
    f = chunks * s.HV * 2 * (4 * C * C * s.K + 2 * C * C * s.V + 3 * C * s.K * s.V)
    return 3 * f if mode == "fwdbwd" else f


def chunk_lightning_flops(s: Shape, mode: str = "fwd") -> float:
    C = CHUNK
    chunks = sum(math.ceil(L / C) for L in (s.varlen or (s.T,) * s.B))
    f = chunks * s.H * 2 * (C * C * s.K + C * C * s.V + 2 * C * s.K * s.V)
    return 3 * f if mode == "fwdbwd" else f


def recurrent_flops(per_kv: int) -> Callable[[Shape, str], float]:
    def f(s: Shape, mode: str = "fwd") -> float:
        return s.tokens * s.HV * per_kv * s.K * s.V

    return f


def io_bytes(s: Shape, x: dict, mode: str) -> float:
    """Inputs once + outputs once + state traffic, as in the module docstring."""
    ins = tensor_bytes(*(x.get(n) for n in ("q", "k", "v", "g", "beta")))
    o = s.tokens * s.HV * s.V * x["v"].element_size()
    st = state_bytes(s, read=x.get("initial_state") is not None, write=x.get("_writes_state", True))
    fwd = ins + o + st
    return fwd + 2 * ins + o if mode == "fwdbwd" else fwd


def roofline_ms(nbytes: float, flops: float, copy_bw: float, mm_rate: float) -> float:
    """copy_bw in bytes/s, mm_rate in flop/s; returns ms."""
    return 1e3 * max(nbytes / copy_bw, flops / mm_rate)


# ---------------------------------------------------------------------------------------------
# inputs
def _lens_cu(s: Shape, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if not s.varlen:
        return None, None
    cu = [0]
    for n in s.varlen:
        cu.append(cu[-1] + n)
    cpu = torch.tensor(cu, dtype=torch.long)
    return cpu.to(device), cpu


def kda_inputs(s: Shape, device, grad: bool, *, pool: bool = False, spec: bool = False,
               state_v_first: bool = False) -> dict:
    Bx, Tx = (1, s.tokens) if s.varlen else (s.B, s.T)
    dt = torch.bfloat16
    x = {
        "q": torch.randn(Bx, Tx, s.H, s.K, device=device, dtype=dt),
        "k": torch.randn(Bx, Tx, s.H, s.K, device=device, dtype=dt),
        "v": torch.randn(Bx, Tx, s.HV, s.V, device=device, dtype=dt),
        "g": torch.randn(Bx, Tx, s.HV, s.K, device=device, dtype=dt),
        "beta": torch.randn(Bx, Tx, s.HV, device=device, dtype=dt),
        "A_log": torch.log(torch.empty(s.HV, device=device).uniform_(1, 16)),
        "dt_bias": 0.5 * torch.randn(s.HV * s.K, device=device),
    }
    x["cu_seqlens"], x["cu_seqlens_cpu"] = _lens_cu(s, device)
    st = (s.HV, s.V, s.K) if state_v_first else (s.HV, s.K, s.V)
    if pool:
        P = 2 * s.n_seqs * (max(s.varlen) if (spec and s.varlen) else (s.T if spec else 1)) + 8
        x["initial_state"] = torch.randn(P, *st, device=device)
        n_idx = s.n_seqs * (s.T if spec and not s.varlen else (max(s.varlen) if spec else 1))
        idx = torch.randperm(P, device=device)[:n_idx].to(torch.int32)
        x["ssm_state_indices"] = idx.view(s.n_seqs, -1) if spec else idx
        x["num_accepted_tokens"] = (torch.randint(1, max(s.T, 2), (s.n_seqs,), device=device).clamp(max=s.T)
                                    .to(torch.int32) if spec else None)
        x["out"] = torch.empty_like(x["v"])
        x["_state_rows"] = s.n_seqs  # roofline counts the rows touched, not the pool
    else:
        x["initial_state"] = torch.randn(s.n_seqs, *st, device=device)
    if grad:
        for n in ("q", "k", "v", "g", "beta"):
            x[n].requires_grad_(True)
    return x


def lightning_inputs(s: Shape, device, grad: bool) -> dict:
    Bx, Tx = (1, s.tokens) if s.varlen else (s.B, s.T)
    dt = torch.bfloat16
    x = {
        "q": torch.randn(Bx, Tx, s.H, s.K, device=device, dtype=dt),
        "k": torch.randn(Bx, Tx, s.H, s.K, device=device, dtype=dt),
        "v": torch.randn(Bx, Tx, s.H, s.V, device=device, dtype=dt),
        "initial_state": torch.randn(s.n_seqs, s.H, s.K, s.V, device=device),
    }
    x["q"] = F.normalize(x["q"].float(), dim=-1).to(dt)
    x["k"] = F.normalize(x["k"].float(), dim=-1).to(dt)
    x["cu_seqlens"], x["cu_seqlens_cpu"] = _lens_cu(s, device)
    if grad:
        for n in ("q", "k", "v"):
            x[n].requires_grad_(True)
    return x


# ---------------------------------------------------------------------------------------------
# calls (same signature for FLA's and fla_cula's functions)
KDA_PREFILL_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0)
KDA_DECODE_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def call_chunk_kda(fn, x):
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], output_final_state=True,
              cu_seqlens=x["cu_seqlens"], cu_seqlens_cpu=x["cu_seqlens_cpu"], A_log=x["A_log"], dt_bias=x["dt_bias"],
              use_beta_sigmoid_in_kernel=True, **KDA_PREFILL_FLAGS)


def call_fused_recurrent_kda(fn, x):
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
              initial_state=x["initial_state"], output_final_state=True, cu_seqlens=x["cu_seqlens"],
              **KDA_DECODE_FLAGS)


def call_fused_recurrent_kda_fwd(fn, x):
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
              initial_state=x["initial_state"], inplace_final_state=True, state_v_first=True,
              cu_seqlens=x["cu_seqlens"], ssm_state_indices=x["ssm_state_indices"],
              num_accepted_tokens=x["num_accepted_tokens"], out=x["out"], **KDA_DECODE_FLAGS)


def call_chunk_lightning(fn, x):
    return fn(x["q"], x["k"], x["v"], 3, 24, initial_state=x["initial_state"], output_final_state=True,
              cu_seqlens=x["cu_seqlens"])


def call_fused_recurrent_lightning(fn, x):
    return fn(x["q"], x["k"], x["v"], 3, 24, initial_state=x["initial_state"], output_final_state=True,
              cu_seqlens=x["cu_seqlens"])


def pool_bytes(s: Shape, x: dict, mode: str) -> float:
    ins = tensor_bytes(*(x.get(n) for n in ("q", "k", "v", "g", "beta")))
    o = s.tokens * s.HV * s.V * x["v"].element_size()
    rows_written = x["ssm_state_indices"].numel()  # per-token writes with [N, Tmax] indices
    per_state = s.HV * s.K * s.V * 4
    return ins + o + per_state * (s.n_seqs + rows_written)


# ---------------------------------------------------------------------------------------------
# shapes
def _S(B, T, H, HV=None, K=128, V=128, varlen=None, label=""):
    return Shape(B, T, H, HV or H, K, V, tuple(varlen) if varlen else None, label)


DECODE_B = (1, 8, 32, 128, 256)
SKEWED_8K = (4096, 2048, 1024, 512, 256, 128, 64, 64)
SHORT_8K = (64,) * 128
DECODE_VARLEN = tuple([1] * 24 + [4] * 8)


def schedule_inputs(s: Shape, device, grad: bool) -> dict:
    cu, _ = _lens_cu(s, device)  # the device tensor: what a training step or a serving engine holds
    return {"cu_seqlens": cu, "T": s.tokens}


def call_chunk_schedule(fn, x):
    return fn(x["cu_seqlens"], x["T"])


def schedule_bytes(s: Shape, x: dict, mode: str) -> float:
    n = s.n_seqs
    return 8 * (n + 1) + 8 * (s.tokens // CHUNK + n) + 4 * (n + 1)


CONV_W = 4


def conv_inputs(s: Shape, device, grad: bool) -> dict:
    """A KDA layer's q short convolution in decode: x [B, 1, H K] bf16, cache [B, H K, 4], weight [H K, 4], silu."""
    D = s.H * s.K
    return {"x": torch.randn(s.B, 1, D, device=device, dtype=torch.bfloat16),
            "cache": torch.randn(s.B, D, CONV_W, device=device, dtype=torch.bfloat16),
            "weight": 0.5 * torch.randn(D, CONV_W, device=device, dtype=torch.bfloat16)}


def call_conv_update(fn, x):
    return fn(x["x"], x["cache"], weight=x["weight"], activation="silu")


def conv_bytes(s: Shape, x: dict, mode: str) -> float:
    """x read and y written, the cache read and written, the weight read."""
    return 2 * tensor_bytes(x["x"]) + 2 * tensor_bytes(x["cache"]) + tensor_bytes(x["weight"])


def registry() -> list[Bench]:
    kda_prefill = [_S(1, 512, 64), _S(1, 4096, 64), _S(1, 16384, 64), _S(2, 1024, 64), _S(2, 4096, 64),
                   _S(2, 8192, 64), _S(2, 16384, 64), _S(8, 4096, 64), _S(32, 1024, 64),
                   _S(1, 8192, 32, varlen=SKEWED_8K, label="skewed"), _S(1, 8192, 32, varlen=SHORT_8K, label="short")]
    kda_train = [_S(2, 4096, 32), _S(2, 8192, 32), _S(8, 4096, 32), _S(1, 32768, 32),
                 _S(1, 8192, 32, varlen=SKEWED_8K, label="skewed")]
    kda_decode = ([_S(b, 1, 32) for b in DECODE_B] + [_S(b, 4, 32) for b in (1, 32, 128)]
                  + [_S(b, 1, 16, 32) for b in (1, 32, 256)] + [_S(b, 1, 8) for b in (1, 32, 256)]
                  + [_S(b, 1, 16) for b in (32, 256)]
                  + [_S(1, 1, 32, varlen=DECODE_VARLEN, label="mixed decode/MTP")])
    kda_serve = ([_S(b, 1, 32) for b in (1, 32, 256)] + [_S(b, 4, 32) for b in (32, 128)]
                 + [_S(1, 1, 32, varlen=DECODE_VARLEN, label="mixed decode/MTP")])
    light_prefill = [_S(1, 4096, 64), _S(1, 16384, 64), _S(2, 8192, 64), _S(8, 4096, 64), _S(16, 2048, 64),
                     _S(1, 8192, 64, varlen=SKEWED_8K, label="skewed"),
                     _S(1, 8192, 8), _S(1, 16384, 16), _S(1, 2048, 16)]   # tensor-parallel shards (the split)
    light_train = [_S(2, 8192, 64), _S(8, 4096, 64)]
    light_decode = [_S(b, 1, 64) for b in DECODE_B] + [_S(b, 4, 64) for b in (32, 128)]
    conv_decode = [_S(b, 1, 16) for b in (1, 32, 128, 256)]
    rb = recurrent_flops
    schedules = [_S(1, 8192, 32, varlen=SKEWED_8K, label="skewed"), _S(1, 8192, 32, varlen=SHORT_8K, label="short"),
                 _S(1, 1, 32, varlen=(1,) * 4096, label="4096 x 1")]
    return [
        Bench("varlen work list", "chunk_schedule", ("eager",), schedules, schedules, schedule_inputs,
              call_chunk_schedule, schedule_bytes, lambda s, mode: 0.0,
              flags="chunk indices + offsets from cu_seqlens, chunk 64: FLA's prepare_chunk_indices/offsets "
                    "(uncached, host sync) vs fla_cula's C++ work list (GPU, no sync, longest first)"),
        Bench("chunk_kda prefill", "chunk_kda", ("eager", "graph"), kda_prefill, [_S(1, 4096, 64)],
              lambda s, d, g: kda_inputs(s, d, g), call_chunk_kda, io_bytes, chunk_kda_flops,
              flags="l2norm, gate in kernel (A_log, dt_bias), safe_gate, lower_bound=-5, beta sigmoid, h0, ht"),
        Bench("chunk_kda train", "chunk_kda", ("fwdbwd",), kda_train, [],
              lambda s, d, g: kda_inputs(s, d, g), call_chunk_kda, io_bytes, chunk_kda_flops,
              grad_inputs=("q", "k", "v", "g", "beta"), flags="as prefill; grads of q, k, v, g, beta"),
        Bench("fused_recurrent_kda decode", "fused_recurrent_kda", ("eager", "graph", "graph_warm"), kda_decode,
              # quick = the issue-4 target rows (decode calls are cheap; FLA's decode kernel does not autotune)
              [_S(b, 1, 32) for b in DECODE_B] + [_S(b, 4, 32) for b in (32, 128)]
              + [_S(32, 1, 16, 32), _S(32, 1, 8)],
              lambda s, d, g: kda_inputs(s, d, g), call_fused_recurrent_kda, io_bytes, rb(8),
              flags="l2norm, gate in kernel (A_log, dt_bias), beta sigmoid, h0, ht (new tensor)"),
        Bench("fused_recurrent_kda_fwd serving", "fused_recurrent_kda_fwd", ("eager", "graph"), kda_serve,
              [_S(32, 1, 32), _S(32, 4, 32)],
              lambda s, d, g: kda_inputs(s, d, g, pool=True, spec=s.T > 1 or bool(s.varlen), state_v_first=True),
              call_fused_recurrent_kda_fwd, pool_bytes, rb(8),
              flags="state pool + ssm_state_indices (T>1: [N,T] + num_accepted_tokens), inplace, out=, "
                    "state_v_first, l2norm, gate in kernel, beta sigmoid"),
        Bench("chunk_lightning_attn prefill", "chunk_lightning_attn", ("eager", "graph"), light_prefill,
              [_S(2, 8192, 64)], lambda s, d, g: lightning_inputs(s, d, g), call_chunk_lightning, io_bytes,
              chunk_lightning_flops, flags="layer 3 of 24, h0, ht"),
        Bench("chunk_lightning_attn train", "chunk_lightning_attn", ("fwdbwd",), light_train, [],
              lambda s, d, g: lightning_inputs(s, d, g), call_chunk_lightning, io_bytes, chunk_lightning_flops,
              grad_inputs=("q", "k", "v"), flags="grads of q, k, v"),
        Bench("causal_conv1d_update decode", "causal_conv1d_update", ("eager", "graph"), conv_decode, conv_decode,
              conv_inputs, call_conv_update, conv_bytes, lambda s, mode: 0.0,
              flags="ShortConvolution's decode step: D = H x 128, W = 4, bf16, silu, cache updated in place"),
        Bench("fused_recurrent_lightning_attn decode", "fused_recurrent_lightning_attn",
              ("eager", "graph", "graph_warm"),
              light_decode, light_decode,  # quick = full: the issue-5 target rows
              lambda s, d, g: lightning_inputs(s, d, g), call_fused_recurrent_lightning, io_bytes, rb(6),
              flags="layer 3 of 24, h0, ht"),
    ]
