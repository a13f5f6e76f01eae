"""A command-line flag declared on the config field it fills (zpd/config.py).

`flag(default, help, group)` returns a dataclass field whose metadata holds the
flag; zpd/ops/flags.py builds each subcommand's parser from those fields, so a
flag's name, default, help, group and SGLang alias are written once."""
from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass
from typing import Any, Callable

# The --help sections, in the order they are shown: a newcomer finds a flag by its topic.
GROUPS = ("model", "parallelism", "memory and batching", "network", "timeouts", "limits",
          "HTTP", "security", "process")

UNSET = object()        # `cli_default` not given: the flag's default is the field's


@dataclass(frozen=True)
class Flag:
    """How one field is set from the command line. `names` are its option strings
    (the first is its name, the others aliases such as SGLang's); "{default}" in
    `help` shows the default."""
    help: str
    group: str
    names: tuple[str, ...] = ()         # () : "--" + the field's name, dashed
    dest: str | None = None             # None: the first name, underscored
    type: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None
    action: str | None = None           # "store_true" or "store_false"
    cli_default: Any = UNSET            # when not given; UNSET: the field's default
    required: bool = False
    metavar: str | None = None
    exclusive: str | None = None        # flags sharing this tag may not be given together

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"flag group {self.group!r} is not one of {GROUPS}")


def flag(default: Any = MISSING, help: str = "", group: str = "", *,
         factory: Callable[[], Any] | None = None, **kw: Any) -> Any:
    """A dataclass field with `default` (or `factory`) that is also a command-line flag."""
    meta = {"flag": Flag(help, group, **kw)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)
