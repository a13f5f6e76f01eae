"""pyflakes finds nothing in the project's Python: an undefined name (as once in
update_weights, answered as a 500 at run time), an unused import or variable."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DIRS = ["engines", "transport", "zpd", "tests", "bench", "examples"]

pytest.importorskip("pyflakes", reason="the test extra installs pyflakes")


def test_pyflakes_is_clean():
    done = subprocess.run([sys.executable, "-m", "pyflakes", *DIRS], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
