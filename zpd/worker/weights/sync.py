"""Trainer weight sync on a worker, the worker's half of a two-phase update that the
router drives (zpd/router/weights/sync.py):

- `join_weights_group`: join a trainer's torch.distributed group as the rank the
  router gives, through a helper process of its own (zpd/worker/weights/helper.py:
  gloo aborts the process that receives an oversized broadcast, and torch can hang
  in a rendezvous past its timeout; the helper takes both, the worker kills it).
- `stage_weights`: check the announced names, shapes and dtypes against the model,
  then have the helper receive every broadcast into memory this worker maps; each
  tensor must arrive whole and without NaN (helper.py says how that is seen),
  then it is copied into staging. A push the model refuses is still received (and
  dropped) so the trainer's broadcasts complete, then answered 400; the model is not
  touched either way.
- `commit_weights` / `discard_weights`: the router commits only once every worker
  has staged everything, else discards everywhere.
- `stage_tensors`: SGLang's update_weights_from_tensor (zpd/worker/weights/tensor_stage.py).
- `destroy_weights_update_group`: leave the group (the helper ends).
- `cancel_weight_update`: end the join or push under way now; its group is left.

Each join and push is bounded by the worker's --weight-sync-timeout (or the
router's shorter one): past it the helper is killed and the step answered 504. A
failed step leaves the worker as it was (old weights and version, no half-joined
group, nothing running), so a retry can start at once.

The staging memory is a second copy of the weights (engines/weights/push.Shadow),
made when the first group is joined and kept while any group is (a tensor push
makes one for itself and drops it after): its commit swaps each fully pushed
parameter with the model's.

The worker core knows nothing of this wing: zpd/ops/worker.py builds a `WeightSync`
on a `SyncPort` of the core's and plugs it in (`WorkerCore.add_part`).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from engines.config import ModelError
from zpd.wire.status import BAD_REQUEST, CONFLICT, INTERNAL, StatusError
from engines.weights.pool import SharedPool
from engines.weights.push import Announced, Shadow, announce, bucket_dtype, push_limit, sizes
from zpd.worker.weights.helper_link import HelperLink, Incoming, SyncFailure
from zpd.wire.admin import (CancelWeightUpdate, CommitWeights, DestroyWeightsGroup, DiscardWeights, JoinWeightsGroup, StageTensors, StageWeights)
from zpd.wire.admin_fields import SyncStep
from zpd.wire.admin_reply import (Cancelled, Destroyed, Discarded, Failed, Joined, StagedPush,
                                  WeightVersion)
from zpd.worker.scheduler import Respond
from zpd.worker.weights.port import SyncPort
from zpd.worker.weights.tensor_stage import Staged, stage_tensors
from zpd.worker.weights.trainer_group import DEFAULT_TRAINER_INIT

log = logging.getLogger("zpd.worker.weights.sync")


@dataclass(eq=False)
class Group:
    """A joined trainer group: its helper process holds the membership."""
    name: str
    backend: str
    link: HelperLink


class Job:
    """The one weight-sync step running off the loop; `cancel` (loop thread) and the
    step's thread (which sets `link` once its helper exists) race safely: whichever
    comes second kills the helper."""

    def __init__(self, step: SyncStep, group: str | None, update_id: str | None = None) -> None:
        self.step, self.group, self.update_id = step, group, update_id
        self.link: HelperLink | None = None
        self.why: tuple[int, str] | None = None

    @property
    def what(self) -> str:
        """In words, as `status` and `cancel_weight_update` report it."""
        if self.step is SyncStep.JOINING:
            return f"joining {self.group}"
        return f"receiving {self.group or 'tensors'}"

    def attach(self, link: HelperLink) -> None:
        self.link = link
        if self.why is not None:
            link.kill(*self.why)

    def cancel(self, status: int, why: str) -> None:
        self.why = self.why or (status, why)
        if self.link is not None:
            self.link.kill(status, why)


class WeightSync:
    """The trainer groups this worker belongs to, and at most one staged push."""

    def __init__(self, port: SyncPort) -> None:
        self.port = port
        self.timeout_s = port.timeout_s          # the most a join or a push may take
        self.groups: dict[str, Group] = {}
        self.job: Job | None = None              # what runs off the loop now
        self.staged: Staged | None = None
        self.shadow: Shadow | None = None        # staging: a second copy of the weights
        self._template: torch.nn.Module | None = None    # see `template`
        self.pool: SharedPool | None = None      # on CPU: where the shadow is, and the
        #                                          weights after a commit (pool.py)
        self.abandoned: set[str] = set()         # the push's id, discarded while receiving

    def commands(self) -> dict[type, Callable[..., None]]:
        return {JoinWeightsGroup: self.join, StageWeights: self.stage,
                CommitWeights: self.commit, DiscardWeights: self.discard,
                DestroyWeightsGroup: self.destroy,
                StageTensors: lambda cmd, respond: stage_tensors(self, cmd, respond),
                CancelWeightUpdate: self.cancel}

    def status(self) -> dict:
        return {"weight_groups": sorted(self.groups), "weights_staged": self.staged is not None,
                "weight_sync_job": self.job.what if self.job else None}

    # --- commands --------------------------------------------------------------

    def join(self, cmd: JoinWeightsGroup, respond: Respond) -> None:
        name, address, port = cmd.group_name, cmd.master_address, cmd.master_port
        world, rank = cmd.world_size, cmd.rank
        # Left out: what the trainer would use with a worker like this one.
        backend = cmd.backend or ("nccl" if self.port.model.device.type == "cuda" else "gloo")
        trainer_init = cmd.trainer_init or DEFAULT_TRAINER_INIT
        relay = None if cmd.relay_size is None else (cmd.relay_rank, cmd.relay_size,
                                                     cmd.relay_key)
        timeout = min(cmd.timeout_s, self.timeout_s)
        if name in self.groups:
            raise StatusError(CONFLICT, f"already in weight group {name!r}: destroy it first")
        self.idle_or_409()
        self.port.require_weights("init_weights_update_group")   # its shadow copies them
        device = self.port.model.device if backend == "nccl" else torch.device("cpu")
        deadline = time.monotonic() + timeout

        def work(job: Job) -> Group:
            link = HelperLink(device)
            job.attach(link)
            try:
                link.join((name, backend, address, port, rank, world, trainer_init, timeout,
                           relay), deadline)
                if self.shadow is None:          # made here, off the loop: it copies the weights
                    self.shadow = self.new_shadow(device)
                    log.warning("weight staging: %d bytes on %s", self.shadow.nbytes, device)
                if self.shadow.pool is not None:
                    link.share_pool(self.shadow.pool)
            except BaseException:
                link.close()
                raise
            return Group(name, backend, link)

        def done(group: Group | None, error: Exception | None) -> None:
            if group is not None:
                if self.shadow is not None:
                    self.shadow.adopt()          # on the loop: no forward reads them now
                self.groups[name] = group
                respond(True, Joined(name, rank, world))
                return
            status = getattr(error, "status", 500)
            respond(False, Failed(status, f"could not join weight group {name!r} as rank "
                                          f"{rank} at {address}:{port}: {error}"
                                  + (f" (limit {timeout:g} s)" if status == 504 else "")
                                  + "; nothing joined"))
            self.drop_shadow()

        self.background(SyncStep.JOINING, name, done, work)

    def stage(self, cmd: StageWeights, respond: Respond) -> None:
        """Receive one push into staging memory; answered once all of it arrived."""
        name, update_id, load_format = cmd.group_name, cmd.update_id, cmd.load_format
        timeout = min(cmd.timeout_s, self.timeout_s)
        group = self.groups.get(name)
        if group is None:
            raise StatusError(BAD_REQUEST, f"no weight group {name!r} here: "
                                           "init_weights_update_group first")
        self.idle_or_409()
        if self.port.running_unpaused():
            raise StatusError(CONFLICT, "weights pushed while requests are running: pause first")
        items, refusal = self._announced(cmd)
        total = sum(a.nbytes for a in items)
        if total > push_limit(self.template):
            raise StatusError(BAD_REQUEST, f"the push announces {total} bytes, more than this "
                                           f"model could take ({push_limit(self.template)})")
        self.staged = None                # a newer push replaces one never committed
        bucket = bucket_dtype(items) if load_format == "flattened_bucket" else None
        shadow = self.shadow if refusal is None else None
        deadline = time.monotonic() + timeout
        log.warning("receiving %d tensors (%d bytes%s) from group %r%s", len(items), total,
                    ", one bucket" if bucket else "", name, f"; refused: {refusal}" if refusal else "")

        def work(job: Job) -> None:
            job.attach(group.link)
            started = time.monotonic()
            self._receive(group.link, items, bucket, shadow, deadline)
            log.warning("received %d bytes from group %r in %.3f s", total, name,
                        time.monotonic() - started)

        def done(_: None, error: Exception | None) -> None:
            status, abandoned = getattr(error, "status", 500), update_id in self.abandoned
            self.abandoned.discard(update_id)
            if error is not None and status == 400:      # drained: the group is still in step
                respond(False, Failed(400, f"{error}; nothing applied"))
            elif error is not None:                      # the helper is gone, or wedged
                self._close(name)
                respond(False, Failed(status, f"{error}"
                                      + (f" (limit {timeout:g} s)" if status == 504 else "")
                                      + f"; group {name!r} left, weights unchanged"))
            elif abandoned:
                respond(False, Failed(409, "discarded while receiving"))
            elif refusal is not None:
                respond(False, Failed(400, f"{refusal}; nothing applied"))
            else:
                self.staged = Staged(update_id, name, items, total)
                respond(True, StagedPush(len(items), total))

        self.background(SyncStep.PUSHING, name, done, work, update_id)

    def commit(self, cmd: CommitWeights, respond: Respond) -> None:
        port = self.port
        update_id, version = cmd.update_id, cmd.weight_version      # version None: kept
        staged = self.staged
        if staged is None or staged.update_id != update_id:
            raise StatusError(CONFLICT, f"no staged push {update_id!r} to commit")
        if port.running_unpaused():
            raise StatusError(CONFLICT, "requests started since the push was staged: pause first")
        port.require_weights("committing pushed weights")     # released since staged
        started = time.monotonic()
        try:
            with port.long_call():       # at --tp > 1 each rank takes its part's rows
                written = port.ranks.commit_weights(self.shadow, staged.written) \
                    if port.ranks is not None else self.shadow.commit(staged.written)
        except RuntimeError as e:        # shapes were checked: this is a real fault
            raise StatusError(INTERNAL, f"applying the pushed weights failed: {e}") from None
        finally:
            self.staged = None
            self.drop_shadow()
        version = port.set_weights(version)
        log.warning("weights from %s committed: version %r (%d elements, %.3f s)",
                    f"group {staged.group!r}" if staged.group else "tensors", version,
                    written, time.monotonic() - started)
        respond(True, WeightVersion(version))

    def discard(self, cmd: DiscardWeights, respond: Respond) -> None:
        """Drop a staged (or still arriving) push; with `destroy`, leave its group too."""
        update_id = cmd.update_id
        if self.staged is not None and self.staged.update_id == update_id:
            self.staged = None
            self.drop_shadow()
        elif self.job is not None and self.job.update_id == update_id:
            self.abandoned.add(update_id)     # only the push under way: a set nobody can grow
        if cmd.destroy is not None:
            self._close(cmd.destroy)
        respond(True, Discarded(update_id))

    def destroy(self, cmd: DestroyWeightsGroup, respond: Respond) -> None:
        name = cmd.group_name
        if name not in self.groups and (self.job is None or self.job.group != name):
            raise StatusError(BAD_REQUEST, f"no weight group {name!r} here")
        self._close(name)
        respond(True, Destroyed(name, True))

    def cancel(self, cmd: CancelWeightUpdate, respond: Respond) -> None:
        """End the join or push under way: its helper is killed, the step answers 409 and
        its group is left. A push already staged is left to the router's commit."""
        job, why = self.job, cmd.reason or "cancelled by admin (cancel_weight_update)"
        if job is not None:
            log.warning("weight sync: %s ended: %s", job.what, why)
            job.cancel(CONFLICT, why)
        respond(True, Cancelled(job.what if job else None))

    # --- helpers ---------------------------------------------------------------

    def _announced(self, cmd: StageWeights) -> tuple[list[Announced], str | None]:
        """The tensors a push announces, and why the model refuses them (None: it takes
        them). Without sizes it cannot even be drained: 400 at once."""
        names, dtypes, shapes = cmd.names, cmd.dtypes, cmd.shapes
        try:
            parsed = sizes(names, dtypes, shapes)
        except ModelError as e:
            raise StatusError(BAD_REQUEST, str(e)) from None
        try:
            return announce(self.template, names, dtypes, shapes), None
        except ModelError as e:
            return [Announced(str(n)[:200], d, s, None) for n, (d, s) in zip(names, parsed)], str(e)

    def _receive(self, link: HelperLink, items: list[Announced], bucket: torch.dtype | None,
                 shadow: Shadow | None, deadline: float) -> None:
        """Every announced tensor, through the helper, into `shadow` (None: a refused
        push, received and dropped): in place where the shadow is shared memory and the
        tensor has its parameter's dtype, else copied in; SyncFailure(400) if any did
        not arrive whole."""
        incoming = [Incoming(a.name, a.dtype, a.shape, a.nbytes) for a in items]
        pool = None if shadow is None else shadow.pool
        targets = [None if shadow is None else shadow.target(a) for a in items]
        direct = [None if pool is None or t is None or t.dtype != a.dtype else pool.offset_of(t)
                  for a, t in zip(items, targets)]
        got, problems = link.stage(incoming, bucket, deadline, pool, direct)
        try:
            if problems:
                more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
                raise SyncFailure(400, "; ".join(problems[:3]) + more)
            with torch.no_grad():
                for target, tensor in zip(targets, got):
                    if target is not None and tensor is not None:
                        target.copy_(tensor)
        finally:
            got.clear()
            link.release()

    def _close(self, name: str) -> None:
        """Leave group `name` now; a step running in it is ended first."""
        if self.job is not None and self.job.group == name:
            self.job.cancel(CONFLICT, f"weight group {name!r} was destroyed meanwhile")
        if self.staged is not None and self.staged.group == name:
            self.staged = None
        group = self.groups.pop(name, None)
        if group is not None:
            group.link.close()
            log.warning("weight group %r left", name)
        self.drop_shadow()

    @property
    def template(self) -> torch.nn.Module:
        """What a push is checked against: the model's network, or at --tp > 1 a template
        of the whole model's (a trainer pushes whole tensors; each rank keeps its rows)."""
        if self.port.ranks is None:
            return self.port.model.net
        if self._template is None:
            self._template = self.port.ranks.whole_template()
        return self._template

    def new_shadow(self, device: torch.device) -> Shadow:
        """Staging for pushes: a copy of the weights, or at --tp > 1 a blank of the whole
        model's shapes (only the rows a push writes are ever applied from it)."""
        if device.type == "cpu" and self.pool is None:
            self.pool = SharedPool(self.template)
        return Shadow(self.template, device, blank=self.port.ranks is not None, pool=self.pool)

    def drop_shadow(self) -> None:
        """The staging memory goes with the last group (a tensor push's, after it)."""
        if not self.groups and self.job is None and self.staged is None \
                and self.shadow is not None:
            self.shadow.close()
            self.shadow = None

    def idle_or_409(self) -> None:
        if self.job is not None:
            raise StatusError(CONFLICT, f"busy {self.job.what}: one weight-sync step at a time")

    def background(self, step: SyncStep, group: str | None,
                   done: Callable[[Any, Exception | None], None],
                   work: Callable[[Job], Any], update_id: str | None = None) -> None:
        """Run `work(job)` on a thread; `done(result, error)` runs on the scheduler's loop,
        once. `work` waits only on its helper, with a deadline (helper_link.py)."""
        job = self.job = Job(step, group, update_id)

        def finish(result: Any, error: Exception | None) -> None:
            self.job = None
            if job.why is not None:
                # Cancelled, whatever the step made of it: a join's group is not kept; a
                # push that arrived whole after all is not staged (its helper is dead); a
                # step that broke on the killed helper (a broken pipe) says why it was.
                # A failure the link itself reports is kept: it names the kill's reason
                # when the kill caused it, and its own (a timeout) when it came first.
                if isinstance(result, Group):
                    result.link.close()
                own = isinstance(error, SyncFailure) and error.status != 400
                result, error = None, error if own else SyncFailure(*job.why)
            done(result, error)

        def run() -> None:
            try:
                result, error = work(job), None
            except Exception as e:        # any failure must reach `finish`, or the job stays
                log.debug("weight sync: %s failed", job.what, exc_info=True)   # its traceback
                result, error = None, untraced(e)
            try:
                self.port.call_soon_threadsafe(finish, result, error)
            except OSError:               # the worker closed meanwhile (its wake pipe)
                if isinstance(result, Group):
                    result.link.close()

        threading.Thread(target=run, name=f"zpd-weights-{group}", daemon=True).start()

    def close(self) -> None:
        if self.job is not None:
            self.job.cancel(CONFLICT, "the worker is shutting down")
        for name in list(self.groups):
            self.groups.pop(name).link.close()


def untraced(error: BaseException) -> BaseException:
    """`error` without its tracebacks (its context's too): their frames hold what the
    step had (a push's shared memory, as large as the push) in a cycle through this
    thread's frame, which only the cyclic collector would free, at no set time."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__context__
    return error
