"""GPU: a serving call whose shapes would make FLA's kernel address memory outside a tensor raises
ValueError before any launch, and the CUDA context stays usable (issue 15, part 6).

The bad calls run in a child process: if a check were missing, FLA's kernel would make an illegal
memory access and lose that process's CUDA context, not this test session's. The child reports,
per case, the exception it got and whether a torch op + synchronize still worked afterwards.

    python -m pytest -q tests/gpu/test_bounds_gpu.py
"""

import json
import os
import subprocess
import sys

import pytest
import torch

_HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _HAS_SM90, reason="needs a CUDA SM90 (Hopper) device")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CHILD = r'''
import json, sys
import torch
import fla_cula
from fla_cula import fused_recurrent_kda_fwd

dev = "cuda"
H = HV = 4
K = V = 128


def acts(B, T):
    g = torch.Generator(device=dev).manual_seed(B * 100 + T)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)
    return (r(B, T, H, K).bfloat16(), r(B, T, H, K).bfloat16(), r(B, T, HV, V).bfloat16(),
            torch.nn.functional.logsigmoid(r(B, T, HV, K)).bfloat16(), r(B, T, HV).sigmoid().bfloat16())


def pool(P):
    return torch.randn(P, HV, K, V, device=dev)


def i32(x):
    return torch.tensor(x, dtype=torch.int32, device=dev)


def fla_patched_fwd(*a, **kw):
    from fla.ops.kda import fused_recurrent as fr
    return fr.fused_recurrent_kda_fwd(*a, **kw)   # FLA's module attribute, patched by fla_cula.patch()


CASES = {
    # the issue's case: cu_seqlens [0, 2, 4, 6], a pool of 8 states, 1-D indices [5, 1, 7]
    "issue_1d_varlen": lambda f: f(*acts(1, 6), initial_state=pool(8), inplace_final_state=True,
                                   cu_seqlens=i32([0, 2, 4, 6]), ssm_state_indices=i32([5, 1, 7])),
    "1d_fixed_T2": lambda f: f(*acts(3, 2), initial_state=pool(8), inplace_final_state=True,
                               ssm_state_indices=i32([5, 1, 7])),
    "2d_narrower_than_T": lambda f: f(*acts(2, 4), initial_state=pool(8), inplace_final_state=True,
                                      ssm_state_indices=i32([[0, 1, 2], [3, 4, 5]])),
    "num_accepted_short": lambda f: f(*acts(3, 2), initial_state=pool(8), inplace_final_state=True,
                                      ssm_state_indices=i32([[0, 1], [2, 3], [4, 5]]), num_accepted_tokens=i32([1, 2])),
    "cu_more_seqs_than_states": lambda f: f(*acts(1, 6), initial_state=pool(2), inplace_final_state=True,
                                            cu_seqlens=i32([0, 2, 4, 6])),
    "pool_not_inplace_multi_token": lambda f: f(*acts(2, 3), initial_state=pool(8), inplace_final_state=False,
                                                output_final_state=True, ssm_state_indices=i32([[0, 1, 2], [3, 4, 5]])),
}

res = {}
for entry, f in (("fla_cula", fused_recurrent_kda_fwd), ("fla_patched", fla_patched_fwd)):
    if entry == "fla_patched":
        fla_cula.patch()
    for name, case in CASES.items():
        try:
            case(f)
            torch.cuda.synchronize()
            err = None
        except ValueError as e:
            err = "ValueError: " + str(e)
        except Exception as e:  # noqa: BLE001 - reported, the test fails on it
            err = type(e).__name__ + ": " + str(e)
        try:
            x = torch.arange(1024, device=dev, dtype=torch.float32)
            ok = float((x * 2).sum().item()) == 1023.0 * 1024
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            ok = f"context lost: {e}"
        res[f"{entry}/{name}"] = {"error": err, "context_ok": ok}
# a valid call after all of them: the kernel still runs (fixed batch, 1-D pool, one token each)
q, k, v, g, beta = acts(3, 1)
p = pool(8)
o, _ = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=p, inplace_final_state=True,
                               ssm_state_indices=i32([5, 1, 7]))
torch.cuda.synchronize()
res["valid_after"] = {"error": None, "context_ok": bool(torch.isfinite(o.float()).all().item())}
print("RESULT " + json.dumps(res))
'''


@pytest.fixture(scope="module")
def child_results():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("FLA_CULA_STRICT", None)   # bad calls are expected to raise, not to be counted as fallbacks
    p = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"child exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


_MATCH = {
    "issue_1d_varlen": "1-D ssm_state_indices",
    "1d_fixed_T2": "1-D ssm_state_indices",
    "2d_narrower_than_T": "2-D ssm_state_indices: expected a slot per token",
    "num_accepted_short": "num_accepted_tokens: expected one entry per sequence",
    "cu_more_seqs_than_states": "initial_state: expected 3 states",
    "pool_not_inplace_multi_token": "expected at most 2 tokens",
}


@pytest.mark.parametrize("entry", ["fla_cula", "fla_patched"])
@pytest.mark.parametrize("case", list(_MATCH))
def test_bad_call_raises_and_context_survives(child_results, entry, case):
    r = child_results[f"{entry}/{case}"]
    assert r["error"] is not None and r["error"].startswith("ValueError: "), r
    assert _MATCH[case] in r["error"], r
    assert r["context_ok"] is True, r


def test_valid_call_after_the_bad_ones(child_results):
    assert child_results["valid_after"]["context_ok"] is True
