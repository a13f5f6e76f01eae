"""The README's first command after installing: scripts/demo.sh asks a real model
(SmolLM2 from its GGUF file) a question through a whole local cluster (real processes,
ZeroMQ, Mooncake on loopback) and through `zpd run`, and checks the answers agree."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.cluster import ROOT

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")


def test_demo_answers_the_question_identically_on_both_paths():
    env = os.environ | {"PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "cluster (1 prefill + 1 decode): 'The capital of France is Paris.'" in lines
    assert "zpd run (one process):          'The capital of France is Paris.'" in lines
    assert "identical token for token: yes" in lines
