"""Trainer weight sync across the cluster: the router's half (the workers' is
zpd/worker/weights/sync.py). Plugged into the router's admin by zpd/ops/router.py.

- `init_weights_update_group`: every worker, in the order of `status`, joins the
  trainer's group as rank `rank_offset + i`; if any cannot, all leave it again.
  Given fewer ranks than workers, the first worker relays to the rest (`_joins`).
- `update_weights_from_distributed`: two phases. Every worker stages the push
  (receives all of it, checked against its model); only when all have it does the
  router send the commit, and the new version is then on every prefill and decode.
  If any worker fails, every worker discards the push and keeps its old weights;
  a broken group (trainer gone, timeout) is left everywhere, so the trainer's next
  `init_weights_update_group` starts clean. Once one worker's join or receive fails
  (a refusal aside: every worker drains a refused push), the others' steps are ended
  at once (`cancel_weight_update` with the reason), not left to their own deadlines.
  New requests queue here from the first phase to the last, as while paused, so no
  request starts between the phases.
- `update_weights_from_tensor`: the same two phases, each worker staging its
  entry of SGLang's `serialized_named_tensors` (one entry: every worker takes it;
  one per worker, in the order of `status`: worker i takes entry i).
- `destroy_weights_update_group`: every worker leaves the group.
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Callable, Protocol

from zpd.config import RouterConfig
from zpd.router.flights import Worker
from zpd.router.hooks import HOLD_SHARE, Peers
from zpd.wire.admin import (AdminCommand, CancelWeightUpdate, CommitWeights, DestroyWeightsGroup,
                            DiscardWeights, InitWeightsGroup, JoinWeightsGroup, StageTensors,
                            StageWeights, UpdateFromDistributed, UpdateFromTensor)
from zpd.wire.admin_fields import MAX_NAME_CHARS, BadArgs, PauseMode, SyncStep
from zpd.wire.admin_reply import WeightVersion, WorkerReply, to_wire
from zpd.wire.loop import Loop

log = logging.getLogger("zpd.router.weights.sync")

Reply = Callable[[bool, dict], None]
Replies = Callable[[list[WorkerReply]], None]
SYNC_COMMANDS = (InitWeightsGroup, UpdateFromDistributed, UpdateFromTensor, DestroyWeightsGroup)
COMMIT_TIMEOUT_S = 60.0     # a commit is a local copy; this only bounds a wedged worker
# Of a command's timeout, the workers' (they answer first, saying why); zpd launch gives
# its HTTP front a --weights-timeout above the workers' --weight-sync-timeout / this.
WORKER_SHARE = 0.9


class FanOut(Protocol):
    """The admin's fan-out (RouterAdmin.fan_out): `cmd` (or `cmd(worker)`) to `targets`,
    `on_done` with one reply each; `each` with each as it comes, and who still waits."""

    def __call__(self, cmd: AdminCommand | Callable[[Worker], AdminCommand],
                 targets: list[Worker], timeout: float, on_done: Replies,
                 each: Callable[[WorkerReply, set], None] | None = None) -> None: ...


class Cluster(Protocol):
    """What the sync reads and changes of its router (RouterServer is one)."""
    cfg: RouterConfig
    loop: Loop
    workers: list[Worker]
    paused: PauseMode | None
    followers: Peers

    def running(self) -> int: ...

    def unpause(self) -> None: ...


@dataclass(frozen=True)
class Push:
    """One two-phase push: what each worker stages, and what it then commits to."""
    update_id: str
    stage: Callable[[Worker], AdminCommand]
    weight_version: str | None         # None: each worker keeps its own (SGLang's way)
    source: str                        # for the log: "group 'g'" or "tensors"
    group: str | None                  # the trainer group (None: tensors)
    timeout: float
    started: float


class RouterWeightSync:
    """The router's weight-sync step: at most one join or push at a time (`step`);
    its workers' steps go out through `fan_out`."""
    COMMANDS = SYNC_COMMANDS

    def __init__(self, server: Cluster, fan_out: FanOut) -> None:
        self.server, self.fan_out = server, fan_out
        self.step: SyncStep | None = None     # the join or push under way
        self.what = ""                        # ... in words, for a 409

    def run(self, cmd: AdminCommand, timeout: float, reply: Reply) -> None:
        if isinstance(cmd, InitWeightsGroup):
            self.init_group(cmd, timeout, reply)
        elif isinstance(cmd, UpdateFromDistributed):
            self.push(cmd, timeout, reply)
        elif isinstance(cmd, UpdateFromTensor):
            self.push_tensors(cmd, timeout, reply)
        else:
            self.fan_out(cmd, self.server.workers, timeout,
                         lambda rs: reply(all(r.ok for r in rs), {"workers": to_wire(rs)}))

    def _begin(self, step: SyncStep, what: str) -> None:
        self.step, self.what = step, what

    def _end(self) -> None:
        self.step, self.what = None, ""

    @property
    def pushing(self) -> bool:
        """A push is under way: new requests queue until its commit is out."""
        return self.step is SyncStep.PUSHING

    # --- init_weights_update_group: join everywhere, or leave everywhere ---------------

    def init_group(self, cmd: InitWeightsGroup, timeout: float, reply: Reply) -> None:
        """1. every worker joins as rank rank_offset + i; 2. if any could not, every worker
        leaves the group again; 3. answer."""
        workers = self.server.workers
        dead = [w.endpoint for w in workers if not w.alive]
        if dead:
            reply(False, {"status": 503, "error": f"workers without a heartbeat: {', '.join(dead)}",
                          "workers": []})
            return
        offset, world = cmd.rank_offset, cmd.world_size
        if offset >= world:
            raise BadArgs(f"rank_offset {offset} leaves this server no rank of world_size {world}")
        joins, ranks, relay = self._joins(cmd, timeout)
        self._begin(SyncStep.JOINING, f"joining weight group {cmd.group_name!r}")

        def joined(replies: list[WorkerReply]) -> None:
            if all(r.ok for r in replies):
                answer(True, replies)
                return
            log.warning("weight group %r: not every worker joined; all leave it", cmd.group_name)
            self.fan_out(DestroyWeightsGroup(cmd.group_name), workers, COMMIT_TIMEOUT_S,
                         lambda _: answer(False, replies))

        def answer(ok: bool, replies: list[WorkerReply]) -> None:
            self._end()
            reply(ok, {"workers": to_wire(replies), "ranks": ranks} | relay)

        # any failure dooms the rest: the trainer's rendezvous waits for every rank
        self.fan_out(lambda w: joins[w.endpoint], workers, timeout, joined,
                     self._end_early("the join", early))

    def _joins(self, cmd: InitWeightsGroup, timeout: float
               ) -> tuple[dict[str, JoinWeightsGroup], dict[str, int], dict]:
        """What each worker joins as, its trainer rank, and the relay (if any).

        The trainer gives this server the ranks rank_offset.. world_size - 1 (as an
        SGLang server at --tp N takes rank_offset + tp_rank). With as many as it has
        workers (or more), worker i joins as rank_offset + i. With fewer (AReaL's
        `sglang:d1`: world_size 2, one rank), that many workers join; the first of
        them also passes every broadcast on to the workers left over, in a relay group
        of the cluster's own (zpd/worker/weights/trainer_group.py). One worker relays
        rather than the router: the router holds no weights and no torch, the workers'
        helpers already receive and check every broadcast, and the relay is then one
        more broadcast of what the first helper received, with its checks and
        deadlines, not a second receiving path."""
        workers, offset = self.server.workers, cmd.rank_offset
        direct = workers[:cmd.world_size - offset]
        ranks = {w.endpoint: offset + i for i, w in enumerate(direct)}
        share = timeout * WORKER_SHARE
        joins = {w.endpoint: cmd.join(ranks[w.endpoint], share) for w in direct}
        rest = workers[len(direct):]
        if not rest:
            return joins, ranks, {}
        key, size, source = uuid.uuid4().hex, 1 + len(rest), direct[0].endpoint
        joins[source] = cmd.join(offset, share, (0, size, key))
        joins |= {w.endpoint: cmd.join(offset, share, (1 + i, size, key))
                  for i, w in enumerate(rest)}
        log.warning("weight group %r: %d ranks for %d workers; %s relays to %s", cmd.group_name,
                    len(direct), len(workers), source, ", ".join(w.endpoint for w in rest))
        return joins, ranks, {"relay": {"from": source, "to": [w.endpoint for w in rest]}}

    # --- pushes: stage everywhere, then commit everywhere or discard everywhere -------

    def _running(self, command: str, reply: Reply) -> bool:
        if self.server.paused is None and self.server.running():
            reply(False, {"status": 409, "error": f"{command} while requests are in flight: "
                                                  "pause first", "workers": []})
            return True
        return False

    def push(self, cmd: UpdateFromDistributed, timeout: float, reply: Reply) -> None:
        if self._running(cmd.COMMAND, reply):
            return
        update_id = uuid.uuid4().hex
        stage = StageWeights(cmd.group_name, update_id, cmd.names, cmd.dtypes, cmd.shapes,
                             cmd.load_format, timeout * WORKER_SHARE)
        self.two_phase(Push(update_id, lambda w: stage, cmd.weight_version,
                            f"group {cmd.group_name!r}", cmd.group_name, timeout,
                            self.server.loop.time()), reply)

    def push_tensors(self, cmd: UpdateFromTensor, timeout: float, reply: Reply) -> None:
        """SGLang's update_weights_from_tensor: the version is kept when none is given."""
        if self._running(cmd.COMMAND, reply):
            return
        workers, entries = self.server.workers, cmd.serialized_named_tensors
        if len(entries) not in (1, len(workers)):
            raise BadArgs(f"'serialized_named_tensors' has {len(entries)} entries: give one "
                          f"(every worker takes it) or one per worker ({len(workers)})")
        index = {w.endpoint: i for i, w in enumerate(workers)}
        update_id = uuid.uuid4().hex

        def stage(w: Worker) -> StageTensors:
            i = index[w.endpoint]
            return StageTensors(update_id, entries[i if len(entries) > 1 else 0],
                                cmd.load_format, i, len(workers))
        self.two_phase(Push(update_id, stage,
                            cmd.weight_version, "tensors", None, timeout,
                            self.server.loop.time()), reply)

    def two_phase(self, push: Push, reply: Reply) -> None:
        """1. stage on every worker (new requests queue meanwhile, here and at the
        routers that follow this one); 2. commit on every worker if all staged, else
        discard everywhere; 3. route what queued, answer."""
        self._begin(SyncStep.PUSHING, f"pushing weights from {push.source}")
        self.server.followers.tell(
            lambda _: self.fan_out(push.stage, self.server.workers, push.timeout,
                                   lambda staged: self._second_phase(push, staged, reply),
                                   self._end_early("the push", lambda r: broke(r) and early(r))
                                   if push.group else None),
            push.timeout * HOLD_SHARE)

    def _end_early(self, step: str, dooms: Callable[[WorkerReply], bool]
                   ) -> Callable[[WorkerReply, set], None]:
        """What ends the step on the workers still at it once one worker's reply `dooms`
        it: all or none move, so the others could only fail too, and waiting for their
        own deadlines (a dead helper leaves the rest waiting on the trainer) would hold
        every queued request that long. Their replies say why they ended."""
        fired: list[bool] = []

        def each(reply: WorkerReply, waiting: set) -> None:
            if fired or reply.ok or not dooms(reply) or not waiting:
                return
            fired.append(True)
            why = f"ended early: {step} failed on {reply.role} {reply.endpoint}"
            log.warning("weight sync: %s (%s %s); ending it on %s", why, reply.status,
                        str(reply.error)[:300], ", ".join(sorted(waiting)))
            self.fan_out(CancelWeightUpdate(why[:MAX_NAME_CHARS]),
                         [w for w in self.server.workers if w.endpoint in waiting],
                         COMMIT_TIMEOUT_S, lambda _: None)
        return each

    def _second_phase(self, push: Push, staged: list[WorkerReply], reply: Reply) -> None:
        server, workers = self.server, self.server.workers
        if all(r.ok for r in staged):
            left = max(COMMIT_TIMEOUT_S, push.timeout - (server.loop.time() - push.started))
            self.fan_out(CommitWeights(push.update_id, push.weight_version), workers, left,
                         lambda got: self._finish(push, committed(push, got), got, reply))
            return
        # A refusal (400) leaves the group usable: every worker drained the push.
        broken = push.group is not None and any(broke(r) for r in staged if not r.ok)
        log.warning("push %s not staged everywhere: discarded%s", push.update_id,
                    f"; group {push.group!r} left" if broken else "")
        self.fan_out(DiscardWeights(push.update_id, push.group if broken else None),
                     workers, COMMIT_TIMEOUT_S, lambda _: self._finish(push, False, staged, reply))

    def _finish(self, push: Push, ok: bool, replies: list[WorkerReply], reply: Reply) -> None:
        server = self.server
        self._end()
        if server.paused is None:
            server.unpause()             # route what queued meanwhile; so do the followers
        else:
            server.followers.tell(lambda _: None, server.cfg.peer_timeout)
        seconds = server.loop.time() - push.started
        log.warning("push %s from %s: %s in %.3f s", push.update_id, push.source,
                    f"version {push.weight_version!r} on every worker" if ok else "failed", seconds)
        got = {r.result.weight_version for r in replies if isinstance(r.result, WeightVersion)}
        reply(ok, {"workers": to_wire(replies), "seconds": round(seconds, 6),
                   "weight_version": (push.weight_version or (got.pop() if len(got) == 1 else None))
                   if ok else None})


def broke(reply: WorkerReply) -> bool:
    """A worker's failed stage that leaves its group out of step (a 400 refusal drained
    every broadcast: the others go on draining theirs)."""
    return reply.status != 400


def early(reply: WorkerReply) -> bool:
    """A failure before the worker's deadline (a 504 is at it: the others, started
    with it, reach theirs at the same moment and say so themselves)."""
    return reply.status != 504


def committed(push: Push, replies: list[WorkerReply]) -> bool:
    ok = all(r.ok for r in replies)
    if not ok:
        log.error("push %s: commit failed on some workers: %s", push.update_id,
                  [r.to_wire() for r in replies if not r.ok])
    return ok
