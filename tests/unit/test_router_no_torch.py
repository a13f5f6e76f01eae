"""The router process, the HTTP front, `zpd launch`'s parent and the CLI never import
torch (issue 44, item 7): none of them computes, so torch's ~2 s import and its
libraries' resident memory are waste there. The front and launch read a model's config,
tokenizer and chat template only (engines/text.py), never its weights.
Each check runs in a fresh interpreter (this one has torch loaded by other tests)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from tests.unit.test_cli_startup import run_cli, unused_port

ROOT = Path(__file__).resolve().parents[2]

# What the router, `zpd` and `zpd admin` import before they load anything.
TORCH_FREE = ("zpd.router.server", "zpd.router.shares", "zpd.ops.router", "zpd.ops.serve",
              "zpd.ops.cli", "zpd.ops.admin", "zpd.client", "engines.sampling_params")


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": str(ROOT)}


def test_router_cli_and_admin_modules_import_no_torch() -> None:
    probe = ("import importlib, json, sys\n"
             f"for m in {TORCH_FREE!r}: importlib.import_module(m)\n"
             "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, env=_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


# The front's start (zpd/ops/serve.py) up to its server, for each kind of model: the
# model's text is loaded and the Front built; the server's coroutine is closed unrun.
FRONT_PROBE = """
import json, sys
from zpd.config import HttpConfig
from zpd.ops import serve
serve.asyncio.run = lambda coro: coro.close() or 0
for model in sys.argv[1:]:
    assert serve.serve_one_http(HttpConfig(model=model, router="127.0.0.1:9")) == 0
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))
"""


def test_the_fronts_start_loads_tiny_null_and_gguf_text_without_torch() -> None:
    done = subprocess.run([sys.executable, "-c", FRONT_PROBE, "tiny", "tiny:3", "null",
                           "null:5,kv_bytes=131072", "smollm2"],
                          capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_zpd_launch_checks_the_models_text_without_torch() -> None:
    # The override is checked against the model's own text in the parent, which stops
    # there (2: a usage error) before starting any child.
    assert run_cli("launch", "--model", "smollm2", "--chat-template", "{% for %}") == \
        {"code": 2, "torch": []}


@contextmanager
def _process(what: str, *args: str, ready: Path) -> Iterator[int]:
    """`python -m zpd *args` until its ready file is written: its pid; stopped after."""
    proc = subprocess.Popen([sys.executable, "-m", "zpd", *args, "--ready-file", str(ready)],
                            env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if not ready.exists():
            proc.kill()
            pytest.fail(f"{what} not ready: {proc.communicate(timeout=10)[1].decode()[-2000:]}")
        yield proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _torch_files(pid: int) -> set[str]:
    """The files of torch that process `pid` has mapped."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {line.split()[-1] for line in maps.splitlines() if "libtorch" in line or "/torch/" in line}


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, str]]:
    """A `zpd router` process over two addresses where no worker listens: (pid, endpoint)."""
    ready = tmp_path_factory.mktemp("router") / "ready.json"
    with _process("router", "router", "--prefill", unused_port(), "--decode", unused_port(),
                  "--port", "0", ready=ready) as pid:
        yield pid, json.loads(ready.read_text())["endpoint"]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc (Linux)")
def test_a_running_router_maps_no_libtorch(router: tuple[int, str]) -> None:
    assert _torch_files(router[0]) == set()


def test_zpd_admin_against_a_running_router_imports_no_torch(router: tuple[int, str]) -> None:
    _, endpoint = router
    # 1: the router answered, naming both workers unavailable
    assert run_cli("admin", "--endpoint", endpoint, "--timeout", "5", "status") == \
        {"code": 1, "torch": []}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc (Linux)")
def test_a_running_http_front_maps_no_libtorch(router: tuple[int, str], tmp_path: Path) -> None:
    with _process("front", "http", "--model", "smollm2", "--router", router[1], "--port", "0",
                  ready=tmp_path / "ready.json") as pid:
        assert _torch_files(pid) == set()
