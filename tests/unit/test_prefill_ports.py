"""The prefill's intake (zpd/worker/dests.py) and writes (zpd/worker/writes.py) driven
through their ports alone: fakes of the scheduler's jobs and calls, a recording
transport, no worker core, no sockets. A job's KV goes only to the pages its room's
decode announced, and a failed write ends the job with the transport's reason."""
from __future__ import annotations

import torch

import transport
from engines.kv.layout import KVLayout
from engines.request import Request
from engines.sampler import SamplingParams
from engines.tp.transfer import LocalPool
from zpd.wire.protocol import Hello, HelloAck, KvDest, KvDone, KvFailed
from zpd.wire.status import INTERNAL
from zpd.worker.dests import DestPort, KvDests
from zpd.worker.jobs import JobPhase, PrefillJob
from zpd.worker.peers import FORBIDDEN, DecodePeers
from zpd.worker.tombstones import Tombstones
from zpd.worker.writes import KvWrites, WritePort

LAYOUT = KVLayout(num_layers=1, page_size=4, num_kv_heads=2, head_dim=8, dtype="float32",
                  element_bytes=4)
OURS = LocalPool(range(0, 2), 0x1000, torch.zeros(8, 1, 2, 4, 2, 8))
THEIR_BASE = 0x100000
DECODE, OTHER = b"decode-1", b"decode-2"


class Recorder:
    """A transport that keeps what it was asked and completes on demand."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, str, list]] = []
        self.done: list[transport.Completion] = []
        self.registered: list[tuple[int, int]] = []

    def register(self, addr: int, length: int) -> None:
        self.registered.append((addr, length))

    def write(self, transfer_id: int, peer: str, runs: list) -> None:
        self.writes.append((transfer_id, peer, runs))

    def poll_completions(self) -> list[transport.Completion]:
        done, self.done = self.done, []
        return done

    def fileno(self) -> int:
        return -1


class Prefill:
    """The scheduler's side of both ports: its jobs and what it is asked to do."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, object]] = []
        self.ended: list[tuple[PrefillJob, int | None, str]] = []
        self.jobs: dict[int, PrefillJob] = {}
        self.backend = Recorder()
        self.peers = DecodePeers(LAYOUT, "prefill-session", self.send)
        self.writes = KvWrites(WritePort(
            self.backend, lambda: [OURS], self.peers, LAYOUT.page_size, self.send,
            lambda: "v1", lambda job: self.dests.problem(job), self.move, self.end,
            lambda job: None))
        self.dests = KvDests(DestPort(
            self.jobs, Tombstones(loop=None, seconds=60.0), self.peers, self.send,
            lambda: False, lambda tokens: -(-tokens // LAYOUT.page_size), self.new_job,
            self.move, self.end, self.writes.start, "hash", "us", lambda session: None,
            lambda ok, reason: HelloAck(ok, LAYOUT, "hash", "prefill-session",
                                        [OURS.announced()], 8, "v1", reason)))

    def send(self, identity: bytes, msg: object) -> None:
        self.sent.append((identity, msg))

    def new_job(self, room: int, epoch: int) -> PrefillJob:
        self.jobs[room] = PrefillJob(room, epoch, deadline=None)
        return self.jobs[room]

    def move(self, job: PrefillJob, phase: JobPhase) -> None:
        job.phase = phase

    def end(self, job: PrefillJob, status: int | None, reason: str) -> None:
        self.jobs.pop(job.room, None)
        self.ended.append((job, status, reason))

    def hello(self, identity: bytes, endpoint: str, session: str) -> None:
        self.dests.on_hello(identity, Hello(endpoint, LAYOUT, "hash", session,
                                            [[0, 2, THEIR_BASE]], 8, "v1"))

    def computed(self, room: int, prompt: int = 6) -> PrefillJob:
        """A job whose request came and whose KV is computed into pages 2 and 3."""
        job = self.jobs.get(room) or self.new_job(room, 0)
        job.req = Request(f"r{room}", list(range(1, prompt + 1)), SamplingParams())
        job.req.pages = [2, 3]
        job.req.output.append(42)
        job.marks |= {"queued": 1.0, "forward": 2.0, "computed": 3.0}
        job.phase = JobPhase.COMPUTED
        return job


def _sent(prefill: Prefill, kind: type) -> list[tuple[bytes, object]]:
    return [(who, m) for who, m in prefill.sent if isinstance(m, kind)]


def test_the_kv_goes_to_the_pages_the_rooms_decode_announced():
    p = Prefill()
    p.hello(DECODE, "10.0.0.2:5001", "decode-session")
    assert _sent(p, HelloAck)[0][1].ok
    p.dests.on_kv_dest(DECODE, KvDest(7, 0, "r7", page_ids=[5, 1]))   # before the request
    job = p.jobs[7]
    assert job.phase is JobPhase.STASHED and job.dest is None
    p.computed(7)
    p.dests.pair(job, "tcp://10.0.0.2:5001")
    assert job.phase is JobPhase.WRITING and job.decode == DECODE
    (tid, session, runs), = p.backend.writes
    page = LAYOUT.page_bytes
    assert session == "decode-session"
    assert runs == [(OURS.base_addr + 2 * page, THEIR_BASE + 5 * page, page),
                    (OURS.base_addr + 3 * page, THEIR_BASE + 1 * page, page)]
    p.backend.done.append(transport.Completion(tid, True, "", 2 * page, 0.001))
    p.writes.on_completions()
    (to, done), = _sent(p, KvDone)
    assert to == DECODE and (done.room, done.epoch, done.first_token) == (7, 0, 42)
    assert p.ended == [(job, None, "")] and not p.writes


def test_a_kv_dest_from_another_decode_is_refused_and_nothing_is_written():
    p = Prefill()
    p.hello(DECODE, "10.0.0.2:5001", "decode-session")
    p.hello(OTHER, "10.0.0.3:5001", "other-session")
    job = p.computed(7)
    p.dests.pair(job, "10.0.0.2:5001")
    p.dests.on_kv_dest(OTHER, KvDest(7, 0, "r7", page_ids=[0, 1]))
    (to, refused), = _sent(p, KvFailed)
    assert to == OTHER and refused.status == FORBIDDEN
    assert p.backend.writes == [] and job.phase is JobPhase.COMPUTED
    p.dests.on_kv_dest(b"stranger", KvDest(8, 0, "r8", page_ids=[0]))
    assert _sent(p, KvFailed)[-1][1].reason == "kv_dest before hello"


def test_a_failed_write_ends_the_job_with_the_transports_reason():
    p = Prefill()
    p.hello(DECODE, "10.0.0.2:5001", "decode-session")
    job = p.computed(7)
    p.dests.pair(job, "10.0.0.2:5001")
    p.dests.on_kv_dest(DECODE, KvDest(7, 0, "r7", page_ids=[0, 1]))
    (tid, _, _), = p.backend.writes
    p.backend.done.append(transport.Completion(tid, False, "timeout", 1024, 1.0))
    p.writes.on_completions()
    assert p.ended == [(job, INTERNAL, "KV transfer failed: timeout")]
    assert p.writes.counters["kv_transfer_failures"] == 1 and not _sent(p, KvDone)


def test_a_kv_dest_outside_the_decodes_pool_ends_the_job_before_any_write():
    p = Prefill()
    p.hello(DECODE, "10.0.0.2:5001", "decode-session")
    job = p.computed(7)
    p.dests.pair(job, "10.0.0.2:5001")
    p.dests.on_kv_dest(DECODE, KvDest(7, 0, "r7", page_ids=[0, 8]))
    assert p.backend.writes == []
    assert p.ended == [(job, INTERNAL, "page id 8 is outside the decode's pool of 8 pages")]
