"""The worker's end of a weight-sync helper process (zpd/worker/weights/helper.py says
why it exists): start it, join a trainer's group through it, stage a push through
it, and kill it, from any thread, when it overstays, is cancelled or its group is
destroyed.

Every call here blocks only in `Connection.poll` with a deadline, never in torch:
a helper stuck in a rendezvous or a broadcast is killed at the deadline, and one
that dies (gloo's SIGABRT on an oversized broadcast) is seen at once as the end of
its pipe. Either way the error names the worker's step and tensor, and the worker
is left as it was.

Helpers are forked from a forkserver that has imported torch once (the first start
pays for it; the next take milliseconds); the worker's own threads are never forked.
"""
from __future__ import annotations

import mmap
import multiprocessing
import multiprocessing.reduction
import os
import signal
import time
from dataclasses import dataclass

import torch

from engines.weights.pool import SharedPool
from zpd.worker.weights import helper as sync_helper
from zpd.worker.weights.trainer_group import GroupError

ALIGN = 64          # each tensor of a per-tensor push starts at a multiple of this
KILL_WAIT_S = 5.0   # a SIGKILLed helper is reaped within this


class SyncFailure(GroupError):
    """A join or push that failed; `status` is the HTTP-like code the worker answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Incoming:
    """One announced tensor as the helper receives it."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def _context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "zpd.worker.weights.helper"])
    return ctx


class HelperLink:
    """One helper process and the pipe to it."""

    def __init__(self, device: torch.device) -> None:
        ctx = _context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=sync_helper.main, args=(child, str(device)),
                                name="zpd-weight-sync", daemon=True)
        self.proc.start()
        child.close()
        self.cuda = device.type == "cuda"
        self.why: tuple[int, str] | None = None     # set by `kill`: the answer's status, reason
        self.pool: int | None = None                # the staging memory the helper maps

    def kill(self, status: int, why: str) -> None:
        """End the helper now (any thread); the step waiting on it fails with `why`."""
        if self.why is None:
            self.why = (status, why)
        if self.proc.is_alive():
            self.proc.kill()

    def close(self) -> None:
        """Leave the group: the helper goes, its connections to the trainer with it."""
        self.kill(409, "its weight group was destroyed")
        self.proc.join(KILL_WAIT_S)
        self.conn.close()

    def join(self, args: tuple, deadline: float) -> None:
        """Join the trainer's group (TrainerGroup.join's arguments) by `deadline`."""
        self.conn.send(("join",) + args)
        reply = self._next(deadline, "joining the trainer's group")
        if reply[0] != "joined":
            raise SyncFailure(502, reply[1])

    def stage(self, items: list[Incoming], bucket: torch.dtype | None, deadline: float,
              pool: SharedPool | None = None, direct: list[int | None] | None = None,
              ) -> tuple[list[torch.Tensor | None], list[str]]:
        """Receive one push; returns each tensor as received (valid until `release`;
        None for one received in place, at its `direct` offset in `pool`) and the
        problems found (a tensor short, NaN): the push is refused unless empty. A
        bucket lands in place only if every tensor of it does, back to back."""
        direct = direct if pool is not None and direct is not None else [None] * len(items)
        if bucket is not None and not _in_order(items, direct):
            direct = [None] * len(items)
        scratch = [a for a, d in zip(items, direct) if d is None]
        offsets = iter(_offsets(scratch, bucket is not None))
        places = [("pool", d) if d is not None else ("scratch", next(offsets)) for d in direct]
        total = max((o + a.nbytes for (w, o), a in zip(places, items) if w == "scratch"),
                    default=0)
        metas = [(a.name, _name(a.dtype), a.shape, w, o, a.nbytes)
                 for (w, o), a in zip(places, items)]
        spec = None if bucket is None else (_name(bucket),) + places[0]
        if pool is not None:
            self.share_pool(pool)
        self.conn.send(("stage", metas, spec, max(0.5, deadline - time.monotonic()), total))
        memory = None if self.cuda or not total else self._share(total)
        flat = None if memory is None else torch.frombuffer(memory, dtype=torch.uint8)
        got, problems = [], []
        for a, (where, offset) in zip(items, places):
            doing = (f"receiving tensor {a.name!r} ({len(got) + 1} of {len(items)}, "
                     f"{a.nbytes} bytes)")
            reply = self._next(deadline, doing)
            if reply[0] != "got":                  # torch's error: the group is broken
                status = 504 if "imed out" in reply[1] else 500
                raise SyncFailure(status, f"{doing}: {reply[1]}")
            if reply[2] is not None:
                problems.append(reply[2])
            raw = reply[3] if self.cuda else None if where == "pool" else \
                flat[offset:offset + a.nbytes]
            got.append(None if raw is None else _typed(raw, a))
        reply = self._next(deadline, "finishing the push")
        if reply[0] != "staged":
            raise SyncFailure(500, reply[1])
        return got, problems

    def share_pool(self, pool: SharedPool) -> None:
        """Have the helper map the staging pool (once: at the join, so that no push
        waits for it)."""
        if self.pool != pool.key:
            self.conn.send(("pool", pool.size))
            multiprocessing.reduction.send_handle(self.conn, pool.fd, self.proc.pid)
            self.pool = pool.key

    def release(self) -> None:
        """The worker has copied what `stage` returned: the helper may drop it."""
        try:
            self.conn.send(("release",))
        except OSError:
            pass

    def _share(self, size: int) -> mmap.mmap:
        """Anonymous shared memory (a memfd: no /dev/shm name to leak), its fd passed to
        the helper over the pipe."""
        fd = os.memfd_create("zpd-weight-push")
        try:
            os.ftruncate(fd, size)
            memory = mmap.mmap(fd, size)
            multiprocessing.reduction.send_handle(self.conn, fd, self.proc.pid)
        finally:
            os.close(fd)
        return memory

    def _next(self, deadline: float, doing: str) -> tuple:
        """The helper's next message, or SyncFailure saying why none came."""
        left, ended = deadline - time.monotonic(), False
        try:
            if left > 0 and self.conn.poll(left):
                return self.conn.recv()
        except (EOFError, OSError):            # it died, or was killed
            ended = True
        if not ended:
            self.kill(504, "timed out (the trainer stalled, or never completed the rendezvous)")
        self.proc.join(KILL_WAIT_S)
        status, why = self.why or (500, self._death())
        raise SyncFailure(status, f"{doing}: {why}")

    def _death(self) -> str:
        code = self.proc.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            hint = (" (gloo aborts so when a broadcast carries more bytes than announced)"
                    if -code == signal.SIGABRT else "")
            return f"the receiving helper process died of {name}{hint}"
        return f"the receiving helper process exited with code {code}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _offsets(items: list[Incoming], bucket: bool) -> list[int]:
    """Where each tensor lands: back to back for a bucket (the trainer's layout), else
    each aligned for its dtype."""
    out, at = [], 0
    for a in items:
        out.append(at)
        at += a.nbytes if bucket else -(-a.nbytes // ALIGN) * ALIGN
    return out


def _in_order(items: list[Incoming], direct: list[int | None]) -> bool:
    """Whether a bucket's tensors land in place back to back, as the bucket is laid out."""
    if None in direct:
        return False
    return all(d + a.nbytes == e for d, a, e in zip(direct, items, direct[1:]))


def _typed(raw: torch.Tensor, a: Incoming) -> torch.Tensor:
    """Bytes as tensor `a` (copied when a bucket left them unaligned for the dtype)."""
    if raw.data_ptr() % a.dtype.itemsize:
        raw = raw.clone()
    return raw.view(a.dtype).view(a.shape)
