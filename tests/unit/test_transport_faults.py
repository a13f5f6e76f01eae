"""Unit tests for transport/: the fault wrapper and plan parsing, backend creation,
and what happens without Mooncake. No processes; every wait is bounded."""

from __future__ import annotations

import importlib
import sys
import time

import pytest

import transport
from transport.mooncake import _unavailable_message, configure_timeouts
from tests.unit.transport_bufs import PAGE, Buf, fake, threaded, wait_for, wait_until


# ---- fault wrapper -----------------------------------------------------------

def faulty(plan: transport.fault_plan.PlanLike) -> tuple[transport.FaultyBackend, transport.Backend, Buf, Buf]:
    fabric, src, dst = transport.FakeFabric(), Buf(16 * PAGE, seed=6), Buf(16 * PAGE)
    a = transport.FaultyBackend(transport.create_backend("fake", fabric=fabric), plan)
    a.register(src.addr, len(src.raw))
    return a, fake(fabric, dst), src, dst


def test_fault_fail_and_drop_write_nothing() -> None:
    a, b, src, dst = faulty("fail:count=1,reason=nic-down;drop:count=1")
    assert isinstance(transport.create_backend("fake", fabric=transport.FakeFabric(), fault_plan=""),
                      transport.FaultyBackend)
    for tid in range(3):
        a.write(tid, b.session_id, [(src.addr + tid * PAGE, dst.addr + tid * PAGE, PAGE)])
    done = {c.transfer_id: c for c in wait_for(a, 3)}
    assert (done[0].ok, done[0].reason) == (False, "nic-down")
    assert (done[1].ok, done[1].reason, done[1].nbytes) == (True, "", PAGE)  # lost
    assert done[2].ok
    assert dst.page(0) == dst.page(1) == bytes(PAGE) and dst.page(2) == src.page(2)


def test_fault_delay_lands_late() -> None:
    a, b, src, dst = faulty("delay:seconds=0.3")
    started = time.monotonic()
    a.write(1, b.session_id, [(src.addr, dst.addr, PAGE)])
    assert a.poll_completions() == [] and dst.page(0) == bytes(PAGE)
    [c] = wait_for(a)
    assert c.ok and time.monotonic() - started >= 0.3 and dst.page(0) == src.page(0)


def test_fault_hang_until_cancel_or_close() -> None:
    a, b, src, dst = faulty(transport.FaultRule("hang", ids=frozenset({1, 2})))
    a.write(1, b.session_id, [(src.addr, dst.addr, PAGE)])
    a.write(2, b.session_id, [(src.addr, dst.addr, PAGE)])
    a.write(3, b.session_id, [(src.addr, dst.addr + PAGE, PAGE)])
    assert [c.transfer_id for c in wait_for(a)] == [3]
    time.sleep(0.05)
    assert a.poll_completions() == []
    a.cancel(1)
    assert [(c.transfer_id, c.reason) for c in wait_for(a)] == [(1, "cancelled")]
    a.close()
    assert [(c.transfer_id, c.ok, c.reason) for c in wait_for(a)] == [(2, False, "closed")]
    assert dst.page(0) == bytes(PAGE)


def test_fault_cancel_during_delay_and_set_fault_at_run_time() -> None:
    a, b, src, dst = faulty(None)
    a.set_fault("delay:seconds=5")
    a.write(1, b.session_id, [(src.addr, dst.addr, PAGE)])
    a.cancel(1)
    assert [(c.transfer_id, c.reason) for c in wait_for(a)] == [(1, "cancelled")]
    a.set_fault([transport.FaultRule("fail", match=lambda tid: tid % 2 == 0, skip=1)])
    for tid in (2, 3, 4):
        a.write(tid, b.session_id, [(src.addr, dst.addr, PAGE)])
    done = {c.transfer_id: c.ok for c in wait_for(a, 3)}
    assert done == {2: True, 3: True, 4: False}  # 2 skipped, 3 not selected
    a.set_fault(None)
    a.write(5, b.session_id, [(src.addr, dst.addr, PAGE)])
    assert wait_for(a)[0].ok
    time.sleep(0.1)
    assert dst.page(0) == src.page(0)


def test_fault_plan_parsing() -> None:
    plan = transport.FaultPlan.parse(" delay:seconds=2.5, count=3 ; drop:skip=1,count=1;hang:ids=7|9 ")
    assert [(r.mode, r.count, r.skip, r.ids, r.seconds) for r in plan.rules] == [
        ("delay", 3, 0, None, 2.5), ("drop", 1, 1, None, 0.0), ("hang", None, 0, frozenset({7, 9}), 0.0)]
    [rule] = transport.FaultPlan.parse('{"mode": "fail", "count": 1, "reason": "nic down"}').rules
    assert (rule.mode, rule.count, rule.reason) == ("fail", 1, "nic down")
    assert transport.FaultPlan.parse("  ").rules == []
    [rule] = transport.FaultPlan.parse('[{"mode": "hang", "ids": [4]}]').rules
    assert rule.ids == frozenset({4})


@pytest.mark.parametrize("text", [
    "explode", "fail:count", "fail:count=-1", "fail:count=1.5", "fail:colour=red",
    "delay", "delay:seconds=0", "hang:seconds=1", "drop:ids=a|b", "[1, 2]", "{not json",
])
def test_bad_fault_plans_raise_a_clear_error(text: str) -> None:
    with pytest.raises(transport.FaultPlanError) as err:
        transport.create_backend("fake", fabric=transport.FakeFabric(), fault_plan=text)
    assert "bad fault plan" in str(err.value) and repr(text.strip()) in str(err.value)
    assert isinstance(err.value, ValueError)


def test_create_backend_wraps_only_for_a_given_plan(monkeypatch) -> None:
    monkeypatch.setenv("ZPD_TRANSPORT_FAULT", "fail")     # zpd's business (zpd/env.py), not transport's
    fabric = transport.FakeFabric()
    wrapped = transport.create_backend("fake", fabric=fabric, fault_plan="fail:count=1")
    plain = transport.create_backend("fake", fabric=fabric)
    assert isinstance(wrapped, transport.FaultyBackend) and not isinstance(plain, transport.FaultyBackend)
    wrapped.write(1, plain.session_id, [])
    assert [(c.transfer_id, c.ok) for c in wait_for(wrapped)] == [(1, False)]


# ---- Mooncake absent ------------------------------------------------------------

def test_import_transport_without_mooncake(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    for name in [m for m in sys.modules if m == "transport" or m.startswith("transport.")]:
        monkeypatch.delitem(sys.modules, name)
    fresh = importlib.import_module("transport")
    assert fresh is not transport and fresh.FakeFabric is not None
    with pytest.raises(fresh.BackendUnavailableError) as err:
        fresh.create_backend("mooncake")
    assert "pip install mooncake-transfer-engine-non-cuda" in str(err.value)
    assert "mooncake-transfer-engine (CUDA 12)" in str(err.value)
    assert "mooncake-transfer-engine-cuda13 (CUDA 13)" in str(err.value)
    assert isinstance(err.value, ImportError) and isinstance(err.value, fresh.TransportError)


def test_missing_shared_library_message_shows_apt_get_and_the_original_error() -> None:
    msg = _unavailable_message(ImportError("libibverbs.so.1: cannot open shared object file"))
    assert "apt-get install -y libibverbs1 librdmacm1 libnuma1" in msg and "libibverbs.so.1" in msg
    cuda = _unavailable_message(ImportError("libcudart.so.12: cannot open shared object file"))
    assert "mooncake-transfer-engine-non-cuda" in cuda and "libcudart.so.12" in cuda


def test_mooncake_timeouts_stay_below_ours() -> None:
    env = {"MC_TCP_STATUS_TIMEOUT_SEC": "2", "MC_TCP_PROGRESS_TIMEOUT_SEC": "300"}
    assert configure_timeouts(10.0, env) == {"MC_TCP_PROGRESS_TIMEOUT_SEC": "5",
                                             "MC_TCP_STATUS_TIMEOUT_SEC": "2"}
    assert configure_timeouts(0.5, {})["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "1"


def test_threaded_connect_opens_the_session_on_the_helper_thread() -> None:
    fabric, src, dst = transport.FakeFabric(), Buf(64, seed=4), Buf(64)
    a, driver = threaded(fabric, src)
    b, _ = threaded(fabric, dst)
    a.connect(b.session_id)
    a.connect("no-such-session")                  # logged; the first write would say why
    wait_until(lambda: driver.opened == [b.session_id])
    a.write(1, b.session_id, [(src.addr, dst.addr, 64)])
    [c] = wait_for(a)
    assert c.ok and dst.raw.raw == src.raw.raw
    a.close(), b.close()
