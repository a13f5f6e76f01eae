"""Building a worker: its core, its optional parts and its scheduler, wired together.
The core never imports an optional part (zpd/worker/weights/: trainer weight sync;
zpd/worker/ha/: a decode's side of a router restart); they are made here, on ports
of the core's, and plugged in (`WorkerCore.add_part`, `DecodeScheduler.plug`)."""
from __future__ import annotations

from typing import Callable

import zmq

import transport
from zpd.config import WorkerConfig
from zpd.wire.loop import Loop
from zpd.wire.protocol import Adopt
from zpd.worker.core import WorkerCore
from zpd.worker.decode import DecodeScheduler
from zpd.worker.ha.adoption import RouterOrphans
from zpd.worker.scheduler import Scheduler
from zpd.worker.weights.port import SyncPort
from zpd.worker.weights.sync import WeightSync

WEIGHT_SYNC = "weight_sync"        # the weights wing's name among the core's parts


def build_worker(cfg: WorkerConfig, ctx: zmq.Context,
                 make_scheduler: Callable[[WorkerCore, zmq.Context], Scheduler],
                 backend: transport.Backend | None = None, loop: Loop | None = None) -> WorkerCore:
    """A worker ready to run: `backend` and `loop` as WorkerCore takes them (tests run
    several workers in one process on a fake transport)."""
    core = WorkerCore(cfg, ctx, backend=backend, loop=loop)
    core.add_part(WEIGHT_SYNC, WeightSync(sync_port(core)))
    core.attach(make_scheduler(core, ctx))
    return core


def sync_port(core: WorkerCore) -> SyncPort:
    """What trainer weight sync may use of `core`."""
    return SyncPort(model=core.model, ranks=core.ranks, timeout_s=core.cfg.weight_sync_timeout,
                    call_soon_threadsafe=core.loop.call_soon_threadsafe,
                    long_call=core.long_call, running_unpaused=core.running_unpaused,
                    require_weights=core.memory.require_weights, set_weights=core.set_weights)


def decode_scheduler(core: WorkerCore, ctx: zmq.Context) -> Scheduler:
    """A decode scheduler with the router-restart wing plugged in: a silent router's
    requests wait --router-grace seconds for its successor to adopt them."""
    sched = DecodeScheduler(core, ctx)
    orphans = RouterOrphans(sched, core, core.cfg.deadlines)
    sched.plug(orphans, {Adopt: orphans.on_adopt})
    return sched
