"""GPU tests: collected everywhere, run only on an SM90 CUDA device (H100/H200).

Every test under tests/gpu gets the ``gpu`` marker and, where there is no CUDA device or it is not
SM90, a skip with the reason. ``strict_mode`` sets FLA_CULA_STRICT=1, so a kernel-routed test
fails (FallbackError) instead of silently running FLA.
"""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # parity/ (case generation, reference runner) lives at the repo root

HERE = os.path.dirname(os.path.abspath(__file__))


def gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"compute capability {major}.{minor}: GPU tests need SM90"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an SM90 CUDA device (H100/H200); skipped elsewhere")


def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    for item in items:
        if str(item.path).startswith(HERE + os.sep):
            item.add_marker(pytest.mark.gpu)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def strict_mode(monkeypatch):
    """FLA_CULA_STRICT=1 for the test: a fallback raises fla_cula.routing.FallbackError."""
    monkeypatch.setenv("FLA_CULA_STRICT", "1")
    yield


@pytest.fixture(scope="session")
def fla_fns():
    from parity.runner import fla_functions

    return fla_functions()


@pytest.fixture(scope="session")
def cula_fns():
    from parity.runner import cula_functions

    return cula_functions()
