"""A fault plan handed to another process through ZPD_TRANSPORT_FAULT, the way
end-to-end fault tests start a worker: the child reads it as a worker does
(zpd.env.Knobs) and the backend it hands the plan to obeys it, while a backend
built without the plan ignores the variable; a malformed plan stops the child
at start-up with a clear message."""

from __future__ import annotations

import os
import subprocess
import sys

from zpd.env import FAULT_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = """
import ctypes, select, transport
from zpd.env import Knobs
fabric = transport.FakeFabric()
a = transport.create_backend("fake", fabric=fabric, fault_plan=Knobs.from_environ().fault_plan)
b = transport.create_backend("fake", fabric=fabric)
src, dst = ctypes.create_string_buffer(b"x" * 8), ctypes.create_string_buffer(8)
a.register(ctypes.addressof(src), 8)
b.register(ctypes.addressof(dst), 8)
for tid in range(3):
    a.write(tid, b.session_id, [(ctypes.addressof(src), ctypes.addressof(dst), 8)])
done = []
while len(done) < 3:
    select.select([a.fileno()], [], [], 5)
    done += a.poll_completions()
print(type(a).__name__, type(b).__name__, sorted((c.transfer_id, c.ok, c.reason) for c in done))
"""


def run_child(plan: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, FAULT_ENV: plan}
    return subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                          text=True, timeout=60, cwd=ROOT)


def test_child_process_obeys_the_fault_plan_in_its_environment() -> None:
    child = run_child('[{"mode": "fail", "skip": 1, "count": 1, "reason": "nic down"}]')
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == \
        "FaultyBackend FakeBackend [(0, True, ''), (1, False, 'nic down'), (2, True, '')]"


def test_child_process_with_a_bad_plan_fails_at_start_up() -> None:
    child = run_child("fail:cuont=1")
    assert child.returncode != 0
    assert "FaultPlanError" in child.stderr and FAULT_ENV in child.stderr
    assert "cuont" in child.stderr
