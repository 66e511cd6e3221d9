"""The varlen work list (fla_cula._C.varlen_schedule through fla_cula.kernels.varlen_schedule) against
FLA's prepare_chunk_indices / prepare_chunk_offsets (fla/ops/utils/index.py), on an SM90 GPU.

The rows as a multiset equal FLA's; their order is longest sequence first (equal lengths: lower
index first), each sequence's chunks in order; rows past num_chunks are (-1, -1); chunk_offsets is
FLA's exactly. Every call runs under torch.cuda.set_sync_debug_mode("error"): a host sync fails."""

import pytest
import torch

from fla_cula import _ext

_ok, _why = _ext.available()
pytestmark = pytest.mark.skipif(not _ok, reason=f"fla_cula._C unavailable: {_why}")


def _cu(lens, dtype):
    lens = torch.tensor(lens, dtype=torch.int64)
    return torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(dtype).cuda()


def _schedule_no_sync(cu, T, C):
    from fla_cula.kernels.varlen_schedule import chunk_schedule

    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = chunk_schedule(cu, T, C)
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize()
    return out


def _expected_order(lens, C):
    """Longest first, ties by index, then the chunks of each sequence in order."""
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    return [(i, c) for i in order for c in range(-(-lens[i] // C))]


_G = torch.Generator().manual_seed(0)
CASES = {
    "uniform-4x2048": [2048] * 4,
    "skewed": [7000, 1, 63, 64, 65, 300, 2, 0, 129],
    "many-short": torch.randint(1, 40, (700,), generator=_G).tolist(),          # > 512: the large CTA
    "empty-seqs": [0, 5, 0, 0, 64, 0],
    "all-empty": [0, 0, 0],
    "n1": [1000],
    "n1-tail": [65],
    "n1-empty": [0],
    "ties": [128, 64, 128, 64, 128],
    "random-3000": torch.randint(0, 3000, (3000,), generator=_G).tolist(),
    "max-seqs": torch.randint(0, 9, (8192,), generator=_G).tolist(),
}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("C", [64, 32])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_fla(case, C, dtype):
    from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets

    lens = CASES[case]
    cu = _cu(lens, dtype)
    T = sum(lens)
    sched = _schedule_no_sync(cu, T, C)
    n = len(lens)
    assert sched.chunk_indices.shape == (T // C + n, 2) and sched.chunk_indices.dtype == torch.int32
    assert sched.num_chunks.shape == () and sched.chunk_offsets.shape == (n + 1,)

    ref_idx = prepare_chunk_indices(cu, C).cpu()
    ref_off = prepare_chunk_offsets(cu, C).cpu()
    count = int(sched.num_chunks)
    assert count == ref_idx.shape[0]
    got = sched.chunk_indices.cpu()
    valid, pad = got[:count], got[count:]
    # the multiset of FLA's rows
    assert sorted(map(tuple, valid.tolist())) == sorted(map(tuple, ref_idx.tolist()))
    # in the order a persistent scheduler wants
    assert list(map(tuple, valid.tolist())) == _expected_order(lens, C)
    assert (pad == -1).all()
    assert torch.equal(sched.chunk_offsets.cpu().long(), ref_off.long())


def test_chunk_offsets_and_count_agree():
    lens = [100, 0, 3, 64, 65]
    sched = _schedule_no_sync(_cu(lens, torch.int32), sum(lens), 64)
    assert int(sched.chunk_offsets[-1]) == int(sched.num_chunks) == 2 + 0 + 1 + 1 + 2


def test_larger_buffer_than_needed_is_padded():
    from fla_cula import _ext

    C_ = _ext.require()
    cu = _cu([10, 70], torch.int32)
    idx = torch.full((50, 2), 7, dtype=torch.int32, device="cuda")
    cnt = torch.empty((), dtype=torch.int32, device="cuda")
    off = torch.empty(3, dtype=torch.int32, device="cuda")
    C_.varlen_schedule(cu, idx, cnt, off, 80, 64)
    torch.cuda.synchronize()
    assert int(cnt) == 3
    assert idx[:3].tolist() == [[1, 0], [1, 1], [0, 0]]
    assert (idx[3:] == -1).all()


@pytest.mark.parametrize(
    "cu",
    [[0, 50, 20, 100], [0, 100, 0, 100], [-5, 10, 2**30, 7], [40, 30, 20, 10], [0, 10**9]],
    ids=["decreasing", "overlapping", "out-of-range", "reversed", "beyond-T"],
)
def test_malformed_cu_seqlens_stays_in_bounds(cu):
    # a schedule of some valid cu_seqlens (clamped to [0, T], running maximum), never a write past
    # the buffer: a canary after chunk_indices stays untouched
    T, C = 100, 32
    n = len(cu) - 1
    rows = T // C + n
    buf = torch.full((rows + 8, 2), 12345, dtype=torch.int32, device="cuda")
    cnt = torch.empty((), dtype=torch.int32, device="cuda")
    off = torch.empty(n + 1, dtype=torch.int32, device="cuda")
    _ext.require().varlen_schedule(torch.tensor(cu, dtype=torch.int64, device="cuda"), buf[:rows], cnt, off, T, C)
    torch.cuda.synchronize()
    assert (buf[rows:] == 12345).all()
    clamped = [min(max(x, 0), T) for x in cu]
    run = [max(clamped[: i + 1]) for i in range(len(clamped))]
    lens = [run[i + 1] - run[i] for i in range(n)]
    assert int(cnt) == sum(-(-L // C) for L in lens)
    assert list(map(tuple, buf[: int(cnt)].tolist())) == _expected_order(lens, C)


def test_side_stream_and_second_device_guard():
    # launched on the caller's current stream: a side stream's result is complete after its sync
    lens = [300, 5, 77]
    cu = _cu(lens, torch.int32)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    from fla_cula.kernels.varlen_schedule import chunk_schedule

    with torch.cuda.stream(s):
        sched = chunk_schedule(cu, sum(lens), 64)
    s.synchronize()
    assert list(map(tuple, sched.chunk_indices[: int(sched.num_chunks)].tolist())) == _expected_order(lens, 64)
    if torch.cuda.device_count() > 1:
        cu1 = cu.to("cuda:1")
        sched1 = chunk_schedule(cu1, sum(lens), 64)
        torch.cuda.synchronize("cuda:1")
        assert sched1.chunk_indices.device == cu1.device
        assert torch.equal(sched1.chunk_indices.cpu(), sched.chunk_indices.cpu())


def test_mixed_devices_rejected():
    cu = _cu([4, 4], torch.int32)
    with pytest.raises(ValueError, match=r"^chunk_offsets: expected a tensor on cuda:0 \(as cu_seqlens\), got cpu$"):
        _ext.require().varlen_schedule(
            cu, torch.empty(2, 2, dtype=torch.int32, device="cuda"), torch.empty((), dtype=torch.int32, device="cuda"),
            torch.empty(3, dtype=torch.int32), 8, 64,
        )


def test_timing_against_fla(capsys):
    """Prints the work list's wall time per call next to FLA's prepare_chunk_indices (which reads the
    chunk count on the host: one sync per call). Distinct cu_seqlens tensors defeat FLA's tensor_cache."""
    import time

    from fla.ops.utils.index import prepare_chunk_indices

    from fla_cula.kernels.varlen_schedule import chunk_schedule

    reps, rows = 20, []
    for name in ("skewed", "many-short", "random-3000"):
        lens = CASES[name]
        cus = [_cu(lens, torch.int32) for _ in range(reps + 3)]
        T = sum(lens)
        for label, call in (("fla_cula", lambda cu, T=T: chunk_schedule(cu, T, 64)),
                            ("FLA", lambda cu: prepare_chunk_indices(cu, 64))):
            for cu in cus[:3]:
                call(cu)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for cu in cus[3:]:
                call(cu)
            torch.cuda.synchronize()
            us = (time.perf_counter() - t0) / reps * 1e6
            rows.append(f"varlen work list  {name:12} N={len(lens):5} C=64  {label:9} {us:8.1f} us/call")
    with capsys.disabled():
        print("\n" + "\n".join(rows))
