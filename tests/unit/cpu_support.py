"""What the CPU-kernel tests share: whether they can run here, and what this CPU has."""
from __future__ import annotations

import os
import shutil

import pytest


def require_compiler() -> None:
    """Skip the calling module where there is no C++ compiler, except in CI, which
    installs one (scripts/install.sh): there a missing kernel is a failure."""
    if shutil.which(os.environ.get("CXX") or "g++") is None and not os.environ.get("CI"):
        pytest.skip("no C++ compiler to build the kernels with", allow_module_level=True)


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists `flag`."""
    try:
        return f" {flag}" in open("/proc/cpuinfo").read()
    except OSError:
        return False
