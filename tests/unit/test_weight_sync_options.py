"""--weight-sync-timeout: on `zpd prefill`, `zpd decode` and `zpd launch` (which
forwards it to its workers and keeps its HTTP front's --weights-timeout above it),
and `zpd admin cancel-weight-update`."""
from __future__ import annotations

import pytest

from zpd.config import HttpConfig, WorkerConfig, default_of
from zpd.ops.admin import COMMANDS
from zpd.ops.cli import build_parser
from zpd.ops.launch import weights_timeout
from zpd.ops.options import worker_argv, worker_config
from zpd.wire.admin import CancelWeightUpdate


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_flag_reaches_the_worker_config(role):
    assert worker_config(parse(role, "--model", "tiny"), role).weight_sync_timeout == \
        default_of(WorkerConfig, "weight_sync_timeout") < 600
    cfg = worker_config(parse(role, "--model", "tiny", "--weight-sync-timeout", "7.5"), role)
    assert cfg.weight_sync_timeout == 7.5


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "1e9"])
def test_a_bad_timeout_is_refused(bad):
    with pytest.raises(ValueError, match="weight-sync-timeout"):
        worker_config(parse("prefill", "--model", "tiny", "--weight-sync-timeout", bad),
                      "prefill")


def test_launch_forwards_it_and_keeps_the_front_above_it():
    argv = worker_argv(parse("launch", "--model", "tiny", "--weight-sync-timeout", "42"))
    assert worker_config(parse("prefill", *argv), "prefill").weight_sync_timeout == 42
    default = default_of(HttpConfig, "weights_timeout")
    assert weights_timeout(default_of(WorkerConfig, "weight_sync_timeout")) == default
    assert weights_timeout(1800) * 0.9 > 1800      # the workers' deadline ends first


def test_admin_has_the_cancel_command():
    args = parse("admin", "cancel-weight-update")
    _, build = COMMANDS[args.admin_command]
    assert build(args) == CancelWeightUpdate() and build(args).envelope().command == \
        "cancel_weight_update"
