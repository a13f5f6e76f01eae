"""The arguments of a worker's weight-sync commands, checked before anything
changes: each error names the field (answered 400)."""
from __future__ import annotations

from zpd.wire.status import BAD_REQUEST, StatusError


def text_arg(args: dict, name: str, limit: int = 256) -> str:
    value = args.get(name)
    if not isinstance(value, str) or not value or len(value) > limit or not value.isprintable():
        raise StatusError(BAD_REQUEST, f"{name!r} must be a printable string of 1 to {limit} "
                                       f"characters, not {value!r:.60}")
    return value


def int_arg(args: dict, name: str, low: int, high: int) -> int:
    value = args.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise StatusError(BAD_REQUEST, f"{name!r} must be an integer in [{low}, {high}], "
                                       f"not {value!r:.40}")
    return value


def port_arg(args: dict) -> int:
    """`master_port`: an integer, or its decimal string (AReaL sends one)."""
    value = args.get("master_port")
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 5:
        value = int(value)
    return int_arg({"master_port": value}, "master_port", 1, 65535)


def seconds_arg(args: dict, name: str, default: float) -> float:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86400:
        raise StatusError(BAD_REQUEST, f"{name!r} must be a number of seconds in (0, 86400]")
    return float(value)
