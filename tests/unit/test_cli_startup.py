"""`zpd --help`, `zpd admin` and `zpd generate` start without importing torch (issue 31):
torch alone takes ~2 s to import, ten times what the rest of these commands need.
Each command runs in a fresh interpreter (this one has torch loaded by other tests),
against a port where nothing listens, so it goes all the way to waiting for an answer."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

# Runs the command in-process, then prints its exit code and the torch modules loaded.
PROBE = """
import json, sys
from zpd.ops.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:           # --help
    code = e.code
torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(json.dumps({"code": code, "torch": torch}))
"""


def unused_port() -> str:
    """An address where nothing listens (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def run_cli(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True,
                          timeout=60)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["admin", "--help"], ["admin", "status", "--help"],
                                  ["generate", "--help"], ["run", "--help"], ["launch", "--help"]])
def test_help_does_not_import_torch(argv: list[str]) -> None:
    assert run_cli(*argv) == {"code": 0, "torch": []}


def test_admin_status_does_not_import_torch() -> None:
    out = run_cli("admin", "--endpoint", unused_port(), "--timeout", "0.2", "status")
    assert out == {"code": 3, "torch": []}        # 3: no answer, after sending the command


def test_generate_does_not_import_torch() -> None:
    out = run_cli("generate", "--router", unused_port(), "--connect-timeout", "0.2",
                  "--input-ids", "1,2", "--temperature", "0", "--max-new-tokens", "2")
    assert out == {"code": 2, "torch": []}        # 2: no router acknowledged the request
