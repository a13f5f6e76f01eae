"""The admin plane's fields: limits, the pause and sync enums, and the checks that
every admin record's fields run when it is made (zpd/wire/admin.py). Torch-free."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from enum import Enum
from typing import Any, Callable, NamedTuple

from zpd.wire.status import BAD_REQUEST, StatusError

MAX_TIMEOUT_S = 3600.0     # longest a fan-out waits for its workers' answers
MAX_RANKS = 4096           # entries of serialized_named_tensors (one per worker at most)
# The engines' own limits (engines.weights.push.MAX_TENSORS and
# engines.formats.tensor_payload.MAX_PAYLOAD_CHARS), restated so that the wire stays
# torch-free; tests/unit/test_admin_records.py checks that they agree.
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
INDEX = Check(lambda v: _int(v) and 0 <= v < MAX_RANKS, f"an integer in [0, {MAX_RANKS})")
COUNT = Check(lambda v: _int(v) and 1 <= v <= MAX_RANKS, f"an integer in [1, {MAX_RANKS}]")
ROWS = Check(lambda v: _int(v) and 1 <= v <= 1 << 30, "a positive integer")
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
