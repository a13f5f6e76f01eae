"""Each subcommand's parser, built from the flags declared on the config fields
(zpd/config.py, zpd/flag.py), and `--config FILE`, which gives any of them from a
TOML (or YAML) file; a flag on the command line wins over the file."""
from __future__ import annotations

import argparse
import tomllib
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from zpd.config import (CommandFlags, Deadlines, HttpConfig, LaunchConfig, PromptLimits,
                        RouterConfig, SlurmConfig, WorkerConfig)
from zpd.flag import GROUPS, UNSET, Flag

Declared = tuple[Flag, Any]          # a flag and the default of its field, shown in its help


def pick(cls: type, *names: str, skip: tuple[str, ...] = ()) -> list[Declared]:
    """The flags declared on `cls`: those of `names` (all when none), less `skip`."""
    chosen = {f.name: f for f in fields(cls) if "flag" in f.metadata and f.name not in skip}
    if names:
        chosen = {n: chosen[n] for n in names}
    return [(_named(f.metadata["flag"], f.name), f.default) for f in chosen.values()]


def _named(flag: Flag, field_name: str) -> Flag:
    """`flag` with its names: by default the field's, dashed."""
    return flag if flag.names else replace(flag, names=("--" + field_name.replace("_", "-"),))


def _text_and_process(*more: str) -> list[Declared]:
    return pick(CommandFlags, "config", "log_level", "tokenizer_path", "chat_template", *more)


_WORKER = [*pick(WorkerConfig), *pick(Deadlines), *pick(PromptLimits),
           *_text_and_process("threads", "context_length")]
# Which records' flags each subcommand takes (within a --help group, in this order).
COMMAND_FLAGS: dict[str, list[Declared]] = {
    "run": [*pick(WorkerConfig, "model", "device", "dtype", "weight_version", "page_size",
                  "kv_cache_mb", "mem_fraction_static", "max_batch", "tp", "ep",
                  "enable_return_routed_experts", "deterministic"),
            *_text_and_process("threads", "context_length")],
    "prefill": _WORKER,
    "decode": _WORKER,
    "router": [*pick(RouterConfig), *pick(PromptLimits), *pick(CommandFlags, "config", "log_level")],
    "http": [*pick(HttpConfig), *pick(PromptLimits),
             *_text_and_process("api_key_file", "admin_api_key_file")],
    "launch": [*pick(LaunchConfig), *pick(WorkerConfig, skip=("host", "port", "ready_file")),
               *pick(Deadlines), *pick(PromptLimits),
               *pick(RouterConfig, "max_client_requests", "max_client_tokens",
                     "max_concurrent_requests", "queue_size", "queue_timeout"),
               *pick(HttpConfig, skip=("router", "workers", "model", "host", "port", "insecure",
                                       "curve_keys", "ready_file", "connect_timeout",
                                       "weights_timeout")),
               *_text_and_process("threads", "context_length", "api_key_file",
                                  "admin_api_key_file")],
}
# Inside a Slurm job (scripts/slurm/zpd.sbatch): `zpd launch`'s flags, spread over the
# allocation's nodes, and the job's own.
COMMAND_FLAGS["slurm"] = [*COMMAND_FLAGS["launch"], *pick(SlurmConfig)]


def usage(declared: list[Declared]) -> str:
    """A short usage line, the required flags and then [FLAGS]: --help lists the rest by
    group, which argparse's usage of seventy flags would bury."""
    needed = [f"{f.names[0]} {f.names[0][2:].upper().replace('-', '_')}"
              for f, _ in declared if f.required]
    return " ".join(["%(prog)s", *needed, "[FLAGS]"])


def add_flags(p: argparse.ArgumentParser, declared: list[Declared]) -> None:
    """Add `declared` to `p`, each in its --help group, the groups in GROUPS' order."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for flag, default in sorted(declared, key=lambda d: GROUPS.index(d[0].group)):
        if flag.group not in groups:
            groups[flag.group] = p.add_argument_group(flag.group)
        g: argparse._ActionsContainer = groups[flag.group]
        if flag.exclusive:
            if flag.exclusive not in exclusive:
                exclusive[flag.exclusive] = g.add_mutually_exclusive_group()
            g = exclusive[flag.exclusive]
        g.add_argument(*flag.names, **_argument(flag, default))


def _argument(flag: Flag, default: Any) -> dict[str, Any]:
    """add_argument's keywords for `flag`, whose field defaults to `default`."""
    shown = f"{default:g}" if isinstance(default, float) else str(default)
    kw: dict[str, Any] = {"help": flag.help.replace("{default}", shown), "dest": flag.dest}
    if flag.required:
        kw["required"] = True
    else:
        kw["default"] = default if flag.cli_default is UNSET else flag.cli_default
    for key in ("type", "choices", "action", "metavar"):
        if getattr(flag, key) is not None:
            kw[key] = getattr(flag, key)
    return kw


def apply_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Make the values of the --config FILE in `argv` the defaults of its subcommand's
    flags, so the command line still wins. Exits 2 (as argparse does) on a missing or
    malformed file, an unknown key or a value of the wrong type."""
    sub = _subcommand(parser, argv)
    path = _config_path(argv[1:]) if sub else None
    if path is None:
        return
    values = {}
    for key, value in _read(sub, path).items():
        action = sub._option_string_actions.get("--" + str(key).replace("_", "-"))
        if action is None or action.dest in ("help", "config"):
            sub.error(f"--config {path}: unknown key {key!r}")
        values[action.dest] = _typed(sub, path, key, action, value)
        action.required = False             # given by the file
    _refuse_exclusive(sub, path, values, argv[1:])
    sub.set_defaults(**values)


def _refuse_exclusive(sub: argparse.ArgumentParser, path: str, values: dict[str, Any],
                      args: list[str]) -> None:
    """Exit 2 when the file and the command line (or the file alone) give two flags of
    one exclusive group: argparse sees only the command line's."""
    for group in sub._mutually_exclusive_groups:
        given = [a.option_strings[0] for a in group._group_actions
                 if a.dest in values or any(arg == o or arg.startswith(o + "=")
                                            for arg in args for o in a.option_strings)]
        if len(given) > 1:
            sub.error(f"--config {path}: {' and '.join(given)} exclude each other")


def _subcommand(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and argv:
            sub = action.choices.get(argv[0])
            return sub if sub is not None and "--config" in sub._option_string_actions else None
    return None


def _config_path(args: list[str]) -> str | None:
    """The value of the last --config in `args`, as argparse would take it."""
    path = None
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg == "--config" and i + 1 < len(args):
            path = args[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
    return path


def _read(sub: argparse.ArgumentParser, path: str) -> dict:
    """The table of the TOML (or, named .yaml/.yml, YAML) file at `path`."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        sub.error(f"--config {path}: {e.strerror or e}")
    yaml = Path(path).suffix in (".yaml", ".yml")
    try:
        table = _yaml(sub, path, text) if yaml else tomllib.loads(text)
    except ValueError as e:                 # tomllib's and PyYAML's errors (YAMLError wrapped)
        sub.error(f"--config {path}: not valid {'YAML' if yaml else 'TOML'}: {e}")
    if not isinstance(table, dict):
        sub.error(f"--config {path}: want a table of flag = value")
    return table


def _yaml(sub: argparse.ArgumentParser, path: str, text: str) -> Any:
    try:
        import yaml
    except ImportError:
        sub.error(f"--config {path}: a YAML file needs PyYAML (pip install pyyaml); "
                  "or write it as TOML")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(str(e)) from None


def _typed(sub: argparse.ArgumentParser, path: str, key: str, action: argparse.Action,
           value: Any) -> Any:
    """`value` as the flag of `action` takes it, or exit 2 naming `key` and the file."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        want, ok, taken = "true or false", isinstance(value, bool), \
            action.const if value is True else action.default
    elif action.type is int:
        want, ok, taken = "an integer", number and isinstance(value, int), value
    elif action.type is float:
        want, ok, taken = "a number", number, float(value) if number else value
    else:
        want, ok, taken = "a string", isinstance(value, str), value
    if ok and action.choices is not None and taken not in action.choices:
        want, ok = f"one of {', '.join(map(str, action.choices))}", False
    if not ok:
        sub.error(f"--config {path}: {key} = {value!r}: want {want}")
    return taken
