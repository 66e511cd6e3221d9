"""Machine / version header shared by the parity and benchmark reports."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib import metadata

import torch


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def git_commit() -> str:
    env = os.environ.get("FLA_CULA_COMMIT")
    if env:
        return env
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0:
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return "unknown"


def machine_header() -> dict[str, str]:
    h: dict[str, str] = {}
    if torch.cuda.is_available():
        idx = torch.cuda.current_device()
        p = torch.cuda.get_device_properties(idx)
        h["gpu"] = f"{p.name} (SM {p.major}.{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB)"
        h["driver"] = driver_version()
        h["cuda (torch)"] = str(torch.version.cuda)
    else:
        h["gpu"] = "none (CPU)"
    h["python"] = platform.python_version()
    h["torch"] = torch.__version__
    h["triton"] = _version("triton")
    h["fla-core"] = _version("fla-core")
    h["flash-linear-attention"] = _version("flash-linear-attention")
    h["nvidia-cutlass-dsl"] = _version("nvidia-cutlass-dsl")
    h["fla_cula commit"] = git_commit()
    h["date (UTC)"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    return h
