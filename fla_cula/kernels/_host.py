"""Host-side helpers shared by the decode wrappers (kda_decode, lightning_decode): dtype tables,
argument checks that return a reason string instead of raising, and the device-correct launch."""

import torch

FLOAT = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
INT = {torch.int32: "int32", torch.int64: "int64"}
I31 = 2 ** 31
KV = 128


def aligned(x) -> bool:
    return x.data_ptr() % 16 == 0


def state_reason(s, N, HV, K, V, vf, pool, what) -> str | None:
    if not isinstance(s, torch.Tensor):
        return f"{what} is not a tensor"
    if s.dtype != torch.float32:
        return f"{what} dtype {s.dtype}: kernel supports float32"
    exp = (HV, V, K) if vf else (HV, K, V)
    if s.ndim != 4 or tuple(s.shape[1:]) != exp:
        return f"{what} shape {tuple(s.shape)}: expected [N, {', '.join(map(str, exp))}]"
    if s.device != pool.device:
        return f"{what} on {s.device}, inputs on {pool.device}"
    st = s.stride()
    if st[1] != K * V or st[2] != exp[2] or st[3] != 1:
        return f"{what} strides {st}: inner [HV, ., .] dims must be contiguous"
    if st[0] % 4 or not aligned(s):
        return f"{what} not 16-byte aligned"
    return None


def launch(fn, dev: torch.device, *args) -> None:
    """Launch on the tensors' device (and that device's current stream, which TVM-FFI reads from
    torch): a call whose tensors live on another GPU than the current one switches device first."""
    if dev.index != torch.cuda.current_device():
        with torch.cuda.device(dev):
            fn(*args)
    else:
        fn(*args)


def qk_reason(named) -> str | None:
    """Activations: tensors of a supported float dtype; q and k of one shape [B, T, H, 128]."""
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            return f"{name} is not a tensor"
        if x.dtype not in FLOAT:
            return f"{name} dtype {x.dtype}: kernel supports bf16/fp16/fp32"
    q, k = named[0][1], named[1][1]
    if q.dtype != k.dtype:
        return f"q dtype {q.dtype} != k dtype {k.dtype}"
    if q.ndim != 4 or k.shape != q.shape:
        return f"q/k shapes {tuple(q.shape)}/{tuple(k.shape)}: expected equal [B, T, H, K]"
    if q.shape[3] != KV:
        return f"head dim {q.shape[3]}: kernel supports 128"
    return None


def seqs_reason(cu_seqlens, B, dev) -> tuple[str | None, int]:
    """(reason or None, number of sequences N). Values are not read here (no host sync): the kernel
    clamps each [cu[n], cu[n+1]) to the token range, so a non-monotone cu_seqlens cannot fault."""
    if cu_seqlens is None:
        return (None if B > 0 else "no sequences"), B
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in INT:
        return "cu_seqlens: expected an int32/int64 tensor", 0
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2 or not cu_seqlens.is_contiguous():
        return f"cu_seqlens shape {tuple(cu_seqlens.shape)}: expected contiguous [N+1], N >= 1", 0
    if cu_seqlens.device != dev:
        return f"cu_seqlens on {cu_seqlens.device}: kernel needs it on {dev}", 0
    if B != 1:
        return f"cu_seqlens with batch {B}: varlen needs B == 1", 0
    return None, cu_seqlens.shape[0] - 1
