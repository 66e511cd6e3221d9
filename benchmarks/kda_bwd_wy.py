"""kda_bwd_wy (and kda_bwd_intra) alone against FLA's chunk_kda_bwd_wy_dqkg_fused (chunk_kda_bwd_intra), same
inputs, same run.

    python -m benchmarks.kda_bwd_wy [--rows '[[2,4096,32],[1,8192,32]]'] [--reps 50] [--vfirst 1]
                                    [--op wy intra pair fused dv gate]

Ops: wy, intra (each kernel against FLA's); pair (our two kernels in sequence, FLA's dAqk given) against FLA's two
kernels in sequence; fused (kda_bwd_dv, then kda_bwd_wy with the intra step and its dAqk made inside) against FLA's
chunk_kda_bwd_dAv, wy and intra kernels in sequence; dv (kda_bwd_dv against chunk_kda_bwd_dAv, which also makes
dAqk); gate (kda_bwd_gate and the sums over chunks against FLA's chunk_local_cumsum(dg, reverse) + kda_gate_bwd).

Random inputs of the training path's shapes (their values do not change the time); each side timed as the median of
--reps CUDA-event intervals after a warm-up, in alternating order; the floor beside them is the kernel's bytes
(~344 KB per chunk and value head: q, k, v, v', do, dv, g, h, dh, Akk in; dq, dk, dg, dv2, dA, db out) at the
measured copy bandwidth of a same-size device copy. `AB_BENCH=kda_bwd_wy` runs it under scripts/device_jobs.sh ab.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def inputs(B: int, T: int, HV: int, vfirst: bool) -> dict:
    d, bf = "cuda", torch.bfloat16
    NT = (T + 63) // 64
    x = dict(q=torch.randn(B, T, HV, 128, device=d, dtype=bf) * 0.1,
             k=torch.randn(B, T, HV, 128, device=d, dtype=bf) * 0.1,
             g=-torch.rand(B, T, HV, 128, device=d) * 2, beta=torch.rand(B, T, HV, device=d),
             A=(torch.randn(B, T, HV, 64, device=d) * 0.1).to(bf),
             h=torch.randn(B, NT, HV, 128, 128, device=d, dtype=bf) * 0.1,
             dh=torch.randn(B, NT, HV, 128, 128, device=d, dtype=bf) * 0.1)
    for n in ("v", "v_new", "do", "dv"):
        x[n] = torch.randn(B, T, HV, 128, device=d, dtype=bf)
    x["state_v_first"] = vfirst
    return x


def ours(x):
    from fla_cula import _ext

    C = _ext.require()
    B, T, HV, _ = x["v"].shape
    out = [torch.empty(B, T, HV, 128, device="cuda") for _ in range(3)]
    dv2, db = torch.empty_like(x["v"]), torch.empty(B, T, HV, device="cuda")
    dA = torch.empty(B, T, HV, 64, device="cuda")

    def call():
        C.kda_bwd_wy(x["q"], x["k"], x["v"], x["v_new"], x["g"], x["beta"], x["A"], x["h"], x["do"], x["dh"],
                     x["dv"], out[0], out[1], dv2, out[2], db, dA, 128 ** -0.5, x["state_v_first"])
    return call


def fla(x):
    from fla_cula.ops.kda_bwd import FLA_CHUNK_KDA_BWD_WY

    def call():
        return FLA_CHUNK_KDA_BWD_WY(q=x["q"], k=x["k"], v=x["v"], v_new=x["v_new"], g=x["g"], beta=x["beta"],
                                    A=x["A"], h=x["h"], do=x["do"], dh=x["dh"], dv=x["dv"], scale=128 ** -0.5,
                                    state_v_first=x["state_v_first"])
    call.run = call
    return call


def intra_inputs(B: int, T: int, HV: int) -> dict:
    d = "cuda"
    x = dict(q=torch.randn(B, T, HV, 128, device=d, dtype=torch.bfloat16) * 0.1,
             k=torch.randn(B, T, HV, 128, device=d, dtype=torch.bfloat16) * 0.1,
             g=(-torch.rand(B, T // 64, 64, HV, 128, device=d) * 7.2).cumsum(2).view(B, T, HV, 128),
             beta=torch.rand(B, T, HV, device=d), db=torch.randn(B, T, HV, device=d))
    for n in ("dAqk", "dAkk"):  # both kernels read only the triangle they need: the rest may hold anything
        x[n] = torch.randn(B, T, HV, 64, device=d)
    for n in ("dq", "dk", "dg"):
        x[n] = torch.randn(B, T, HV, 128, device=d)
    return x


def ours_intra(x):
    from fla_cula import _ext

    C = _ext.require()
    out = [torch.empty_like(x[n]) for n in ("dq", "dk", "dg", "db")]

    def call():
        C.kda_bwd_intra(x["q"], x["k"], x["g"], x["beta"], x["dAqk"], x["dAkk"], x["dq"], x["dk"], x["dg"], x["db"],
                        *out, 5.0 / 0.6931471805599453)
    return call


def fla_intra(x):
    from fla_cula.ops.kda_bwd import FLA_CHUNK_KDA_BWD_INTRA

    def call():
        FLA_CHUNK_KDA_BWD_INTRA(q=x["q"], k=x["k"], g=x["g"], beta=x["beta"], dAqk=x["dAqk"], dAkk=x["dAkk"],
                                dq=x["dq"], dk=x["dk"], db=x["db"], dg=x["dg"], chunk_size=64, safe_gate=True,
                                lower_bound=-5.0)
    return call


def pair_inputs(B: int, T: int, HV: int, vfirst: bool) -> dict:
    x = inputs(B, T, HV, vfirst)
    x["dAqk"] = torch.randn(B, T, HV, 64, device="cuda")
    return x


def fla_pair(x, dAv: bool = False):
    from fla_cula.ops.kda_bwd import FLA_CHUNK_KDA_BWD_INTRA, chunk_kda_bwd_dAv

    wy = fla(x)

    def call():
        dAqk = x["dAqk"]
        if dAv:
            dAqk = chunk_kda_bwd_dAv(q=x["q"], k=x["k"], v=x["v_new"], do=x["do"], A=x["A"], scale=128 ** -0.5)[0]
        dq, dk, _, db, dg, dA = wy.run()
        FLA_CHUNK_KDA_BWD_INTRA(q=x["q"], k=x["k"], g=x["g"], beta=x["beta"], dAqk=dAqk, dAkk=dA, dq=dq, dk=dk,
                                db=db, dg=dg, chunk_size=64, safe_gate=True, lower_bound=-5.0)
    return call


def ours_pair(x, fused: bool):
    from fla_cula import _ext

    C = _ext.require()
    B, T, HV, _ = x["v"].shape
    dq, dk, dg = (torch.empty(B, T, HV, 128, device="cuda") for _ in range(3))
    dv2, db = torch.empty_like(x["v"]), torch.empty(B, T, HV, device="cuda")
    dA = torch.empty(B, T, HV, 64, device="cuda")
    dv = torch.empty_like(x["v"])
    shift = 5.0 / 0.6931471805599453
    wy_args = [x[n] for n in ("q", "k", "v", "v_new", "g", "beta", "A", "h", "do", "dh", "dv")]

    def call():
        if fused:  # dv as chunk_kda_bwd_dAv's, then wy with the intra step (dAqk made inside)
            C.kda_bwd_dv(x["A"], x["do"], dv)
            C.kda_bwd_wy(*wy_args, dq, dk, dv2, dg, db, None, 128 ** -0.5, x["state_v_first"], None, None, True,
                         shift)
        else:
            C.kda_bwd_wy(*wy_args, dq, dk, dv2, dg, db, dA, 128 ** -0.5, x["state_v_first"])
            C.kda_bwd_intra(x["q"], x["k"], x["g"], x["beta"], x["dAqk"], dA, dq, dk, dg, db, dq, dk, dg, db, shift)
    return call


def ours_dv(x):
    from fla_cula import _ext

    C, dv = _ext.require(), torch.empty_like(x["do"])
    return lambda: C.kda_bwd_dv(x["A"], x["do"], dv)


def fla_dv(x):
    from fla_cula.ops.kda_bwd import chunk_kda_bwd_dAv

    return lambda: chunk_kda_bwd_dAv(q=x["q"], k=x["k"], v=x["v_new"], do=x["do"], A=x["A"], scale=128 ** -0.5)


def gate_inputs(B: int, T: int, HV: int) -> dict:
    d = "cuda"
    return dict(dg=torch.randn(B, T, HV, 128, device=d), g_raw=torch.randn(B, T, HV, 128, device=d).bfloat16(),
                A_log=torch.randn(HV, device=d), dt_bias=torch.randn(HV * 128, device=d))


def ours_gate(x):
    from fla_cula import _ext

    C = _ext.require()
    B, T, HV, K = x["dg"].shape
    dg_raw = torch.empty_like(x["g_raw"])
    chunks = B * ((T + 63) // 64)
    dA_part, dbias_part = torch.empty(chunks, HV, device="cuda"), torch.empty(chunks, HV * K, device="cuda")

    def call():  # the kernel and the two sums over chunks that complete dA_log's and dt_bias's gradients
        C.kda_bwd_gate(x["dg"], x["g_raw"], x["A_log"], x["dt_bias"], -5.0, dg_raw, dA_part, dbias_part)
        dA_part.sum(0)
        dbias_part.sum(0)
    return call


def fla_gate(x):
    from fla.ops.kda.gate import kda_gate_bwd
    from fla.ops.utils import chunk_local_cumsum

    def call():
        dyg = chunk_local_cumsum(x["dg"], chunk_size=64, reverse=True)
        kda_gate_bwd(g=x["g_raw"], A_log=x["A_log"], dt_bias=x["dt_bias"], dyg=dyg, lower_bound=-5.0)
    return call


def _us(call, reps: int) -> list[float]:
    e = [(torch.cuda.Event(True), torch.cuda.Event(True)) for _ in range(reps)]
    for a, b in e:
        a.record()
        call()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 for a, b in e]


def _copy_us(nbytes: float) -> float:
    """A device copy moving nbytes in all (nbytes / 2 read, nbytes / 2 written): the memory floor's clock."""
    src = torch.empty(int(nbytes) // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return statistics.median(_us(lambda: dst.copy_(src), 20))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="[[2,4096,32],[1,8192,32]]", help="JSON list of [B, T, HV]")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--vfirst", type=int, default=1, help="state layout: 1 V-first (the KDA layer's), 0 K-first")
    ap.add_argument("--op", nargs="+", choices=("wy", "intra", "pair", "fused", "dv", "gate"),
                    default=["wy", "intra"])
    a = ap.parse_args(argv)
    print(f"{'op':>6} {'B':>3} {'T':>6} {'HV':>4} {'FLA us':>9} {'ours us':>9} {'speedup':>8} {'floor us':>9}")
    for op in a.op:
        for B, T, HV in json.loads(a.rows):
            _row(op, B, T, HV, a)
    return 0


# bytes per (chunk, value head): wy reads q, k, v, v', do, dv, g, h, dh, Akk and writes dq, dk, dg, dv2, dA, db;
# intra reads q, k, g, dAqk, dAkk, dq, dk, dg and writes dq, dk, dg; the pair both; dv reads Aqk, do and writes dv
# (40 KB); fused: wy's without dA out, plus dv's; gate reads dg (fp32) and g_raw (bf16) and writes dg_raw (bf16)
BYTES = {"wy": 344e3, "intra": 290e3, "pair": 634e3, "fused": 368e3, "dv": 40e3, "gate": 64 * 128 * 8}


def _row(op: str, B: int, T: int, HV: int, a) -> None:
    from fla_cula import _ext

    need = {"gate": "kda_bwd_gate", "wy": "kda_bwd_wy", "dv": "kda_bwd_dv", "fused": "kda_bwd_dv"}.get(op,
                                                                                                 "kda_bwd_intra")
    if not hasattr(_ext.require(), need):
        print(f"{op:>6} {B:>3} {T:>6} {HV:>4}  (this build has no {need})")
        return
    if op == "gate":
        x = gate_inputs(B, T, HV)
        calls = {"fla": fla_gate(x), "ours": ours_gate(x)}
    elif op == "wy":
        x = inputs(B, T, HV, bool(a.vfirst))
        calls = {"fla": fla(x), "ours": ours(x)}
    elif op in ("pair", "fused"):
        x = pair_inputs(B, T, HV, bool(a.vfirst))
        calls = {"fla": fla_pair(x, dAv=op == "fused"), "ours": ours_pair(x, op == "fused")}
    elif op == "dv":
        x = inputs(B, T, HV, bool(a.vfirst))
        calls = {"fla": fla_dv(x), "ours": ours_dv(x)}
    else:
        x = intra_inputs(B, T, HV)
        calls = {"fla": fla_intra(x), "ours": ours_intra(x)}
    for c in calls.values():
        c()
        c()
    t = {n: [] for n in calls}
    for _ in range(2):
        for n, c in calls.items():
            t[n] += _us(c, a.reps // 2)
    med = {n: statistics.median(v) for n, v in t.items()}
    copy = _copy_us(B * ((T + 63) // 64) * HV * BYTES[op])
    print(f"{op:>6} {B:>3} {T:>6} {HV:>4} {med['fla']:9.1f} {med['ours']:9.1f} {med['fla'] / med['ours']:7.2f}x "
          f"{copy:9.1f}")
    del x, calls
    torch.cuda.empty_cache()


if __name__ == "__main__":
    raise SystemExit(main())
