"""The decode worker's scheduler: reserve pages, ask prefill for the KV, then generate.

Step: admit requests waiting for pages, one decode step for the running batch, emit
tokens (the core polls sockets and fires deadlines around it). Pages a prefill
write may still reach are fenced (zpd/worker/fences.py says until when). What a pause
and continue do to the requests is zpd/worker/retraction.py's.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Mapping

import zmq

from engines.batch import DecodeBatch
from engines.request import Request
from zpd.wire.status import (ABORTED, BAD_REQUEST, CONFLICT, DEADLINE, INTERNAL, UNAVAILABLE,
                             StatusError)
from zpd.wire.admin import Continue
from zpd.wire.admin_fields import PauseMode
from zpd.wire.deadline import Deadline
from zpd.wire.protocol import (Abort, Generate, Hello, KvDest, KvDone, KvFailed,
                               Message, Recompute, Tokens)
from zpd.worker.core import WorkerCore
from zpd.worker.jobs import DecodeJob, DecodePhase
from zpd.worker.links import LinkState, PrefillLink, PrefillLinks, well_formed
from zpd.worker.pages import PageBook, Prefix
from zpd.worker.parts import (asks_prompt_logprobs_again, cached_tokens, final_meta,
                              first_logprobs, recompute_sampling, take_prompt_logprobs,
                              rows_of, take_routed, token_part)
from zpd.worker.peers import model_layout
from zpd.worker.retraction import Retraction
from zpd.worker.router_loss import EndAtOnce, RouterLoss
from zpd.worker.scheduler import Handler, step_failure

log = logging.getLogger("zpd.worker.decode")


class DecodeScheduler:
    def __init__(self, core: WorkerCore, ctx: zmq.Context) -> None:
        self.core, self.pool, self.loop = core, core.pool, core.loop
        self.deadlines = core.cfg.deadlines
        self.jobs: dict[int, DecodeJob] = {}                  # room -> job
        self.by_rid: dict[str, DecodeJob] = {}
        self.waiting: deque[DecodeJob] = deque()              # WAITING, in arrival order
        # Its pages, fences and prefix cache: full prefix pages kept after their requests
        # end; a request whose prefix is there asks its prefill for the other pages only.
        self.pages = PageBook.for_worker(core, self._prefill_dead)
        self.batch = DecodeBatch(core.compute, core.cfg.max_batch)
        self.transferring = 0        # jobs in TRANSFERRING: each will join the batch at kv_done
        self.retraction = Retraction(self, core.model.cfg.vocab_size)   # pause, continue
        self.links = PrefillLinks(ctx, self.loop, self._hello(), self.on_prefill_message,
                                  self.on_refused, self.on_prefill_restarted,
                                  core.security.client_options(), self.deadlines.heartbeat,
                                  self.deadlines.peer_timeout, core.drops)
        self.orphans: RouterLoss = EndAtOnce(self.end_router)      # a silent router's requests
        self.handlers = {Generate: self.on_generate, Abort: self.on_abort}

    def plug(self, orphans: RouterLoss, handlers: Mapping[type[Message], Handler]) -> None:
        """Let `orphans` (a wing: zpd/ops/serve.py plugs it in before the core's attach)
        keep a silent router's requests, taking `handlers`' messages (its `adopt`)."""
        self.orphans = orphans
        self.handlers |= handlers

    def _hello(self) -> Hello:
        """Our pools, one per tensor-parallel rank, and the whole model's KV layout."""
        core, pools = self.core, self.core.rank_pools
        return Hello(core.endpoint, model_layout(core.layout, pools), core.compat_hash,
                     core.backend.session_id, [p.announced() for p in pools],
                     self.pool.num_pages, core.model.version)

    # --- phases --------------------------------------------------------------------

    def move(self, job: DecodeJob, phase: DecodePhase) -> None:
        """The one place a job changes phase: its queue, batch membership and deadline
        follow (a pause stops the deadline's clock)."""
        if job.phase is DecodePhase.WAITING:
            self.waiting.remove(job)
        elif job.phase is DecodePhase.RUNNING:
            self.batch.remove(job.req.rid)
        self.transferring += (phase is DecodePhase.TRANSFERRING) - \
            (job.phase is DecodePhase.TRANSFERRING)
        job.phase = phase
        paused = self.core.paused is not None
        if phase is DecodePhase.WAITING:
            self.waiting.append(job)
            job.deadline.start(self.deadlines.wait_pages, "waiting for KV pages", paused=paused)
        elif phase is DecodePhase.TRANSFERRING:
            job.deadline.start(self.deadlines.wait_kv_done, "waiting for the KV (kv_done)",
                               paused=paused)
        else:
            job.deadline.cancel()
        if phase is DecodePhase.RUNNING:
            self.batch.add(job.req)

    def _expire(self, job: DecodeJob, what: str) -> None:
        if self.jobs.get(job.room) is job:
            self.finish(job, DEADLINE, f"deadline expired {what}", tell_prefill=True)

    # --- the step ------------------------------------------------------------------

    def has_work(self) -> bool:
        return len(self.batch) > 0 or self._can_admit()

    def step(self) -> None:
        self.admit()
        try:
            with self.core.long_call():
                stepped = self.batch.step()
        except Exception as e:    # one bad batch must not take every other request down
            # A step that raised changed nothing: its batch is still `running`.
            self.step_failed([self.by_rid[rid] for rid in self.batch.running], e)
            return
        for req in stepped:
            self.emit(self.by_rid[req.rid])

    def step_failed(self, batch: list[DecodeJob], error: Exception) -> None:
        """The decode step of `batch` raised: end exactly those requests with 500 (503
        if the worker is lost) and free their pages (their prefills are done with them)."""
        log.error("decode step of rids %s failed", [j.req.rid for j in batch], exc_info=error)
        status, reason = step_failure("decode step", error, self.core.failure())
        for job in batch:
            self.finish(job, status, reason, tell_prefill=False)

    def _can_admit(self) -> bool:
        # Admitted is as good as running: kv_done moves a job into the batch unchecked.
        in_batch = len(self.batch) + self.transferring
        if not (self.waiting and in_batch < self.batch.max_batch and self.core.schedulable()):
            return False
        job = self.waiting[0]
        return self.pages.fits(self._prefix(job), self.pool.pages_for(job.req.max_context))

    def _prefix(self, job: DecodeJob) -> Prefix:
        """The tokens whose KV the prefill sends, prompt + output[:-1], as the prefix
        cache sees them (hashed once per epoch)."""
        n = len(job.req.prompt) + max(0, len(job.req.output) - 1)
        job.prefix_keys = self.pages.prefix(job.req, n, job.prefix_keys)
        return job.prefix_keys

    def admit(self) -> None:
        """FIFO: reserve pages for prompt + max_new_tokens (the cached ones of its
        prefix first), then ask for the KV."""
        while self._can_admit():
            job = self.waiting[0]
            skip = self.pages.reserve(job.req, self._prefix(job),
                                      self.pool.pages_for(job.req.max_context))
            if skip is None:
                return
            job.skip = skip
            link = self.links.get(self.retraction.prefill_for(job))
            if link.state in (LinkState.REFUSED, LinkState.DEAD):
                status = UNAVAILABLE if link.state is LinkState.DEAD else INTERNAL
                self.finish(job, status, link.reason, tell_prefill=True)
                continue
            job.prefill = link.endpoint
            self.move(job, DecodePhase.TRANSFERRING)
            link.when_ready(lambda j=job, l=link, epoch=job.epoch: self._request_kv(j, l, epoch))

    def _request_kv(self, job: DecodeJob, link: PrefillLink, epoch: int) -> None:
        if self.jobs.get(job.room) is not job or job.epoch != epoch or \
                job.phase is not DecodePhase.TRANSFERRING:      # ended or retracted meanwhile
            return
        req = job.req
        prefix = req.prompt + req.output[:-1]
        if epoch > 0:      # the prefill forgot this request when it was retracted
            link.send(Recompute(req.rid, job.room, epoch, prefix, recompute_sampling(req)))
        need = self.pool.pages_for(len(prefix))
        # the prefix's first job.skip pages this decode holds already (its prefix cache)
        link.send(KvDest(job.room, epoch, req.rid, req.pages[job.skip:need], cached_pages=job.skip))
        job.asked = epoch

    # --- from the router -----------------------------------------------------------

    def on_generate(self, identity: bytes, msg: Generate) -> None:
        if msg.room in self.jobs:
            log.warning("duplicate generate rid=%r room=%d dropped", msg.rid, msg.room)
            return
        if not well_formed(msg.prefill):      # before any socket is made for it
            self.refuse(identity, msg, BAD_REQUEST,
                        f"prefill {msg.prefill[:80]!r} is not an endpoint (host:port)")
            return
        if msg.rid in self.by_rid or msg.rid in self.core.tokenizing.pending:
            # e.g. an orphan of a restarted router that reused the rid
            self.refuse(identity, msg, CONFLICT,
                        f"rid {msg.rid!r} is already in flight on decode {self.core.endpoint}")
            return
        self.core.read_request_then(msg.rid, (identity, msg),
                                    msg, lambda *got: self._start(identity, msg, *got))

    def _start(self, identity: bytes, msg: Generate, prompt: list[int], params, error,
               paused_meanwhile: bool) -> None:
        """A generate whose prompt is read: as if it arrived now (a long text's did later)."""
        if msg.room in self.jobs:
            log.warning("duplicate generate rid=%r room=%d dropped", msg.rid, msg.room)
            return
        job = DecodeJob(msg.room, msg.epoch, Request(msg.rid, prompt, params), msg.prefill, identity,
                        msg.stream, Deadline(self.loop, lambda what: self._expire(job, what)),
                        owner=msg.owner)
        self.jobs[msg.room], self.by_rid[msg.rid] = job, job
        log.info("rid=%r room=%d epoch=%d generate via prefill %s", msg.rid, msg.room, msg.epoch,
                 msg.prefill)
        if error is None and params.scores_only:
            error = StatusError(BAD_REQUEST, "max_new_tokens 0 is scored by a prefill alone: "
                                             "no decode takes part in it")
        if error is not None:
            self.finish(job, error.status, str(error), tell_prefill=True)
        elif self.core.dropping:
            self.move(job, DecodePhase.HELD)     # the prefill drops it; recomputed after continue
        else:
            job.epoch += paused_meanwhile        # so did a pause while it was tokenized
            self.move(job, DecodePhase.WAITING)

    def refuse(self, identity: bytes, msg: Generate, status: int, reason: str) -> None:
        """Answer a generate we make no job for, and free its prefill (if it names one
        we may dial), so nothing waits for it."""
        log.warning("rid=%r room=%d refused: %s", msg.rid, msg.room, reason)
        if well_formed(msg.prefill):
            self.links.get(msg.prefill).send(KvFailed(msg.room, msg.epoch, status, reason))
        self.core.send(identity, Tokens.abort(msg.rid, status, reason))

    def on_abort(self, identity: bytes, msg: Abort) -> None:
        tokenizing = self.core.tokenizing.cancel(msg.rid)
        if tokenizing is not None:
            self.refuse(*tokenizing, msg.status or ABORTED, msg.reason or "aborted")
        job = self.by_rid.get(msg.rid)
        if job is not None:
            self.finish(job, msg.status or ABORTED, msg.reason or "aborted", tell_prefill=True)

    def on_peer_silent(self, identity: bytes) -> None:
        """A router that stopped pinging is gone: its requests end, unless a router
        restarted on its endpoint adopts them first (the wing plugged in, if any)."""
        self.orphans.on_silent(identity)

    def on_peer_back(self, identity: bytes) -> None:
        self.orphans.on_back(identity)

    def refuse_tokenizing(self, identity: bytes) -> None:
        """End the router's prompts still being tokenized (no job holds them yet)."""
        tokenizing = self.core.tokenizing
        for rid in [r for r, (client, _) in tokenizing.pending.items() if client == identity]:
            self.refuse(*tokenizing.cancel(rid), UNAVAILABLE, "router unavailable")

    def end_router(self, identity: bytes) -> None:
        """End every request of the router with 503."""
        self.refuse_tokenizing(identity)
        orphans = [j for j in self.jobs.values() if j.client == identity]
        if orphans:
            log.error("router %r silent: ending its %d requests", identity[:64], len(orphans))
        for job in orphans:
            self.finish(job, UNAVAILABLE, "router unavailable", tell_prefill=True)

    # --- from prefills ---------------------------------------------------------------

    def on_prefill_message(self, link: PrefillLink, msg: Message) -> None:
        key = (getattr(msg, "room", -1), getattr(msg, "epoch", -1))
        if isinstance(msg, (KvDone, KvFailed)) and self.pages.answered(key, link.endpoint):
            return                               # the prefill answered: nothing more will land
        job = self.jobs.get(key[0])
        if job is None or job.epoch != key[1] or job.phase is not DecodePhase.TRANSFERRING \
                or job.prefill != link.endpoint:     # only the prefill it asked may answer
            log.debug("dropping %s for an unknown or old room, or another prefill's, from %s",
                      msg.TYPE, link.endpoint)
            return
        if isinstance(msg, KvDone):
            self.on_kv_done(job, msg)
        elif isinstance(msg, KvFailed):        # the prefill will not write any more
            self.finish(job, msg.status, f"prefill {link.endpoint}: {msg.reason}", may_land=False)
        else:
            log.warning("unexpected %s from prefill %s", msg.TYPE, link.endpoint)

    def on_kv_done(self, job: DecodeJob, msg: KvDone) -> None:
        req = job.req
        req.timings = msg.timings.to_wire() if msg.timings is not None else {}
        cached = cached_tokens(req, msg)
        problem = cached if isinstance(cached, str) else take_routed(req, msg, self.core.model.cfg)
        if problem is None and not req.output:   # after a recompute the decode has its tokens
            problem = self._take_first_token(req, msg)
            req.finish = self.core.compute.finished(req) if problem is None else None
        elif problem is None and asks_prompt_logprobs_again(req):    # see recompute_sampling
            problem = take_prompt_logprobs(req, msg)
        if problem:                              # the write is over: nothing to fence
            self.finish(job, INTERNAL, f"prefill {job.prefill} sent {problem}",
                        tell_prefill=True, may_land=False)
            return
        if job.cached_tokens is None:            # a recompute's figure is not the request's
            job.cached_tokens = cached
        log.info("rid=%r room=%d epoch=%d kv received", req.rid, job.room, job.epoch)
        self.pages.computed(req, self._prefix(job))      # its prefix's full pages are complete
        self.move(job, DecodePhase.FINISHED if req.finished else DecodePhase.RUNNING)
        self.emit(job)

    def _take_first_token(self, req: Request, msg: KvDone) -> str | None:
        """Emit the first token the prefill sampled, with its logprobs; or say what is
        wrong with them."""
        vocab = self.core.model.cfg.vocab_size
        if not 0 <= msg.first_token < vocab:
            return f"first token {msg.first_token}, outside [0, {vocab})"
        logprobs = first_logprobs(req, msg)
        if isinstance(logprobs, str):
            return logprobs
        problem = take_prompt_logprobs(req, msg)
        if problem is None:
            req.emit(msg.first_token, msg.weight_version, *logprobs)
        return problem

    def on_refused(self, link: PrefillLink) -> None:
        """The prefill refused our hello (500) or stopped answering (503): fail its
        requests now, also those still waiting for pages, which would only fail later."""
        dead = link.state is LinkState.DEAD
        for job in [j for j in self.jobs.values() if self._uses(j, link)]:
            # A refused prefill never got our pages; a dead (perhaps only frozen) one
            # may still write: its pages stay fenced.
            self.finish(job, UNAVAILABLE if dead else INTERNAL, link.reason, tell_prefill=True,
                        may_land=dead)

    def _uses(self, job: DecodeJob, link: PrefillLink) -> bool:
        if job.phase is DecodePhase.TRANSFERRING:
            return job.prefill == link.endpoint
        return job.phase is DecodePhase.WAITING and \
            self.retraction.prefill_for(job) == link.endpoint

    def on_prefill_restarted(self, link: PrefillLink) -> None:
        """The prefill answered our hello from a new transport session: the process
        that might have written into fenced pages is gone, so they are free."""
        released = self.pages.prefill_restarted(link.endpoint)
        if released:
            log.warning("prefill %s restarted: released %d fences", link.endpoint, released)

    def _prefill_dead(self, endpoint: str) -> bool:
        link = self.links.links.get(endpoint)
        return link is not None and link.state is LinkState.DEAD

    # --- output and endings ---------------------------------------------------------

    def emit(self, job: DecodeJob) -> None:
        req = job.req
        if not req.finished and not job.stream:
            return
        if job.sent == len(req.output) and not req.finished:
            return
        start, job.sent = job.sent, len(req.output)
        meta, rows = {}, None
        if req.finished:
            rows = rows_of(req)                 # its routed experts go just ahead
            meta = final_meta(req, self.core.model.tokenizer, job.cached_tokens or 0, rows)
            log.info("rid=%r room=%d epoch=%d finished: %s after %d tokens", req.rid, job.room,
                     job.epoch, req.finish.get("type"), len(req.output))
            if rows is not None:
                self.core.send(job.client, rows)
        self.core.queue_token(job.client, token_part(req, start, meta), job.owner)
        if req.finished:
            self.orphans.ended(job, meta, rows)     # kept if its router is gone
            self._forget(job)

    def finish(self, job: DecodeJob, status: int, reason: str, tell_prefill: bool = False,
               may_land: bool = True) -> None:
        """End the request with an error status and tell the client. `may_land`
        False: the prefill is known not to write into its pages any more."""
        log.info("rid=%r room=%d epoch=%d ends: %d %s", job.req.rid, job.room, job.epoch,
                 status, reason)
        if tell_prefill and job.phase is not DecodePhase.HELD:
            self.links.get(job.prefill).send(KvFailed(job.room, job.epoch, status, reason))
        self.release(job, fence=may_land and job.write_may_land)
        self.move(job, DecodePhase.FINISHED)
        job.req.abort(status, reason)
        self.emit(job)

    def release(self, job: DecodeJob, fence: bool) -> None:
        """Give back the request's pages (if it has any: a waiting or held one has
        none), or fence them if a prefill write may still land."""
        if job.req not in self.pages:
            return
        if fence:
            self.pages.fence(job.req, (job.room, job.epoch), job.prefill)
        else:
            self.pages.release(job.req)

    def _forget(self, job: DecodeJob) -> None:
        self.jobs.pop(job.room, None)
        self.by_rid.pop(job.req.rid, None)
        self.move(job, DecodePhase.FINISHED)
        self.release(job, fence=False)

    # --- pause, continue, status (the core's admin commands call these) ---------------
    # Pause and continue are `self.retraction`'s (zpd/worker/retraction.py).

    def busy(self) -> bool:
        return bool(self.jobs) or self.pages.fenced > 0

    def on_pause(self, mode: PauseMode) -> None:
        if mode is PauseMode.ABORT:                      # prompts still being tokenized end too
            for rid in list(self.core.tokenizing.pending):
                self.refuse(*self.core.tokenizing.cancel(rid), ABORTED, "aborted by pause(abort)")
        self.retraction.on_pause(mode)

    def quiescent(self) -> bool:
        """pause(retract|abort) is answered once no page is fenced: then no worker
        holds KV for any request and memory can be flushed."""
        return not (self.pages.fenced and self.core.dropping)

    def on_resume(self, cmd: Continue) -> int:
        return self.retraction.on_resume(cmd)

    def on_memory_released(self) -> None:
        pass                                     # nothing kept beside the pool

    def on_memory_resumed(self) -> None:
        self.links.rehello(self._hello())       # prefills must learn our pool's new address

    def on_weights_changed(self) -> None:
        self.pages.weights_changed()

    def flush_cache(self) -> int:
        return self.pages.invalidate()

    def status(self) -> dict:
        phases = [j.phase for j in self.jobs.values()]
        cache = self.pages.status()
        return {"page_size": self.pool.layout.page_size,
                "prefix_cache": cache["prefix_cache"], "counters": cache["counters"],
                "queues": {"waiting_pages": phases.count(DecodePhase.WAITING),
                           "waiting_kv": phases.count(DecodePhase.TRANSFERRING),
                           "running": len(self.batch), "held": phases.count(DecodePhase.HELD)},
                "held": [j.req.rid for j in self.jobs.values() if j.phase is DecodePhase.HELD],
                "peers": self.links.status()}

    def close(self) -> None:
        self.links.close()
