"""Trainer weight sync on a worker, the worker's half of a two-phase update that the
router drives (zpd/router/weight_sync.py):

- `join_weights_group`: join a trainer's torch.distributed group as the rank the
  router gives (off the scheduler thread: heartbeats keep flowing).
- `stage_weights`: check the announced names, shapes and dtypes against the model,
  then receive every broadcast into staging memory, on a thread. A push the model
  refuses is still received (and dropped) so the trainer's broadcasts complete,
  then answered 400; the model is not touched either way.
- `commit_weights` / `discard_weights`: the router commits only once every worker
  has staged everything, else discards everywhere.

- `stage_tensors`: SGLang's update_weights_from_tensor, one rank's entry: decode
  it (engines/tensor_payload.py, a restricted unpickler; the tensors are in memory
  the trainer shares on this host), check it against the model, copy it into
  staging; committed or discarded as above.
- `destroy_weights_update_group`: leave the group.

The staging memory is a second copy of the weights (engines/weight_push.Shadow),
made when the first group is joined and kept while any group is (a tensor push
makes one for itself and drops it after): a push lands in place, and its commit
swaps each fully pushed parameter with the model's.

One background job (a join, a receive or a decode) runs at a time. A join is
abandoned at its timeout (plus slack) or when its group is destroyed, even if
torch never returns (trainer_group.py says when it does not): the worker is free
for a retry, and a group that arrives late is closed.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from engines.config import ModelError
from engines.request import BAD_REQUEST, CONFLICT, INTERNAL, StatusError
from engines.tensor_payload import PayloadError, decode_named_tensors
from engines.weight_push import (MAX_TENSORS, Announced, Shadow, announce, bucket_dtype,
                                 push_limit, sizes, unflatten)
from zpd.worker.scheduler import Respond
from zpd.worker.sync_args import int_arg, port_arg, seconds_arg, text_arg
from zpd.worker.trainer_group import (BACKENDS, DEFAULT_TRAINER_INIT, TRAINER_INITS, GroupError,
                                      TrainerGroup)

if TYPE_CHECKING:
    from zpd.worker.core import WorkerCore

log = logging.getLogger("zpd.worker.weight_sync")

LOAD_FORMATS = (None, "flattened_bucket")
JOIN_SLACK_S = 2.0          # at most this long past its timeout, a join still in torch is abandoned


@dataclass(eq=False)
class Staged:
    """A push received in full (into the shadow), waiting for the router's commit or
    discard."""
    update_id: str
    group: str | None          # None: a tensor push (update_weights_from_tensor)
    written: list[Announced]
    nbytes: int


class _Abandoned(GroupError):
    """A join given up on (timeout, or its group destroyed); torch may still be in it."""

    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class WeightSync:
    """The trainer groups this worker belongs to, and at most one staged push."""

    def __init__(self, core: "WorkerCore") -> None:
        self.core = core
        self.groups: dict[str, TrainerGroup] = {}
        self.job: str | None = None              # what the background thread is doing
        self.job_group: str | None = None
        self.staged: Staged | None = None
        self.shadow: Shadow | None = None        # staging: a second copy of the weights
        self.scratch: torch.Tensor | None = None     # bytes for what cannot land in place
        self.abandoned: set[str] = set()         # update ids discarded while receiving
        self.job_token: object | None = None     # the running job's; None once it answered
        self.job_abandon: Callable[[], None] | None = None     # ends a join now
        self.doomed: set[str] = set()            # groups to close once the job ends

    def commands(self) -> dict[str, Callable[[dict, Respond], None]]:
        return {"join_weights_group": self.join, "stage_weights": self.stage,
                "commit_weights": self.commit, "discard_weights": self.discard,
                "destroy_weights_update_group": self.destroy, "stage_tensors": self.stage_tensors}

    def status(self) -> dict:
        return {"weight_groups": sorted(self.groups), "weights_staged": self.staged is not None,
                "weight_sync_job": self.job}

    # --- commands --------------------------------------------------------------

    def join(self, args: dict, respond: Respond) -> None:
        name = text_arg(args, "group_name")
        # Left out: what the trainer would use with a worker like this one.
        backend = args.get("backend") or ("nccl" if self.core.model.device.type == "cuda" else "gloo")
        if backend not in BACKENDS:
            raise StatusError(BAD_REQUEST, f"'backend' must be one of {', '.join(BACKENDS)}")
        trainer_init = args.get("trainer_init", DEFAULT_TRAINER_INIT)
        if trainer_init not in TRAINER_INITS:
            raise StatusError(BAD_REQUEST, f"'trainer_init' must be one of {', '.join(TRAINER_INITS)}")
        address = text_arg(args, "master_address")
        port = port_arg(args)
        world = int_arg(args, "world_size", 2, 1 << 16)
        rank = int_arg(args, "rank", 1, world - 1)
        timeout = seconds_arg(args, "timeout_s", 60.0)
        if name in self.groups:
            raise StatusError(CONFLICT, f"already in weight group {name!r}: destroy it first")
        self._idle_or_409()
        self.core.memory.require_weights("init_weights_update_group")   # its shadow copies them

        def done(group: TrainerGroup | None, error: Exception | None) -> None:
            if isinstance(error, _Abandoned):
                self.doomed.discard(name)
                respond(False, {"status": 504 if error.timed_out else 409, "error": str(error)})
            elif group is not None:
                self.groups[name] = group
                respond(True, {"group_name": name, "rank": rank, "world_size": world})
            else:
                self.doomed.discard(name)
                respond(False, {"status": 500, "error": str(error)})

        def work() -> TrainerGroup:
            group = TrainerGroup.join(name, backend, address, port, rank, world, trainer_init,
                                      timeout)
            if self.shadow is None:          # made here, off the loop: it copies the weights
                device = group.device if backend == "nccl" else torch.device("cpu")
                self.shadow = Shadow(self.core.model.net, device)
                log.warning("weight staging: %d bytes on %s", self.shadow.nbytes, device)
            return group

        # abandoned before the router's own wait (timeout / 0.9) ends, so the answer says why
        self._background(f"joining {name}", name, done, work,
                         limit_s=timeout + min(JOIN_SLACK_S, 0.05 * timeout))

    def stage(self, args: dict, respond: Respond) -> None:
        """Receive one push into staging memory; answered once all of it arrived."""
        core = self.core
        name = text_arg(args, "group_name")
        update_id = text_arg(args, "update_id")
        load_format = args.get("load_format")
        if load_format not in LOAD_FORMATS:
            raise StatusError(BAD_REQUEST, "'load_format' must be null (one broadcast per "
                                           "tensor) or \"flattened_bucket\"")
        deadline = time.monotonic() + seconds_arg(args, "timeout_s", 600.0)
        group = self.groups.get(name)
        if group is None:
            raise StatusError(BAD_REQUEST, f"no weight group {name!r} here: "
                                           "init_weights_update_group first")
        self._idle_or_409()
        if core.paused is None and core.scheduler.busy():
            raise StatusError(CONFLICT, "weights pushed while requests are running: pause first")
        names, dtypes, shapes = (args.get(k) for k in ("names", "dtypes", "shapes"))
        if not all(isinstance(v, list) for v in (names, dtypes, shapes)):
            raise StatusError(BAD_REQUEST, "'names', 'dtypes' and 'shapes' must be lists")
        try:
            parsed = sizes(names, dtypes, shapes)
        except ModelError as e:           # no sizes: we cannot even drain it
            raise StatusError(BAD_REQUEST, str(e)) from None
        refusal = None
        try:
            items = announce(core.model.net, names, dtypes, shapes)
        except ModelError as e:
            refusal = str(e)
            items = [Announced(str(n), d, s, None) for n, (d, s) in zip(names, parsed)]
        total = sum(a.nbytes for a in items)
        if total > push_limit(core.model.net):
            raise StatusError(BAD_REQUEST, f"the push announces {total} bytes, more than this "
                                           f"model could take ({push_limit(core.model.net)})")
        self.staged = None                # a newer push replaces one never committed
        device = group.device if group.backend == "nccl" else torch.device("cpu")
        bucket = load_format == "flattened_bucket"
        shadow, keep = self.shadow, refusal is None
        log.warning("receiving %d tensors (%d bytes%s) from group %r%s", len(items), total,
                    ", one bucket" if bucket else "", name, f"; refused: {refusal}" if refusal else "")

        def receive() -> None:
            started = time.monotonic()
            self._receive(group, items, bucket, shadow if keep else None, device, deadline)
            log.warning("received %d bytes from group %r in %.3f s", total, name,
                        time.monotonic() - started)

        def done(_: None, error: Exception | None) -> None:
            if error is not None:         # the group is broken (trainer gone, timeout)
                self._close(name)
                respond(False, {"status": 504 if "imeout" in str(error) else 500,
                                "error": f"{error}; group {name!r} closed, weights unchanged"})
            elif update_id in self.abandoned:
                self.abandoned.discard(update_id)
                respond(False, {"status": 409, "error": "discarded while receiving"})
            elif refusal is not None:
                respond(False, {"status": 400, "error": f"{refusal}; nothing applied"})
            else:
                self.staged = Staged(update_id, name, items, total)
                respond(True, {"staged_tensors": len(items), "staged_bytes": total})
            if name in self.doomed:
                self.doomed.discard(name)
                self._close(name)

        self._background(f"receiving {name}", name, done, receive)

    def stage_tensors(self, args: dict, respond: Respond) -> None:
        """SGLang's update_weights_from_tensor on this worker: `payload` is this rank's
        entry of `serialized_named_tensors`. Decoded and checked off the loop, then
        staged like a broadcast push; answered 400 (nothing staged) if refused."""
        core = self.core
        update_id = text_arg(args, "update_id")
        payload = args.get("payload")
        if not isinstance(payload, str) or not payload:
            raise StatusError(BAD_REQUEST, "'payload' must be a non-empty base64 string")
        load_format = args.get("load_format")
        if load_format not in LOAD_FORMATS:
            raise StatusError(BAD_REQUEST, "'load_format' must be null ((name, tensor) pairs) "
                                           "or \"flattened_bucket\"")
        self._idle_or_409()
        if core.paused is None and core.scheduler.busy():
            raise StatusError(CONFLICT, "weights pushed while requests are running: pause first")
        core.memory.require_weights("update_weights_from_tensor")
        net, limit = core.model.net, push_limit(core.model.net)
        self.staged = None                # a newer push replaces one never committed

        def work() -> list[Announced]:
            named = decode_named_tensors(payload, limit, MAX_TENSORS,
                                         bucket=load_format == "flattened_bucket")
            items = announce(net, [n for n, _ in named], [str(t.dtype) for _, t in named],
                             [list(t.shape) for _, t in named])
            if self.shadow is None:       # made here, off the loop: it copies the weights
                self.shadow = Shadow(net, core.model.device)
            with torch.no_grad():
                for a, (_, tensor) in zip(items, named):
                    target = self.shadow.target(a)
                    if target is not None:
                        target.copy_(tensor)
            return items

        def done(items: list[Announced] | None, error: Exception | None) -> None:
            if isinstance(error, (PayloadError, ModelError)):
                respond(False, {"status": 400, "error": f"{error}; nothing applied"})
            elif error is not None:
                respond(False, {"status": 500, "error": f"staging the tensors failed: {error}"})
            elif update_id in self.abandoned:
                self.abandoned.discard(update_id)
                respond(False, {"status": 409, "error": "discarded while receiving"})
            else:
                self.staged = Staged(update_id, None, items, sum(a.nbytes for a in items))
                respond(True, {"staged_tensors": len(items), "staged_bytes": self.staged.nbytes})
            self._drop_shadow()

        self._background("receiving tensors", None, done, work)

    def commit(self, args: dict, respond: Respond) -> None:
        core = self.core
        update_id = text_arg(args, "update_id")
        version = None if args.get("version") is None else text_arg(args, "version")   # None: kept
        staged = self.staged
        if staged is None or staged.update_id != update_id:
            raise StatusError(CONFLICT, f"no staged push {update_id!r} to commit")
        if core.paused is None and core.scheduler.busy():
            raise StatusError(CONFLICT, "requests started since the push was staged: pause first")
        core.memory.require_weights("committing pushed weights")     # released since staged
        started = time.monotonic()
        try:
            with core.long_call():
                written = self.shadow.commit(staged.written)
        except RuntimeError as e:        # shapes were checked: this is a real fault
            raise StatusError(INTERNAL, f"applying the pushed weights failed: {e}") from None
        finally:
            self.staged = None
            self._drop_shadow()
        if version is not None:
            core.model.version = version
        core.scheduler.on_weights_changed()
        log.warning("weights from %s committed: version %r (%d elements, %.3f s)",
                    f"group {staged.group!r}" if staged.group else "tensors", core.model.version,
                    written, time.monotonic() - started)
        respond(True, {"weight_version": core.model.version})

    def discard(self, args: dict, respond: Respond) -> None:
        """Drop a staged (or still arriving) push; with `destroy`, leave its group too."""
        update_id = text_arg(args, "update_id")
        if self.staged is not None and self.staged.update_id == update_id:
            self.staged = None
            self._drop_shadow()
        elif self.job is not None and self.job.startswith("receiving"):
            self.abandoned.add(update_id)
        group = args.get("destroy")
        if isinstance(group, str) and group:
            self._close(group)
        respond(True, {"discarded": update_id})

    def destroy(self, args: dict, respond: Respond) -> None:
        name = text_arg(args, "group_name")
        if name not in self.groups and self.job_group != name:
            raise StatusError(BAD_REQUEST, f"no weight group {name!r} here")
        self._close(name)
        respond(True, {"group_name": name, "destroyed": True})

    # --- helpers ---------------------------------------------------------------

    def _close(self, name: str) -> None:
        """Leave group `name` now, or once the job using it ends (a join: now)."""
        if self.job_group == name and self.job_abandon is not None:
            self.job_abandon()            # a join, maybe stuck in torch: answered, let go
        elif self.job_group == name:
            self.doomed.add(name)
            return
        if self.staged is not None and self.staged.group == name:
            self.staged = None
        group = self.groups.pop(name, None)
        if group is not None:
            group.close()
        self._drop_shadow()

    def _drop_shadow(self) -> None:
        """The staging memory goes with the last group (a tensor push's, after it)."""
        if not self.groups and self.job is None and self.staged is None:
            self.shadow = self.scratch = None

    def _idle_or_409(self) -> None:
        if self.job is not None:
            raise StatusError(CONFLICT, f"busy {self.job}: one weight-sync step at a time")

    def _background(self, job: str, group: str | None,
                    done: Callable[[Any, Exception | None], None], work: Callable[[], Any],
                    limit_s: float | None = None) -> None:
        """Run `work` on a thread; `done(result, error)` runs on the scheduler's loop,
        once. With `limit_s` (a join), the job can be abandoned: at that limit, or by
        `job_abandon`; what the thread returns later is then closed."""
        token, timers = object(), []
        self.job, self.job_group, self.job_token = job, group, token

        def finish(result: Any, error: Exception | None) -> None:
            if self.job_token is not token:       # abandoned: nobody waits for it now
                if isinstance(result, TrainerGroup):
                    log.warning("%s ended after it was abandoned: closed", job)
                    result.close()
                self._drop_shadow()
                return
            self.job = self.job_group = self.job_token = self.job_abandon = None
            for timer in timers:
                timer.cancel()
            done(result, error)

        if limit_s is not None:
            timers.append(self.core.loop.call_later(limit_s, lambda: finish(None, _Abandoned(
                f"could not join weight group {group!r} within {limit_s:.1f} s (the trainer's "
                "address accepted but never completed the rendezvous); nothing joined", True))))
            self.job_abandon = lambda: finish(None, _Abandoned(
                f"weight group {group!r} was destroyed while joining; nothing joined", False))

        def run() -> None:
            try:
                result, error = work(), None
            except (GroupError, RuntimeError, ValueError, OSError) as e:
                result, error = None, e
            try:
                self.core.loop.call_soon_threadsafe(finish, result, error)
            except OSError:               # the worker closed meanwhile (an abandoned join)
                if isinstance(result, TrainerGroup):
                    result.close()

        threading.Thread(target=run, name=f"zpd-weights-{group}", daemon=True).start()

    def close(self) -> None:
        for name in list(self.groups):
            self.groups.pop(name).close()

    def _buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """`nbytes` of scratch (kept: a bucket or a converted tensor lands here)."""
        if self.scratch is None or self.scratch.numel() < nbytes or self.scratch.device != device:
            self.scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self.scratch[:nbytes]

    def _receive(self, group: TrainerGroup, items: list[Announced], bucket: bool,
                 shadow: Shadow | None, device: torch.device, deadline: float) -> None:
        """Every announced tensor from `group`, in order, into `shadow` (None: a refused
        push, received and dropped). A tensor of the parameter's dtype and device
        lands in place where its memory is row-major; any other (a column-major float32
        projection: LlamaForCausalLM.column_major_float32) goes through scratch and is
        converted or copied."""
        if bucket:
            dtype = bucket_dtype(items)
            flat = self._buffer(sum(a.nbytes for a in items), device).view(dtype)
            group.receive(flat, deadline)
            if shadow is not None:
                for a, part in zip(items, unflatten(flat, items)):
                    target = shadow.target(a)
                    if target is not None:
                        target.copy_(part)
            return
        for a in items:
            target = shadow.target(a) if shadow is not None else None
            if (target is not None and target.dtype == a.dtype and target.device == device
                    and target.is_contiguous()):
                group.receive(target, deadline)
                continue
            landing = self._buffer(a.nbytes, device).view(a.dtype).view(a.shape)
            group.receive(landing, deadline)
            if target is not None:
                target.copy_(landing)
