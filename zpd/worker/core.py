"""What prefill and decode workers share: model, KV pool, transport, socket, loop,
liveness, the pause state and the admin commands. The request state is the
scheduler's (zpd/worker/scheduler.py says what the two give each other). Optional
parts (trainer weight sync, zpd/worker/weights/) are plugged in by the assembly
(zpd/ops/worker.py) through `add_part`; the core never imports them."""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Iterator, Protocol

import zmq

import transport
from engines.compute import Compute
from engines.kv.layout import KVLayout
from engines.kv.pool import KVPool
from engines.loader import load_model
from zpd.wire.status import CONFLICT, StatusError
from engines.tp.transfer import LocalPool
from zpd.config import WorkerConfig
from zpd.env import Knobs, configure_engine
from zpd.wire.admin import (AdminCommand, Continue, Pause, Status, parse, split_timeout)
from zpd.wire.admin_fields import PauseMode, drops
from zpd.wire.admin_reply import AdminResult, Continued, Failed, WorkerStatus
from zpd.wire.loop import Loop
from zpd.wire.net import Router
from zpd.wire.protocol import Admin, AdminReply, Message, Ping, Pong, TokenPart, Tokens
from zpd.wire.step import MAX_BODIES, pack_step
from zpd.wire.router_proof import load_router_secret
from zpd.wire.security import WORKER_POLICY, Security
from zpd.worker.mem_fraction import kv_cache_mb
from zpd.worker.busy import BusyResponder
from zpd.worker.memory import MemoryPort, WeightsAndMemory
from zpd.worker.scheduler import Gate, Respond, Scheduler
from zpd.worker.compat import compat_hash
from zpd.worker.request_reading import RequestReading
from zpd.worker.tokenizing import Tokenizing

log = logging.getLogger("zpd.worker.core")

AdminHandler = Callable[[Any, Respond], None]     # (the parsed command, its answer)


class AdminPart(Protocol):
    """An optional part plugged into the core (`WorkerCore.add_part`): the admin
    commands it answers, its fields of `status`, and what it closes with the worker."""

    def commands(self) -> dict[type[AdminCommand], AdminHandler]: ...

    def status(self) -> dict: ...

    def close(self) -> None: ...


class WorkerCore(RequestReading):
    """The parts of a worker that are not request state. `backend` and `loop` may be
    given (tests run several workers in one process on a fake transport)."""

    def __init__(self, cfg: WorkerConfig, ctx: zmq.Context, backend: transport.Backend | None = None,
                 loop: Loop | None = None) -> None:
        self.cfg = cfg
        knobs = Knobs.from_environ()              # before the model loads: a bad value fails fast
        configure_engine()
        self.tp, self.tp_procs = None, []         # --tp > 1: the other ranks (engines/tp/)
        if cfg.tp > 1 or cfg.ep > 1:
            from engines.tp.spawn import lead
            self.model, self.tp, self.tp_procs = lead(cfg.model, cfg.device, cfg.dtype,
                                                      cfg.weight_version, cfg.overrides, cfg.tp,
                                                      ep=cfg.ep)
        else:
            self.model = load_model(cfg.model, cfg.device, cfg.dtype, cfg.weight_version,
                                    cfg.overrides)
        self.layout = KVLayout.for_model(self.model.cfg, cfg.page_size, self.model.dtype)
        kv_mb = kv_cache_mb(cfg.mem_fraction_static, cfg.kv_cache_mb, self.model.net,
                            self.model.device)
        self.pool = KVPool.with_budget(self.layout, kv_mb, self.model.dtype,
                                       self.model.device, clear_on_free=cfg.clear_freed_pages)
        self.compute = Compute(self.model, self.pool, self.tp, cfg.enable_return_routed_experts,
                               cfg.deterministic)
        self.backend = backend or transport.create_backend(
            cfg.transport, host=cfg.host, device_name=cfg.ib_device, protocol=cfg.protocol,
            transfer_timeout_s=cfg.deadlines.transfer * 0.75, fault_plan=knobs.fault_plan)
        for buf in self.rank_buffers:             # rank 0 writes and reads every rank's KV
            self.backend.register(buf.data_ptr(), buf.numel() * buf.element_size())
        self.security = Security(cfg.curve_keys, ctx,
                                 router_secret=load_router_secret(cfg.router_secret_file))
        # Our one ROUTER socket: the router process, decode peers and admins connect to it.
        self.sock = Router(ctx, cfg.host, cfg.port, self.security.server_options(WORKER_POLICY))
        self.endpoint = self.sock.endpoint
        self.loop = loop or Loop(busy_poll=cfg.deadlines.busy_poll_us / 1e6)
        self.compat_hash = compat_hash(self.model, self.layout, self.model.whole_cfg)
        # the other tensor-parallel ranks, as the memory and weight commands reach them
        self.ranks = self.compute.runner if self.tp is not None else None
        self.memory = WeightsAndMemory(self._memory_port())
        self.weight_listeners: list[Callable[[], None]] = []   # told of every weight change
        self.parts: dict[str, AdminPart] = {}     # optional parts, by name (`add_part`)
        self.paused: PauseMode | None = None
        self.drop_pauses = 0                      # pauses that drop requests begun so far
        self.pause_waiters: list[Respond] = []
        self.pinged_at: dict[bytes, float] = {}   # peer identity -> last message from it
        self.silent: dict[bytes, float] = {}      # peers found silent -> since, until heard
        self._checked_at = self.loop.time()       # the last peer check (a stall shows here)
        self.unreachable: set[bytes] = set()      # peers gone when our tokens were sent
        self.drops = knobs.drops
        self.slow_s = knobs.slow_s
        # peer -> its client (Generate.owner) -> rid -> tokens not sent yet
        self.outbox: dict[bytes, dict[str, dict[str, TokenPart]]] = {}
        self.scheduler: Scheduler | None = None
        self.handlers: dict[type[Message], Callable[[bytes, Message], None]] = {
            Ping: self._on_ping, Admin: self._on_admin}
        self.admin_commands: dict[type[AdminCommand], Callable[..., None]] = {
            Pause: self.pause, Continue: self.resume, Status: self.status,
            **self.memory.commands()}
        self.loop.add_socket(self.sock, self._on_socket)
        self.loop.every(cfg.deadlines.heartbeat, self._check_peers)
        if self.tp is not None:
            self.loop.every(cfg.deadlines.heartbeat, self._check_ranks)
        # Pings are answered during forwards longer than this, so a busy worker stays alive.
        self.responder = BusyResponder(self.sock, self._answer_while_busy,
                                       min(cfg.deadlines.heartbeat, cfg.deadlines.peer_timeout / 4))
        self.tokenizing = Tokenizing(self.loop)   # long prompts, off the scheduler thread

    def attach(self, scheduler: Scheduler) -> None:
        """Hand the core its scheduler; its handlers join the core's own."""
        overlap = set(scheduler.handlers) & set(self.handlers)
        if overlap:
            raise ValueError(f"the core already handles {sorted(c.TYPE for c in overlap)}")
        self.scheduler = scheduler
        self.handlers |= scheduler.handlers
        self.weight_listeners.append(scheduler.on_weights_changed)

    def add_part(self, name: str, part: AdminPart) -> None:
        """Plug in an optional part: its commands join the core's admin commands, its
        status fields the core's `status`, and it closes with the worker."""
        commands = part.commands()
        overlap = set(commands) & set(self.admin_commands)
        if overlap or name in self.parts:
            raise ValueError(f"part {name!r}: plugged in already, or it answers the core's "
                             f"commands {sorted(c.COMMAND for c in overlap)}")
        self.parts[name] = part
        self.admin_commands |= commands

    def _memory_port(self) -> MemoryPort:
        """What the memory commands act on; the scheduler's parts through lambdas, since
        it is attached after the core is built."""
        return MemoryPort(
            model=self.model, pool=self.pool, backend=self.backend, ranks=self.ranks,
            weights_root=self.cfg.weights_root, long_call=self.long_call,
            rank_buffers=lambda: self.rank_buffers, running_unpaused=self.running_unpaused,
            busy=lambda: self.scheduler.busy(), dropping=lambda: self.dropping,
            set_weights=self.set_weights, flush_cache=lambda: self.scheduler.flush_cache(),
            pages_in_use=lambda: self.scheduler.pages.in_use,
            memory_released=lambda: self.scheduler.on_memory_released(),
            memory_resumed=lambda: self.scheduler.on_memory_resumed())

    # --- the loop ------------------------------------------------------------------

    @property
    def rank_buffers(self) -> list:
        """Every tensor-parallel rank's KV pool, in rank order (ours alone at --tp 1)."""
        if self.tp is not None:
            return self.compute.runner.rank_buffers
        return [] if self.pool.buffer is None else [self.pool.buffer]

    def run(self, stop: threading.Event) -> None:
        """Until `stop`, or until a tensor-parallel rank is lost (`failure` says why)."""
        while not stop.is_set() and self.failure() is None:
            self.run_once()

    def failure(self) -> str | None:
        """Why this worker cannot go on: one of its other ranks died (`_check_ranks`,
        every heartbeat), or a collective failed (then the ranks are out of step for
        good); None while all is well. A field read: the loop asks every round."""
        return None if self.tp is None else self.tp.broken

    def _check_ranks(self) -> None:
        """Off the hot path, once a heartbeat: a rank process that exited breaks the group."""
        dead = next((p for p in self.tp_procs if p.exitcode is not None), None)
        if dead is not None and self.tp.broken is None and not self.tp.stopped:
            self.tp.broken = f"tensor-parallel rank process {dead.name} exited ({dead.exitcode})"

    def run_once(self, block: bool = True) -> None:
        """Poll sockets and fire due timers (waiting only when there is nothing to run),
        one scheduling round unless paused, answer a pause that has settled, emit."""
        runnable = self.gate is not Gate.PAUSED and self.scheduler.has_work()
        self.loop.run_once(max_wait=0 if runnable or not block else None)
        self.flush_tokens()          # e.g. first tokens from kv_done: before the step
        if self.gate is not Gate.PAUSED:     # a pause may have come with those messages
            self.scheduler.step()
        self._answer_pause_waiters()
        self.flush_tokens()

    @contextmanager
    def long_call(self) -> Iterator[None]:
        """Wrap a long call on the scheduler thread (a forward, a weight load): peers'
        pings are answered meanwhile; other messages wait for the loop, in order."""
        served = self.responder.served_calls
        try:
            with self.responder.busy():
                yield
                if self.slow_s:
                    time.sleep(self.slow_s)
        finally:
            if self.responder.served_calls != served:   # its poll may have taken the fd's edge
                self.loop.touch(self.sock)
            if self.responder.backlog:
                self.loop.call_soon_threadsafe(self._drain_backlog)   # even if the socket is quiet

    def _answer_while_busy(self, identity: bytes, msg: Message) -> bool:
        """On the responder thread: answer a ping now, unless the worker is failing (a
        rank lost or frozen: its peers must see it silent); keep anything else."""
        if isinstance(msg, Ping):
            if self.failure() is not None:
                return True
            self._on_ping(identity, msg)
            return True
        if identity in self.pinged_at:
            self.pinged_at[identity] = self.loop.time()
        return False

    def _drain_backlog(self) -> None:
        while self.responder.backlog:
            self._dispatch(*self.responder.backlog.popleft())

    # --- sending -------------------------------------------------------------------

    def send(self, identity: bytes, msg: Message) -> None:
        """Every message to a peer goes out here (ZPD_DROP_MESSAGES may lose it),
        after the tokens queued before it, so the peer sees them in order."""
        if self.outbox:
            self.flush_tokens()
        if not self.drops.drops(msg):
            self.sock.send(identity, msg)

    def queue_token(self, identity: bytes, part: TokenPart, owner: str = "") -> None:
        """Queue a request's new tokens for `flush_tokens`; a second part for the same
        rid before the flush is appended to the first. `owner`: the request's client
        at that router (Generate.owner; "" where unknown)."""
        parts = self.outbox.setdefault(identity, {}).setdefault(owner, {})
        old = parts.get(part.rid)
        if old is not None:
            part = old.then(part)
        parts[part.rid] = part

    def flush_tokens(self) -> None:
        """Send the queued tokens: one step per peer (a decode step's worth), one body
        in it per client, which the router passes on unread (zpd/wire/step.py)."""
        outbox, self.outbox = self.outbox, {}
        for identity, owners in outbox.items():
            bodies = [msg for msg in (Tokens.pack(list(parts.values()))
                                      for parts in owners.values()) if not self.drops.drops(msg)]
            for at in range(0, len(bodies), MAX_BODIES):
                if not self.sock.send_frames(identity, pack_step(bodies[at:at + MAX_BODIES])) \
                        and self.sock.last_send_unreachable:    # a decode keeps what ends for it
                    self.unreachable.add(identity)              # (zpd/worker/ha/adoption.py)

    # --- receiving -----------------------------------------------------------------

    def _on_socket(self) -> None:
        self._drain_backlog()               # what came during a long call goes first
        got = self.sock.recv()
        if got is not None:
            self._dispatch(*got)

    def _dispatch(self, identity: bytes, msg: Message) -> None:
        if identity in self.pinged_at:
            # Any message shows the peer is alive: a burst of requests queued ahead of
            # its ping must not make it look silent.
            self.pinged_at[identity] = self.loop.time()
        if self.unreachable:
            self.unreachable.discard(identity)
        handler = self.handlers.get(type(msg))
        if handler is None:
            log.warning("%s: dropping unexpected %s from %r", self.cfg.role, msg.TYPE, identity[:32])
            return
        try:
            handler(identity, msg)
        except Exception:     # the last line of defence: a handler's bug costs one message
            log.exception("%s: %s from %r failed; dropped", self.cfg.role, msg.TYPE, identity[:32])

    def _on_ping(self, identity: bytes, msg: Ping) -> None:
        """Also called on the responder thread: it sends straight to the socket (a pong's
        place among queued tokens does not matter), never through the token outbox."""
        self.pinged_at[identity] = self.loop.time()
        if identity in self.silent:             # back: the scheduler hears of it on the loop
            self.loop.call_soon_threadsafe(self._peer_back, identity)
        pong = Pong(msg.seq, msg.sent_at, self.endpoint)
        if not self.drops.drops(pong):
            self.sock.send(identity, pong)

    def _peer_back(self, identity: bytes) -> None:
        if self.silent.pop(identity, None) is not None:
            log.warning("%s: peer %r pings again", self.cfg.role, identity[:64])
            self.scheduler.on_peer_back(identity)

    def _check_peers(self) -> None:
        """Peers that used to ping us and stopped (a dead router): the scheduler ends
        their requests, and they are forgotten until they ping again. Silence counts
        only while we listened: after our own stall (SIGSTOP, swapping) what peers sent
        meanwhile is still unread, so the stall is added to every peer's time."""
        now, heartbeat = self.loop.time(), self.cfg.deadlines.heartbeat
        gap, self._checked_at = now - self._checked_at, now
        if gap > 2 * heartbeat:             # a long step too (the responder heard pings)
            if gap > self.cfg.deadlines.peer_timeout:
                log.warning("%s: the loop stood still for %.1f s; peers' silence counts "
                            "from now", self.cfg.role, gap)
            for peer, at in list(self.pinged_at.items()):
                self.pinged_at[peer] = min(at + gap - heartbeat, now)
        limit = now - self.cfg.deadlines.peer_timeout
        for peer in [p for p, at in self.pinged_at.items() if at < limit]:
            del self.pinged_at[peer]
            self.silent[peer] = now
            self.scheduler.on_peer_silent(peer)
        forget = now - self.cfg.deadlines.router_grace - self.cfg.deadlines.peer_timeout
        for peer in [p for p, since in self.silent.items() if since < forget]:
            del self.silent[peer]           # whatever it held ended long ago

    # --- admin ---------------------------------------------------------------------

    def _on_admin(self, identity: bytes, msg: Admin) -> None:
        def respond(ok: bool, result: AdminResult) -> None:
            self.send(identity, AdminReply(msg.req_id, ok, {"endpoint": self.endpoint,
                                                            "role": self.cfg.role}
                                           | result.to_wire()))
        known = {cls.COMMAND: cls for cls in self.admin_commands}
        if msg.command not in known:
            respond(False, Failed(400, f"unknown command {msg.command!r}; known: "
                                       f"{', '.join(sorted(known))}"))
            return
        log.info("admin %s %.400s", msg.command, dict(msg.args))     # bounded: payloads are MiBs
        try:
            cmd = parse(msg.command, split_timeout(msg.args, 0.0)[0])    # timeout: the caller's
            self.admin_commands[type(cmd)](cmd, respond)
        except StatusError as e:
            respond(False, Failed(e.status, str(e)))
        except Exception as e:  # an admin command must answer, whatever happened
            log.exception("admin %s failed", msg.command)
            respond(False, Failed(500, f"{type(e).__name__}: {e}"))

    def pause(self, cmd: Pause, respond: Respond) -> None:
        """Stop scheduling; answered once the scheduler is quiescent (no write of a
        retracted or aborted request can still land anywhere)."""
        mode = cmd.mode
        if self.paused not in (None, mode):
            raise StatusError(CONFLICT, f"already paused ({self.paused}); continue first")
        self.paused = mode
        self.drop_pauses += mode.drops
        self.scheduler.on_pause(mode)
        self.pause_waiters.append(respond)
        self._answer_pause_waiters()

    def _answer_pause_waiters(self) -> None:
        if self.pause_waiters and self.scheduler.quiescent():
            waiters, self.pause_waiters = self.pause_waiters, []
            for respond in waiters:
                respond(True, self.status_fields())

    def resume(self, cmd: Continue, respond: Respond) -> None:
        self.memory.require_resident("continue")
        was, self.paused = self.paused, None
        resumed = self.scheduler.on_resume(cmd)
        respond(True, Continued(self.status_fields(), was, resumed))

    def status(self, cmd: Status, respond: Respond) -> None:
        respond(True, self.status_fields())

    def status_fields(self) -> WorkerStatus:
        """This worker's part of `status` (docs/design.md, "Python client")."""
        fields = self.scheduler.status()
        # The page book's counts: free + held + fenced + cached == total is its invariant
        # (zpd/worker/pages.py checks it), each figure counted on its own.
        return WorkerStatus(
            weight_version=self.model.version, paused=self.paused, memory=self.memory.state,
            weights_memory=self.memory.weights_state, device=str(self.pool.device),
            dtype=str(self.model.dtype).removeprefix("torch."),
            context_length=self.model.cfg.max_position, max_batch=self.cfg.max_batch,
            kv_pages=self.scheduler.pages.counts(),
            # tensor-parallel ranks, and the processes of ranks 1.. (rank 0 is this one)
            tp_size=self.cfg.tp, tp_pids=[p.pid for p in self.tp_procs],
            loop_max_late_ms=round(self.loop.max_late * 1e3, 3), ep_size=self.cfg.ep,
            deterministic=self.cfg.deterministic,
            more={k: v for part in self.parts.values() for k, v in part.status().items()}
            | fields)

    @property
    def dropping(self) -> bool:
        """A pause that drops in-flight requests (retract, abort) is in force."""
        return drops(self.paused)

    @property
    def gate(self) -> Gate:
        """May this worker schedule? Every question of it reads this."""
        return Gate.of(self.paused, self.memory.released)

    def schedulable(self) -> bool:
        """A round may admit requests: the gate is open."""
        return self.gate is Gate.OPEN

    def running_unpaused(self) -> bool:
        """Requests are in flight and no pause holds them: a weight or cache change
        now would land under their feet (409, pause first)."""
        return self.gate is not Gate.PAUSED and self.scheduler.busy()

    def set_weights(self, version: str | None) -> str:
        """The one writer of the weight version, for every path that changes the weights
        (a checkpoint, a push's commit) or their name: the version becomes `version`
        (None: kept), and every listener hears of it (the scheduler drops KV computed
        under the old weights). Returns the version now."""
        if version is not None:
            self.model.version = version
        for listener in self.weight_listeners:
            listener()
        return self.model.version

    @property
    def rank_pools(self) -> list[LocalPool]:
        """Every tensor-parallel rank's KV pool and the model's kv heads it holds, in rank
        order: what our KV writes read and our hello announces (engines/tp/transfer.py).
        At --tp 1 our one pool, of every kv head."""
        shard, whole = self.model.shard, self.model.whole_cfg
        if shard is None:
            return [LocalPool(range(whole.num_kv_heads), self.memory.pool_addr, self.pool.buffer)]
        return [LocalPool(replace(shard.plan, rank=r).kv_heads(whole), buf.data_ptr(), buf)
                for r, buf in enumerate(self.rank_buffers)]

    # --- process ---------------------------------------------------------------------

    def close(self) -> None:
        if self.tp is not None:
            from engines.tp.spawn import stop
            stop(self.tp, self.tp_procs)
        self.tokenizing.close()
        for part in self.parts.values():
            part.close()
        self.responder.close()
        self.backend.close()
        self.sock.close()
        self.loop.close()
        self.security.close()
