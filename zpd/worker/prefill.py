"""The prefill worker's scheduler: compute prompts' KV and write it into decode memory.

A job may start computing before decode's `kv_dest` arrives; the write starts once
both are there. Messages may arrive in either order (router -> prefill and decode ->
prefill are different sockets), so a `kv_dest` for an unknown room is kept briefly.
Whenever a job ends, the decode is told (`kv_failed`/`kv_done`) only once no write of
ours can still land in its pages: that message is what lets it reuse them.
"""
from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
import time
from dataclasses import dataclass, field

import transport
from engines.sampler import SamplingParams
from zpd.wire.deadline import Deadline
from zpd.wire.loop import Timer
from zpd.wire.protocol import (Abort, Admin, Generate, Hello, HelloAck, KvDest, KvDone, KvFailed,
                          Recompute, TokenPart, Tokens)
from engines.request import (ABORTED, BAD_REQUEST, DEADLINE, INTERNAL, Request, RequestError,
                         validate, validate_prefix)
from zpd.worker.core import AdminError, Respond, WorkerCore, pause_mode

log = logging.getLogger("zpd.worker.prefill")


@dataclass
class DecodePeer:
    session: str
    base_addr: int


@dataclass(eq=False)
class Job:
    room: int
    epoch: int
    req: Request | None = None           # None: kv_dest came first
    decode: bytes | None = None          # decode's identity on our socket
    dest: list[int] | None = None
    computed: bool = False
    transfer_id: int | None = None
    deadline: Deadline | None = None   # set by the scheduler when it makes the job
    failure: tuple[int, str] | None = None
    notice: tuple[int, str] | None = None   # kv_failed to send once the write is over
    marks: dict = field(default_factory=dict)   # monotonic times: queued, forward, computed
    early_to: bytes | None = None        # a streaming client's router: send it the first token


def _timings(marks: dict, transfer_s: float) -> dict:
    """Milliseconds spent in each step of a job (Request.timings names them)."""
    ms = lambda s: round(s * 1e3, 3)                       # noqa: E731
    return {"prefill_queue": ms(marks["forward"] - marks["queued"]),
            "prefill_forward": ms(marks["computed"] - marks["forward"]),
            "kv_dest_wait": ms(max(0.0, marks["write"] - marks["computed"])),
            "kv_transfer": ms(transfer_s)}


class PrefillScheduler:
    def __init__(self, core: WorkerCore, ctx=None) -> None:
        self.core, self.pool, self.loop = core, core.pool, core.loop
        self.deadlines = core.cfg.deadlines
        self.jobs: dict[int, Job] = {}
        self.pending: deque[Job] = deque()          # generate received, not computed yet
        self.tombstones: dict[int, tuple[int, Timer]] = {}   # room -> (epoch, expiry): ended here
        self.by_transfer: dict[int, Job] = {}
        self.peers: dict[bytes, DecodePeer] = {}
        self.transfer_ids = itertools.count(1)
        self.pause_waiters: list[Respond] = []
        core.handlers |= {Generate: self.on_generate, Recompute: self.on_recompute,
                          Hello: self.on_hello, KvDest: self.on_kv_dest, KvFailed: self.on_kv_failed,
                          Abort: self.on_abort, Admin: core.on_admin}
        core.admin_commands |= {"status": self.status, "pause": self.pause, "continue": self.resume}
        core.busy = lambda: bool(self.jobs)
        self.loop.add_fd(core.backend.fileno(), self.on_completions)

    # --- loop ------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.loop.run_once(max_wait=0 if self._runnable() else None)
            batch = self.schedule()
            if batch:
                started = time.monotonic()
                with self.core.long_call():
                    self.core.compute.prefill([j.req for j in batch])
                for job in batch:
                    job.marks |= {"forward": started, "computed": time.monotonic()}
                self.after_compute(batch)

    def _runnable(self) -> bool:
        while self.pending and self.jobs.get(self.pending[0].room) is not self.pending[0]:
            self.pending.popleft()                      # ended while queued
        return self.core.paused is None and not self.core.memory_released and bool(self.pending) \
            and self.pool.allocator.can_alloc(self.pool.pages_for(len(self.pending[0].req.prompt)))

    def schedule(self) -> list[Job]:
        """FIFO: take queued jobs while pages and the token budget allow."""
        batch, tokens = [], 0
        while self._runnable():
            job = self.pending[0]
            n = len(job.req.prompt)
            if batch and tokens + n > self.core.cfg.max_prefill_tokens:
                break
            job.req.pages = self.pool.allocator.alloc(self.pool.pages_for(n))
            self.pending.popleft()
            batch.append(job)
            tokens += n
        return batch

    def after_compute(self, batch: list[Job]) -> None:
        for job in batch:
            job.computed = True
            self._send_first_token(job)
            if job.dest is not None:
                self.start_write(job)
            else:
                self._deadline(job, self.deadlines.wait_kv_dest, "waiting for kv_dest")

    def _send_first_token(self, job: Job) -> None:
        """A streamed request's first token goes straight to its router, so the client
        does not wait for the KV write, kv_done and the decode's hop. The decode sends
        it again (the router passes each index once); if the request ends at that
        token, only the decode's final answer says so."""
        req = job.req
        if job.early_to is None or len(req.output) != 1 or self.core.compute.stop(req) is not None:
            return
        part = TokenPart(req.rid, list(req.output), list(req.weight_versions))
        self.core.send(job.early_to, Tokens.pack([part], first=True))

    # --- requests ----------------------------------------------------------------

    def on_generate(self, identity: bytes, msg: Generate) -> None:
        prompt, params, failure = [], SamplingParams(), None
        try:
            params = SamplingParams.from_dict(msg.sampling)
            prompt = self.core.prompt_ids(msg)
            validate(prompt, params, self.core.model.cfg, self.pool.layout.page_size, self.pool.num_pages)
        except (RequestError, ValueError) as e:
            failure = (getattr(e, "status", BAD_REQUEST), str(e))
        self.admit(msg.rid, msg.room, msg.epoch, prompt, params, failure)
        job = self.jobs.get(msg.room)
        if msg.stream and job is not None and job.req is not None and job.epoch == msg.epoch:
            job.early_to = identity

    def on_recompute(self, identity: bytes, msg: Recompute) -> None:
        """KV for prompt + output[:-1] again, under the current weights, as a new epoch."""
        failure, params = None, SamplingParams()
        try:
            params = SamplingParams.from_dict(msg.sampling)
            validate_prefix(msg.input_ids, self.core.model.cfg, self.pool.num_pages * self.pool.layout.page_size)
        except (RequestError, ValueError) as e:
            failure = (getattr(e, "status", BAD_REQUEST), str(e))
        old = self.jobs.get(msg.room)
        if old is not None and old.epoch < msg.epoch:
            self.end(old, None, "superseded by a recompute")
        self.admit(msg.rid, msg.room, msg.epoch, list(msg.input_ids), params, failure, identity)

    def admit(self, rid: str, room: int, epoch: int, prompt: list[int], params: SamplingParams,
              failure: tuple[int, str] | None, decode: bytes | None = None) -> None:
        if self._tombstoned(room, epoch):
            log.info("rid=%s room=%d epoch=%d already ended here; not computing", rid, room, epoch)
            return
        if self.core.paused in ("retract", "abort"):
            # decode holds the request and will send a recompute after continue
            log.info("rid=%s room=%d epoch=%d arrived while paused; dropped", rid, room, epoch)
            self._tombstone(room, epoch)
            return
        job = self.jobs.get(room)
        if job is None:
            job = self.jobs[room] = self._job(room, epoch)
        elif job.req is not None or job.epoch != epoch:
            log.warning("duplicate or stale request for room %d epoch %d dropped", room, epoch)
            return
        job.req, job.failure = Request(rid, prompt, params), failure
        job.marks["queued"] = time.monotonic()
        job.decode = job.decode or decode
        log.info("rid=%s room=%d epoch=%d queued (%d prompt tokens)", rid, room, epoch, len(prompt))
        if failure is None:
            self.pending.append(job)
            self._deadline(job, self.deadlines.wait_pages, "waiting for KV pages")
        elif job.decode is not None:
            self.end(job, *failure)
        else:
            self._deadline(job, self.deadlines.stash, "waiting for kv_dest")

    def on_hello(self, identity: bytes, msg: Hello) -> None:
        ok = msg.compat_hash == self.core.compat_hash
        reason = "" if ok else (f"incompatible peers: prefill {self.core.endpoint} serves "
                                f"{self.core.model.spec} ({self.core.layout.to_dict()}), decode "
                                f"{msg.decode} has layout {msg.layout} (hash {msg.compat_hash} != "
                                f"{self.core.compat_hash})")
        if ok:
            self.peers[identity] = DecodePeer(msg.session_id, msg.base_addr)
            self.core.backend.connect(msg.session_id)     # handshake now, not at its first write
        else:
            log.error("hello from %s refused: %s", msg.decode, reason)
        self.core.send(identity, HelloAck(
            ok, self.core.layout.to_dict(), self.core.compat_hash, self.core.backend.session_id,
            self.core.pool_addr, self.pool.num_pages, self.core.model.version, reason))

    def on_kv_dest(self, identity: bytes, msg: KvDest) -> None:
        if identity not in self.peers:
            self.core.send(identity, KvFailed(msg.room, msg.epoch, INTERNAL, "kv_dest before hello"))
            return
        job = self.jobs.get(msg.room)
        if job is None and (self._tombstoned(msg.room, msg.epoch) or self.core.paused in ("retract", "abort")):
            # nothing of ours will ever write there: the decode may reuse the pages
            self.core.send(identity, KvFailed(msg.room, msg.epoch, ABORTED, "ended at prefill"))
            return
        if job is None:
            job = self.jobs[msg.room] = self._job(msg.room, msg.epoch)
            self._deadline(job, self.deadlines.stash, "waiting for generate")
        if job.epoch != msg.epoch or job.dest is not None:
            log.warning("stale or duplicate kv_dest for room %d epoch %d dropped", msg.room, msg.epoch)
            return
        job.decode, job.dest = identity, list(msg.page_ids)
        if job.failure is not None:
            self.end(job, *job.failure)
        elif job.computed:
            self.start_write(job)

    def on_kv_failed(self, identity: bytes, msg: KvFailed) -> None:
        """The decode gave up on (room, epoch); answer once our write cannot land.
        The answer is what lets it reuse the pages, so it must come as soon as that
        is true, not only when we had a job for the room."""
        job = self.jobs.get(msg.room)
        log.info("room=%d epoch=%d decode gave up (%d %s)", msg.room, msg.epoch, msg.status, msg.reason)
        if job is not None and job.epoch <= msg.epoch:
            job.decode = job.decode or identity
            self.end(job, ABORTED, "acknowledged")
            return
        self._tombstone(msg.room, msg.epoch)     # its generate may still be on the way
        writing = self._writing(msg.room, msg.epoch)
        if writing is not None:                   # ended, but its write is still in flight
            writing.notice = writing.notice or (ABORTED, "acknowledged")
        else:                                     # finished, or never started here
            self.core.send(identity, KvFailed(msg.room, msg.epoch, ABORTED, "nothing in flight"))

    def _writing(self, room: int, epoch: int) -> Job | None:
        return next((j for j in self.by_transfer.values() if j.room == room and j.epoch <= epoch),
                    None)

    def on_abort(self, identity: bytes, msg: Abort) -> None:
        for job in [j for j in self.jobs.values() if j.req is not None and j.req.rid == msg.rid]:
            self.end(job, msg.status or ABORTED, msg.reason or "aborted")

    # --- transfer ----------------------------------------------------------------

    def start_write(self, job: Job) -> None:
        peer = self.peers[job.decode]
        n = len(job.req.pages)
        if len(job.dest) < n:
            self.end(job, INTERNAL, f"decode gave {len(job.dest)} pages for {n}")
            return
        runs = transport.coalesce_runs(self.pool.data_ptr, job.req.pages, peer.base_addr,
                                       job.dest[:n], self.pool.layout.page_bytes)
        job.transfer_id = next(self.transfer_ids)
        job.marks["write"] = time.monotonic()
        self.by_transfer[job.transfer_id] = job
        self._deadline(job, self.deadlines.transfer, "KV transfer", suspendable=False)
        self.core.backend.write(job.transfer_id, peer.session, runs)

    def on_completions(self) -> None:
        for c in self.core.backend.poll_completions():
            job = self.by_transfer.pop(c.transfer_id, None)
            if job is None:
                continue
            job.transfer_id = None
            if self.jobs.get(job.room) is not job:
                self._finish_ended(job)              # ended while writing
            elif not c.ok:
                self.end(job, INTERNAL, f"KV transfer failed: {c.reason}")
            else:
                log.info("rid=%s room=%d epoch=%d kv written (%d bytes, %.1f ms)", job.req.rid,
                         job.room, job.epoch, c.nbytes, c.seconds * 1e3)
                first = job.req.output[-1] if job.req.output else -1
                self.core.send(job.decode, KvDone(job.room, job.epoch, first, self.core.model.version,
                                                  _timings(job.marks, c.seconds)))
                self.end(job, None, "")
        self._answer_pause_waiters()

    # --- endings -------------------------------------------------------------------

    def end(self, job: Job, status: int | None, reason: str) -> None:
        """Forget the job. With a status, tell its decode (once no write can land)."""
        if self.jobs.get(job.room) is job:
            del self.jobs[job.room]
        if status is not None and status != ABORTED:
            log.warning("room=%d epoch=%d failed: %d %s", job.room, job.epoch, status, reason)
        job.deadline.cancel()
        job.notice = None if status is None else (status, reason)
        if job.transfer_id is not None:
            self.core.backend.cancel(job.transfer_id)   # its completion finishes the job
        else:
            self._finish_ended(job)

    def _finish_ended(self, job: Job) -> None:
        if job.notice is not None and job.decode is not None:
            self.core.send(job.decode, KvFailed(job.room, job.epoch, *job.notice))
        if job.req is not None and job.req.pages:
            self.pool.allocator.free_pages(job.req.pages)
            job.req.pages = []

    def _tombstone(self, room: int, epoch: int) -> None:
        old = self.tombstones.get(room)
        if old is not None:
            old[1].cancel()
        self.tombstones[room] = (epoch, self.loop.call_later(self.deadlines.stash,
                                                             self.tombstones.pop, room, None))

    def _tombstoned(self, room: int, epoch: int) -> bool:
        tomb = self.tombstones.get(room)
        return tomb is not None and epoch <= tomb[0]

    def _job(self, room: int, epoch: int) -> Job:
        job = Job(room, epoch)
        job.deadline = Deadline(self.loop, lambda what: self._expire(job, what))
        return job

    def _deadline(self, job: Job, seconds: float, what: str, suspendable: bool = True) -> None:
        """A phase's deadline; a pause stops its clock unless it is a KV write's."""
        job.deadline.start(seconds, what, paused=suspendable and self.core.paused is not None)

    def _expire(self, job: Job, what: str) -> None:
        if self.jobs.get(job.room) is job:
            self.end(job, DEADLINE, f"deadline expired {what}")

    # --- admin -------------------------------------------------------------------

    def pause(self, args: dict, respond: Respond) -> None:
        mode = pause_mode(args)
        if self.core.paused is not None and self.core.paused != mode:
            raise AdminError(409, f"already paused ({self.core.paused}); continue first")
        self.core.paused = mode
        for job in self.jobs.values():
            if job.transfer_id is None:
                job.deadline.suspend()           # a held job waits as long as the pause
        if mode in ("retract", "abort"):
            # Everything in flight is dropped: decode holds (retract) or ends (abort) it.
            for job in list(self.jobs.values()):
                self._tombstone(job.room, job.epoch)
                self.end(job, ABORTED, f"pause({mode})")
        self.pause_waiters.append(respond)
        self._answer_pause_waiters()

    def _answer_pause_waiters(self) -> None:
        """A pause is answered once no write of ours is in flight."""
        if self.pause_waiters and not self.by_transfer:
            waiters, self.pause_waiters = self.pause_waiters, []
            for respond in waiters:
                respond(True, self._status())

    def resume(self, args: dict, respond: Respond) -> None:
        was, self.core.paused = self.core.paused, None
        for job in self.jobs.values():
            job.deadline.resume()
        respond(True, self._status() | {"was_paused": was})

    def status(self, args: dict, respond: Respond) -> None:
        respond(True, self._status())

    def _status(self) -> dict:
        jobs = list(self.jobs.values())
        owners = {j for j in jobs + list(self.by_transfer.values()) if j.req is not None}
        return {"weight_version": self.core.model.version, "paused": self.core.paused,
                "memory": self.core.memory_state(),
                "kv_pages": self.core.kv_pages(sum(len(j.req.pages) for j in owners), 0),
                "queues": {"waiting": sum(1 for j in jobs if j.req is not None and not j.computed),
                           "waiting_kv_dest": sum(1 for j in jobs if j.computed and j.dest is None),
                           "writing": len(self.by_transfer),
                           "stashed": sum(1 for j in jobs if j.req is None)},
                "peers": len(self.peers)}
