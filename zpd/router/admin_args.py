"""What the router's admin commands accept. Every argument is checked before any
state changes: a pause with an unknown mode must not leave the router queueing
every request, and a NaN timeout must not stop every timer of its loop."""
from __future__ import annotations

import math
from typing import Any, Callable

from engines.formats.tensor_payload import MAX_PAYLOAD_CHARS
from engines.weight_push import MAX_TENSORS
from zpd.worker.scheduler import PAUSE_MODES
from zpd.worker.trainer_group import TRAINER_INITS

MAX_TIMEOUT_S = 3600.0     # longest a fan-out waits for its workers' answers
MAX_RANKS = 4096           # entries of serialized_named_tensors (one per worker at most)


class BadArgs(ValueError):
    """An admin command's arguments are wrong: answered 400, nothing changed."""


def _text(value: Any) -> bool:
    return isinstance(value, str) and value != ""


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _port(value: Any) -> bool:
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 5:
        value = int(value)                 # AReaL sends the port as a string
    return _int(value) and 1 <= value <= 65535


def _payloads(value: Any) -> bool:
    """serialized_named_tensors: all of it travels in one router frame (16 MiB)."""
    return (isinstance(value, list) and 0 < len(value) <= MAX_RANKS
            and all(isinstance(v, str) and v for v in value)
            and sum(map(len, value)) <= MAX_PAYLOAD_CHARS)


Check = tuple[Callable[[Any], bool], str]     # the test, and what it wants (for the error)
TEXT: Check = (_text, "a non-empty string")
TAGS: Check = (lambda v: v is None or (isinstance(v, list) and len(v) <= 8
                                      and all(_text(t) and len(t) <= 64 for t in v)),
               "null or a list of at most 8 tag names")

# Each command the router knows -> the arguments it takes. Commands not named here
# go to the workers as they are: each worker refuses (400) what it does not know.
ARGS: dict[str, dict[str, Check]] = {
    "pause": {"mode": (lambda v: isinstance(v, str) and v in PAUSE_MODES,
                       f"one of {', '.join(PAUSE_MODES)}")},
    "continue": {},
    "update_weights": {"path": TEXT, "version": (lambda v: v is None or _text(v),
                                                 "a non-empty string (or null: the version stays)")},
    "abort": {"rid": TEXT},
    "abort_all": {},
    "update_weight_version": {"version": TEXT},
    "status": {}, "flush_cache": {},
    # SGLang's memory tags; the workers check the names (zpd/worker/memory.py)
    "release_memory": {"tags": TAGS}, "resume_memory": {"tags": TAGS},
    # trainer weight sync (zpd/router/weight_sync.py); workers check the tensors
    "init_weights_update_group": {
        "master_address": TEXT, "master_port": (_port, "a port (an integer or its decimal "
                                                         "string, 1 to 65535)"),
        "rank_offset": (lambda v: _int(v) and 1 <= v < 1 << 16, "an integer >= 1 (rank 0 is "
                                                                "the trainer)"),
        "world_size": (lambda v: _int(v) and 2 <= v <= 1 << 16, "an integer >= 2"),
        "group_name": TEXT, "backend": (lambda v: v in ("gloo", "nccl"), "gloo or nccl"),
        "trainer_init": (lambda v: v in TRAINER_INITS, " or ".join(TRAINER_INITS))},
    "update_weights_from_distributed": {
        "names": (lambda v: isinstance(v, list) and 0 < len(v) <= MAX_TENSORS,
                  f"a list of 1 to {MAX_TENSORS} tensor names"),
        "dtypes": (lambda v: isinstance(v, list), "a list of dtype names"),
        "shapes": (lambda v: isinstance(v, list), "a list of shapes"),
        "group_name": TEXT, "weight_version": (lambda v: v is None or _text(v),
                                               "a non-empty string (or null)"),
        "load_format": (lambda v: v in (None, "flattened_bucket"),
                        'null (one broadcast per tensor) or "flattened_bucket"')},
    "destroy_weights_update_group": {"group_name": TEXT},
    # ends the join or push under way on every worker (zpd/worker/weight_sync.py); never blocked
    "cancel_weight_update": {},
    "update_weights_from_tensor": {
        "serialized_named_tensors": (_payloads, f"a list of 1 to {MAX_RANKS} base64 strings of "
                                                f"{MAX_PAYLOAD_CHARS} characters in all at most"),
        "weight_version": (lambda v: v is None or _text(v), "a non-empty string (or null: the "
                                                            "version stays)"),
        "load_format": (lambda v: v in (None, "flattened_bucket"),
                        'null ((name, tensor) pairs) or "flattened_bucket"')},
}
REQUIRED = {"update_weights": ("path",), "abort": ("rid",), "update_weight_version": ("version",),
            "init_weights_update_group": ("master_address", "master_port", "rank_offset",
                                          "world_size", "group_name"),
            "update_weights_from_distributed": ("names", "dtypes", "shapes", "group_name"),
            "destroy_weights_update_group": ("group_name",),
            "update_weights_from_tensor": ("serialized_named_tensors",)}


def check_args(command: str, args: dict) -> None:
    """Raise BadArgs unless `args` are what `command` takes."""
    known = ARGS.get(command)
    if known is None:
        return
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise BadArgs(f"{command} takes no argument {', '.join(map(repr, unknown))}"
                      + (f"; it takes {', '.join(sorted(known))}" if known else ""))
    for name in REQUIRED.get(command, ()):
        if name not in args:
            raise BadArgs(f"{command} needs {name!r}")
    for name, value in args.items():
        ok, wanted = known[name]
        if not ok(value):
            raise BadArgs(f"{command}: {name!r} must be {wanted}, not {value!r:.80}")


def admin_timeout(raw: Any, default: float) -> float:
    """The `timeout` argument (seconds; None: `default`), capped at MAX_TIMEOUT_S."""
    if raw is None:
        return default
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or \
            not math.isfinite(raw) or raw <= 0:
        raise BadArgs(f"timeout must be a positive number of seconds, not {raw!r:.40}")
    return min(float(raw), MAX_TIMEOUT_S)
