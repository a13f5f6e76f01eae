"""The worker's helpers driven through their ports alone, with no WorkerCore: the page
book built for a fake host, the memory commands on a fake MemoryPort, a tensor push
on a fake weight-sync port, and the one derived gate (zpd/worker/scheduler.py)."""
from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from engines.kv.layout import KVLayout
from engines.kv.pool import KVPool
from engines.loader import load_model
from engines.request import Request
from engines.sampler import SamplingParams
from zpd.config import WorkerConfig
from zpd.wire.admin import (FlushCache, ReleaseMemory, ResumeMemory, StageTensors, UpdateWeights,
                            UpdateWeightVersion)
from zpd.wire.admin_fields import PauseMode
from zpd.wire.admin_reply import AdminResult, Flushed, MemoryState, VersionChanged, WeightVersion
from zpd.wire.loop import Loop
from zpd.wire.status import StatusError
from zpd.worker.memory import MemoryPort, WeightsAndMemory
from zpd.worker.pages import PageBook
from zpd.worker.scheduler import Gate
from zpd.worker.weights.port import SyncPort
from zpd.worker.weights.tensor_stage import stage_tensors

LAYOUT = KVLayout(num_layers=1, page_size=4, num_kv_heads=1, head_dim=2, dtype="float32",
                  element_bytes=4)


class Backend:
    """The transport's registrations, as a set of addresses."""

    def __init__(self) -> None:
        self.registered: set[int] = set()

    def register(self, addr: int, length: int) -> None:
        self.registered.add(addr)

    def unregister(self, addr: int) -> None:
        self.registered.remove(addr)


class Scheduler:
    """What the memory commands ask of a scheduler, with what they told it."""

    def __init__(self) -> None:
        self.busy = self.dropping = self.paused = False
        self.in_use = 0
        self.told: list[str] = []
        self.versions: list[str | None] = []

    def flush_cache(self) -> int:
        self.told.append("flush")
        return 3

    def set_weights(self, version: str | None) -> str:
        self.versions.append(version)
        return version or "kept"


@pytest.fixture(scope="module")
def model():
    return load_model("tiny:1", version="v1")


@pytest.fixture
def world(model):
    """A memory-commands object over a fake port: a real pool and model, fake the rest."""
    pool = KVPool(LAYOUT, 8, torch.float32, torch.device("cpu"))
    backend, sched = Backend(), Scheduler()
    backend.register(pool.data_ptr, pool.nbytes)
    port = MemoryPort(
        model=model, pool=pool, backend=backend, ranks=None, weights_root=None,
        long_call=nullcontext, rank_buffers=lambda: [] if pool.buffer is None else [pool.buffer],
        running_unpaused=lambda: sched.busy and not sched.paused, busy=lambda: sched.busy,
        dropping=lambda: sched.dropping, set_weights=sched.set_weights,
        flush_cache=sched.flush_cache, pages_in_use=lambda: sched.in_use,
        memory_released=lambda: sched.told.append("released"),
        memory_resumed=lambda: sched.told.append("resumed"))
    return WeightsAndMemory(port), sched, backend, pool


def answer(command, cmd) -> AdminResult:
    got = []
    command(cmd, lambda ok, result: got.append((ok, result)))
    assert len(got) == 1 and got[0][0], got
    return got[0][1]


def test_the_page_book_of_a_fake_host_keys_its_cache_by_the_current_version():
    loop = Loop(clock=lambda: 0.0)
    pool = KVPool(LAYOUT, 8, torch.float32, torch.device("cpu"))
    model = SimpleNamespace(version="v1")
    host = SimpleNamespace(cfg=WorkerConfig(role="decode", model="tiny:1"), pool=pool, loop=loop,
                           model=model)
    book = PageBook.for_worker(host)
    req = Request("r", list(range(9)), SamplingParams())
    first = book.prefix(req, 9)
    assert first.version == "v1" and len(first.keys) == 2       # two full pages of 4
    assert book.reserve(req, first, 3) == 0
    book.computed(req, first)
    book.release(req)
    assert book.hit(book.prefix(req, 9)) == 2                   # cached under v1
    model.version = "v2"
    assert book.prefix(req, 9, first).version == "v2"
    assert book.hit(book.prefix(req, 9)) == 0                   # v1's KV is not v2's
    book.check()
    assert book.counts() == {"total": 8, "free": 6, "held": 0, "fenced": 0, "cached": 2}
    loop.close()


def test_clear_freed_pages_leaves_the_fake_hosts_book_without_a_cache():
    loop = Loop(clock=lambda: 0.0)
    host = SimpleNamespace(cfg=WorkerConfig(role="decode", model="tiny:1", clear_freed_pages=True),
                           pool=KVPool(LAYOUT, 8, torch.float32, torch.device("cpu")), loop=loop,
                           model=SimpleNamespace(version="v1"))
    book = PageBook.for_worker(host)
    req = Request("r", list(range(9)), SamplingParams())
    assert not book.caching and book.prefix(req, 9).keys == ()
    loop.close()


def test_kv_release_and_resume_go_through_the_port(world):
    memory, sched, backend, pool = world
    sched.in_use = 2
    with pytest.raises(StatusError) as refused:
        memory.release_memory(ReleaseMemory(tags=["kv_cache"]), lambda *a: None)
    assert refused.value.status == 409 and not memory.released and pool.buffer is not None
    assert sched.told == ["flush"]                     # cached pages go first, then the check
    sched.in_use = 0
    assert answer(memory.release_memory, ReleaseMemory(tags=["kv_cache"])) == \
        MemoryState(memory="released", weights_memory="resident")
    assert memory.released and memory.pool_addr == 0 and not backend.registered
    assert sched.told == ["flush", "flush", "released"]
    assert answer(memory.resume_memory, ResumeMemory(tags=["kv_cache"])).memory == "resident"
    assert backend.registered == {pool.data_ptr} and memory.pool_addr == pool.data_ptr
    assert sched.told[-1] == "resumed" and not memory.released


def test_weights_are_released_only_when_nothing_runs_on_them(world):
    memory, sched, _, _ = world
    sched.busy = True
    with pytest.raises(StatusError):
        memory.release_memory(ReleaseMemory(tags=["weights"]), lambda *a: None)
    assert memory.weights_held is None
    sched.dropping = True                              # a retract pause emptied the batch
    released = answer(memory.release_memory, ReleaseMemory(tags=["weights"]))
    assert released.weights_memory == "released"
    with pytest.raises(StatusError) as refused:
        memory.update_weights(UpdateWeights(path="tiny:2"), lambda *a: None)
    assert refused.value.status == 409
    resumed = answer(memory.resume_memory, ResumeMemory(tags=["weights"]))
    assert resumed.weights_memory == "resident" and memory.weights_held is None


def test_every_weight_change_goes_through_the_one_writer(world):
    memory, sched, _, _ = world
    assert answer(memory.update_weight_version, UpdateWeightVersion(weight_version="v9")) == \
        VersionChanged(weight_version="v9", previous="v1")
    sched.busy = True                                  # running, not paused: refused
    with pytest.raises(StatusError):
        memory.update_weights(UpdateWeights(path="tiny:1", weight_version="v3"), lambda *a: None)
    with pytest.raises(StatusError):
        memory.flush_cache(FlushCache(), lambda *a: None)
    sched.paused = True
    assert answer(memory.update_weights, UpdateWeights(path="tiny:1", weight_version="v3")) == \
        WeightVersion("v3")
    assert sched.versions == ["v9", "v3"]
    assert answer(memory.flush_cache, FlushCache()) == Flushed(3)


def test_a_tensor_push_is_refused_through_the_sync_port():
    calls = []
    port = SyncPort(model=SimpleNamespace(device=torch.device("cpu")), ranks=None, timeout_s=1.0,
                    call_soon_threadsafe=lambda *a: calls.append("loop"), long_call=nullcontext,
                    running_unpaused=lambda: True, require_weights=lambda what: calls.append(what),
                    set_weights=lambda version: calls.append(version))
    sync = SimpleNamespace(port=port, idle_or_409=lambda: calls.append("idle"))
    with pytest.raises(StatusError) as refused:
        stage_tensors(sync, StageTensors(update_id="u", payload="AAAA"), lambda *a: None)
    assert refused.value.status == 409 and calls == ["idle"]     # checked before anything moved


@pytest.mark.parametrize("paused, released, gate", [
    (None, False, Gate.OPEN), (None, True, Gate.RELEASED),
    (PauseMode.RETRACT, False, Gate.PAUSED), (PauseMode.IN_PLACE, True, Gate.PAUSED)])
def test_the_gate_is_derived_from_the_pause_and_the_memory(paused, released, gate):
    assert Gate.of(paused, released) is gate

