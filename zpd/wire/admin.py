"""The admin plane's commands: one frozen record per command, checked once, here.

An admin command travels in the wire's ``Admin`` envelope (``zpd.wire.messages``) as
its name and an argument object; ``parse`` turns that into the command's record, and
every record checks its fields when it is made, so the HTTP front, the router, the
workers and ``zpd admin`` refuse the same input with the same 400 message. A record
goes back onto the wire with ``envelope``. Torch-free: ``zpd admin`` imports this.

Each field's metadata is its ``Check``: a test, what it wants (for the error), and a
conversion (a decimal string to a port, a string to a ``PauseMode``). A field typed
``X | None`` takes null; a required field has no default.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, ClassVar, Mapping, NamedTuple

from zpd.wire.messages import Admin
from zpd.wire.status import BAD_REQUEST, StatusError

MAX_TIMEOUT_S = 3600.0     # longest a fan-out waits for its workers' answers
MAX_RANKS = 4096           # entries of serialized_named_tensors (one per worker at most)
# The engines' own limits (engines.weight_push.MAX_TENSORS and
# engines.formats.tensor_payload.MAX_PAYLOAD_CHARS), restated so that the wire stays
# torch-free; tests/unit/test_protocol.py checks that they agree.
MAX_TENSORS = 100_000
MAX_PAYLOAD_CHARS = 8 << 20
MAX_NAME_CHARS = 256       # group names, update ids, addresses
MAX_SECONDS = 86400.0
KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
MEMORY_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)    # SGLang's names; cuda_graph: nothing here
GROUP_BACKENDS = ("gloo", "nccl")
TRAINER_INITS = ("init_custom_process_group", "init_process_group")
LOAD_FORMATS = (None, "flattened_bucket")


class PauseMode(str, Enum):
    """How a pause treats the requests in flight: `abort` ends them (499), `in_place`
    keeps them and their KV, `retract` drops their KV and recomputes them after continue."""
    ABORT = "abort"
    IN_PLACE = "in_place"
    RETRACT = "retract"

    def __str__(self) -> str:
        return self.value

    @property
    def drops(self) -> bool:
        """In-flight work is dropped: prefills forget their requests, decodes free (retract)
        or end (abort) theirs, and no batch is left running."""
        return self is not PauseMode.IN_PLACE


def drops(mode: PauseMode | None) -> bool:
    """A pause that drops in-flight work is in force."""
    return mode is not None and mode.drops


class SyncStep(str, Enum):
    """The weight-sync step under way (router and worker): joining a trainer's group, or
    pushing weights (a worker: receiving them into staging)."""
    JOINING = "joining"
    PUSHING = "pushing"

    def __str__(self) -> str:
        return self.value


class BadArgs(StatusError):
    """An admin command's arguments are wrong: answered 400, nothing changed."""

    def __init__(self, message: str) -> None:
        super().__init__(BAD_REQUEST, message)


# --- field checks -------------------------------------------------------------------

class Check(NamedTuple):
    test: Callable[[Any], bool]
    wanted: str                                   # what the field must be (for the error)
    convert: Callable[[Any], Any] = lambda v: v   # the checked value as the record holds it


def _int(v: Any) -> bool:
    return type(v) is int


def _text(v: Any) -> bool:
    return type(v) is str and v != ""


def _name(v: Any) -> bool:
    return type(v) is str and 0 < len(v) <= MAX_NAME_CHARS and v.isprintable()


def _port_value(v: Any) -> Any:
    """AReaL sends the port as a decimal string."""
    return int(v) if type(v) is str and v.isascii() and v.isdigit() and len(v) <= 5 else v


def _seconds(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and 0 < v <= MAX_SECONDS


def _strings(v: Any, most: int) -> bool:
    return type(v) is list and 0 < len(v) <= most and all(_text(s) for s in v)


TEXT = Check(_text, "a non-empty string")
NAME = Check(_name, f"a printable string of 1 to {MAX_NAME_CHARS} characters")
VERSION = Check(_text, "a non-empty string (or null: the version stays)")
RID = Check(_text, "a non-empty string")
MODE = Check(lambda v: v in tuple(PauseMode), f"one of {', '.join(m.value for m in PauseMode)}",
             PauseMode)
TAGS = Check(lambda v: type(v) is list and all(t in MEMORY_TAGS for t in v),
             f"null or a list of memory tags ({', '.join(MEMORY_TAGS)})",
             lambda v: sorted(set(v)))
PORT = Check(lambda v: _int(_port_value(v)) and 1 <= _port_value(v) <= 65535,
             "a port (an integer or its decimal string, 1 to 65535)", _port_value)
WORLD = Check(lambda v: _int(v) and 2 <= v <= 1 << 16, "an integer in [2, 65536]")
RANK_OFFSET = Check(lambda v: _int(v) and 1 <= v < 1 << 16,
                    "an integer >= 1 (rank 0 is the trainer)")
RANK = Check(lambda v: _int(v) and 1 <= v < 1 << 16, "an integer >= 1 (rank 0 is the trainer)")
BACKEND = Check(lambda v: v in GROUP_BACKENDS, " or ".join(GROUP_BACKENDS))
TRAINER_INIT = Check(lambda v: v in TRAINER_INITS, " or ".join(TRAINER_INITS))
SECONDS = Check(_seconds, f"a number of seconds in (0, {MAX_SECONDS:g}]", float)
NAMES = Check(lambda v: type(v) is list and 0 < len(v) <= MAX_TENSORS,
              f"a list of 1 to {MAX_TENSORS} tensor names")
LIST = Check(lambda v: type(v) is list, "a list")
LOAD_FORMAT = Check(lambda v: v in LOAD_FORMATS, 'null or "flattened_bucket"')
PAYLOADS = Check(lambda v: _strings(v, MAX_RANKS) and sum(map(len, v)) <= MAX_PAYLOAD_CHARS,
                 f"a list of 1 to {MAX_RANKS} base64 strings of {MAX_PAYLOAD_CHARS} characters "
                 "in all at most")
PAYLOAD = Check(lambda v: _text(v) and len(v) <= MAX_PAYLOAD_CHARS, "a non-empty base64 string")
STRINGS = Check(lambda v: type(v) is list and all(type(s) is str for s in v), "a list of strings")
OBJECT = Check(lambda v: type(v) is dict, "an object")


def arg(check: Check, default: Any = dataclasses.MISSING) -> Any:
    """A record field checked by `check`."""
    return field(default=default, metadata={"check": check})


# --- records ---------------------------------------------------------------------------

class AdminCommand:
    """Base of every admin record. `COMMAND` is its wire name; `ALIASES` are old
    argument names still taken for a field (the Python client's `version`);
    `ROUTER_SETS` are fields only the router fills in (a client may not)."""

    __slots__ = ()
    COMMAND: ClassVar[str] = ""
    ALIASES: ClassVar[Mapping[str, str]] = {}
    ROUTER_SETS: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, optional = getattr(self, f.name), f.default is None
            if value is None and optional:
                continue
            check: Check = f.metadata["check"]
            if not check.test(value):
                raise BadArgs(f"{self.COMMAND}: {f.name!r} must be {check.wanted}, not {value!r:.80}")
            object.__setattr__(self, f.name, check.convert(value))
        self.check()

    def check(self) -> None:
        """What no single field says (fields that must agree); raises BadArgs."""

    def args(self) -> dict:
        """The argument object on the wire: null fields left out."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    def envelope(self, req_id: str = "") -> Admin:
        return Admin(self.COMMAND, self.args(), req_id)


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


@dataclass(frozen=True, slots=True)
class Pause(AdminCommand):
    COMMAND: ClassVar[str] = "pause"
    mode: PauseMode = arg(MODE, PauseMode.RETRACT)


@dataclass(frozen=True, slots=True)
class Continue(AdminCommand):
    """`prefills`: the live prefills (those that answered their continue); `early`: rid ->
    a first token the client has from a prefill (TokenPart.early_entry). Router-set."""
    COMMAND: ClassVar[str] = "continue"
    ROUTER_SETS: ClassVar[tuple[str, ...]] = ("prefills", "early")
    prefills: list[str] | None = arg(STRINGS, None)
    early: dict | None = arg(OBJECT, None)


@dataclass(frozen=True, slots=True)
class Status(AdminCommand):
    COMMAND: ClassVar[str] = "status"


@dataclass(frozen=True, slots=True)
class FlushCache(AdminCommand):
    COMMAND: ClassVar[str] = "flush_cache"


@dataclass(frozen=True, slots=True)
class AbortRequest(AdminCommand):
    """End one request (router only)."""
    COMMAND: ClassVar[str] = "abort"
    rid: str = arg(RID)


@dataclass(frozen=True, slots=True)
class AbortAll(AdminCommand):
    COMMAND: ClassVar[str] = "abort_all"


@dataclass(frozen=True, slots=True)
class UpdateWeights(AdminCommand):
    """Load a checkpoint; without a version the current one stays (SGLang's way)."""
    COMMAND: ClassVar[str] = "update_weights"
    ALIASES: ClassVar[Mapping[str, str]] = {"version": "weight_version"}
    path: str = arg(TEXT)
    weight_version: str | None = arg(VERSION, None)


@dataclass(frozen=True, slots=True)
class UpdateWeightVersion(AdminCommand):
    COMMAND: ClassVar[str] = "update_weight_version"
    ALIASES: ClassVar[Mapping[str, str]] = {"version": "weight_version"}
    weight_version: str = arg(TEXT)


class _Tagged:
    """SGLang's memory `tags` (null: all of them)."""
    __slots__ = ()

    @property
    def tag_set(self) -> set[str]:
        return set(MEMORY_TAGS if self.tags is None else self.tags)


@dataclass(frozen=True, slots=True)
class ReleaseMemory(_Tagged, AdminCommand):
    COMMAND: ClassVar[str] = "release_memory"
    tags: list[str] | None = arg(TAGS, None)


@dataclass(frozen=True, slots=True)
class ResumeMemory(_Tagged, AdminCommand):
    COMMAND: ClassVar[str] = "resume_memory"
    tags: list[str] | None = arg(TAGS, None)


class _Announced:
    """A push's announced tensors: as many names, dtypes and shapes."""
    __slots__ = ()

    def check(self) -> None:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise BadArgs(f"{self.COMMAND}: 'names', 'dtypes' and 'shapes' must have the same "
                          "length")


@dataclass(frozen=True, slots=True)
class InitWeightsGroup(AdminCommand):
    """Every worker joins the trainer's group as rank rank_offset + i (router)."""
    COMMAND: ClassVar[str] = "init_weights_update_group"
    master_address: str = arg(NAME)
    master_port: int = arg(PORT)
    rank_offset: int = arg(RANK_OFFSET)
    world_size: int = arg(WORLD)
    group_name: str = arg(NAME)
    backend: str | None = arg(BACKEND, None)          # None: nccl on CUDA workers, else gloo
    trainer_init: str | None = arg(TRAINER_INIT, None)

    def join(self, rank: int, timeout_s: float) -> JoinWeightsGroup:
        """What one worker is told."""
        return JoinWeightsGroup(self.group_name, self.master_address, self.master_port,
                                self.world_size, rank, timeout_s, self.backend, self.trainer_init)


@dataclass(frozen=True, slots=True)
class JoinWeightsGroup(AdminCommand):
    """One worker's part of init_weights_update_group (the router's to send)."""
    COMMAND: ClassVar[str] = "join_weights_group"
    group_name: str = arg(NAME)
    master_address: str = arg(NAME)
    master_port: int = arg(PORT)
    world_size: int = arg(WORLD)
    rank: int = arg(RANK)
    timeout_s: float = arg(SECONDS, MAX_SECONDS)      # the worker's own limit caps it
    backend: str | None = arg(BACKEND, None)
    trainer_init: str | None = arg(TRAINER_INIT, None)

    def check(self) -> None:
        if self.rank >= self.world_size:
            raise BadArgs(f"{self.COMMAND}: 'rank' {self.rank} must be below 'world_size' "
                          f"{self.world_size}")


@dataclass(frozen=True, slots=True)
class UpdateFromDistributed(_Announced, AdminCommand):
    """The trainer broadcasts each announced tensor in its group (router, two-phase)."""
    COMMAND: ClassVar[str] = "update_weights_from_distributed"
    names: list = arg(NAMES)
    dtypes: list = arg(LIST)
    shapes: list = arg(LIST)
    group_name: str = arg(NAME)
    weight_version: str | None = arg(VERSION, None)     # None: each worker keeps its own
    load_format: str | None = arg(LOAD_FORMAT, None)


@dataclass(frozen=True, slots=True)
class StageWeights(_Announced, AdminCommand):
    """One worker's first phase of update_weights_from_distributed."""
    COMMAND: ClassVar[str] = "stage_weights"
    group_name: str = arg(NAME)
    update_id: str = arg(NAME)
    names: list = arg(NAMES)
    dtypes: list = arg(LIST)
    shapes: list = arg(LIST)
    load_format: str | None = arg(LOAD_FORMAT, None)
    timeout_s: float = arg(SECONDS, MAX_SECONDS)      # the worker's own limit caps it


@dataclass(frozen=True, slots=True)
class UpdateFromTensor(AdminCommand):
    """SGLang's update_weights_from_tensor: one entry (every worker) or one per worker."""
    COMMAND: ClassVar[str] = "update_weights_from_tensor"
    serialized_named_tensors: list[str] = arg(PAYLOADS)
    weight_version: str | None = arg(VERSION, None)
    load_format: str | None = arg(LOAD_FORMAT, None)


@dataclass(frozen=True, slots=True)
class StageTensors(AdminCommand):
    """One worker's first phase of update_weights_from_tensor: its entry."""
    COMMAND: ClassVar[str] = "stage_tensors"
    update_id: str = arg(NAME)
    payload: str = arg(PAYLOAD)
    load_format: str | None = arg(LOAD_FORMAT, None)


@dataclass(frozen=True, slots=True)
class CommitWeights(AdminCommand):
    """The second phase when every worker staged: apply, and move to `weight_version`
    (None: each keeps its own)."""
    COMMAND: ClassVar[str] = "commit_weights"
    ALIASES: ClassVar[Mapping[str, str]] = {"version": "weight_version"}
    update_id: str = arg(NAME)
    weight_version: str | None = arg(VERSION, None)


@dataclass(frozen=True, slots=True)
class DiscardWeights(AdminCommand):
    """The second phase when any worker failed; `destroy`: leave that group too."""
    COMMAND: ClassVar[str] = "discard_weights"
    update_id: str = arg(NAME)
    destroy: str | None = arg(NAME, None)


@dataclass(frozen=True, slots=True)
class DestroyWeightsGroup(AdminCommand):
    COMMAND: ClassVar[str] = "destroy_weights_update_group"
    group_name: str = arg(NAME)


@dataclass(frozen=True, slots=True)
class CancelWeightUpdate(AdminCommand):
    """End the join or push under way on every worker; never blocked."""
    COMMAND: ClassVar[str] = "cancel_weight_update"


COMMANDS: Mapping[str, type[AdminCommand]] = {cls.COMMAND: cls for cls in (
    Pause, Continue, Status, FlushCache, AbortRequest, AbortAll, UpdateWeights,
    UpdateWeightVersion, ReleaseMemory, ResumeMemory, InitWeightsGroup, JoinWeightsGroup,
    UpdateFromDistributed, StageWeights, UpdateFromTensor, StageTensors, CommitWeights,
    DiscardWeights, DestroyWeightsGroup, CancelWeightUpdate)}


# --- decoding ---------------------------------------------------------------------------

def parse(command: str, args: Mapping[str, Any], client: bool = False) -> AdminCommand:
    """The record of `command` with `args` (an Admin envelope's, its `timeout` taken
    out: see `split_timeout`); BadArgs names what is wrong. `client`: refuse the fields
    only the router fills in."""
    cls = COMMANDS.get(command)
    if cls is None:
        raise BadArgs(f"unknown command {command!r}")
    values = dict(args)
    for old, new in cls.ALIASES.items():
        if old in values:
            if new in values:
                raise BadArgs(f"{command}: give {new!r} or {old!r}, not both")
            values[new] = values.pop(old)
    known = [f.name for f in dataclasses.fields(cls)
             if not (client and f.name in cls.ROUTER_SETS)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise BadArgs(f"{command} takes no argument {', '.join(map(repr, unknown))}"
                      + (f"; it takes {', '.join(sorted(known))}" if known else ""))
    for f in dataclasses.fields(cls):
        if f.name not in values and f.default is dataclasses.MISSING:
            raise BadArgs(f"{command} needs {f.name!r}")
    return cls(**values)


def split_timeout(args: Mapping[str, Any], default: float) -> tuple[dict, float]:
    """An envelope's arguments without `timeout`, and that timeout (seconds; absent or
    null: `default`), capped at MAX_TIMEOUT_S: a NaN or negative one must not stop
    every timer of a loop."""
    rest = dict(args)
    raw = rest.pop("timeout", None)
    if raw is None:
        return rest, default
    if type(raw) not in (int, float) or not math.isfinite(raw) or raw <= 0:
        raise BadArgs(f"timeout must be a positive number of seconds, not {raw!r:.40}")
    return rest, min(float(raw), MAX_TIMEOUT_S)
