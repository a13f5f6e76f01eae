"""A worker's answer to an admin command, as the router folds it: parsed once where it
arrives (`from_wire`), or made by the router for a worker that could not answer. The
JSON a client gets (`to_wire`) is the dict the worker sent, with its endpoint and
role (docs/design.md, "Admin"). Torch-free."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

ENVELOPE = ("ok", "endpoint", "role")      # the router's own keys: a worker's are dropped


@dataclass(frozen=True, slots=True)
class WorkerReply:
    """`status` and `error` are set on a failure (an int and a string, else they stay
    in `result`); `result` holds the command's own fields (weight_version, ...)."""
    ok: bool
    endpoint: str
    role: str
    status: int | None = None
    error: str | None = None
    result: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, ok: bool, result: Mapping[str, Any], endpoint: str,
                  role: str) -> WorkerReply:
        rest = {k: v for k, v in result.items() if k not in ENVELOPE}
        status = rest.pop("status") if type(rest.get("status")) is int else None
        error = rest.pop("error") if type(rest.get("error")) is str else None
        return cls(bool(ok), endpoint, role, status, error, rest)

    @classmethod
    def failed(cls, endpoint: str, role: str, status: int, error: str) -> WorkerReply:
        """The router's answer for a worker that did not (dead, silent, too slow)."""
        return cls(False, endpoint, role, status, error)

    def to_wire(self) -> dict[str, Any]:
        extra = {k: v for k, v in (("status", self.status), ("error", self.error))
                 if v is not None}
        return {"ok": self.ok} | self.result | extra | {"endpoint": self.endpoint,
                                                         "role": self.role}


def to_wire(replies: list[WorkerReply]) -> list[dict[str, Any]]:
    """The `workers` list of an answer."""
    return [r.to_wire() for r in replies]
