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
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, Mapping

from zpd.wire.admin_fields import (BACKEND, COUNT, INDEX, BadArgs, Check, LIST, LOAD_FORMAT, MAX_SECONDS,
                                  MAX_TIMEOUT_S, MEMORY_TAGS, MODE, NAME, NAMES, OBJECT,
                                  PAYLOAD, PAYLOADS, PORT, PauseMode, RANK, RANK_OFFSET, RID, ROWS,
                                  SECONDS, STRINGS, TAGS, TEXT, TRAINER_INIT, VERSION, WORLD,
                                  arg)
from zpd.wire.admin_reply import (AdminResult, Cancelled, Continued, Destroyed, Discarded,
                                  Flushed, Joined, MemoryState, NoResult, StagedPush,
                                  VersionChanged, WeightValues, WeightVersion, WorkerStatus)
from zpd.wire.messages import Admin


# --- records ---------------------------------------------------------------------------

class AdminCommand:
    """Base of every admin record. `COMMAND` is its wire name; `ALIASES` are old
    argument names still taken for a field (the Python client's `version`);
    `ROUTER_SETS` are fields only the router fills in (a client may not); `RESULT` is
    the record of a worker's answer (zpd/wire/admin_reply.py)."""

    __slots__ = ()
    COMMAND: ClassVar[str] = ""
    RESULT: ClassVar[type[AdminResult]] = NoResult
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
    RESULT: ClassVar[type[AdminResult]] = WorkerStatus
    mode: PauseMode = arg(MODE, PauseMode.RETRACT)


@dataclass(frozen=True, slots=True)
class Continue(AdminCommand):
    """`prefills`: the live prefills (those that answered their continue); `early`: rid ->
    a first token the client has from a prefill (FirstToken.to_wire). Router-set."""
    COMMAND: ClassVar[str] = "continue"
    RESULT: ClassVar[type[AdminResult]] = Continued
    ROUTER_SETS: ClassVar[tuple[str, ...]] = ("prefills", "early")
    prefills: list[str] | None = arg(STRINGS, None)
    early: dict | None = arg(OBJECT, None)


@dataclass(frozen=True, slots=True)
class Status(AdminCommand):
    COMMAND: ClassVar[str] = "status"
    RESULT: ClassVar[type[AdminResult]] = WorkerStatus


@dataclass(frozen=True, slots=True)
class FlushCache(AdminCommand):
    COMMAND: ClassVar[str] = "flush_cache"
    RESULT: ClassVar[type[AdminResult]] = Flushed


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
    RESULT: ClassVar[type[AdminResult]] = WeightVersion
    ALIASES: ClassVar[Mapping[str, str]] = {"version": "weight_version"}
    path: str = arg(TEXT)
    weight_version: str | None = arg(VERSION, None)


@dataclass(frozen=True, slots=True)
class UpdateWeightVersion(AdminCommand):
    COMMAND: ClassVar[str] = "update_weight_version"
    RESULT: ClassVar[type[AdminResult]] = VersionChanged
    ALIASES: ClassVar[Mapping[str, str]] = {"version": "weight_version"}
    weight_version: str = arg(TEXT)


@dataclass(frozen=True, slots=True)
class GetWeights(AdminCommand):
    """SGLang's get_weights_by_name: the first `truncate_size` rows of weight `name`."""
    COMMAND: ClassVar[str] = "get_weights"
    RESULT: ClassVar[type[AdminResult]] = WeightValues
    name: str = arg(NAME)
    truncate_size: int = arg(ROWS, 100)


class _Tagged:
    """SGLang's memory `tags` (null: all of them)."""
    __slots__ = ()

    @property
    def tag_set(self) -> set[str]:
        return set(MEMORY_TAGS if self.tags is None else self.tags)


@dataclass(frozen=True, slots=True)
class ReleaseMemory(_Tagged, AdminCommand):
    COMMAND: ClassVar[str] = "release_memory"
    RESULT: ClassVar[type[AdminResult]] = MemoryState
    tags: list[str] | None = arg(TAGS, None)


@dataclass(frozen=True, slots=True)
class ResumeMemory(_Tagged, AdminCommand):
    COMMAND: ClassVar[str] = "resume_memory"
    RESULT: ClassVar[type[AdminResult]] = MemoryState
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

    def join(self, rank: int, timeout_s: float, relay: tuple[int, int, str] | None = None
             ) -> JoinWeightsGroup:
        """What one worker is told; `relay`: (its rank, size, key) in the cluster's relay
        group (zpd/router/weights/sync.py)."""
        return JoinWeightsGroup(self.group_name, self.master_address, self.master_port,
                                self.world_size, rank, timeout_s, self.backend, self.trainer_init,
                                *(relay or (None, None, None)))


@dataclass(frozen=True, slots=True)
class JoinWeightsGroup(AdminCommand):
    """One worker's part of init_weights_update_group (the router's to send)."""
    COMMAND: ClassVar[str] = "join_weights_group"
    RESULT: ClassVar[type[AdminResult]] = Joined
    group_name: str = arg(NAME)
    master_address: str = arg(NAME)
    master_port: int = arg(PORT)
    world_size: int = arg(WORLD)
    rank: int = arg(RANK)
    timeout_s: float = arg(SECONDS, MAX_SECONDS)      # the worker's own limit caps it
    backend: str | None = arg(BACKEND, None)
    trainer_init: str | None = arg(TRAINER_INIT, None)
    # With fewer trainer ranks than workers: this worker's rank in the cluster's relay
    # group of relay_size, met on the trainer's store under relay_key. Rank 0 also
    # joins the trainer's group as `rank` and passes each broadcast on; the others
    # receive from it alone (their `rank` is rank 0's).
    relay_rank: int | None = arg(INDEX, None)
    relay_size: int | None = arg(COUNT, None)
    relay_key: str | None = arg(NAME, None)

    def check(self) -> None:
        if self.rank >= self.world_size:
            raise BadArgs(f"{self.COMMAND}: 'rank' {self.rank} must be below 'world_size' "
                          f"{self.world_size}")
        relay = (self.relay_rank, self.relay_size, self.relay_key)
        if relay.count(None) not in (0, 3) or (self.relay_size or 2) < 2 \
                or (self.relay_rank or 0) >= (self.relay_size or 1):
            raise BadArgs(f"{self.COMMAND}: 'relay_rank', 'relay_size' and 'relay_key' go "
                          f"together, the rank below the size (>= 2), not {relay}")


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
    RESULT: ClassVar[type[AdminResult]] = StagedPush
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
    RESULT: ClassVar[type[AdminResult]] = StagedPush
    update_id: str = arg(NAME)
    payload: str = arg(PAYLOAD)
    load_format: str | None = arg(LOAD_FORMAT, None)
    rank: int = arg(INDEX, 0)          # this worker's index of `ranks` (a LocalSerializedTensor's)
    ranks: int = arg(COUNT, 1)

    def check(self) -> None:
        if self.rank >= self.ranks:
            raise BadArgs(f"{self.COMMAND}: 'rank' {self.rank} must be below 'ranks' {self.ranks}")


@dataclass(frozen=True, slots=True)
class CommitWeights(AdminCommand):
    """The second phase when every worker staged: apply, and move to `weight_version`
    (None: each keeps its own)."""
    COMMAND: ClassVar[str] = "commit_weights"
    RESULT: ClassVar[type[AdminResult]] = WeightVersion
    ALIASES: ClassVar[Mapping[str, str]] = {"version": "weight_version"}
    update_id: str = arg(NAME)
    weight_version: str | None = arg(VERSION, None)


@dataclass(frozen=True, slots=True)
class DiscardWeights(AdminCommand):
    """The second phase when any worker failed; `destroy`: leave that group too."""
    COMMAND: ClassVar[str] = "discard_weights"
    RESULT: ClassVar[type[AdminResult]] = Discarded
    update_id: str = arg(NAME)
    destroy: str | None = arg(NAME, None)


@dataclass(frozen=True, slots=True)
class DestroyWeightsGroup(AdminCommand):
    COMMAND: ClassVar[str] = "destroy_weights_update_group"
    RESULT: ClassVar[type[AdminResult]] = Destroyed
    group_name: str = arg(NAME)


@dataclass(frozen=True, slots=True)
class CancelWeightUpdate(AdminCommand):
    """End the join or push under way on every worker; never blocked. `reason`: what
    the ended step answers (the router's own, when one worker's failure dooms the rest)."""
    COMMAND: ClassVar[str] = "cancel_weight_update"
    RESULT: ClassVar[type[AdminResult]] = Cancelled
    reason: str | None = arg(NAME, None)


COMMANDS: Mapping[str, type[AdminCommand]] = {cls.COMMAND: cls for cls in (
    Pause, Continue, Status, FlushCache, AbortRequest, AbortAll, UpdateWeights,
    UpdateWeightVersion, GetWeights, ReleaseMemory, ResumeMemory, InitWeightsGroup, JoinWeightsGroup,
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
