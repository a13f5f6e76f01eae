"""The prefill worker's scheduler: compute prompts' KV and write it into decode memory.

A job may start computing before decode's `kv_dest` arrives; the write starts once
both are there. Messages may arrive in either order (router -> prefill and decode ->
prefill are different sockets), so a `kv_dest` for an unknown room is kept briefly;
only the room's own decode may say where its KV goes (zpd/worker/dests.py takes
hellos and kv_dests, with the checks of zpd/worker/peers.py; zpd/worker/writes.py
writes the KV, and zpd/worker/pages.py keeps the pages).
Whenever a job ends, the decode is told (`kv_failed`/`kv_done`) only once no write of
ours can still land in its pages: that message is what lets it reuse them.

A scoring request (max_new_tokens 0) has no decode: the router names none, the prompt
is computed here with the logprobs it asks for, and its final answer goes straight
back to the router (`answer_to`); nothing is written anywhere.
"""
from __future__ import annotations

import logging
import time
from collections import deque

from engines.request import (MAX_PROMPT_LOGPROB_ENTRIES, Request, prompt_logprob_entries,
                             validate_prefix, validate_prompt_logprobs, validate_routing)
from zpd.wire.status import ABORTED, BAD_REQUEST, DEADLINE, StatusError
from engines.sampler import SamplingParams
from zpd.wire.admin import Continue
from zpd.wire.admin_fields import PauseMode
from zpd.wire.deadline import Deadline
from zpd.wire.protocol import (Abort, Generate, Hello, HelloAck, KvDest, KvFailed, Recompute,
                               Tokens)
from zpd.worker.core import WorkerCore
from zpd.worker.dests import DestPort, KvDests
from zpd.worker.fair import FairTurns, StepBudget
from zpd.worker.jobs import JobPhase, PrefillJob
from zpd.worker.pages import PageBook, Prefix
from zpd.worker.parts import final_meta, rows_of, token_part
from zpd.worker.peers import DecodePeers, model_layout
from zpd.worker.scheduler import step_failure
from zpd.worker.tombstones import Tombstones
from zpd.worker.writes import KvWrites, WritePort, prefill_timings

log = logging.getLogger("zpd.worker.prefill")


# Each phase's deadline (a Deadlines field and what was awaited); a pause stops the
# clock of every one but the KV write's.
PHASE_DEADLINES = {
    JobPhase.STASHED: ("stash", "waiting for generate"),
    JobPhase.REJECTED: ("stash", "waiting for kv_dest"),
    JobPhase.QUEUED: ("wait_pages", "waiting for KV pages"),
    JobPhase.COMPUTED: ("wait_kv_dest", "waiting for kv_dest"),
    JobPhase.WRITING: ("transfer", "KV transfer"),
}


class PrefillScheduler:
    def __init__(self, core: WorkerCore, ctx=None) -> None:
        self.core, self.pool, self.loop = core, core.pool, core.loop
        self.deadlines = core.cfg.deadlines
        self.jobs: dict[int, PrefillJob] = {}                # room -> live job
        self.pending: deque[PrefillJob] = deque()             # QUEUED, in arrival order
        self.turns = FairTurns()                              # taken in turns between callers
        self.budget = StepBudget(core.cfg.max_prefill_tokens, core.cfg.prefill_step_seconds,
                                 self.pool.layout.page_size)
        self.tombstones = Tombstones(self.loop, self.deadlines.stash)     # ended here
        self.peers = DecodePeers(model_layout(core.layout, core.rank_pools),
                                 core.backend.session_id, core.send)
        self.page_size = self.pool.layout.page_size
        self.dests = KvDests(DestPort(                        # hellos and kv_dests
            self.jobs, self.tombstones, self.peers, core.send, lambda: core.dropping,
            self.pool.pages_for, self.new_job, self.move, self.end,
            lambda job: self.writes.start(job), core.compat_hash,
            f"{core.endpoint} serves {core.model.spec}", core.backend.connect, self._hello_ack))
        self.writes = KvWrites(WritePort(                     # KV writes in flight
            core.backend, lambda: core.rank_pools, self.peers, self.page_size, core.send,
            lambda: core.model.version, self.dests.problem, self.move, self.end,
            self.finish_ended))
        self.pages = PageBook.for_worker(core)               # the pool's pages and prefix cache
        # cumulative, reported in status for /metrics
        self.counters = {"prompt_tokens_computed": 0, "prefill_forward_seconds": 0.0}
        self.handlers = {Generate: self.on_generate, Recompute: self.on_recompute,
                         Hello: self.dests.on_hello, KvDest: self.dests.on_kv_dest,
                         KvFailed: self.on_kv_failed, Abort: self.on_abort}
        self.loop.add_fd(core.backend.fileno(), self.writes.on_completions)

    def _hello_ack(self, ok: bool, reason: str) -> HelloAck:
        """Our answer to a decode's hello: our pools and model, or why we refuse it."""
        core = self.core
        return HelloAck(ok, self.peers.layout, core.compat_hash,
                        core.backend.session_id, [p.announced() for p in core.rank_pools],
                        core.pool.num_pages, core.model.version, reason)

    # --- phases --------------------------------------------------------------------

    def move(self, job: PrefillJob, phase: JobPhase) -> None:
        """The one place a job changes phase: its queue membership and deadline follow."""
        if job.phase is JobPhase.QUEUED:
            self.pending.remove(job)
        job.phase = phase
        if phase is JobPhase.QUEUED:
            self.pending.append(job)
        spec = PHASE_DEADLINES.get(phase)
        if spec is None:
            job.deadline.cancel()
        else:
            suspendable = phase is not JobPhase.WRITING      # the write goes on during a pause
            job.deadline.start(getattr(self.deadlines, spec[0]), spec[1],
                               paused=suspendable and self.core.paused is not None)

    def new_job(self, room: int, epoch: int) -> PrefillJob:
        job = PrefillJob(room, epoch, Deadline(self.loop, lambda what: self._expire(job, what)))
        self.jobs[room] = job
        return job

    def _expire(self, job: PrefillJob, what: str) -> None:
        if self.jobs.get(job.room) is job:
            self.end(job, DEADLINE, f"deadline expired {what}")

    # --- the step ------------------------------------------------------------------

    def has_work(self) -> bool:
        return self._fits(self.turns.first(self.pending)) if self.pending else False

    def _fits(self, job: PrefillJob) -> bool:
        return self.core.schedulable() and \
            self.pages.fits(self._prefix(job), self.pool.pages_for(len(job.req.prompt)))

    def _prefix(self, job: PrefillJob) -> Prefix:
        """The job's prompt as the prefix cache sees it (hashed once per weight version),
        a hit short of what its prompt logprobs read."""
        req = job.req
        job.prefix_keys = self.pages.prefix(req, len(req.prompt), job.prefix_keys, req.reusable_prefix)
        return job.prefix_keys

    def step(self) -> None:
        if self.pending and self.writes:
            self.writes.settle()
        batch = self.take_batch()
        if not batch:
            return
        started = time.monotonic()
        try:
            with self.core.long_call():
                self.core.compute.prefill([j.req for j in batch],
                                          [j.skip * self.page_size for j in batch])
        except Exception as e:    # one bad batch must not take every other request down
            self.compute_failed(batch, e)
            return
        done = time.monotonic()
        for job in batch:
            job.marks |= {"forward": started, "computed": done}
            self.pages.computed(job.req, self._prefix(job))
        computed = sum(len(j.req.prompt) - j.skip * self.page_size for j in batch)
        self.budget.took(computed, done - started)
        self.counters["prompt_tokens_computed"] += computed
        self.counters["prefill_forward_seconds"] += done - started
        self.after_compute(batch)

    def take_batch(self) -> list[PrefillJob]:
        """Callers in turn (zpd/worker/fair.py): give queued jobs their pages (the
        cached prefix's, then new ones) while pages, the token budget and the prompt
        logprob budget allow. A job whose next page to compute is being computed by a job
        already in the batch waits one step, then takes it from the cache: eight samples
        of one prompt compute it once."""
        batch, tokens, entries, computing = [], 0, 0, set()
        budget = self.budget.tokens()
        for job in self.turns.order(self.pending):
            if not self._fits(job):
                break
            n, prefix = len(job.req.prompt), self._prefix(job)
            scored = prompt_logprob_entries(n, job.req.params) if job.req.prompt_logprob_ask else 0
            keys, hit = prefix.usable(self.page_size), self.pages.hit(prefix)
            # wait for a batch-mate only for a page this prompt could take from the cache
            # (the page of its last token is always computed)
            if hit < min(len(keys), (n - 1) // self.page_size) and keys[hit] in computing:
                continue
            if batch and (tokens + n - hit * self.page_size > budget
                          or entries + scored > MAX_PROMPT_LOGPROB_ENTRIES):
                break       # (a step's logprobs are held whole until its answers are sent)
            skip = self.pages.reserve(job.req, prefix, self.pool.pages_for(n))
            if skip is None:                     # `_fits` said there is room: cannot happen
                break
            job.skip = skip
            self.move(job, JobPhase.COMPUTING)
            batch.append(job)
            tokens, entries = tokens + n - hit * self.page_size, entries + scored
            computing.update(prefix.keys[hit:])
        self.turns.served(batch, self.pending)
        return batch

    def after_compute(self, batch: list[PrefillJob]) -> None:
        for job in batch:
            if job.answer_to is not None:
                self._answer_scored(job)
                continue
            self._send_first_token(job)
            if job.dest is not None:
                self.writes.start(job)
            else:
                self.move(job, JobPhase.COMPUTED)

    def compute_failed(self, batch: list[PrefillJob], error: Exception) -> None:
        """The forward or sampling of `batch` raised: end exactly its jobs with 500 and
        free their pages; the worker goes on serving."""
        log.error("prefill of rooms %s failed", [j.room for j in batch], exc_info=error)
        status, reason = step_failure("prefill step", error, self.core.failure())
        for job in batch:
            if job.decode is not None or job.answer_to is not None:
                self.end(job, status, reason)
                continue
            # Its decode is not known until its kv_dest comes: refused, as at admission.
            self.pages.release(job.req)
            job.failure = (status, reason)
            self.move(job, JobPhase.REJECTED)

    def _send_first_token(self, job: PrefillJob) -> None:
        """A streamed request's first token goes straight to its router, so the client
        does not wait for the KV write, kv_done and the decode's hop. The decode sends
        it again (the router passes each index once); if the request ends at that
        token, only the decode's final answer says so."""
        req = job.req
        if job.early_to is None or len(req.output) != 1 or self.core.compute.stop(req) is not None:
            return
        self.core.send(job.early_to, Tokens.pack([token_part(req, 0)], first=True))

    def _answer_scored(self, job: PrefillJob) -> None:
        """A scoring request is done once computed: its answer (prompt logprobs, no
        output token) to its router, and its pages back (the prefix cache keeps them)."""
        req = job.req
        req.timings = prefill_timings(job.marks)
        self._answer_router(job, job.skip * self.page_size)
        log.info("rid=%r room=%d scored: %d prompt tokens (%d cached) under weights %r",
                 req.rid, job.room, len(req.prompt), job.skip * self.page_size, req.scored_version)
        self.end(job, None, "scored")

    def _answer_router(self, job: PrefillJob, cached: int) -> None:
        """A scoring request's final answer, scored or ended, built as a decode builds one."""
        req = job.req
        rows = rows_of(req)                     # its routed experts go just ahead
        if rows is not None:
            self.core.send(job.answer_to, rows)
        self.core.queue_token(job.answer_to, token_part(
            req, 0, final_meta(req, self.core.model.tokenizer, cached, rows)),
            job.caller[1] if len(job.caller) > 1 else "")

    # --- requests ------------------------------------------------------------------

    def on_generate(self, identity: bytes, msg: Generate) -> None:
        # a long text is admitted once tokenized, as if it arrived then (what comes for
        # its room meanwhile is stashed or tombstoned as for any late generate)
        self.core.read_request_then((msg.room, msg.epoch), identity, msg,
                                    lambda *got: self._admit_generate(identity, msg, *got))

    def _admit_generate(self, identity: bytes, msg: Generate, prompt: list[int], params, error,
                        paused_meanwhile: bool) -> None:
        scoring = not msg.decode        # max_new_tokens 0: no decode, we answer the router
        if paused_meanwhile and not scoring:  # as if it arrived in that pause: the decode recomputes it
            log.info("rid=%r room=%d epoch=%d tokenized across a pause; dropped", msg.rid,
                     msg.room, msg.epoch)
            self.tombstones.add(msg.room, msg.epoch)
            return
        failure = None if error is None else (error.status, str(error))
        if failure is None and scoring != params.scores_only:
            failure = (BAD_REQUEST, "a generate names no decode exactly when its max_new_tokens "
                                    "is 0 (a prompt scored by a prefill alone)")
        job = self.admit(msg.rid, msg.room, msg.epoch, prompt, params, failure,
                         answer_to=identity if scoring else None)
        if job is not None:     # (a scoring job pairs with no decode: every kv_dest is refused)
            job.early_to = identity if msg.stream else None
            job.caller = (identity, msg.owner, msg.user)
            self.dests.pair(job, msg.decode)

    def on_recompute(self, identity: bytes, msg: Recompute) -> None:
        """KV for prompt + output[:-1] again, under the current weights, as a new epoch.
        The decode asks only the logprobs it still needs (parts.recompute_sampling): the
        first token's where it has none yet, the prompt's where it never got them."""
        failure, params = None, msg.sampling
        try:
            if msg.refused:
                raise ValueError(msg.refused)
            validate_prefix(msg.input_ids, self.core.model.cfg, self.pool.num_pages * self.pool.layout.page_size)
            validate_prompt_logprobs(len(msg.input_ids), params, self.core.model.cfg)
            validate_routing(len(msg.input_ids) + 1, params, self.core.model.cfg,
                             self.core.compute.routed_experts)
            self.core.compute.grammars.check(params.constraint)
        except (StatusError, ValueError) as e:
            failure = (getattr(e, "status", BAD_REQUEST), str(e))
        old = self.jobs.get(msg.room)
        if old is not None and old.epoch < msg.epoch:
            self.end(old, None, "superseded by a recompute")
        job = self.admit(msg.rid, msg.room, msg.epoch, list(msg.input_ids), params, failure,
                         identity)
        if job is not None:                      # the decode that asks is the room's decode
            job.caller = (identity,)
            self.dests.pair(job, self.peers.endpoint(identity), identity)

    def admit(self, rid: str, room: int, epoch: int, prompt: list[int], params: SamplingParams,
              failure: tuple[int, str] | None, decode: bytes | None = None,
              answer_to: bytes | None = None) -> PrefillJob | None:
        """Queue the request (or keep its refusal for its decode); the job, or None if
        it was dropped. A scoring request (`answer_to`, its router) is queued even in a
        pause that drops requests: no decode holds it, so it waits here for continue."""
        if (room, epoch) in self.tombstones:
            log.info("rid=%r room=%d epoch=%d already ended here; not computing", rid, room, epoch)
            return None
        if self.core.dropping and answer_to is None:
            # decode holds the request and will send a recompute after continue
            log.info("rid=%r room=%d epoch=%d arrived while paused; dropped", rid, room, epoch)
            self.tombstones.add(room, epoch)
            return None
        job = self.jobs.get(room) or self.new_job(room, epoch)
        if job.phase not in (JobPhase.NEW, JobPhase.STASHED) or job.epoch != epoch:
            log.warning("duplicate or stale request for room %d epoch %d dropped", room, epoch)
            return None
        job.req, job.failure = Request(rid, prompt, params), failure
        job.marks["queued"] = time.monotonic()
        job.decode, job.answer_to = job.decode or decode, answer_to
        log.info("rid=%r room=%d epoch=%d queued (%d prompt tokens)", rid, room, epoch, len(prompt))
        if failure is None:
            self.move(job, JobPhase.QUEUED)
        elif job.decode is not None or answer_to is not None:
            self.end(job, *failure)
        else:
            self.move(job, JobPhase.REJECTED)
        return job if self.jobs.get(room) is job else None

    def on_abort(self, identity: bytes, msg: Abort) -> None:
        for job in [j for j in self.jobs.values() if j.req is not None and j.req.rid == msg.rid]:
            self.end(job, msg.status or ABORTED, msg.reason or "aborted")

    # --- from decodes (their hellos and kv_dests go to `self.dests`) ------------------

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
        self.tombstones.add(msg.room, msg.epoch)     # its generate may still be on the way
        writing = self.writes.writing(msg.room, msg.epoch)
        if writing is not None:                   # ended, but its write is still in flight
            writing.notice = writing.notice or (ABORTED, "acknowledged")
        else:                                     # finished, or never started here
            self.core.send(identity, KvFailed(msg.room, msg.epoch, ABORTED, "nothing in flight"))

    # --- endings ---------------------------------------------------------------------

    def end(self, job: PrefillJob, status: int | None, reason: str) -> None:
        """Forget the job. With a status, tell its decode (once no write can land)."""
        if self.jobs.get(job.room) is job:
            del self.jobs[job.room]
        if status is not None and status != ABORTED:
            log.warning("room=%d epoch=%d failed: %d %s", job.room, job.epoch, status, reason)
        self.move(job, JobPhase.ENDED)
        job.notice = None if status is None else (status, reason)
        if job.transfer_id is not None:
            self.core.backend.cancel(job.transfer_id)   # its completion finishes the job
        else:
            self.finish_ended(job)

    def finish_ended(self, job: PrefillJob) -> None:
        """The ended job's write is over (or there was none): tell its decode (or a
        scoring request's router), free."""
        if job.notice is not None and job.answer_to is not None:
            job.req.abort(*job.notice)
            self._answer_router(job, 0)
        elif job.notice is not None and job.decode is not None:
            self.core.send(job.decode, KvFailed(job.room, job.epoch, *job.notice))
        if job.req in self.pages:
            self.pages.release(job.req)

    # --- pause, continue, status (the core's admin commands call these) ---------------

    def busy(self) -> bool:
        return bool(self.jobs)

    def on_pause(self, mode: PauseMode) -> None:
        for job in self.jobs.values():
            if job.phase is not JobPhase.WRITING:
                job.deadline.suspend()           # a held job waits as long as the pause
        if mode.drops:
            # Everything in flight is dropped: decode holds (retract) or ends (abort) it.
            # A scoring request is only ever queued here (it ends in the step that
            # computes it): retract keeps it, to be scored under the weights of continue.
            for job in list(self.jobs.values()):
                if job.answer_to is not None and mode is PauseMode.RETRACT:
                    continue
                self.tombstones.add(job.room, job.epoch)
                self.end(job, ABORTED, f"pause({mode})")

    def quiescent(self) -> bool:
        """A pause is answered once no write of ours is in flight."""
        return not self.writes

    def on_resume(self, cmd: Continue) -> None:
        for job in self.jobs.values():
            job.deadline.resume()

    def on_memory_released(self) -> None:
        self.writes.planner.release(self.core.backend.unregister)

    def on_memory_resumed(self) -> None:
        pass                                     # decodes learn our address at their next hello

    def on_peer_silent(self, identity: bytes) -> None:
        """A job ends by its deadline or its decode; a scoring one whose router is gone
        has no one to answer."""
        for job in [j for j in self.jobs.values() if j.answer_to == identity]:
            self.end(job, None, "its router is silent")

    def on_peer_back(self, identity: bytes) -> None:
        """Its scoring jobs ended already; new ones need nothing more."""

    def on_weights_changed(self) -> None:
        self.pages.weights_changed()

    def flush_cache(self) -> int:
        """Drop every cached page (the caller checked no request runs)."""
        return self.pages.invalidate()

    def status(self) -> dict:
        phases = [j.phase for j in self.jobs.values()]
        cache = self.pages.status()
        return {"page_size": self.page_size,
                "prefix_cache": cache["prefix_cache"],
                "queues": {"waiting": phases.count(JobPhase.QUEUED) + phases.count(JobPhase.REJECTED),
                           "waiting_kv_dest": phases.count(JobPhase.COMPUTED),
                           "writing": len(self.writes),
                           "stashed": phases.count(JobPhase.STASHED)},
                "peers": len(self.peers),
                "counters": self.counters | self.writes.counters | cache["counters"]}

    def close(self) -> None:
        self.loop.remove_fd(self.core.backend.fileno())
