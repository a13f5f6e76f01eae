"""Optional ZeroMQ CURVE on every zpd socket: encryption, authorised keys, and rights.

One key directory (made by `zpd keys DIR`) serves a whole cluster; copy it to
every node. Layout:

    server.key, server.key_secret     every router and worker binds with this pair
    cluster.key, cluster.key_secret   the router and decode workers connect with it
    admin.key, admin.key_secret       `zpd admin` connects with it
    client.key, client.key_secret     `zpd generate` and zpd.Client connect with it
    authorized/{client,admin,cluster}/*.key   public keys allowed in, by rights

Rights nest: `client` may submit, abort and (after a router restart) resume its
requests; `admin` may also send admin commands; `cluster` may send everything,
including the control messages between workers (hello, kv_dest, ...) and the
routers' own (generate to a worker, adopt, a follower's follow). Every bound socket runs a ZAP handler that admits
only keys found under authorized/ (re-read at each handshake, so adding or removing
a key file takes effect for new connections without a restart) and tags each
connection with its rights; the socket wrapper (zpd.wire.net.Router) then checks each
inbound message's type against those rights (`Policy`). Without keys the same check
asks, for router-only messages, whether the sender is a proven router
(zpd/wire/router_proof.py). A plaintext peer or an unknown key
never completes the handshake, so none of its messages is ever read; the refusal
is logged by the side that has keys.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from zpd.wire.net import Curve, SocketOptions
from zpd.wire.protocol import Admin, AdminReply, Generate, Message, Tokens
from zpd.wire.router_proof import proven_router

log = logging.getLogger("zpd.wire.security")

RIGHTS = ("client", "admin", "cluster")          # each includes those before it
KEY_NAMES = ("server", "cluster", "admin", "client")
ZAP_DOMAIN = "zpd"

@dataclass(frozen=True)
class Policy:
    """Who may send what to one bound socket.

    `rights`: under CURVE, the least rights each message type needs ("admin:NAME" for
    the admin command NAME, else "admin"); anything unlisted needs "cluster".
    `routers_only`: without keys, only a proven router (zpd/wire/router_proof.py) may
    send these; `open_without_secret` of them stay open to anyone on a process that
    holds no router secret (a keyless cluster without one is open by design: loopback)."""

    rights: Mapping[str, str]
    routers_only: frozenset[str] = frozenset()
    open_without_secret: frozenset[str] = frozenset()


# A follower's FOLLOW is an admin envelope, but only a router may send it: a client
# that follows could make every pause wait for it and every update refuse (409).
ROUTER_POLICY = Policy({"generate": "client", "abort": "client", "ping": "client",
                        "resume": "client",     # only for the caller's own rids (adoption.py)
                        "admin": "admin", "admin:follow": "cluster"},
                       routers_only=frozenset({"admin:follow"}))
# Workers take requests only from the router (cluster key): a client key cannot
# bypass the router's room assignment by writing to a worker directly. Without keys,
# `adopt` hands a dead router's requests (and their tokens) over: a proven router only.
WORKER_POLICY = Policy({"ping": "client", "admin": "admin"},
                       routers_only=frozenset({"generate", "abort", "adopt"}),
                       open_without_secret=frozenset({"generate", "abort"}))


def message_kind(msg: Message) -> str:
    """The name a Policy lists `msg` under: its type, or "admin:NAME" for an admin
    command that the policy names."""
    return f"admin:{msg.command}" if isinstance(msg, Admin) else msg.TYPE


class SecurityError(ValueError):
    """Missing or unreadable key files (a ValueError so the CLI reports it plainly)."""


def create_keys(directory: str | Path) -> list[Path]:
    """Make a fresh key set in `directory`; refuses to overwrite an existing one."""
    root = Path(directory)
    if (root / "server.key_secret").exists():
        raise SecurityError(f"{root} already holds keys; remove it or pick another directory")
    root.mkdir(parents=True, exist_ok=True)
    made = []
    for name in KEY_NAMES:
        public, _ = write_key_pair(root, name)
        made.append(public)
        if name != "server":
            add_authorized(root, public, "cluster" if name == "cluster" else name)
    return made


def write_key_pair(directory: Path, name: str) -> tuple[Path, Path]:
    """A fresh pair `name`.key / `name`.key_secret in `directory`, in ZeroMQ's certificate
    format (zmq.auth.load_certificate reads it). The secret file is created 0600: made
    readable and then chmod'ed, it would be open to every local user in between.
    Neither file may exist already (nor be a symlink planted in its place)."""
    public, secret = zmq.curve_keypair()
    paths = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path, mode, keys in ((paths[1], 0o600, (public, secret)), (paths[0], 0o644, (public,))):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        except FileExistsError:
            raise SecurityError(f"{path} exists already; pick another name") from None
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(_certificate(*keys))
    return paths


def _certificate(public: bytes, secret: Optional[bytes] = None) -> str:
    lines = ["#   ZeroMQ CURVE " + ("**Secret** Certificate" if secret else "Public Certificate"),
             "#   made by `zpd keys`" + ("; keep it private" if secret else ""),
             "", "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def add_authorized(directory: str | Path, public_key_file: Path, rights: str) -> Path:
    """Authorise the public key in `public_key_file` with `rights`."""
    if rights not in RIGHTS:
        raise SecurityError(f"unknown rights {rights!r}; use one of {', '.join(RIGHTS)}")
    dest = Path(directory) / "authorized" / rights
    dest.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(public_key_file, dest / public_key_file.name))


def _load(path: Path, secret: bool) -> tuple[bytes, Optional[bytes]]:
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise SecurityError(f"cannot read CURVE key {path}: {e} (create keys with `zpd keys DIR`)") \
            from None
    if secret and not secret_key:
        raise SecurityError(f"{path} holds no secret key")
    return public, secret_key


def client_curve(directory: str | Path, name: str = "client") -> Curve:
    """Keys to connect with: the pair `name` in `directory` plus the server's public key."""
    root = Path(directory)
    public, secret = _load(root / f"{name}.key_secret", secret=True)
    server_public, _ = _load(root / "server.key", secret=False)
    return Curve(public, secret, server_public)


def rights_of(directory: Path, z85_key: bytes) -> Optional[str]:
    """The highest rights under which `z85_key` is authorised, or None."""
    found = None
    for rights in RIGHTS:
        for path in sorted((directory / "authorized" / rights).glob("*.key")):
            try:
                if zmq.auth.load_certificate(path)[0] == z85_key:
                    found = rights
                    break
            except (OSError, ValueError):
                log.warning("ignoring unreadable key file %s", path)
    return found


def has_rights(user: str, needed: str) -> bool:
    return user in RIGHTS and RIGHTS.index(user) >= RIGHTS.index(needed)


class Guard:
    """Checks each inbound message on a bound socket against its sender: under CURVE
    its key's rights (the ZAP User-Id), without keys whether a router-only message
    comes from a proven router. Refused requests and admin commands are answered
    with 403 so the sender learns why instead of waiting for a timeout."""

    def __init__(self, policy: Policy, keyed: bool = True,
                 router_secret: Optional[bytes] = None) -> None:
        self.policy, self.keyed, self.secret = policy, keyed, router_secret

    def __call__(self, user: str, identity: bytes,
                 msg: Message) -> Optional[tuple[str, Optional[Message]]]:
        why = self.keyed_refusal(user, msg) if self.keyed else self.keyless_refusal(identity, msg)
        if why is None:
            return None
        if isinstance(msg, Admin):
            return why, AdminReply(msg.req_id, False, {"error": why, "status": 403})
        if isinstance(msg, Generate):
            return why, Tokens.abort(msg.rid, 403, why)
        return why, None

    def keyed_refusal(self, user: str, msg: Message) -> Optional[str]:
        kind, rights = message_kind(msg), self.policy.rights
        needed = rights.get(kind, rights.get(msg.TYPE, "cluster"))
        if has_rights(user, needed):
            return None
        return f"{kind} needs {needed!r} rights; this key has {user or 'none'!r}"

    def keyless_refusal(self, identity: bytes, msg: Message) -> Optional[str]:
        kind, policy = message_kind(msg), self.policy
        if kind not in policy.routers_only or proven_router(identity, self.secret):
            return None
        if self.secret is None and kind in policy.open_without_secret:
            return None
        return (f"{kind} is taken only from a router of this cluster: start every router "
                "and worker with the same --router-secret-file (or --curve-keys)")


class _Authenticator(ThreadAuthenticator):
    """ZAP handler that admits keys found under authorized/ and names each
    connection's User-Id after its rights."""

    def __init__(self, ctx: zmq.Context, root: Path) -> None:
        super().__init__(ctx, log=logging.getLogger("zpd.wire.security.zap"))
        self.root = root
        self.refused: dict[bytes, int] = {}
        self.configure_curve_callback(ZAP_DOMAIN, self)

    def callback(self, domain: str, z85_key: bytes) -> bool:
        if rights_of(self.root, z85_key) is not None:
            return True
        n = self.refused[z85_key] = self.refused.get(z85_key, 0) + 1
        if n & (n - 1) == 0:         # a refused peer retries forever: log 1st, 2nd, 4th...
            log.warning("refused CURVE key %s: not under %s/authorized/ (%d attempts)",
                        z85_key.decode(), self.root, n)
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        return rights_of(self.root, z85.encode(client_public_key)) or ""


class Security:
    """One process's CURVE setup from --curve-keys (None: plaintext everywhere).

    `server_options` are for the process's bound ROUTER (starts the ZAP handler on
    `ctx` first); `client_options` for its DEALERs to other cluster processes.
    Handshake failures on either are logged with a hint. Call `close` before the
    context is destroyed."""

    def __init__(self, keys_dir: Optional[str], ctx: zmq.Context, name: str = "cluster",
                 router_secret: Optional[bytes] = None) -> None:
        self.root = Path(keys_dir) if keys_dir else None
        self.router_secret = router_secret      # --router-secret-file (router_proof.py)
        self.ctx, self._auth = ctx, None
        self._server: Optional[Curve] = None
        self._client: Optional[Curve] = None
        self._watch = _HandshakeWatch() if self.root else None
        if self.root is not None:
            public, secret = _load(self.root / "server.key_secret", secret=True)
            self._server = Curve(public, secret)
            if (self.root / f"{name}.key_secret").exists():
                self._client = client_curve(self.root, name)

    @property
    def enabled(self) -> bool:
        return self.root is not None

    def server_options(self, policy: Policy) -> SocketOptions:
        if self.root is None:
            guard = Guard(policy, keyed=False, router_secret=self.router_secret)
            return SocketOptions(guard=guard if policy.routers_only else None)
        if self._auth is None:
            self._auth = _Authenticator(self.ctx, self.root)
            self._auth.start()
        return SocketOptions(curve=self._server, guard=Guard(policy), zap_domain=ZAP_DOMAIN,
                             monitor=self._watch.add)

    def proven_router(self, identity: bytes) -> bool:
        """Is the peer `identity` one of the cluster's routers? Under CURVE whatever
        passed the guard's rights check is; without keys, its identity must carry the
        tag of this cluster's router secret (zpd/wire/router_proof.py)."""
        return self.enabled or proven_router(identity, self.router_secret)

    def client_options(self) -> SocketOptions:
        if self.root is None:
            return SocketOptions()
        if self._client is None:
            raise SecurityError(f"no {self.root}/cluster.key_secret: this process connects to "
                                "workers and needs the cluster key (see `zpd keys`)")
        return SocketOptions(curve=self._client, monitor=self._watch.add)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


class _HandshakeWatch:
    """Logs failed CURVE handshakes on monitored sockets, from one helper thread.
    A refused peer reconnects forever, so repeats are logged at powers of two."""

    HINTS = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "key not authorised (not under authorized/)",
             # Also what a bound socket sees when a plaintext peer hangs up first.
             zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "CURVE handshake failed: peer without "
                                                   "--curve-keys, or with another server key"}

    def __init__(self) -> None:
        self._pending: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._counts: dict[tuple, int] = {}
        self._thread: Optional[threading.Thread] = None

    def add(self, sock: zmq.Socket) -> None:
        events = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        with self._lock:
            self._pending.append(sock.get_monitor_socket(events))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="zpd-handshakes", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        poller, monitors = zmq.Poller(), []
        while not self._stop.is_set():
            with self._lock:
                new, self._pending = self._pending, []
            for m in new:
                poller.register(m, zmq.POLLIN)
                monitors.append(m)
            for m, _ in poller.poll(100):
                self._report(parse_monitor_message(m.recv_multipart()))
        for m in monitors:          # sockets are closed by the thread that used them
            m.close(linger=0)

    def _report(self, event: dict) -> None:
        endpoint = event["endpoint"].decode(errors="replace")
        kind = (endpoint, event["event"], event["value"])
        n = self._counts[kind] = self._counts.get(kind, 0) + 1
        if n & (n - 1):
            return
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            why = ("peer speaks plaintext: start it with --curve-keys"
                   if event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
                   else f"protocol error 0x{event['value']:x}")
        else:
            why = self.HINTS.get(event["event"], f"event {event['event']}")
        log.warning("refused connection on %s: %s (%d so far)", endpoint, why, n)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
