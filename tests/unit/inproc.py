"""A whole cluster in one process, for fast deterministic tests of the handoff.

The real router, prefill and decode schedulers and worker cores, talking over
inproc ZeroMQ sockets of one context; KV moves through the fake transport (one
FakeFabric: real bytes copied between the two KV pools); every loop runs on one
manual clock, so deadlines and heartbeats fire when a test moves time, not when
the machine is slow. `pump` turns every loop once, without blocking.
"""
from __future__ import annotations

import itertools
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import zmq

import transport
from engines.loader import load_model
from engines.offline import OfflineEngine
from engines.request import Request
from engines.sampler import SamplingParams
from zpd.config import Deadlines, RouterConfig, WorkerConfig
from zpd.ops.router import build_router
from zpd.ops.worker import build_worker, decode_scheduler
from zpd.wire.loop import Loop
from zpd.wire.net import Dealer
from zpd.wire.protocol import Abort, Accepted, Admin, AdminReply, Generate, Pong, Rows, Tokens, encode
from zpd.wire.rows import RowsInbox
from zpd.wire.router_proof import write_router_secret
from zpd.worker.core import WorkerCore
from zpd.worker.prefill import PrefillScheduler

DEADLINES = Deadlines(transfer=20.0, heartbeat=0.5, peer_timeout=2.0)
_names = itertools.count()


class Clock:
    """The manual clock of every loop in the cluster."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now



def send_raw(dealer: Dealer, msg: Generate, sampling: dict) -> None:
    """Send `msg` with `sampling` in place of its record, unchecked: what a client that
    skips the check (or a hostile one) puts on the wire."""
    frames = encode(msg)
    header = orjson.loads(frames[0]) | {"sampling": sampling}
    dealer.socket.send_multipart([orjson.dumps(header), *frames[1:]])

@dataclass
class Answer:
    """What the client got for one request."""
    token_ids: list[int] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    finish: dict | None = None
    meta: dict = field(default_factory=dict)
    logprobs: list[float] | None = None            # None: no part carried any
    top_logprobs: list[list[tuple[int, float]]] | None = None
    ids_logprobs: list[list[float]] | None = None   # token_ids_logprob's, per token

    @property
    def status(self) -> int | None:
        return None if self.finish is None else self.finish.get("status_code")


class InprocCluster:
    """Router + one prefill + one decode (tiny model unless `model`, float64) in this process."""

    def __init__(self, complete_after_polls: int = 0, fault_plan=None, kv_cache_mb: float = 1.0,
                 max_batch: int = 8, clear_freed_pages: bool = False,
                 router_args: dict | None = None, model: str = "tiny",
                 prefix_cache: bool = True, dtype: str = "float64", tp: tuple[int, int] = (1, 1),
                 ep: tuple[int, int] = (1, 1), routed_experts: bool = False) -> None:
        """`tp`, `ep`: the prefill's and the decode's tensor- and expert-parallel ranks
        (more than one starts processes for the others, engines/tp/). `routed_experts`:
        the workers' --enable-return-routed-experts."""
        self.ctx = zmq.Context()
        self.dtype = dtype
        self.model = model
        self.clock = Clock()
        self.fabric = transport.FakeFabric()
        tag = next(_names)
        self.clear_freed_pages, self.prefix_cache, self.tp = clear_freed_pages, prefix_cache, tp
        self.routed_experts = routed_experts
        self.ep = ep
        # what `zpd launch` hands its routers and workers (zpd/wire/router_proof.py)
        self.secret_dir = tempfile.mkdtemp(prefix="zpd-inproc-")
        self.secret_file = str(write_router_secret(Path(self.secret_dir) / "router.secret"))
        self.prefill = self._worker("prefill", f"inproc://p{tag}", complete_after_polls, fault_plan,
                                    kv_cache_mb, max_batch)
        self.decode = self._worker("decode", f"inproc://d{tag}", 0, None, kv_cache_mb, max_batch)
        self.router = build_router(RouterConfig((self.prefill.endpoint,), (self.decode.endpoint,),
                                                host=f"inproc://r{tag}", heartbeat=0.5,
                                                peer_timeout=2.0, router_secret_file=self.secret_file,
                                                **(router_args or {})),
                                   self.ctx, Loop(clock=self.clock))
        self.client = Dealer(self.ctx, self.router.endpoint, identity=b"client")
        self.answers: dict[str, Answer] = {}
        self.rows = RowsInbox()                # routed experts ahead of their final part
        self.replies: dict[str, dict] = {}
        self.accepted: set[str] = set()        # rids the router acknowledged
        self.pong: Pong | None = None          # the router's last answer to our Ping
        self.silent: set[str] = set()          # roles whose loops are not turned
        self.rids = itertools.count()

    def _worker(self, role: str, host: str, polls: int, plan, kv_mb: float, max_batch: int) -> WorkerCore:
        cfg = WorkerConfig(role=role, model=self.model, host=host, dtype=self.dtype, kv_cache_mb=kv_mb,
                           max_batch=max_batch, transport="fake", deadlines=DEADLINES,
                           clear_freed_pages=self.clear_freed_pages, prefix_cache=self.prefix_cache,
                           tp=self.tp[role == "decode"], ep=self.ep[role == "decode"],
                           router_secret_file=self.secret_file,
                           enable_return_routed_experts=self.routed_experts)
        backend = transport.FakeBackend(self.fabric, complete_after_polls=polls)
        if plan is not None:
            backend = transport.FaultyBackend(backend, plan)
        make = PrefillScheduler if role == "prefill" else decode_scheduler
        return build_worker(cfg, self.ctx, make, backend=backend, loop=Loop(clock=self.clock))

    # --- driving ---------------------------------------------------------------------

    def pump(self, rounds: int = 30) -> None:
        """Turn every loop `rounds` times (messages, timers, a scheduling round each)."""
        for _ in range(rounds):
            if "router" not in self.silent:
                self.router.loop.run_once(max_wait=0)
            for core in (self.prefill, self.decode):
                if core.cfg.role not in self.silent:
                    core.run_once(block=False)
            self._read_client()

    def advance(self, seconds: float, step: float = 0.25) -> None:
        """Move the clock by `seconds`, pumping at every `step` so heartbeats flow."""
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.clock.now = min(end, self.clock.now + step)
            self.pump(3)

    def until(self, done, rounds: int = 400, patience_s: float = 20.0) -> None:
        """Pump until done(); past `rounds`, keep going for `patience_s` of wall time,
        since some work (a weight push, a busy responder) runs on threads that a
        loaded machine may not schedule within the rounds."""
        for _ in range(rounds):
            if done():
                return
            self.pump(1)
        give_up = time.monotonic() + patience_s
        while time.monotonic() < give_up:
            if done():
                return
            self.pump(1)
            time.sleep(0.001)
        raise AssertionError("the cluster did not get there")

    def _read_client(self) -> None:
        while True:
            msg = self.client.recv()
            if msg is None:
                return
            if isinstance(msg, AdminReply):
                self.replies[msg.req_id] = {"ok": msg.ok} | msg.result
                continue
            if isinstance(msg, Accepted):
                self.accepted.update(msg.rids)
                continue
            if isinstance(msg, Pong):
                self.pong = msg               # the router's boot id, as a client learns it
                continue
            if isinstance(msg, Rows):
                self.rows.take(msg)
                continue
            for part in msg.unpack() if isinstance(msg, Tokens) else []:
                part = self.rows.finish(part)
                got = self.answers.setdefault(part.rid, Answer())
                if part.start is not None and part.start < len(got.token_ids):   # had those
                    part = part.skip(min(len(got.token_ids) - part.start, len(part.token_ids)))
                got.token_ids += part.token_ids
                got.weight_versions += part.weight_versions
                if part.logprobs is not None:
                    got.logprobs = (got.logprobs or []) + part.logprobs
                if part.top_logprobs is not None:
                    got.top_logprobs = (got.top_logprobs or []) + part.top_logprobs
                if part.ids_logprobs is not None:
                    got.ids_logprobs = (got.ids_logprobs or []) + part.ids_logprobs
                if part.finished:
                    got.finish, got.meta = part.finish, part.meta

    # --- client side -------------------------------------------------------------------

    def submit(self, prompt: list[int], max_new: int = 8, stream: bool = True, rid: str | None = None,
               sampling: dict | SamplingParams | None = None) -> str:
        """Greedy, ignoring EOS, unless `sampling` says otherwise (sent as it is: the
        router's decode checks it)."""
        rid = rid or f"r{next(self.rids)}"
        if isinstance(sampling, SamplingParams):
            sampling = sampling.to_wire()
        send_raw(self.client, Generate(rid, prompt, stream=stream), {
            "temperature": 0, "max_new_tokens": max_new, "ignore_eos": True} | (sampling or {}))
        return rid

    def abort(self, rid: str) -> None:
        self.client.send(Abort(rid, 499, "test abort"))

    def admin(self, command: str, wait: bool = True, **args) -> str | dict:
        req_id = f"a{next(self.rids)}"
        self.client.send(Admin(command, args, req_id))
        if not wait:
            return req_id
        self.until(lambda: req_id in self.replies)
        return self.replies[req_id]

    def finished(self, rid: str) -> bool:
        return rid in self.answers and self.answers[rid].finish is not None

    def run(self, rid: str, rounds: int = 400) -> Answer:
        self.until(lambda: self.finished(rid), rounds)
        return self.answers[rid]

    # --- checks ------------------------------------------------------------------------

    def serves_again(self, prompt: list[int] = (5, 17, 99, 3, 42)) -> None:
        """A short greedy request equals `zpd run`'s answer, and every page comes back."""
        rid = self.submit(list(prompt), 4)
        assert self.run(rid).token_ids == reference(self, list(prompt), 4)
        self.check_pages()

    def pages(self, core: WorkerCore) -> dict:
        return core.status_fields().to_wire()["kv_pages"]

    def check_pages(self, idle: bool = True) -> None:
        """free + held + fenced + cached == total on both workers (and the page book's
        own check); with `idle`, every page free or cached (no request's, no fence's)."""
        for core in (self.prefill, self.decode):
            core.scheduler.pages.check()
            p = self.pages(core)
            assert p["free"] + p["held"] + p["fenced"] + p["cached"] == p["total"], (core.cfg.role, p)
            if idle:
                assert p["free"] + p["cached"] == p["total"], (core.cfg.role, p)

    def close(self) -> None:
        if self.ctx.closed:
            return                                 # closed already (a test may close early)
        self.client.close()
        self.router.close()
        for core in (self.prefill, self.decode):
            core.scheduler.close()
            core.close()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.secret_dir, ignore_errors=True)


def reference(cluster: InprocCluster, prompt: list[int], max_new: int) -> list[int]:
    """`zpd run`'s greedy tokens for the same model (the prefill's weights; the whole
    model where the prefill holds one tensor-parallel rank's part)."""
    model = cluster.prefill.model
    if model.shard is not None:
        model = load_model(cluster.model, dtype=cluster.dtype, version=model.version)
    engine = OfflineEngine(model, kv_cache_mb=1)
    params = SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)
    return engine.run([Request("ref", prompt, params)])[0]["output_ids"]
