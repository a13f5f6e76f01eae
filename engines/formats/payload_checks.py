"""The checks every part of a decoded weight payload goes through
(engines/formats/tensor_payload.py): integers in range, sizes, dtypes, and the one
error a refused payload raises."""
from __future__ import annotations

from typing import Any

import torch


class PayloadError(ValueError):
    """The payload is not SGLang's serialized named tensors, or asks for more than
    is allowed: refused, nothing mapped is kept."""


FILE_SYSTEM_HINT = ("call torch.multiprocessing.set_sharing_strategy(\"file_system\") in the "
                    "trainer before serializing")


def integer(name: str, value: Any, low: int = 0, high: int = 1 << 48) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise PayloadError(f"{name} must be an integer in [{low}, {high}], not {value!r:.40}")
    return value


def sizes(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > 16:
        raise PayloadError(f"{name} must be a tuple of at most 16 sizes, not {value!r:.60}")
    return tuple(integer(name, v) for v in value)


def dtype(value: Any) -> torch.dtype:
    if not isinstance(value, torch.dtype):
        raise PayloadError(f"dtype {value!r:.40} is not a torch dtype")
    return value


class Record:
    """Base of the inert records a pickle may build (SGLang's dataclasses, torch's
    DupFd): made from their pickled state (NEWOBJ + BUILD), never called, and only
    with the fields named in FIELDS."""
    FIELDS: tuple[str, ...] = ()
    PICKLED_AS = ""

    def __init__(self, *args: Any) -> None:
        raise PayloadError(f"{self.PICKLED_AS} is built from its state, not called")

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and state[1] is None:
            state = state[0]                      # (dict, slots) as a dataclass may pickle
        if not isinstance(state, dict) or set(state) - set(self.FIELDS):
            raise PayloadError(f"{self.PICKLED_AS} state {state!r:.80} has other fields")
        self.__dict__.update(state)

    def field(self, name: str) -> Any:
        value = self.__dict__.get(name)
        if value is None:
            raise PayloadError(f"{self.PICKLED_AS} {self.__dict__!r:.60} lacks {name!r}")
        return value
