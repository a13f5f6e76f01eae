"""The parsers built from the flags declared on the config fields: the same flags as
before (tests/unit/data/cli_flags.json, recorded from the hand-written parsers),
--help grouped by topic, and --config FILE."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from zpd.flag import GROUPS
from zpd.ops.cli import build_parser
from zpd.ops.flags import COMMAND_FLAGS, apply_config_file

RECORDED = json.loads((Path(__file__).parent / "data" / "cli_flags.json").read_text())
FIELDS = ("flags", "dest", "default", "type", "choices", "action", "required")


def subcommands() -> dict[str, argparse.ArgumentParser]:
    return next(a for a in build_parser()._actions
                if isinstance(a, argparse._SubParsersAction)).choices


def described(p: argparse.ArgumentParser) -> dict[str, dict]:
    """Each flag of `p` (help and --config aside) as the fixture records it."""
    out = {}
    for a in p._actions:
        if a.option_strings and a.dest not in ("help", "config"):
            kind = getattr(a.type, "__name__", None)
            out[a.option_strings[0]] = {
                "flags": list(a.option_strings), "dest": a.dest, "default": a.default,
                "type": kind, "choices": list(a.choices) if a.choices else None,
                "action": type(a).__name__, "required": a.required}
    return out


@pytest.mark.parametrize("command", sorted(RECORDED))
def test_same_flags_as_recorded(command: str) -> None:
    # Sampling flags are parsed by zpd/ops/options.py's own table, not declared on configs.
    sampling = {a["flags"][0] for a in RECORDED[command] if a["group"] == "sampling"}
    want = {a["flags"][0]: {k: a[k] for k in FIELDS} for a in RECORDED[command]
            if a["flags"][0] not in sampling}
    got = {k: v for k, v in described(subcommands()[command]).items() if k not in sampling}
    assert got == want


def test_kv_pool_flags_exclude_each_other(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["prefill", "--model", "tiny", "--kv-cache-mb", "64",
                                   "--mem-fraction-static", "0.5"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_launch_help_is_grouped() -> None:
    launch = subcommands()["launch"]
    text = launch.format_help()
    for group in GROUPS:
        assert f"\n{group}:\n" in text
    titles = {id(a): g.title for g in launch._action_groups for a in g._group_actions}
    ungrouped = [a.option_strings for a in launch._actions
                 if a.dest != "help" and titles.get(id(a)) not in GROUPS]
    assert ungrouped == []


@pytest.mark.parametrize("command", sorted(COMMAND_FLAGS))
def test_every_declared_flag_is_in_a_group(command: str) -> None:
    p = subcommands()[command]
    titles = {id(a): g.title for g in p._action_groups for a in g._group_actions}
    declared = {name for flag, _ in COMMAND_FLAGS[command] for name in flag.names}
    assert declared and all(titles[id(p._option_string_actions[n])] in GROUPS for n in declared)


def test_help_shows_the_field_default() -> None:
    text = subcommands()["launch"].format_help()
    assert "{default}" not in text and "(default 180)" in text.replace("\n", " ")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    apply_config_file(parser, argv)
    return parser.parse_args(argv)


def refusal(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_config_file_values_apply(tmp_path: Path) -> None:
    f = tmp_path / "cluster.toml"
    f.write_text('model = "tiny"\nmax-batch = 32\nkv_wait_timeout = 5\nno-cpu-bind = true\n'
                 'dtype = "float64"\nincremental-streaming-output = true\ntp-size = 2\n')
    args = parse(["launch", "--config", str(f)])
    assert (args.model, args.max_batch, args.kv_wait_timeout, args.cpu_bind, args.dtype,
            args.incremental_streaming_output, args.tp) == ("tiny", 32, 5.0, False, "float64",
                                                            True, 2)
    assert isinstance(args.kv_wait_timeout, float)


def test_command_line_wins_over_file(tmp_path: Path) -> None:
    f = tmp_path / "w.toml"
    f.write_text('model = "tiny"\nmax-batch = 32\npeer-timeout = 9.5\n')
    args = parse(["decode", "--max-batch", "8", f"--config={f}", "--model", "null"])
    assert (args.max_batch, args.peer_timeout, args.model) == (8, 9.5, "null")


def test_unknown_key_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "r.toml"
    f.write_text('prefill = "127.0.0.1:1"\ndecode = "127.0.0.1:2"\nmax-bach = 3\n')
    err = refusal(["router", "--config", str(f)], capsys)
    assert "'max-bach'" in err and str(f) in err
    # a flag of another subcommand is unknown here too
    f.write_text("max-batch = 3\n")
    assert "'max-batch'" in refusal(["router", "--prefill", "a:1", "--decode", "b:2",
                                     "--config", str(f)], capsys)


@pytest.mark.parametrize("line, want", [
    ('max-batch = "32"', "want an integer"), ("max-batch = 3.5", "want an integer"),
    ("max-batch = true", "want an integer"), ('heartbeat = "fast"', "want a number"),
    ('insecure = "yes"', "want true or false"), ("device = 1", "want a string"),
    ('dtype = "int8"', "want one of float32"), ("model = [1]", "want a string")])
def test_bad_type_refused(tmp_path: Path, capsys: pytest.CaptureFixture, line: str,
                          want: str) -> None:
    f = tmp_path / "p.toml"
    f.write_text(line + "\n")
    err = refusal(["prefill", "--model", "tiny", "--config", str(f)], capsys)
    assert want in err and line.split(" =")[0] in err and str(f) in err


def test_missing_or_malformed_file_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "none.toml"
    assert str(missing) in refusal(["http", "--model", "tiny", "--config", str(missing)], capsys)
    bad = tmp_path / "bad.toml"
    bad.write_text("max-batch = \n")
    assert "not valid TOML" in refusal(["run", "--config", str(bad)], capsys)


def test_config_file_in_yaml(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    f = tmp_path / "w.yaml"
    f.write_text("model: tiny\nmax_batch: 4\nclear-freed-pages: true\n")
    args = parse(["prefill", "--config", str(f)])
    assert (args.model, args.max_batch, args.clear_freed_pages) == ("tiny", 4, True)


def test_config_file_reaches_the_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from zpd.ops.cli import main
    f = tmp_path / "p.toml"
    f.write_text("tp = 0\n")
    assert main(["prefill", "--model", "tiny", "--config", str(f)]) == 2
    assert "--tp must be at least 1" in capsys.readouterr().err


def test_file_and_command_line_exclusive_flags_refused(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "m.toml"
    f.write_text('model = "tiny"\nkv-cache-mb = 64\n')
    err = refusal(["decode", "--config", str(f), "--mem-fraction-static", "0.5"], capsys)
    assert "--kv-cache-mb and --mem-fraction-static exclude each other" in err
    f.write_text('model = "tiny"\nkv-cache-mb = 64\nmem-fraction-static = 0.5\n')
    assert "exclude each other" in refusal(["prefill", "--config", str(f)], capsys)
    f.write_text('model = "tiny"\nkv-cache-mb = 64\n')
    assert parse(["decode", "--config", str(f)]).kv_cache_mb == 64
