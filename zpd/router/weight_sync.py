"""Trainer weight sync across the cluster: the router's half (the workers' is
zpd/worker/weight_sync.py).

- `init_weights_update_group`: every worker, in the order of `status`, joins the
  trainer's group as rank `rank_offset + i`; if any cannot, all leave it again.
- `update_weights_from_distributed`: two phases. Every worker stages the push
  (receives all of it, checked against its model); only when all have it does the
  router send the commit, and the new version is then on every prefill and decode.
  If any worker fails, every worker discards the push and keeps its old weights;
  a broken group (trainer gone, timeout) is left everywhere, so the trainer's next
  `init_weights_update_group` starts clean. New requests queue here from the first
  phase to the last, as while paused, so no request starts between the phases.
- `update_weights_from_tensor`: the same two phases, each worker staging its
  entry of SGLang's `serialized_named_tensors` (one entry: every worker takes it;
  one per worker, in the order of `status`: worker i takes entry i).
- `destroy_weights_update_group`: every worker leaves the group.
"""
from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Callable

from zpd.router.admin_args import BadArgs

if TYPE_CHECKING:
    from zpd.router.admin import RouterAdmin

log = logging.getLogger("zpd.router.weight_sync")

Reply = Callable[[bool, dict], None]
# While a push is under way, these would change weights or let requests run.
COMMANDS = ("init_weights_update_group", "update_weights_from_distributed",
            "update_weights_from_tensor", "destroy_weights_update_group")
BLOCKED = frozenset({"continue", "update_weights", *COMMANDS})
COMMIT_TIMEOUT_S = 60.0     # a commit is a local copy; this only bounds a wedged worker
# Of a command's timeout, the workers' (they answer first, saying why); zpd launch gives
# its HTTP front a --weights-timeout above the workers' --weight-sync-timeout / this.
WORKER_SHARE = 0.9


class RouterWeightSync:
    def __init__(self, admin: "RouterAdmin") -> None:
        self.admin = admin
        self.server = admin.server
        self.active: str | None = None        # the push or join under way

    def run(self, command: str, args: dict, timeout: float, reply: Reply) -> None:
        if self.active is not None:
            reply(False, {"status": 409, "error": f"{command} while {self.active}: wait for it",
                          "workers": []})
        elif command == "init_weights_update_group":
            self.init_group(args, timeout, reply)
        elif command == "update_weights_from_distributed":
            self.push(args, timeout, reply)
        elif command == "update_weights_from_tensor":
            self.push_tensors(args, timeout, reply)
        else:
            self.admin.fan_out("destroy_weights_update_group", args, self.server.workers, timeout,
                               lambda rs: reply(all(r["ok"] for r in rs), {"workers": rs}))

    def init_group(self, args: dict, timeout: float, reply: Reply) -> None:
        workers = self.server.workers
        dead = [w.endpoint for w in workers if not w.alive]
        if dead:
            reply(False, {"status": 503, "error": f"workers without a heartbeat: {', '.join(dead)}",
                          "workers": []})
            return
        offset, world = args["rank_offset"], args["world_size"]
        if offset + len(workers) > world:
            raise BadArgs(f"rank_offset {offset} + {len(workers)} workers exceeds world_size {world}")
        ranks = {w.endpoint: offset + i for i, w in enumerate(workers)}
        name = args["group_name"]
        self.active = f"joining weight group {name!r}"
        common = {k: v for k, v in args.items() if k not in ("rank_offset",)}

        def joined(replies: list[dict]) -> None:
            if all(r["ok"] for r in replies):
                self.active = None
                reply(True, {"workers": replies, "ranks": ranks})
                return
            log.warning("weight group %r: not every worker joined; all leave it", name)
            self.admin.fan_out("destroy_weights_update_group", {"group_name": name}, workers,
                               COMMIT_TIMEOUT_S, lambda _: failed(replies))

        def failed(replies: list[dict]) -> None:
            self.active = None
            reply(False, {"workers": replies, "ranks": ranks})

        self.admin.fan_out("join_weights_group",
                           lambda w: common | {"rank": ranks[w.endpoint], "timeout_s": timeout * WORKER_SHARE},
                           workers, timeout, joined)

    def _running(self, command: str, reply: Reply) -> bool:
        if self.server.paused is None and self.server.inflight:
            reply(False, {"status": 409, "error": f"{command} while requests are in flight: "
                                                  "pause first", "workers": []})
            return True
        return False

    def push(self, args: dict, timeout: float, reply: Reply) -> None:
        if self._running("update_weights_from_distributed", reply):
            return
        lengths = {len(args[k]) for k in ("names", "dtypes", "shapes")}
        if len(lengths) != 1:
            raise BadArgs("'names', 'dtypes' and 'shapes' must have the same length")
        name, update_id = args["group_name"], uuid.uuid4().hex
        version = args.get("weight_version")      # None: each worker keeps its own (SGLang's way)
        stage = {k: args.get(k) for k in ("names", "dtypes", "shapes", "load_format")} | {
            "group_name": name, "update_id": update_id, "timeout_s": timeout * WORKER_SHARE}
        self._two_phase("stage_weights", lambda w: stage, update_id, version,
                        f"group {name!r}", name, timeout, reply)

    def push_tensors(self, args: dict, timeout: float, reply: Reply) -> None:
        """SGLang's update_weights_from_tensor: the version is kept when none is given."""
        if self._running("update_weights_from_tensor", reply):
            return
        workers, entries = self.server.workers, args["serialized_named_tensors"]
        if len(entries) not in (1, len(workers)):
            raise BadArgs(f"'serialized_named_tensors' has {len(entries)} entries: give one "
                          f"(every worker takes it) or one per worker ({len(workers)})")
        index = {w.endpoint: (i if len(entries) > 1 else 0) for i, w in enumerate(workers)}
        update_id = uuid.uuid4().hex
        self._two_phase("stage_tensors", lambda w: {"update_id": update_id,
                                                    "load_format": args.get("load_format"),
                                                    "payload": entries[index[w.endpoint]]},
                        update_id, args.get("weight_version"), "tensors", None, timeout, reply)

    def _two_phase(self, stage_command: str, stage: Callable, update_id: str,
                   version: str | None, source: str, name: str | None, timeout: float,
                   reply: Reply) -> None:
        """Stage on every worker, then commit everywhere or discard everywhere. A
        `version` of None keeps each worker's own."""
        server = self.server
        workers = server.workers
        self.active = f"pushing weights from {source}"
        server.updating = True               # new requests queue until the commit is out
        started = server.loop.time()

        def staged(replies: list[dict]) -> None:
            if all(r["ok"] for r in replies):
                left = max(COMMIT_TIMEOUT_S, timeout - (server.loop.time() - started))
                self.admin.fan_out("commit_weights", {"update_id": update_id} |
                                   ({"version": version} if version else {}),
                                   workers, left, committed)
                return
            # A refusal (400) leaves the group usable: every worker drained the push.
            broken = name is not None and any(r.get("status") != 400
                                              for r in replies if not r["ok"])
            log.warning("push %s not staged everywhere: discarded%s", update_id,
                        f"; group {name!r} left" if broken else "")
            self.admin.fan_out("discard_weights", {"update_id": update_id} |
                               ({"destroy": name} if broken else {}), workers, COMMIT_TIMEOUT_S,
                               lambda _: finish(False, replies))

        def committed(replies: list[dict]) -> None:
            ok = all(r["ok"] for r in replies)
            if not ok:
                log.error("push %s: commit failed on some workers: %s", update_id,
                          [r for r in replies if not r["ok"]])
            finish(ok, replies)

        def finish(ok: bool, replies: list[dict]) -> None:
            self.active = None
            server.updating = False
            if server.paused is None:
                server.unpause()             # route what queued meanwhile
            seconds = server.loop.time() - started
            log.warning("push %s from %s: %s in %.3f s", update_id, source,
                        f"version {version!r} on every worker" if ok else "failed", seconds)
            got = {r.get("weight_version") for r in replies if r.get("ok")}
            reply(ok, {"workers": replies, "seconds": round(seconds, 6),
                       "weight_version": (version or (got.pop() if len(got) == 1 else None))
                       if ok else None})

        self.admin.fan_out(stage_command, stage, workers, timeout, staged)
