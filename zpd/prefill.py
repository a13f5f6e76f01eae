"""The prefill worker's scheduler: compute prompts' KV and write it into decode memory.

A job may start computing before decode's `kv_dest` arrives; the write starts once
both are there. Messages may arrive in either order (router -> prefill and decode ->
prefill are different sockets), so a `kv_dest` for an unknown room is kept briefly.
"""
from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass

import transport
from engines.sampler import SamplingParams
from zpd.loop import Timer
from zpd.protocol import Abort, Admin, Generate, Hello, HelloAck, KvDest, KvDone, KvFailed
from zpd.request import BAD_REQUEST, DEADLINE, INTERNAL, Request, RequestError, validate
from zpd.worker import WorkerCore

log = logging.getLogger("zpd.prefill")


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
    timer: Timer | None = None
    failure: tuple[int, str] | None = None


class PrefillScheduler:
    def __init__(self, core: WorkerCore) -> None:
        self.core, self.pool, self.loop = core, core.pool, core.loop
        self.deadlines = core.cfg.deadlines
        self.jobs: dict[int, Job] = {}
        self.pending: deque[Job] = deque()      # generate received, not computed yet
        self.tombstones: dict[int, Timer] = {}   # rooms decode gave up before their generate came
        self.by_transfer: dict[int, Job] = {}
        self.peers: dict[bytes, DecodePeer] = {}
        self.transfer_ids = itertools.count(1)
        core.handlers |= {Generate: self.on_generate, Hello: self.on_hello, KvDest: self.on_kv_dest,
                          KvFailed: self.on_kv_failed, Abort: self.on_abort, Admin: core.on_admin}
        core.admin_commands["status"] = self.status
        self.loop.add_fd(core.backend.fileno(), self.on_completions)

    # --- loop ------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.loop.run_once(max_wait=0 if self._runnable() else None)
            batch = self.schedule()
            if batch:
                self.core.compute.prefill([j.req for j in batch])
                self.after_compute(batch)

    def _runnable(self) -> bool:
        while self.pending and self.jobs.get(self.pending[0].room) is not self.pending[0]:
            self.pending.popleft()                      # dropped while queued
        return bool(self.pending) and self.pool.allocator.can_alloc(
            self.pool.pages_for(len(self.pending[0].req.prompt)))

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
            if job.dest is not None:
                self.start_write(job)
            else:
                self._deadline(job, self.deadlines.wait_kv_dest, "waiting for kv_dest")

    # --- messages ----------------------------------------------------------------

    def on_generate(self, identity: bytes, msg: Generate) -> None:
        tombstone = self.tombstones.pop(msg.room, None)
        if tombstone is not None:
            tombstone.cancel()
            log.info("rid=%s room=%d already given up by decode; not computing", msg.rid, msg.room)
            return
        job = self.jobs.get(msg.room)
        if job is None:
            job = self.jobs[msg.room] = Job(msg.room, msg.epoch)
        elif job.req is not None or job.epoch != msg.epoch:
            log.warning("duplicate generate for room %d dropped", msg.room)
            return
        prompt, params = [], SamplingParams()
        try:
            params = SamplingParams.from_dict(msg.sampling)
            prompt = self.core.prompt_ids(msg)
            validate(prompt, params, self.core.model.cfg, self.pool.layout.page_size,
                     self.pool.num_pages)
        except (RequestError, ValueError) as e:
            job.failure = (getattr(e, "status", BAD_REQUEST), str(e))
        job.req = Request(msg.rid, prompt, params)
        log.info("rid=%s room=%d epoch=%d generate (%d prompt tokens)", msg.rid, msg.room,
                 msg.epoch, len(prompt))
        if job.failure is None:
            self.pending.append(job)
            self._deadline(job, self.deadlines.wait_pages, "waiting for KV pages")
        elif job.decode is not None:
            self.fail(job, *job.failure)
        if job.decode is None and job.failure is not None:
            self._deadline(job, self.deadlines.stash, "waiting for kv_dest")

    def on_hello(self, identity: bytes, msg: Hello) -> None:
        ok = msg.compat_hash == self.core.compat_hash
        reason = "" if ok else (f"incompatible peers: prefill {self.core.endpoint} serves "
                                f"{self.core.model.spec} ({self.core.layout.to_dict()}), decode "
                                f"{msg.decode} has layout {msg.layout} (hash {msg.compat_hash} != "
                                f"{self.core.compat_hash})")
        if ok:
            self.peers[identity] = DecodePeer(msg.session_id, msg.base_addr)
        else:
            log.error("hello from %s refused: %s", msg.decode, reason)
        self.core.router.send(identity, HelloAck(
            ok, self.core.layout.to_dict(), self.core.compat_hash, self.core.backend.session_id,
            self.pool.data_ptr, self.pool.num_pages, self.core.model.version, reason))

    def on_kv_dest(self, identity: bytes, msg: KvDest) -> None:
        if identity not in self.peers:
            self.core.router.send(identity, KvFailed(msg.room, msg.epoch, INTERNAL, "kv_dest before hello"))
            return
        job = self.jobs.get(msg.room)
        if job is None:
            job = self.jobs[msg.room] = Job(msg.room, msg.epoch)
            self._deadline(job, self.deadlines.stash, "waiting for generate")
        if job.epoch != msg.epoch or job.dest is not None:
            log.warning("stale or duplicate kv_dest for room %d epoch %d dropped", msg.room, msg.epoch)
            return
        job.decode, job.dest = identity, list(msg.page_ids)
        if job.failure is not None:
            self.fail(job, *job.failure)
        elif job.computed:
            self.start_write(job)

    def on_kv_failed(self, identity: bytes, msg: KvFailed) -> None:
        job = self.jobs.get(msg.room)
        log.info("room=%d decode gave up (%d %s)", msg.room, msg.status, msg.reason)
        if job is None:
            # The generate is still on its way from the router: remember not to compute it.
            self.tombstones[msg.room] = self.loop.call_later(self.deadlines.stash,
                                                             self.tombstones.pop, msg.room, None)
        elif job.epoch == msg.epoch:
            job.decode = None            # nothing more to tell the decode
            self.drop(job)

    def on_abort(self, identity: bytes, msg: Abort) -> None:
        for job in [j for j in self.jobs.values() if j.req is not None and j.req.rid == msg.rid]:
            self.drop(job)

    # --- transfer ----------------------------------------------------------------

    def start_write(self, job: Job) -> None:
        peer = self.peers[job.decode]
        n = len(job.req.pages)
        if len(job.dest) < n:
            self.fail(job, INTERNAL, f"decode gave {len(job.dest)} pages for {n}")
            return
        runs = transport.coalesce_runs(self.pool.data_ptr, job.req.pages, peer.base_addr,
                                       job.dest[:n], self.pool.layout.page_bytes)
        job.transfer_id = next(self.transfer_ids)
        self.by_transfer[job.transfer_id] = job
        self._deadline(job, self.deadlines.transfer, "KV transfer")
        self.core.backend.write(job.transfer_id, peer.session, runs)

    def on_completions(self) -> None:
        for c in self.core.backend.poll_completions():
            job = self.by_transfer.pop(c.transfer_id, None)
            if job is None:
                continue
            job.transfer_id = None
            if not c.ok:
                self.fail(job, INTERNAL, f"KV transfer failed: {c.reason}")
            elif self.jobs.get(job.room) is job:
                first = job.req.output[-1] if job.req.output else -1
                log.info("rid=%s room=%d epoch=%d kv written (%d bytes, %.1f ms)", job.req.rid,
                         job.room, job.epoch, c.nbytes, c.seconds * 1e3)
                self.core.router.send(job.decode, KvDone(job.room, job.epoch, first,
                                                         self.core.model.version))
                self.drop(job)
            else:
                self._free(job)       # dropped while writing: the pages were kept until now

    # --- endings -------------------------------------------------------------------

    def fail(self, job: Job, status: int, reason: str) -> None:
        log.warning("room=%d epoch=%d failed: %d %s", job.room, job.epoch, status, reason)
        if job.decode is not None:
            self.core.router.send(job.decode, KvFailed(job.room, job.epoch, status, reason))
        self.drop(job)

    def drop(self, job: Job) -> None:
        """Forget the job; its pages come back now, or when an in-flight write ends."""
        if self.jobs.get(job.room) is job:
            del self.jobs[job.room]
        if job.timer is not None:
            job.timer.cancel()
        if job.transfer_id is not None:
            self.core.backend.cancel(job.transfer_id)   # completion frees the pages
        else:
            self._free(job)

    def _free(self, job: Job) -> None:
        if job.req is not None and job.req.pages:
            self.pool.allocator.free_pages(job.req.pages)
            job.req.pages = []

    def _deadline(self, job: Job, seconds: float, what: str) -> None:
        if job.timer is not None:
            job.timer.cancel()
        job.timer = self.loop.call_later(seconds, self._expire, job, what)

    def _expire(self, job: Job, what: str) -> None:
        job.timer = None
        if self.jobs.get(job.room) is job:
            self.fail(job, DEADLINE, f"deadline expired {what}")

    def status(self, args: dict) -> dict:
        jobs = list(self.jobs.values())
        return {"weight_version": self.core.model.version, "paused": None,
                "kv_pages": self.core.kv_pages(),
                "queues": {"waiting": sum(1 for j in jobs if j.req is not None and not j.computed),
                           "waiting_kv_dest": sum(1 for j in jobs if j.computed and j.dest is None),
                           "writing": len(self.by_transfer),
                           "stashed": sum(1 for j in jobs if j.req is None)},
                "peers": len(self.peers)}
