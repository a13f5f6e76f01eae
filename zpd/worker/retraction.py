"""What a pause does to a decode's requests, and how continue brings them back.

pause(abort) ends every request; pause(retract) drops each one's KV and holds it
(HELD), fencing pages a prefill write may still reach. The pause is answered once
no page is fenced. Continue re-admits the held requests as a new epoch: their
prefix (prompt + output so far) is recomputed by a prefill the router says is live.
"""
from __future__ import annotations

import logging
from typing import Protocol

from zpd.wire.admin import Continue
from zpd.wire.admin_fields import PauseMode
from zpd.wire.first_token import FirstToken
from zpd.wire.messages import ProtocolError
from zpd.wire.status import ABORTED
from zpd.wire.protocol import KvFailed
from zpd.worker.jobs import DecodeJob, DecodePhase
from zpd.worker.links import PrefillLinks, well_formed
from zpd.worker.parts import first_token_problem, take_first_token

log = logging.getLogger("zpd.worker.decode")      # its lines are the decode scheduler's


class HeldJobs(Protocol):
    """What the decode scheduler lends its retraction: its jobs and prefill links are
    read, its `move`, `finish` and `release` called; a job's phase is never set here."""

    jobs: dict[int, DecodeJob]
    links: PrefillLinks

    def move(self, job: DecodeJob, phase: DecodePhase) -> None: ...

    def finish(self, job: DecodeJob, status: int, reason: str, tell_prefill: bool = False,
               may_land: bool = True) -> None: ...

    def release(self, job: DecodeJob, fence: bool) -> None: ...


class Retraction:
    """The decode's pause, retract and continue, over `sched` (a `HeldJobs`);
    `vocab` bounds the early tokens continue hands over."""

    def __init__(self, sched: HeldJobs, vocab: int) -> None:
        self.sched, self.vocab = sched, vocab
        self.live_prefills: list[str] | None = None            # from the router's continue

    def on_pause(self, mode: PauseMode) -> None:
        for job in list(self.sched.jobs.values()):
            job.deadline.suspend()             # a held request waits as long as the pause
            if mode is PauseMode.ABORT:
                self.sched.finish(job, ABORTED, "aborted by pause(abort)", tell_prefill=True)
            elif mode is PauseMode.RETRACT and job.phase is not DecodePhase.HELD:
                self.retract(job)

    def retract(self, job: DecodeJob) -> None:
        """Drop the request's KV and hold it; its last token is fed again after continue."""
        s = self.sched
        if job.phase is DecodePhase.TRANSFERRING:
            s.links.get(job.prefill).send(KvFailed(job.room, job.epoch, ABORTED, "retracted"))
        s.release(job, fence=job.write_may_land)
        s.move(job, DecodePhase.HELD)
        job.req.retractions += 1
        log.info("rid=%r room=%d epoch=%d retracted after %d tokens", job.req.rid, job.room,
                 job.epoch, len(job.req.output))

    def on_resume(self, cmd: Continue) -> int:
        """Re-admit held requests as a new epoch; they are recomputed by a live prefill."""
        prefills = cmd.prefills
        if prefills:
            live = [p for p in prefills if well_formed(p)]
            if len(live) < len(prefills):
                log.warning("continue: ignoring prefills that are no endpoints in %.200r", prefills)
            self.live_prefills = live or self.live_prefills
        jobs = self.sched.jobs
        held = sorted((j for j in jobs.values() if j.phase is DecodePhase.HELD),
                      key=lambda j: j.req.arrived)
        early = cmd.early or {}
        for job in held:
            self._take_early_token(job, early.get(job.req.rid))
        for job in jobs.values():
            job.deadline.resume()
        for job in held:
            job.epoch += 1
            self.sched.move(job, DecodePhase.WAITING)
        return len(held)

    def prefill_for(self, job: DecodeJob) -> str:
        """The request's own prefill, unless the router said it is gone after a pause."""
        live = self.live_prefills
        if job.epoch == 0 or not live or job.prefill in live:
            return job.prefill
        return live[job.room % len(live)]

    def _take_early_token(self, job: DecodeJob, got: object) -> None:
        """The client already has this request's first token (its prefill sent it to the
        router before the KV arrived here): resume after it, as after any token."""
        req = job.req
        if req.output or got is None:
            return
        try:
            first = FirstToken.from_wire(got)
            problem = first_token_problem(req, first, self.vocab)
        except ProtocolError as e:
            problem = str(e)
        if problem:
            log.warning("rid=%r: %s; ignored", req.rid, problem)
            return
        take_first_token(req, first)     # sent again with the next ones: the router passes it once
        log.info("rid=%r room=%d resumes after its first token %d (%s), which its prefill sent "
                 "ahead", req.rid, job.room, first.token, first.version)
