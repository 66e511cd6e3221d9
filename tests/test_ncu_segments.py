"""benchmarks.ncu_segments on a small synthetic ncu source-page CSV (CPU only)."""

from __future__ import annotations

from benchmarks import ncu_segments as ns

HEADER = ['"Address"', '"Source"', '"Warp Stall Sampling (All Samples)"', '"Instructions Executed"',
          '"stall_barrier"', '"stall_short_sb"', '"stall_short_sb (Not Issued)"']


def _row(addr: str, sass: str, samples: int, executed: int, barrier: int, short_sb: int) -> str:
    return ",".join(f'"{x}"' for x in (addr, sass, samples, executed, barrier, short_sb, 999))


def _csv(tmp_path, kernels):
    lines = []
    for name, rows in kernels:
        lines += [f'"Kernel Name","{name}"', ",".join(HEADER)] + [_row(*r) for r in rows]
    path = tmp_path / "source_sass.csv"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


ROWS = [
    ("0x0", "MUFU.EX2 R1, R2", 30, "1,000", 0, 20),
    ("0x10", "@!P0 LDS R3, [R4]", 10, 1000, 0, 10),
    ("0x20", "BAR.SYNC.DEFER_BLOCKING 0x0", 20, 1000, 20, 0),
    ("0x30", "HMMA.16816.F32.BF16 R8, R12, R16, R8", 40, 2000, 0, 5),
    ("0x40", "BAR.ARV 0x1, 0x100", 0, 1000, 0, 0),
]


def test_segments_cut_at_bar_sync(tmp_path):
    kernels = ns.read_kernels(_csv(tmp_path, [("k1", ROWS), ("k1", ROWS[:2]), ("k2", ROWS[3:])]))
    assert list(kernels) == ["k1", "k2"]  # a kernel listed twice keeps its first listing
    segs = ns.segments(kernels["k1"])
    assert [(s.first, s.last) for s in segs] == [(0, 2), (3, 4)]  # BAR.ARV does not cut
    assert segs[0].executed == 3000 and segs[0].samples == 60
    assert segs[0].stalls["short_sb"] == 30 and segs[0].stalls["barrier"] == 20
    assert "short_sb (Not Issued)" not in segs[0].stalls
    assert segs[0].ops == {"MUFU": 1000, "LDS": 1000}  # the guarded LDS counts as LDS
    assert segs[1].ops == {"HMMA": 2000}


def test_report_and_main(tmp_path, capsys):
    path = _csv(tmp_path, [("k1", ROWS)])
    text = ns.report("k1", ns.read_kernels(path)["k1"], 0.0)
    assert "    0-    2   50.0%    60.0%" in text and "    3-    4   50.0%    40.0%" in text
    assert ns.main([path, "--min", "55"]) == 0
    out = capsys.readouterr().out
    assert "    0-    2" in out and "    3-    4" not in out  # below --min in both columns
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    assert ns.main([str(empty)]) == 2
