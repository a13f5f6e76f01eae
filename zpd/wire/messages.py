"""The control plane's messages: one frozen, slotted dataclass per wire type (the
token stream's, ``Tokens``, is in ``zpd.wire.tokens``), and ``new_room``, which
defines a request's room.

Each record's fields are its wire fields, in order; ``zpd.wire.protocol`` derives the
codec from the annotations (``list[int]`` travels as an int32 blob, ``list[float]`` as a
float32 blob; an optional field left None is not sent at all) and re-exports every name
here, so ``from zpd.wire.protocol import Generate`` is the usual import.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from engines.kv.layout import KVLayout
from engines.sampling_params import SamplingParams
from zpd.wire.payloads import AdoptedRequest, KvTimings

# Field metadata of a record field the codec never sends: what the decode itself found.
LOCAL = {"wire": False}


def new_room() -> int:
    """A fresh room. A room is the id of one request across its prefill/decode pair: the
    router makes one when it routes the request (``Generate.room``), and every message
    between that pair (KvDest, KvDone, KvFailed, Recompute) names it, so the workers match
    KV transfers by an id the router chose, never by the client's rid. Random and 63
    bits (positive as a signed 64-bit int), so rooms of different routers, or of a
    restarted one, do not collide. ``epoch`` counts a room's recomputes (0, then +1 after
    each retraction); a message for an unknown room or an older epoch is dropped, never
    applied."""
    return random.getrandbits(63)


class ProtocolError(ValueError):
    """A message could not be encoded or decoded; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Message:
    """Base of every wire message; subclasses are frozen slotted dataclasses."""

    __slots__ = ()
    TYPE: ClassVar[str] = ""


# --- message types -----------------------------------------------------------
# ``room`` and ``epoch``, wherever they appear, are defined at ``new_room``.


@dataclass(frozen=True, slots=True)
class Generate(Message):
    """Start a request. A client sends room=0; the router assigns the room (see
    ``new_room``) and epoch 0, and names the prefill and decode chosen for it; a
    scoring request (max_new_tokens 0) names no decode: its prefill answers it."""

    TYPE: ClassVar[str] = "generate"
    rid: str
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    room: int = 0
    epoch: int = 0
    prefill: str = ""
    decode: str = ""
    text: str = ""  # a text prompt, tokenized by the workers, when input_ids is empty
    # a conversation {"messages": [{"role", "content"}, ...]} that the workers render with
    # the model's chat template and tokenize, when input_ids and text are empty; optional
    # "tools" and "chat_template_kwargs" are the template's `tools` and extra variables
    chat: dict = field(default_factory=dict)
    # Who the client submits for, among its own users (the HTTP front names each HTTP
    # caller): the router's second level of fairness, after the client itself. At most
    # MAX_USER_CHARS printable characters (the router refuses others with 400); ""
    # is the client itself. The router passes it on: a prefill takes turns between
    # callers too (zpd/worker/fair.py).
    user: str = ""
    # Which of that user's calls it belongs to (the HTTP front names each HTTP request,
    # so one batch of a thousand does not make the same user's next call wait behind
    # it): the router's third level of fairness. Bounded as `user`; not passed on.
    call: str = ""
    # The router sets it: its client's identity (hex), which a decode keeps so that a
    # router restarted on the same endpoint can give the request back to that client
    # (zpd/router/ha/adoption.py).
    owner: str = ""
    # Why the decode refused the sender's sampling parameters ("": it did not; then
    # `sampling` holds them, else the defaults). Never sent: its receiver answers the
    # request with 400 and this reason (the router before routing it).
    refused: str = field(default="", metadata=LOCAL)

    @property
    def scores_only(self) -> bool:
        """max_new_tokens 0: the prompt is scored, nothing generated."""
        return not self.refused and self.sampling.scores_only


MAX_USER_CHARS = 128


def user_problem(user: str, call: str = "") -> str | None:
    """Why `user` or `call` is no valid Generate.user or .call (None: both are)."""
    for name, value in (("user", user), ("call", call)):
        if len(value) > MAX_USER_CHARS or not value.isprintable():
            return f"{name} must be at most {MAX_USER_CHARS} printable characters"
    return None


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """Decode → prefill handshake. ``layout`` is the whole model's KV layout (every kv
    head, whatever the TP), sent as its fields with page_bytes and order. ``pools`` are the decode's registered KV pools that
    prefill will write into, one per tensor-parallel rank in rank order, each
    ``[head_start, head_stop, base_addr]``: the model's kv heads it holds and its
    page 0; every pool has ``num_pages`` pages (engines/tp/transfer.py)."""

    TYPE: ClassVar[str] = "hello"
    decode: str
    layout: KVLayout
    compat_hash: str
    session_id: str
    pools: list[list[int]]
    num_pages: int
    weight_version: str


@dataclass(frozen=True, slots=True)
class HelloAck(Message):
    """Prefill → decode answer to Hello, with the prefill's own layout, hash,
    Mooncake session and pools (as Hello's); ok=False carries the mismatch in
    ``reason``."""

    TYPE: ClassVar[str] = "hello_ack"
    ok: bool
    layout: KVLayout
    compat_hash: str
    session_id: str
    pools: list[list[int]]
    num_pages: int
    weight_version: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class KvDest(Message):
    """Decode → prefill: where to write this request's KV. The prefix's first
    ``cached_pages`` pages the decode holds already (its prefix cache) and are not
    written; ``page_ids`` are the decode's pages for the rest of the prefix, one per
    page, in order. ``aux_slot`` is the decode's auxiliary-buffer slot for the request
    (-1: none)."""

    TYPE: ClassVar[str] = "kv_dest"
    room: int
    epoch: int
    rid: str
    page_ids: list[int]
    aux_slot: int = -1
    cached_pages: int = 0

    def __post_init__(self) -> None:
        if self.cached_pages < 0:
            raise ProtocolError(f"kv_dest: cached_pages {self.cached_pages} is negative")


@dataclass(frozen=True, slots=True)
class KvDone(Message):
    """Prefill → decode: the KV is written; ``first_token`` was sampled under
    ``weight_version``; ``timings`` say where the prefill's time went. When its request asked for logprobs, ``logprob`` holds the
    first token's (one entry) and, with top logprobs, ``top_ids``/``top_logprobs`` its
    alternatives, highest first, and with token_ids_logprob, ``ids_logprobs`` those
    ids' (in the order asked); otherwise they are None and not sent.
    ``cached_tokens``: the prompt tokens the prefill took from its prefix cache instead
    of computing (0 from a peer that predates the field); the decode checks it against
    the prompt's length."""

    TYPE: ClassVar[str] = "kv_done"
    room: int
    epoch: int
    first_token: int
    weight_version: str
    timings: Optional[KvTimings] = None
    logprob: Optional[list[float]] = None
    top_ids: Optional[list[int]] = None
    top_logprobs: Optional[list[float]] = None
    cached_tokens: int = 0
    ids_logprobs: Optional[list[float]] = None
    # The prompt's logprobs when its request asked (logprob_start_len k): positions
    # max(k, 1)..len-1, then per position its top_logprobs_num (id, logprob) pairs and
    # its token_ids_logprob ids' logprobs, flat. Only on the first epoch's kv_done.
    prompt_logprobs: Optional[list[float]] = None
    prompt_top_ids: Optional[list[int]] = None
    prompt_top_logprobs: Optional[list[float]] = None
    prompt_ids_logprobs: Optional[list[float]] = None
    # When its request asked for its routed experts (engines/routed.py): the rows of every
    # position the prefill computed (prompt + output[:-1]: a recompute's replace the
    # decode's), [positions, layers, experts per token] flat in the model's compact
    # little-endian dtype (engines/routed_wire.py: uint8 up to 256 experts), in pieces
    # of at most 4 MiB, and with return_routed_expert_weights their gate weights,
    # float32, flat alike.
    routed_experts: Optional[list[bytes]] = None
    routed_expert_weights: Optional[list[bytes]] = None

    def __post_init__(self) -> None:
        if (self.prompt_top_ids is None) != (self.prompt_top_logprobs is None) or \
                (self.prompt_top_ids is not None and len(self.prompt_top_ids) != len(self.prompt_top_logprobs)):
            raise ProtocolError("kv_done: prompt_top_ids and prompt_top_logprobs must come "
                                "together, as many of each")
        if self.cached_tokens < 0:
            raise ProtocolError(f"kv_done: cached_tokens {self.cached_tokens} is negative")
        if self.logprob is not None and len(self.logprob) != 1:
            raise ProtocolError(f"kv_done: {len(self.logprob)} logprobs for one first token")
        if (self.top_ids is None) != (self.top_logprobs is None) or \
                (self.top_ids is not None and (self.logprob is None
                                               or len(self.top_ids) != len(self.top_logprobs))):
            raise ProtocolError("kv_done: top_ids and top_logprobs must come together, as "
                                "many of each, with a logprob")
        if self.ids_logprobs is not None and self.logprob is None:
            raise ProtocolError("kv_done: ids_logprobs without a logprob")


@dataclass(frozen=True, slots=True)
class KvFailed(Message):
    """Either direction: the transfer for (room, epoch) is abandoned; ``status``
    is one of the DESIGN status codes."""

    TYPE: ClassVar[str] = "kv_failed"
    room: int
    epoch: int
    status: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Recompute(Message):
    """Decode → prefill after a retraction: rebuild KV for prompt + output[:-1]
    under the current weights, as (room, epoch+1)."""

    TYPE: ClassVar[str] = "recompute"
    rid: str
    room: int
    epoch: int
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    refused: str = field(default="", metadata=LOCAL)    # as Generate.refused


@dataclass(frozen=True, slots=True)
class Accepted(Message):
    """Router → client, at once for every Generate it receives, whatever it then does
    with it (routes it, queues it while paused, or answers an error): the client
    learns within seconds that a router listens at the address it was given. One
    message acknowledges every generate of that client the router read in one go:
    `rid` and the rids in `more`."""

    TYPE: ClassVar[str] = "accepted"
    rid: str
    boot: str = ""     # the router process's boot id (see Ping.boot)
    more: Optional[list[str]] = None

    @property
    def rids(self) -> list[str]:
        return [self.rid] if self.more is None else [self.rid, *self.more]


@dataclass(frozen=True, slots=True)
class Abort(Message):
    """Client/admin → router → workers: end ``rid`` with ``status``."""

    TYPE: ClassVar[str] = "abort"
    rid: str
    status: int = 499
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Admin(Message):
    """Admin command (pause, continue, update_weights, status, ...); the reply
    echoes ``req_id`` so a fan-out can match answers."""

    TYPE: ClassVar[str] = "admin"
    command: str
    args: dict = field(default_factory=dict)
    req_id: str = ""


@dataclass(frozen=True, slots=True)
class AdminReply(Message):
    """Answer to one Admin message."""

    TYPE: ClassVar[str] = "admin_reply"
    req_id: str
    ok: bool
    result: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Ping(Message):
    """Heartbeat; the receiver answers Pong echoing ``seq`` and ``sent_at``."""

    TYPE: ClassVar[str] = "ping"
    seq: int
    sent_at: float
    sender: str = ""
    # A router's boot id, new each time it starts: a client that sees it change
    # resumes its requests (zpd/wire/resume.py).
    boot: str = ""


@dataclass(frozen=True, slots=True)
class Pong(Message):
    """Heartbeat answer; ``sent_at`` is the Ping's, so RTT needs one clock."""

    TYPE: ClassVar[str] = "pong"
    seq: int
    sent_at: float
    sender: str = ""
    boot: str = ""     # a router's answer to a client's ping carries its boot id


@dataclass(frozen=True, slots=True)
class Resume(Message):
    """Client → a router that restarted (its boot id changed): go on with ``rid``, of
    which the client has ``have`` tokens. The router sends the tokens past those, then
    the rest as they come; a request it does not hold for this client ends 503."""

    TYPE: ClassVar[str] = "resume"
    rid: str
    have: int = 0

    def __post_init__(self) -> None:
        if self.have < 0:
            raise ProtocolError(f"resume: have {self.have} is negative")


@dataclass(frozen=True, slots=True)
class Adopt(Message):
    """Router → decode, when the router starts: hand over the requests of the earlier
    processes of this router's endpoint (identity ``router@{endpoint}/{boot}``)."""

    TYPE: ClassVar[str] = "adopt"


@dataclass(frozen=True, slots=True)
class Adopted(Message):
    """Decode → router, the answer to Adopt: ``requests`` maps each rid handed over to
    its AdoptedRequest; the tokens themselves follow in a Tokens message (streamed
    requests: all so far). ``paused``: the decode's pause mode ("" when it runs), which
    the new router takes on."""

    TYPE: ClassVar[str] = "adopted"
    requests: dict[str, AdoptedRequest] = field(default_factory=dict)
    paused: str = ""
    # The rids whose entries the router's decode refused, with why (never sent): the
    # router aborts them at their decode, and adopts the others.
    refused: dict[str, str] = field(default_factory=dict, metadata=LOCAL)


@dataclass(frozen=True, slots=True)
class Error(Message):
    """Reply to a message that could not be handled when the sender is known
    (e.g. malformed or unexpected); ``rid`` is set when one could be read."""

    TYPE: ClassVar[str] = "error"
    status: int
    reason: str
    rid: str = ""
