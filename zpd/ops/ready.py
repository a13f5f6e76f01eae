"""Ready files: how a started process tells its launcher where it listens."""
from __future__ import annotations

import os

import orjson


def write_ready_file(path: str | os.PathLike | None, record: dict) -> None:
    """Write `record` as JSON to `path` atomically (a reader never sees half a file);
    nothing when `path` is None."""
    if not path:
        return
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "wb") as f:
        f.write(orjson.dumps(record))
    os.replace(tmp, path)


def write_role_ready(path: str | os.PathLike | None, role: str, endpoint: str) -> None:
    """A started process's ready file: its role, where it listens and its pid."""
    write_ready_file(path, {"role": role, "endpoint": endpoint, "pid": os.getpid()})
