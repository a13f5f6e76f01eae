"""The router's choice of a worker per request: least loaded among the live workers
of the role, ties at random (one pass: it runs for every request)."""
from __future__ import annotations

from dataclasses import dataclass, field

from zpd.router.affinity import least_loaded
from zpd.router.server import RouterServer


@dataclass(eq=False)
class FakeWorker:
    role: str
    load: int
    alive: bool = True
    endpoint: str = field(default="")


@dataclass
class FakeRouter:
    workers: list


def test_least_loaded_gives_every_tie() -> None:
    a, b, c = FakeWorker("decode", 3), FakeWorker("decode", 1), FakeWorker("decode", 1)
    assert least_loaded([a, b, c]) == (1, [b, c])
    assert least_loaded([a]) == (3, [a])


def test_pick_skips_dead_workers_and_other_roles() -> None:
    idle_prefill = FakeWorker("prefill", 0)
    dead = FakeWorker("decode", 0, alive=False)
    busy, light = FakeWorker("decode", 5), FakeWorker("decode", 2)
    router = FakeRouter([idle_prefill, dead, busy, light])
    assert {RouterServer.pick(router, "decode") for _ in range(20)} == {light}
    assert RouterServer.pick(router, "prefill") is idle_prefill
    assert RouterServer.pick(FakeRouter([dead]), "decode") is None


def test_pick_spreads_ties() -> None:
    ties = [FakeWorker("decode", 1) for _ in range(3)]
    router = FakeRouter(ties + [FakeWorker("decode", 2)])
    assert {id(RouterServer.pick(router, "decode")) for _ in range(200)} == {id(w) for w in ties}
