"""Router identities that cannot be claimed, and the proof that a peer is a router.

A router connects to every worker (and a follower to its coordinator) with the
ZeroMQ identity `router@{endpoint}/{boot}.{tag}`. Clients learn `endpoint` and
`boot` (every Pong and Accepted carries the boot id), never `tag`:

- with a router secret (`--router-secret-file`, written by `zpd launch` and the
  launch scripts, the same file for every router and worker of a cluster) the tag
  is an HMAC of `router@{endpoint}/{boot}` under that secret, so a worker or a
  coordinator that holds the secret checks that the peer is one of the cluster's
  routers without any exchange;
- without one it is a random nonce: nobody can name the identity, but nobody can
  check it either.

Workers never hand an identity in use over to a new connection (zpd/wire/net.py), so
a router's route cannot be taken while it is connected, and an identity nobody can
name cannot be claimed once it is gone. Under CURVE a peer is proven by its key's
rights (zpd/wire/security.py); this module is for clusters without keys, whose
limit is the network itself: the tag travels in plaintext, so whoever can read the
cluster's traffic can reuse an identity once its router has gone (as they read
every token already).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import stat
from pathlib import Path

ROUTER_PREFIX = b"router@"
SECRET_BYTES = 32          # what `write_router_secret` makes (hex in the file)
MIN_SECRET_BYTES = 16      # shorter secrets are refused: guessable
TAG_CHARS = 32             # hex characters of the tag (128 bits)


class RouterSecretError(ValueError):
    """A router secret file that is missing, unsafe or too short (a ValueError so the
    CLI reports it plainly)."""


def write_router_secret(path: str | Path) -> Path:
    """A fresh secret at `path`, created 0600 (never readable by others, not for a
    moment) and never through an existing file or a planted symlink."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise RouterSecretError(f"{path} exists already; remove it or pick another path") from None
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(os.urandom(SECRET_BYTES).hex() + "\n")
    return path


def load_router_secret(path: str | Path | None) -> bytes | None:
    """The secret in `path` (None: no path given). Refused: a file that others may read
    or write (the secret would be anyone's) and one shorter than MIN_SECRET_BYTES."""
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise RouterSecretError(f"cannot read --router-secret-file {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        secret = f.read(4096).strip()
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RouterSecretError(f"--router-secret-file {path} is open to other users "
                                f"(mode {stat.S_IMODE(mode):o}); chmod 600 it")
    if len(secret) < MIN_SECRET_BYTES:
        raise RouterSecretError(f"--router-secret-file {path} holds fewer than "
                                f"{MIN_SECRET_BYTES} bytes; make one with `zpd keys DIR --router-secret`")
    return secret


def _tag(secret: bytes, name: bytes) -> bytes:
    return hmac.new(secret, name, hashlib.sha256).hexdigest()[:TAG_CHARS].encode()


def router_identity(endpoint: str, boot: str, secret: bytes | None) -> bytes:
    """The identity a router with this endpoint and boot id connects with."""
    name = ROUTER_PREFIX + f"{endpoint}/{boot}".encode()
    tag = _tag(secret, name) if secret is not None else os.urandom(TAG_CHARS // 2).hex().encode()
    return name + b"." + tag


def router_endpoint(identity: bytes) -> bytes | None:
    """The endpoint of a router's identity `router@{endpoint}/{boot}` (None: not one)."""
    if not identity.startswith(ROUTER_PREFIX):
        return None
    endpoint, sep, boot = identity[len(ROUTER_PREFIX):].rpartition(b"/")
    return endpoint if sep and endpoint and boot else None


def proven_router(identity: bytes, secret: bytes | None) -> bool:
    """Does `identity` carry the tag only a holder of `secret` can make?"""
    if secret is None or router_endpoint(identity) is None:
        return False
    name, _, tag = identity.rpartition(b".")
    return hmac.compare_digest(tag, _tag(secret, name))
