"""Several routers over one pool of workers (active-active).

Each request belongs to the router that routed it: workers answer the router that
sent each request, so routers share nothing per request. What must hold across the
whole pool, one router coordinates and the others (started with `--coordinator
HOST:PORT`) follow:

- pauses and weight pushes: before the coordinator pauses the workers or stages a
  push, every follower holds its new requests (its queue waits, as the coordinator's
  does) and says so; after continue, or the push's end, they route again. A follower
  learns the coordinator's state from each answer to its heartbeat too, so a lost or
  late word mends itself within a heartbeat;
- continue: the first tokens a follower's clients got from a prefill (ahead of the
  KV) go with the coordinator's to the decodes, which resume after them;
- abort_all ends every router's requests, and abort finds a rid on any router;
- the admin commands a follower's clients send it, but for `status` and an abort of
  its own rid, go to the coordinator, whose answer comes back through the follower:
  any router is an admin entry point. With the coordinator silent they get 503;
  requests keep being served.

Router to router is the admin plane: `Admin` envelopes with two commands of their
own, FOLLOW (follower to coordinator) and STATE (coordinator to follower), over the
coordinator's client socket. Only a proven router may send FOLLOW there: under
CURVE a cluster key, without keys a router whose identity carries the tag of the
cluster's --router-secret-file (zpd/wire/router_proof.py); a client that could
follow would make every pause wait for it and every update refuse (409).
"""
from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass
from typing import Callable, Collection, Protocol

from zpd.config import RouterConfig
from zpd.router.flights import Fanout, InFlight
from zpd.router.hooks import Acks
from zpd.router.memory import ReleasedMemory
from zpd.wire.admin_fields import PauseMode
from zpd.wire.liveness import PeerClock
from zpd.wire.loop import Loop, Timer
from zpd.wire.net import Dealer
from zpd.wire.protocol import Admin, AdminReply, Message
from zpd.wire.router_proof import router_endpoint

log = logging.getLogger("zpd.router.ha.peers")

FOLLOW = "follow"          # follower -> coordinator each heartbeat: {endpoint, inflight}
STATE = "router_state"     # coordinator -> follower: {paused, pushing, memory_released, early}
MAX_FOLLOWERS = 64         # identities that may follow at once (a flood of them is refused)
MAX_INFLIGHT = 1 << 20     # what a follower may say it routes (its queue and shares are less)
LOCAL = ("status",)        # what a follower answers itself
RUN_FOR_COORDINATOR = ("abort", "abort_all")   # what the coordinator has its followers run



class Front(Protocol):
    """The router's client socket, where followers and their coordinator's words come."""

    def send(self, identity: bytes, msg: Message) -> bool: ...


class Led(Protocol):
    """What the coordinator's side reads of its router (RouterServer is one)."""
    cfg: RouterConfig
    front: Front
    loop: Loop
    paused: PauseMode | None
    released: ReleasedMemory           # workers whose memory is released

    @property
    def pushing(self) -> bool: ...


class Runs(Protocol):
    """The follower's admin: its clients' first tokens; what the coordinator has it run."""

    def early_tokens(self) -> dict: ...

    def on_admin(self, client: bytes, msg: Admin,
                 answer: Callable[[AdminReply], object] | None = None) -> None: ...


class Following(Led, Protocol):
    """What the follower's side reads and changes of its router (RouterServer is one)."""
    endpoint: str
    inflight: dict[str, InFlight]
    admin: Runs

    @property
    def queued(self) -> Collection[str]: ...

    @property
    def holding(self) -> bool: ...

    def hold(self, mode: PauseMode) -> None: ...

    def unpause(self) -> None: ...

    def dispatch(self) -> None: ...

    def end_queued(self, rid: str, status: int, reason: str) -> None: ...


@dataclass(eq=False)
class Follower:
    """A router following this one, as the coordinator sees it."""
    identity: bytes
    endpoint: str
    clock: PeerClock
    inflight: int = 0          # its requests routed to the workers, as it last said


class Followers:
    """The coordinator's side: who follows, and telling them its state."""

    def __init__(self, server: Led) -> None:
        self.server = server
        self.known: dict[bytes, Follower] = {}
        self.asking: dict[str, Fanout[dict]] = {}
        self.ids = itertools.count(1)

    def on_admin(self, identity: bytes, msg: Admin) -> bool:
        """Take a router's FOLLOW (False: not one, an admin command for this router)."""
        if msg.command != FOLLOW:
            return False
        self.on_follow(identity, msg)
        return True

    def on_follow(self, identity: bytes, msg: Admin) -> None:
        """A follower's heartbeat: remember it, answer with the state to follow."""
        server, now = self.server, self.server.loop.time()
        endpoint, inflight = msg.args.get("endpoint"), msg.args.get("inflight")
        problem = follow_problem(identity, endpoint, inflight)
        if problem is not None:
            log.warning("follow from %r refused: %s", identity[:64], problem)
            server.front.send(identity, AdminReply(msg.req_id, False, {"status": 400, "error": problem}))
            return
        got = self.known.get(identity)
        if got is None:
            if len(self.known) >= MAX_FOLLOWERS:
                server.front.send(identity, AdminReply(msg.req_id, False, {
                    "status": 503, "error": f"{MAX_FOLLOWERS} routers follow already"}))
                return
            log.warning("router %s follows this one", endpoint[:80])
            got = self.known[identity] = Follower(identity, endpoint[:200], PeerClock(now))
        got.clock.heard(now)
        got.inflight = inflight
        server.front.send(identity, AdminReply(msg.req_id, True, self.state()))

    def state(self) -> dict:
        server = self.server
        return {"paused": server.paused.value if server.paused else None,
                "pushing": server.pushing, "memory_released": bool(server.released)}

    def expire(self, now: float) -> None:
        """Each heartbeat: forget a follower silent past --peer-timeout (it sends its
        FOLLOW each heartbeat of its own, so waiting for one is our ping)."""
        for identity, f in list(self.known.items()):
            f.clock.pinged(now)
            if f.clock.silent(now, self.server.cfg.peer_timeout):
                log.error("router %s stopped following (silent %.1f s)", f.endpoint,
                          f.clock.silence(now))
                del self.known[identity]

    def inflight(self) -> int:
        """Requests the followers have routed, as they last said."""
        return sum(f.inflight for f in self.known.values())

    def fields(self) -> list[dict]:
        return [{"endpoint": f.endpoint, "inflight": f.inflight} for f in self.known.values()]

    # --- asking every follower --------------------------------------------------------

    def tell(self, then: Acks, timeout: float, early: bool = False) -> None:
        """Send the state now; `then(acks)` once every follower confirmed it (each ack:
        endpoint, ok, and with `early`, its first tokens) or `timeout` passed."""
        self.ask(STATE, self.state() | {"early": early}, then, timeout)

    def ask(self, command: str, args: dict, then: Acks, timeout: float) -> None:
        key = f"peers-{next(self.ids)}"
        asking = self.asking[key] = Fanout(then, set(self.known))
        for identity in self.known:
            self.server.front.send(identity, Admin(command, args, key))
        if not asking.waiting:
            self._done(key)
        else:
            asking.timer = self.server.loop.call_later(timeout, self._done, key)

    def on_reply(self, identity: bytes, msg: AdminReply) -> bool:
        """Take a follower's answer; False: not one this side waits for."""
        asking, follower = self.asking.get(msg.req_id), self.known.get(identity)
        if asking is None or follower is None or identity not in asking.waiting:
            return False
        asking.waiting.discard(identity)
        follower.clock.heard(self.server.loop.time())
        inflight = msg.result.get("inflight")
        if type(inflight) is int and 0 <= inflight <= MAX_INFLIGHT:
            follower.inflight = inflight
        asking.replies.append(msg.result | {"ok": msg.ok, "endpoint": follower.endpoint})
        if not asking.waiting:
            self._done(msg.req_id)
        return True

    def _done(self, key: str) -> None:
        asking = self.asking.pop(key, None)
        if asking is None:
            return
        if asking.timer is not None:
            asking.timer.cancel()
        late = [self.known[i].endpoint for i in asking.waiting if i in self.known]
        if late:
            log.error("routers %s did not confirm in time", ", ".join(late))
        asking.on_done(asking.replies + [{"ok": False, "endpoint": ep, "status": 504,
                                       "error": "no answer before the timeout"} for ep in late])


def follow_problem(identity: bytes, endpoint: object, inflight: object) -> str | None:
    """What is wrong with a FOLLOW's fields (None: nothing). Its sender is a proven router
    already (the socket's guard: zpd/wire/security.py ROUTER_POLICY); the endpoint it
    reports must be the one its identity names, so one router follows only once."""
    if type(endpoint) is not str or type(inflight) is not int or not 0 <= inflight <= MAX_INFLIGHT:
        return f"follow needs 'endpoint' (a string) and 'inflight' (0 to {MAX_INFLIGHT})"
    if router_endpoint(identity) != endpoint.encode():
        return "follow's 'endpoint' is not the endpoint of the router that sends it"
    return None


class CoordinatorLink:
    """The follower's side: its link to the coordinator, the state it follows, and the
    admin commands it passes on."""

    def __init__(self, server: Following, endpoint: str, dealer: Dealer) -> None:
        self.server, self.endpoint, self.dealer = server, endpoint, dealer
        self.clock = PeerClock(server.loop.time())
        self.pushing = False                   # the coordinator pushes weights: hold
        self.memory_released = False           # the workers' memory is released: hold
        self.passed: dict[str, tuple[bytes, Admin, Timer]] = {}   # our req_id -> the client's
        self.ids = itertools.count(1)
        self.tag = os.urandom(4).hex()         # our req_ids cannot be guessed by a client
        server.loop.add_socket(dealer, self.on_message)
        self.send_follow()                     # known to the coordinator before routing anything

    @property
    def alive(self) -> bool:
        return not self.clock.silent(self.server.loop.time(), self.server.cfg.peer_timeout)

    def heartbeat(self) -> None:
        self.send_follow()
        if self.server.holding and not self.alive:
            self.stranded()

    def send_follow(self) -> None:
        server = self.server
        self.clock.pinged(server.loop.time())
        self.dealer.send(Admin(FOLLOW, {"endpoint": server.endpoint,
                                        "inflight": len(server.inflight)}, FOLLOW))

    def stranded(self) -> None:
        """We hold for a coordinator that fell silent (killed, frozen, cut off) in a pause
        or a push: only it can end that, so what waits here would wait for as long as it
        stays away, its queue clock stopped. End it (503, retry later) instead; requests
        that come meanwhile end at the next heartbeat, and all runs again once the
        coordinator answers and says the pool runs."""
        waiting = list(self.server.queued)
        if waiting:
            log.error("coordinator %s silent while the pool is paused: ending the %d requests "
                      "waiting here with 503", self.endpoint, len(waiting))
        reason = f"coordinator {self.endpoint} is unavailable while the pool is paused"
        for rid in waiting:
            self.server.end_queued(rid, 503, reason)

    def on_message(self) -> None:
        msg = self.dealer.recv()
        if msg is None:
            return
        self.clock.heard(self.server.loop.time())
        if isinstance(msg, AdminReply) and msg.req_id == FOLLOW:
            if msg.ok:
                self.follow(msg.result)
            else:
                log.error("coordinator %s refuses this router: %s", self.endpoint,
                          msg.result.get("error"))
        elif isinstance(msg, AdminReply):
            self.answered(msg)
        elif isinstance(msg, Admin) and msg.command == STATE:
            self.follow(msg.args)
            server = self.server
            self.dealer.send(AdminReply(msg.req_id, True, {
                "inflight": len(server.inflight),
                "early": server.admin.early_tokens() if msg.args.get("early") is True else {}}))
        elif isinstance(msg, Admin) and msg.command in RUN_FOR_COORDINATOR:
            self.server.admin.on_admin(b"", msg, answer=self.dealer.send)
        else:
            log.warning("dropping unexpected %s from coordinator %s", msg.TYPE, self.endpoint)

    def follow(self, state: dict) -> None:
        """Take the coordinator's state: hold new requests while it is paused or pushes."""
        server = self.server
        try:
            paused = None if state.get("paused") is None else PauseMode(state["paused"])
        except ValueError:
            log.error("coordinator %s sent pause mode %.40r", self.endpoint, state.get("paused"))
            return
        was, self.pushing = server.holding, state.get("pushing") is True
        self.memory_released = state.get("memory_released") is True
        if paused is not None and server.paused is None:
            log.warning("paused (%s) by coordinator %s", paused.value, self.endpoint)
            server.hold(paused)
        elif paused is None and server.paused is not None:
            log.warning("continued by coordinator %s", self.endpoint)
            server.unpause()
        elif was and not server.holding:
            server.dispatch()

    # --- passing admin commands on ------------------------------------------------------

    def passes(self, command: str, args: dict) -> bool:
        """Does the coordinator answer this command (not this router)?"""
        if command in LOCAL:
            return False
        rid = args.get("rid")
        return not (command == "abort" and (rid in self.server.inflight or rid in self.server.queued))

    def pass_on(self, client: bytes, msg: Admin, timeout: float) -> None:
        if not self.alive:
            self.server.front.send(client, AdminReply(msg.req_id, False, {
                "status": 503, "router": self.server.endpoint,
                "error": f"coordinator {self.endpoint} is unavailable (no heartbeat)"}))
            return
        key = f"{self.tag}-{next(self.ids)}"
        timer = self.server.loop.call_later(timeout + self.server.cfg.peer_timeout,
                                            self.expired, key)
        self.passed[key] = (client, msg, timer)
        self.dealer.send(Admin(msg.command, msg.args, key))

    def answered(self, msg: AdminReply) -> None:
        got = self.passed.pop(msg.req_id, None)
        if got is None:
            return
        client, asked, timer = got
        timer.cancel()
        self.server.front.send(client, AdminReply(asked.req_id, msg.ok,
                                                  msg.result | {"via": self.server.endpoint}))

    def expired(self, key: str) -> None:
        got = self.passed.pop(key, None)
        if got is not None:
            client, asked, _ = got
            self.server.front.send(client, AdminReply(asked.req_id, False, {
                "status": 504, "router": self.server.endpoint,
                "error": f"coordinator {self.endpoint} did not answer in time"}))

    def fields(self) -> dict:
        return {"endpoint": self.endpoint, "alive": self.alive}

    def close(self) -> None:
        self.dealer.close()
