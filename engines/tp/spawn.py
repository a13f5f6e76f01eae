"""Starting a tensor-parallel model: the leader (this process, rank 0) starts a process
for each other rank, every rank loads the model and keeps its part of it. The group
has max(--tp, --ep) ranks (engines/tp/plan.py)."""
from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
from dataclasses import dataclass

import torch

from engines.formats.overrides import ModelOverrides
from engines.loader import LoadedModel, load_model
from engines.config import ModelError
from engines.models.null import is_null
from engines.tp import heartbeat
from engines.tp.group import Rendezvous, TpGroup, join
from engines.tp.plan import TpPlan
from engines.tp.shard import shard_model
from engines.tp.shared_pool import remove_files

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to load its part: the model as the command line named it."""
    model: str
    device: str
    dtype: str
    version: str | None
    overrides: ModelOverrides | None
    size: int                         # ranks of the group
    rendezvous: str                   # the FileStore the ranks meet at (group.Rendezvous)
    threads: int | None = None        # CPU threads of the whole group (None: torch's)
    log_level: int = logging.WARNING
    tp: int = 0                       # --tp (0: size)
    ep: int = 1                       # --ep: experts over the ranks (1 or size)


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:(k + r) for cuda:k (cuda is cuda:0); the CPU for all."""
    if not device.startswith("cuda"):
        return device
    first = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{first + rank}"


def load_whole(spec: RankSpec, rank: int) -> LoadedModel:
    return load_model(spec.model, rank_device(spec.device, rank), spec.dtype, spec.version,
                      spec.overrides)


def part_of(whole: LoadedModel, rank: int, spec: RankSpec, group: TpGroup) -> LoadedModel:
    """This rank's part of the model (the whole one is then let go)."""
    return shard_model(whole, TpPlan.for_rank(whole.cfg, rank, spec.tp or spec.size, spec.ep), group)


def _threads(spec: RankSpec) -> None:
    total = spec.threads or torch.get_num_threads()
    torch.set_num_threads(max(1, total // spec.size))


def _bound_to_leader() -> None:
    """A rank lives and dies with its leader: the terminal's or a launcher's SIGINT and
    SIGTERM are for the leader (which stops the ranks in order), and where Linux allows,
    the rank is killed when the leader exits, however it exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _follower_main(spec: RankSpec, rank: int, slots) -> None:
    from engines.tp.runner import Follower
    _bound_to_leader()
    heartbeat.beat(slots, rank)
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s rank{rank} %(name)s %(message)s")
    _threads(spec)
    tp = join(rank, spec.size, spec.rendezvous, rank_device(spec.device, rank).split(":")[0])
    Follower(part_of(load_whole(spec, rank), rank, spec, tp), tp).serve()


def lead(model: str, device: str, dtype: str, version: str | None,
         overrides: ModelOverrides | None, size: int, threads: int | None = None, ep: int = 1
         ) -> tuple[LoadedModel, TpGroup, list[mp.Process]]:
    """Start ranks 1..n-1 (n = max(size, ep)) and join them as rank 0: (rank 0's part,
    the group, the other ranks' processes). `size` is --tp, `ep` --ep. A model that
    cannot be split so is a ValueError before any process starts."""
    if is_null(model):
        raise ModelError("the null model runs at --tp 1 only, and --ep 1")
    meeting = Rendezvous()
    try:
        return _lead(model, device, dtype, version, overrides, size, threads, meeting, ep)
    except BaseException:
        meeting.close()
        raise


def _lead(model: str, device: str, dtype: str, version: str | None,
          overrides: ModelOverrides | None, tp_size: int, threads: int | None,
          meeting: Rendezvous, ep: int) -> tuple[LoadedModel, TpGroup, list[mp.Process]]:
    size = max(tp_size, ep)
    spec = RankSpec(model, device, dtype, version, overrides, size, meeting.path, threads,
                    logging.getLogger().getEffectiveLevel(), tp_size, ep)
    whole = load_whole(spec, 0)
    TpPlan.for_rank(whole.cfg, 0, tp_size, ep)        # checks the split
    ctx = mp.get_context("spawn")
    slots = ctx.RawArray("d", size)                   # each rank's last heartbeat
    procs = [ctx.Process(target=_follower_main, args=(spec, r, slots), daemon=True,
                         name=f"zpd-tp-rank{r}") for r in range(1, size)]
    for p in procs:
        p.start()
    _threads(spec)
    try:
        tp = join(0, size, spec.rendezvous, rank_device(device, 0).split(":")[0])
    except BaseException:
        _kill(procs)
        raise
    tp.rendezvous, tp.watchdog = meeting, heartbeat.Watchdog(tp, procs, slots)
    log.info("tensor parallel over %d ranks, experts over %d (pids %s)", size, ep,
             [os.getpid()] + [p.pid for p in procs])
    return part_of(whole, 0, spec, tp), tp, procs


def stop(tp: TpGroup, procs: list[mp.Process], timeout_s: float = 30.0) -> None:
    """Tell the other ranks to stop and wait for them (a broken group's are killed);
    then remove the rendezvous and any pool file a rank left."""
    tp.stopped = True
    if tp.watchdog is not None:
        tp.watchdog.close()
    if tp.broken is None:
        try:
            tp.tell("stop")
        except RuntimeError as e:
            log.warning("could not tell the other ranks to stop: %s", e)
            timeout_s = 0.0
    for p in procs:
        p.join(timeout_s if tp.broken is None else 0.0)
    _kill(procs)
    if tp.rendezvous is not None:
        tp.rendezvous.close()


def _kill(procs: list[mp.Process]) -> None:
    """Kill what is left of the ranks and unlink the pool files they left."""
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
        for path in remove_files(p.pid):
            log.warning("removed %s, left by tensor-parallel rank process %d", path, p.pid)
