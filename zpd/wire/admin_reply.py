"""A worker's answer to an admin command: the command's result record (one per command
that answers with data, named by the command's `RESULT`, zpd/wire/admin.py), and
`WorkerReply`, that answer as the router folds it: parsed once where it arrives
(`from_wire`, into the record of the command it answers), or made by the router for a
worker that could not answer. The JSON a client gets (`to_wire`) is the worker's result
with its endpoint and role (docs/design.md, "Admin"). Torch-free."""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping, TypeVar

ENVELOPE = ("ok", "endpoint", "role")      # the router's own keys: a worker's are dropped
MALFORMED = 500                            # a reply the router cannot read: a worker's fault

R = TypeVar("R", bound="AdminResult")


class ResultError(ValueError):
    """A worker's result that is not its command's record: a field missing, unknown, or
    of the wrong type."""


class AdminResult:
    """Base of a result record: its fields are the reply's JSON keys, each checked
    against its annotation when the record is made (by the worker or by `from_wire`)."""

    __slots__ = ()

    def __post_init__(self) -> None:
        for name, hint in _hints(type(self)).items():
            value = getattr(self, name)
            if not _fits(value, hint):
                raise ResultError(f"{type(self).__name__}: {name!r} must be {_wanted(hint)}, "
                                  f"not {value!r:.80}")

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_wire(cls: type[R], wire: Mapping[str, Any]) -> R:
        fields = dataclasses.fields(cls)
        unknown = sorted(set(wire) - {f.name for f in fields})
        if unknown:
            raise ResultError(f"{cls.__name__}: unexpected {', '.join(map(repr, unknown))}")
        missing = [f.name for f in fields if f.name not in wire and _required(f)]
        if missing:
            raise ResultError(f"{cls.__name__}: missing {', '.join(map(repr, missing))}")
        return cls(**wire)


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return {f.name: typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls)}


def _options(hint: Any) -> tuple:
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) \
        else (hint,)


def _fits(value: Any, hint: Any) -> bool:
    return any(_is(value, t) for t in _options(hint))


def _is(value: Any, t: Any) -> bool:
    """JSON's types: a bool is no int, an int is a float (1.0 may arrive as 1)."""
    if t is type(None):
        return value is None
    if t in (int, float) and type(value) is bool:
        return False
    if t is float:
        return isinstance(value, (int, float))
    if isinstance(t, type) and issubclass(t, AdminResult):
        return isinstance(value, t)
    return isinstance(value, typing.get_origin(t) or t)


def _wanted(hint: Any) -> str:
    return " or ".join("null" if t is type(None) else getattr(t, "__name__", str(t))
                       for t in _options(hint))


# --- each command's result ----------------------------------------------------------

@dataclass(frozen=True, slots=True)
class NoResult(AdminResult):
    """A command that answers with no fields of its own."""


@dataclass(frozen=True, slots=True)
class WorkerStatus(AdminResult):
    """A worker's `status` (and its answer to `pause`): the core's fields, then `more`,
    its scheduler's and plugged-in parts' (queues, peers, prefix cache, counters, weight
    groups). Those differ by role and part, and the contract names only some of them
    (docs/design.md, "Python client": "at least"), so they stay free-form."""
    weight_version: str | None
    paused: str | None
    memory: str
    weights_memory: str
    device: str
    dtype: str
    context_length: int
    max_batch: int
    kv_pages: dict
    tp_size: int
    tp_pids: list
    loop_max_late_ms: float
    ep_size: int = 1            # expert-parallel ranks (a mixture's experts split over them)
    deterministic: bool = False  # --deterministic (docs/deterministic.md)
    more: dict = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        core = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "more"}
        return core | self.more

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> WorkerStatus:
        names = {f.name for f in dataclasses.fields(cls)} - {"more"}
        return super(WorkerStatus, cls).from_wire(
            {k: v for k, v in wire.items() if k in names}
            | {"more": {k: v for k, v in wire.items() if k not in names}})


@dataclass(frozen=True, slots=True)
class Continued(AdminResult):
    """`continue`: the worker's status, the pause it left, and (a decode) how many held
    requests it re-admitted."""
    status: WorkerStatus
    was_paused: str | None
    resumed: int | None = None          # None: a prefill, which holds none

    def to_wire(self) -> dict[str, Any]:
        return self.status.to_wire() | {"was_paused": self.was_paused} \
            | ({} if self.resumed is None else {"resumed": self.resumed})

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> Continued:
        rest = dict(wire)
        if "was_paused" not in rest:
            raise ResultError("Continued: missing 'was_paused'")
        was, resumed = rest.pop("was_paused"), rest.pop("resumed", None)
        return cls(WorkerStatus.from_wire(rest), was, resumed)


@dataclass(frozen=True, slots=True)
class MemoryState(AdminResult):
    """`release_memory` / `resume_memory`: "resident" or "released", each."""
    memory: str
    weights_memory: str


@dataclass(frozen=True, slots=True)
class WeightVersion(AdminResult):
    """`update_weights` / `commit_weights`: the version the worker now serves."""
    weight_version: str | None


@dataclass(frozen=True, slots=True)
class VersionChanged(AdminResult):
    """`update_weight_version`: the new name of the weights, and the old one."""
    weight_version: str
    previous: str | None


@dataclass(frozen=True, slots=True)
class WeightValues(AdminResult):
    """`get_weights`: the rows asked for, as nested lists of floats (SGLang's shape)."""
    values: list


@dataclass(frozen=True, slots=True)
class Flushed(AdminResult):
    flushed_pages: int


@dataclass(frozen=True, slots=True)
class Joined(AdminResult):
    """`join_weights_group`: the trainer group joined, as which rank."""
    group_name: str
    rank: int
    world_size: int


@dataclass(frozen=True, slots=True)
class StagedPush(AdminResult):
    """`stage_weights` / `stage_tensors`: what the worker holds, ready to commit."""
    staged_tensors: int
    staged_bytes: int


@dataclass(frozen=True, slots=True)
class Discarded(AdminResult):
    discarded: str                      # the push's update id


@dataclass(frozen=True, slots=True)
class Destroyed(AdminResult):
    group_name: str
    destroyed: bool


@dataclass(frozen=True, slots=True)
class Cancelled(AdminResult):
    cancelled: str | None               # the step ended, in words (None: none ran)


@dataclass(frozen=True, slots=True)
class Failed(AdminResult):
    """Any command's failure: an HTTP-like status (docs/design.md) and why."""
    status: int
    error: str


# --- the reply ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class WorkerReply:
    """`status` and `error` are set on a failure; `result` (on success) is the record
    of the command's result."""
    ok: bool
    endpoint: str
    role: str
    status: int | None = None
    error: str | None = None
    result: AdminResult | None = None

    @classmethod
    def from_wire(cls, ok: bool, wire: Mapping[str, Any], endpoint: str, role: str,
                  kind: type[AdminResult]) -> WorkerReply:
        """`wire` read as `kind` (ok) or `Failed`; one that is neither becomes a failed
        reply saying what is wrong with it, never an exception in the router."""
        rest = {k: v for k, v in wire.items() if k not in ENVELOPE}
        try:
            if ok:
                return cls(True, endpoint, role, result=kind.from_wire(rest))
            failed = Failed.from_wire(rest)
        except ResultError as e:
            return cls.failed(endpoint, role, MALFORMED, f"malformed reply from the worker: {e}")
        return cls.failed(endpoint, role, failed.status, failed.error)

    @classmethod
    def failed(cls, endpoint: str, role: str, status: int, error: str) -> WorkerReply:
        """The router's answer for a worker that did not (dead, silent, too slow)."""
        return cls(False, endpoint, role, status, error)

    def to_wire(self) -> dict[str, Any]:
        result = {} if self.result is None else self.result.to_wire()
        extra = {k: v for k, v in (("status", self.status), ("error", self.error))
                 if v is not None}
        return {"ok": self.ok} | result | extra | {"endpoint": self.endpoint,
                                                    "role": self.role}


def to_wire(replies: list[WorkerReply]) -> list[dict[str, Any]]:
    """The `workers` list of an answer."""
    return [r.to_wire() for r in replies]
