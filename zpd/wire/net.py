"""Thin ROUTER/DEALER wrappers that speak ``zpd.wire.protocol`` messages.

Every process binds one ``Router``; a peer connects one ``Dealer`` and both
directions use that pair. Neither wrapper blocks on send or raises for bad
bytes: a send that cannot be queued (peer gone, peer's queue full) is counted
and logged and returns False; a malformed inbound message is logged with the
peer's identity and dropped. Socket options live in ``configure_socket`` so
security (CURVE) and tuning have exactly one place.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import zmq

from zpd.wire.protocol import MAX_FRAME_BYTES, Message, ProtocolError, encode
from zpd.wire.step import decode_any

log = logging.getLogger("zpd.wire.net")


@dataclass(frozen=True)
class Curve:
    """CURVE keys (z85 bytes, from ``zmq.curve_keypair()``). A server needs its
    own pair; a client needs its pair plus ``server_public``. Without a ZAP
    authenticator this encrypts but admits any client key."""

    public: bytes
    secret: bytes
    server_public: Optional[bytes] = None


@dataclass(frozen=True)
class SocketOptions:
    """Tuning shared by Router and Dealer; the defaults suit loopback and LAN."""

    hwm: int = 10_000  # messages queued per peer before sends are dropped
    # The largest frame accepted; a larger one closes the sender's connection. A bound
    # ROUTER hears whoever connects, so it takes no more than the protocol needs. A
    # DEALER hears only the peer it dialled, whose Tokens carry the final texts of every
    # request that ended in one decode step (max_batch x a whole output each).
    max_msg_bytes: int = MAX_FRAME_BYTES
    max_dealer_msg_bytes: int = 256 << 20
    keepalive_idle_s: int = 10  # TCP keepalive finds half-open links that
    keepalive_intvl_s: int = 5  # app heartbeats would only see as silence
    keepalive_cnt: int = 3
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 2_000
    curve: Optional[Curve] = None
    zap_domain: str = ""  # ZAP domain of a CURVE server (zpd.wire.security)
    # Called with each inbound message's sender rights (its ZAP User-Id; "" without
    # CURVE), its identity and the message; returns None to accept, or (reason, reply
    # or None) to refuse.
    guard: Optional[Callable[[str, bytes, Message],
                             Optional[tuple[str, Optional[Message]]]]] = None
    # Called with each new socket before it binds or connects (handshake logging).
    monitor: Optional[Callable[[zmq.Socket], None]] = None


# pyzmq's compiled send, frame by frame: its Python send_multipart costs twice as much
# per message (flag enums, per-frame checks), which at a router is per token
_SEND = zmq.backend.Socket.send
_MORE, _LAST = int(zmq.SNDMORE) | int(zmq.NOBLOCK), int(zmq.NOBLOCK)

INPROC = "inproc://"   # an in-process endpoint (tests): bound and connected as it is


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6addr]:port"`` (optionally ``tcp://``) → (host, port)."""
    hostport = endpoint.removeprefix("tcp://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bad endpoint {endpoint!r}, want host:port")
    return host.strip("[]"), int(port)


def format_endpoint(host: str, port: int) -> str:
    """The inverse of ``parse_endpoint``; IPv6 hosts get brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def configure_socket(sock: zmq.Socket, *, host: str, server: bool, opts: SocketOptions) -> None:
    """Apply every socket option zpd uses; the one place to add security."""
    sock.setsockopt(zmq.LINGER, 0)  # close never waits on a dead peer
    sock.setsockopt(zmq.SNDHWM, opts.hwm)
    sock.setsockopt(zmq.RCVHWM, opts.hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, opts.max_msg_bytes if server else opts.max_dealer_msg_bytes)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, opts.keepalive_idle_s)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, opts.keepalive_intvl_s)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, opts.keepalive_cnt)
    sock.setsockopt(zmq.RECONNECT_IVL, opts.reconnect_ivl_ms)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, opts.reconnect_ivl_max_ms)
    if not host.startswith(INPROC):
        sock.setsockopt(zmq.IPV6, 1 if ":" in host else 0)
    if server:
        # Unroutable sends raise EHOSTUNREACH (caught in Router.send) instead
        # of vanishing, so the caller learns the peer is gone.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Never hand a connected peer's identity over to a newer connection: whoever
        # named it would take the peer's route and every message meant for it (a
        # router's tokens). A restarted peer connects under a new identity instead
        # (zpd/wire/router_proof.py); a second connection claiming one in use is
        # refused by ZeroMQ until the first is gone.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
    if opts.curve is not None:
        _apply_curve(sock, server=server, curve=opts.curve)
        if server and opts.zap_domain:
            sock.setsockopt(zmq.ZAP_DOMAIN, opts.zap_domain.encode())
    if opts.monitor is not None:
        opts.monitor(sock)


def _apply_curve(sock: zmq.Socket, *, server: bool, curve: Curve) -> None:
    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
    if server:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
    elif curve.server_public is None:
        raise ValueError("a CURVE client needs server_public")
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)


def _wait_readable(sock: zmq.Socket, timeout: Optional[float]) -> bool:
    if timeout is None:
        return bool(sock.poll(None, zmq.POLLIN))
    if timeout <= 0:
        return True     # the receive says (zmq.Again) if nothing waits: one syscall less
    return bool(sock.poll(int(timeout * 1000) or 1, zmq.POLLIN))


class _Endpoint:
    """Shared send/recv bookkeeping; ``socket`` is exposed for ``Loop``."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.socket = sock
        self.dropped_sends = 0  # counts sends that could not be queued
        self.last_send_unreachable = False  # the last failed send: peer not connected
        self.bad_messages = 0  # counts inbound messages that failed to decode
        # Set by a Loop watching the socket (zpd/wire/readiness.py): a send or receive
        # may take the edge its ZMQ_FD would fire on, so each one is reported there.
        self.touched: Optional[set[zmq.Socket]] = None

    def _send_frames(self, frames: list, peer: str, copy: bool = True) -> bool:
        sock, last = self.socket, len(frames) - 1
        if self.touched is not None:
            self.touched.add(sock)
        try:
            for i, frame in enumerate(frames):      # a message is queued whole or not at all
                _SEND(sock, frame, _MORE if i < last else _LAST, copy, False)
            return True
        except zmq.Again:
            why, self.last_send_unreachable = "send queue full (peer slow or gone)", False
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            why, self.last_send_unreachable = "peer not connected", True
        self.dropped_sends += 1
        # Powers of two: a dead peer's heartbeats must not flood the log.
        if self.dropped_sends & (self.dropped_sends - 1) == 0:
            log.warning("dropped send to %s: %s (%d dropped so far)", peer, why, self.dropped_sends)
        return False

    def _recv_frames(self, timeout: Optional[float]) -> Optional[list[bytes]]:
        if self.touched is not None:
            self.touched.add(self.socket)
        if not _wait_readable(self.socket, timeout):
            return None
        try:
            return self.socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def _decode(self, frames: list[bytes], peer: str) -> Optional[Message]:
        try:
            return decode_any(frames)
        except ProtocolError as e:
            self.bad_messages += 1
            log.warning("dropped malformed message from %s: %s", peer, e.reason)
            return None

    def close(self) -> None:
        """Close the socket without lingering on unsent messages."""
        self.socket.close(linger=0)

    def __enter__(self) -> "_Endpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Router(_Endpoint):
    """The process's bound ROUTER socket. ``endpoint`` is the "host:port"
    actually bound (port 0 picks a free one); only ``host`` is bound. A host
    ``inproc://NAME`` binds that in-process endpoint (``port`` unused)."""

    def __init__(self, ctx: zmq.Context, host: str, port: int,
                 opts: SocketOptions = SocketOptions()) -> None:
        sock = ctx.socket(zmq.ROUTER)
        configure_socket(sock, host=host, server=True, opts=opts)
        bracketed = f"[{host}]" if ":" in host else host
        try:
            sock.bind(host if host.startswith(INPROC) else f"tcp://{bracketed}:{port or '*'}")
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        super().__init__(sock)
        if host.startswith(INPROC):
            self.endpoint = host
        else:
            _, bound_port = parse_endpoint(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            self.endpoint = format_endpoint(host, bound_port)
        self.guard = opts.guard
        self.keyed = opts.curve is not None and opts.guard is not None  # rights to read
        self.refused = 0  # counts inbound messages the guard refused

    def send(self, identity: bytes, msg: Message) -> bool:
        """Queue ``msg`` for peer ``identity``; False if it had to be dropped."""
        return self._send_frames([identity, *encode(msg)], _peer_name(identity))

    def send_frames(self, identity: bytes, frames: list) -> bool:
        """Queue frames encoded already (bytes or zmq Frames, sent without a copy: a
        step, a body the router passes on); False if they had to be dropped."""
        return self._send_frames([identity, *frames], _peer_name(identity), copy=False)

    def recv(self, timeout: Optional[float] = 0) -> Optional[tuple[bytes, Message]]:
        """Next (identity, message); None if none arrived within ``timeout``
        seconds (0: don't wait, None: wait forever), it was malformed or the
        guard refused it."""
        got = self._recv_keyed(timeout) if self.keyed else self._recv_plain(timeout)
        if got is None:
            return None
        user, identity, msg = got
        refusal = None if self.guard is None else self.guard(user, identity, msg)
        if refusal is None:
            return identity, msg
        why, reply = refusal
        self.refused += 1
        if self.refused & (self.refused - 1) == 0:
            log.warning("refused %s from %s: %s (%d refused so far)", msg.TYPE,
                        _peer_name(identity), why, self.refused)
        if reply is not None:
            self.send(identity, reply)
        return None

    def _recv_plain(self, timeout: Optional[float]) -> Optional[tuple[str, bytes, Message]]:
        frames = self._recv_frames(timeout)
        if frames is None:
            return None
        msg = self._decode(frames[1:], _peer_name(frames[0]))
        return None if msg is None else ("", frames[0], msg)

    def _recv_keyed(self, timeout: Optional[float]) -> Optional[tuple[str, bytes, Message]]:
        # Zero-copy frames carry the connection's metadata, here the rights that
        # the ZAP handler gave the sender's key.
        if self.touched is not None:
            self.touched.add(self.socket)
        if not _wait_readable(self.socket, timeout):
            return None
        try:
            frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        try:
            user = frames[0].get("User-Id") or ""
        except zmq.ZMQError:
            user = ""
        identity = frames[0].bytes
        msg = self._decode([f.bytes for f in frames[1:]], _peer_name(identity))
        return None if msg is None else (user, identity, msg)


class Dealer(_Endpoint):
    """A DEALER connected to one peer's Router. Messages sent before the
    connection is up are queued (up to the HWM) and delivered on connect, so a
    handshake can be sent right after construction."""

    def __init__(self, ctx: zmq.Context, endpoint: str, identity: Optional[bytes] = None,
                 opts: SocketOptions = SocketOptions()) -> None:
        inproc = endpoint.startswith(INPROC)
        host, port = (endpoint, 0) if inproc else parse_endpoint(endpoint)
        sock = ctx.socket(zmq.DEALER)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        configure_socket(sock, host=host, server=False, opts=opts)
        self.endpoint = endpoint if inproc else format_endpoint(host, port)
        sock.connect(endpoint if inproc else f"tcp://{self.endpoint}")
        super().__init__(sock)

    def send(self, msg: Message) -> bool:
        """Queue ``msg`` for the peer; False if it had to be dropped."""
        return self._send_frames(encode(msg), self.endpoint)

    def send_frames(self, frames: list[bytes]) -> bool:
        """Queue a message encoded already (one encoding for several peers)."""
        return self._send_frames(frames, self.endpoint)

    def recv(self, timeout: Optional[float] = 0) -> Optional[Message]:
        """Next message; None on timeout (see ``Router.recv``) or if malformed. A
        worker's step (zpd/wire/step.py) comes as one ``Tokens`` of all its bodies."""
        frames = self._recv_frames(timeout)
        return None if frames is None else self._decode(frames, self.endpoint)

    def read(self, frames: list[bytes]) -> Optional[Message]:
        """`frames` of `recv_frames` decoded as `recv` decodes them; None if malformed."""
        return self._decode(frames, self.endpoint)

    def recv_frames(self) -> Optional[list]:
        """The next message's frames undecoded, as zmq Frames (no copy), if one is
        there; for a reader that decodes them itself (the router's, zpd/router/relay.py)."""
        try:
            return self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None


def _peer_name(identity: bytes) -> str:
    # Identities are arbitrary bytes (zmq's default is 5 binary bytes); keep
    # log lines short and printable.
    return repr(identity[:64])
