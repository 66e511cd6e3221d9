"""CuTe DSL compile infrastructure on the CPU: sm_90a compiles, PTX checks, the process and disk caches."""

import os
import subprocess
import sys
import tempfile

import pytest

from fla_cula import jit
from fla_cula.kernels.probe import ProbeConfig, ScaleAdd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECS = jit.registered_specs()


def _spec_id(s):
    return s.name + "-" + "-".join(f"{k}={v}" for k, v in s.key)


@pytest.mark.parametrize("spec", SPECS, ids=[_spec_id(s) for s in SPECS])
def test_every_registered_kernel_compiles_for_sm90a(spec):
    """Each registered specialization compiles for sm_90a on this GPU-less machine and its PTX holds
    the instructions the kernel is meant to use (KernelSpec.expect_ptx)."""
    with tempfile.TemporaryDirectory() as d:
        compiled = jit.compile_spec(spec, keep_ptx_dir=d)
        assert jit.missing_ptx(spec, compiled.__ptx__) == []


def test_missing_ptx_reports_absent_instruction():
    spec = ScaleAdd(ProbeConfig("float32")).spec()
    assert jit.missing_ptx(spec, ".target sm_90a\nld.global.v4.f32 x;") == [spec.expect_ptx[1]]
    assert len(jit.missing_ptx(spec, "")) == 3


def test_digest_holds_the_specialization_arch_and_dsl_version(monkeypatch):
    a = ScaleAdd(ProbeConfig("bfloat16")).spec()
    b = ScaleAdd(ProbeConfig("float32")).spec()
    assert a.digest() != b.digest()
    assert a.digest() == ScaleAdd(ProbeConfig("bfloat16")).spec().digest()
    d0 = a.digest()
    monkeypatch.setattr(jit, "dsl_version", lambda: "9.9.9")
    assert a.digest() != d0
    monkeypatch.undo()
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    assert a.digest() != d0


def _child(cache, code):
    env = dict(os.environ, FLA_CULA_CACHE_DIR=str(cache), PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


_CHILD = ("from fla_cula import jit\nfrom fla_cula.kernels.probe import ProbeConfig, ScaleAdd\n"
          "jit.get_compiled(ScaleAdd(ProbeConfig('float32')).spec())\nprint(jit.stats)")


def test_disk_cache_across_processes_and_corrupt_entry(tmp_path):
    first = _child(tmp_path, _CHILD)
    assert "'compiled': 1" in first and "'disk_hits': 0" in first
    objs = list(tmp_path.rglob("*.o"))
    assert len(objs) == 1 and objs[0].stat().st_size > 0
    second = _child(tmp_path, _CHILD)
    assert "'compiled': 0" in second and "'disk_hits': 1" in second
    objs[0].write_bytes(b"not an object file")
    third = _child(tmp_path, _CHILD)
    assert "'corrupt': 1" in third and "'compiled': 1" in third
    fourth = _child(tmp_path, _CHILD)
    assert "'disk_hits': 1" in fourth, "the recompiled entry replaced the corrupt one"


def test_concurrent_processes_compile_once(tmp_path):
    env = dict(os.environ, FLA_CULA_CACHE_DIR=str(tmp_path), PYTHONPATH=REPO)
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    compiled = sum(int(o.strip().splitlines()[-1].split("'compiled': ")[1].split(",")[0]) for o, _ in outs)
    assert compiled == 1, "the per-key lock lets one process compile and the others load"
    assert not list(tmp_path.rglob("*.tmp")), "no temp file left behind"


def test_process_cache_returns_same_callable(tmp_path, monkeypatch):
    monkeypatch.setenv("FLA_CULA_CACHE_DIR", str(tmp_path))
    spec = ScaleAdd(ProbeConfig("bfloat16")).spec()
    jit._mem.pop(spec, None)
    f1 = jit.get_compiled(spec)
    f2 = jit.get_compiled(ScaleAdd(ProbeConfig("bfloat16")).spec())
    assert f1 is f2 and jit.is_cached_in_process(spec) and jit.is_cached_on_disk(spec)
