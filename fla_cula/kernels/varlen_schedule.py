"""The varlen work list of the prefill kernels: chunk and segment indices from cu_seqlens, on the GPU.

Host wrapper of the CUDA C++ kernel ``fla_cula._C.varlen_schedule``
(csrc/varlen_schedule/: one CTA, CUB block scans and a block radix sort). For a packed batch of N
sequences (``cu_seqlens`` [N+1], int32 or int64, on an SM90 GPU), T tokens and chunk size C:

  chunk_indices  [T // C + N, 2] int32  (sequence, chunk within the sequence) of every chunk, the
                 longest sequence first (equal lengths: lower index first), each sequence's chunks
                 in order; rows from ``num_chunks`` on are (-1, -1). The rows as a multiset are FLA's
                 ``prepare_chunk_indices(cu_seqlens, C)``; the order is for a persistent scheduler
                 (longest work first).
  num_chunks     [] int32               the number of valid rows (on the device).
  chunk_offsets  [N+1] int32            FLA's ``prepare_chunk_offsets(cu_seqlens, C)``, in sequence order.

The shapes depend only on host-known sizes (T from q.shape[1], N from cu_seqlens.shape), so nothing
here synchronizes with the device: no .item(), no .tolist(), no data-dependent torch op. The kernel
clamps cu_seqlens to [0, T] and takes a running maximum, so a malformed cu_seqlens gives the
schedule of some valid one and never an out-of-bounds write.

Import fails (ImportError with the reason) where the C++ extension is not built or is stale; the
kernel registry reports that as the routing reason of the ops that use it.
"""

from typing import NamedTuple

import torch

from fla_cula import _ext

_ok, _why = _ext.available()
if not _ok:
    raise ImportError(_why)
_C = _ext.require()

MAX_SEQUENCES: int = _C.VARLEN_SCHEDULE_MAX_SEQS  # one CTA sorts the sequences: N <= 8192


class ChunkSchedule(NamedTuple):
    chunk_indices: torch.Tensor  # [T // C + N, 2] int32, longest sequence first, (-1, -1) past num_chunks
    num_chunks: torch.Tensor     # [] int32 on the device
    chunk_offsets: torch.Tensor  # [N + 1] int32


def max_chunks(total_tokens: int, num_seqs: int, chunk_size: int) -> int:
    """Rows of chunk_indices: an upper bound of sum(ceil(len / C)) over sequences summing to T."""
    return total_tokens // chunk_size + num_seqs


def chunk_schedule(cu_seqlens: torch.Tensor, total_tokens: int, chunk_size: int = 64) -> ChunkSchedule:
    """The chunk schedule of a packed batch, enqueued on the current stream of cu_seqlens' device.

    cu_seqlens: int32 or int64 [N+1], contiguous, CUDA (SM90); N <= MAX_SEQUENCES.
    total_tokens: T, the packed length (q.shape[1]); cu_seqlens[-1] <= T is assumed, not checked.
    chunk_size: C (64 for the KDA/GLA chunk kernels, 32 for some intra-chunk passes).

    Raises TypeError / ValueError naming the expected and the actual value; dtype, layout and device
    are checked in C++ (the same messages for every C++ kernel).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens: expected shape (N+1,) with N >= 0, got {tuple(cu_seqlens.shape)}")
    for name, v in (("total_tokens", total_tokens), ("chunk_size", chunk_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size}")
    if total_tokens < 0:
        raise ValueError(f"total_tokens: expected >= 0, got {total_tokens}")
    n = cu_seqlens.shape[0] - 1
    if n > MAX_SEQUENCES:
        raise ValueError(f"cu_seqlens: expected at most {MAX_SEQUENCES} sequences, got {n}")
    dev = cu_seqlens.device
    chunk_indices = torch.empty(max_chunks(total_tokens, n, chunk_size), 2, dtype=torch.int32, device=dev)
    num_chunks = torch.empty((), dtype=torch.int32, device=dev)
    chunk_offsets = torch.empty(n + 1, dtype=torch.int32, device=dev)
    _C.varlen_schedule(cu_seqlens, chunk_indices, num_chunks, chunk_offsets, total_tokens, chunk_size)
    return ChunkSchedule(chunk_indices, num_chunks, chunk_offsets)


def cpp_kernels_info() -> list[dict]:
    """This kernel's entry of ``fla_cula._ext.cpp_kernels()`` for ``fla_cula info``: name, arch, and per
    specialization its CTA size, sequence limit, dynamic shared memory and (where cuobjdump is found)
    registers, stack, local and static shared bytes read from the built module."""
    return [k for k in _ext.cpp_kernels() if k["name"] == "varlen_schedule"]
