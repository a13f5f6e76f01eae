"""Fault plans: which writes a FaultyBackend breaks, and how.

A plan is an ordered list of rules. For each write, the first rule that
selects it decides its fate; a write no rule selects goes through untouched.

Modes:
    fail   complete at once with ok=False (reason: the rule's `reason`)
    delay  hand the write to the real backend `seconds` later
    hang   never complete until cancel() ("cancelled") or close() ("closed")
    drop   complete at once with ok=True but write nothing: a lost transfer

Selectors (all optional, combined with AND):
    ids=3|5|9   only these transfer ids (in Python also `match=callable`)
    skip=K      let the first K selected writes through first
    count=N     fault only the next N selected writes (default: all of them)

As text (FaultPlan.parse; how a zpd worker in another process gets one, from
$ZPD_TRANSPORT_FAULT, see zpd/env.py), the compact form is rules separated by
";", each `mode[:key=value,key=value...]`:

    "fail:count=1"
    "delay:seconds=2.5,count=3;drop:skip=1,count=1"
    "hang:ids=7|9"

or JSON, one object or a list: '[{"mode": "fail", "count": 1, "reason": "nic down"}]'.
A malformed plan raises FaultPlanError naming its source and the problem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Union

from .base import TransportError

MODES = ("fail", "delay", "hang", "drop")
_KEYS = ("mode", "count", "skip", "ids", "seconds", "reason")
_FORMAT = ('expected rules like "fail:count=1" or "delay:seconds=0.5,skip=2;drop:ids=3|4" '
           'or JSON [{"mode": "hang", "count": 1}]; modes: ' + ", ".join(MODES) +
           "; keys: count, skip, ids, seconds (delay only), reason")


class FaultPlanError(TransportError, ValueError):
    """A fault plan that cannot be understood."""


@dataclass
class FaultRule:
    """One way to break writes; `count` and `skip` count down as writes pass."""

    mode: str
    count: int | None = None
    skip: int = 0
    ids: frozenset[int] | None = None
    match: Callable[[int], bool] | None = None
    seconds: float = 0.0
    reason: str = "injected failure"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise FaultPlanError(f"unknown fault mode {self.mode!r}; {_FORMAT}")
        if (self.count is not None and self.count < 0) or self.skip < 0:
            raise FaultPlanError(f"count and skip must be >= 0 in {self!r}")
        if (self.mode == "delay") != (self.seconds > 0):
            raise FaultPlanError(f"'seconds' > 0 is required by delay and only by delay: {self!r}")
        if self.ids is not None:
            self.ids = frozenset(int(i) for i in self.ids)

    def selects(self, transfer_id: int) -> bool:
        """Does this rule take the write? Consumes skip/count when it does."""
        if self.count == 0:
            return False
        if self.ids is not None and transfer_id not in self.ids:
            return False
        if self.match is not None and not self.match(transfer_id):
            return False
        if self.skip:
            self.skip -= 1
            return False
        if self.count is not None:
            self.count -= 1
        return True


class FaultPlan:
    """An ordered list of FaultRules; not thread-safe (FaultyBackend locks it)."""

    def __init__(self, rules: Iterable[FaultRule] = ()) -> None:
        self.rules = list(rules)

    def choose(self, transfer_id: int) -> FaultRule | None:
        for rule in self.rules:
            if rule.selects(transfer_id):
                return rule
        return None

    def __repr__(self) -> str:
        return f"FaultPlan({self.rules!r})"

    @classmethod
    def parse(cls, text: str, source: str = "fault plan") -> "FaultPlan":
        """Parse the compact or JSON form (see the module docstring)."""
        text = text.strip()
        try:
            if text and text[0] in "[{":
                specs = _json_specs(text)
            else:
                specs = [_compact_spec(part) for part in text.split(";") if part.strip()]
            return cls(_rule(spec) for spec in specs)
        except FaultPlanError as exc:
            raise FaultPlanError(f"bad {source} {text!r}: {exc}") from None
        except (ValueError, TypeError) as exc:
            raise FaultPlanError(f"bad {source} {text!r}: {exc}; {_FORMAT}") from None


PlanLike = Union[FaultPlan, FaultRule, Iterable[FaultRule], str, None]


def as_plan(plan: PlanLike) -> FaultPlan:
    """Accept a plan, a rule, rules, plan text or None (no faults)."""
    if plan is None:
        return FaultPlan()
    if isinstance(plan, FaultPlan):
        return plan
    if isinstance(plan, FaultRule):
        return FaultPlan([plan])
    if isinstance(plan, str):
        return FaultPlan.parse(plan)
    return FaultPlan(plan)


def _json_specs(text: str) -> list[dict[str, Any]]:
    data = json.loads(text)
    specs = data if isinstance(data, list) else [data]
    if not all(isinstance(s, dict) for s in specs):
        raise FaultPlanError(f"JSON plan must be an object or a list of objects; {_FORMAT}")
    return specs


def _compact_spec(part: str) -> dict[str, Any]:
    mode, _, args = part.strip().partition(":")
    spec: dict[str, Any] = {"mode": mode.strip()}
    for item in filter(None, (a.strip() for a in args.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise FaultPlanError(f"expected key=value, got {item!r}; {_FORMAT}")
        spec[key.strip()] = value.strip()
    return spec


def _rule(spec: dict[str, Any]) -> FaultRule:
    unknown = set(spec) - set(_KEYS)
    if unknown or "mode" not in spec:
        raise FaultPlanError(f"unknown keys {sorted(unknown)} or no mode in {spec}; {_FORMAT}")
    ids = spec.get("ids")
    if isinstance(ids, str):
        ids = [int(i) for i in ids.split("|") if i.strip()]
    count = spec.get("count")
    return FaultRule(mode=str(spec["mode"]), count=None if count is None else _int(count),
                     skip=_int(spec.get("skip", 0)), ids=None if ids is None else frozenset(ids),
                     seconds=float(spec.get("seconds", 0.0)),
                     reason=str(spec.get("reason", "injected failure")))


def _int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise FaultPlanError(f"expected an integer, got {value!r}")
    return int(value)
