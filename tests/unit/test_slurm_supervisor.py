"""`zpd slurm`'s supervisor on stand-in steps (a local command in place of srun): a step
that never gets ready is stopped after --startup-timeout, started again after the
backoff, and given up after --max-restarts, which ends the job with exit code 1."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from zpd.ops.slurm import Supervisor
from zpd.ops.slurm_nodes import Node
from zpd.ops.slurm_steps import Step


class LocalStep(Step):
    """Runs `sleep` here: never writes its ready file."""

    def srun_argv(self) -> list[str]:
        return ["sleep", "30"]


def test_a_step_never_ready_is_stopped_restarted_then_given_up(tmp_path: Path) -> None:
    for sub in ("ready", "logs"):
        (tmp_path / sub).mkdir()
    args = argparse.Namespace(startup_timeout=0.2, restart_backoff=0.05, max_restarts=1,
                              curve_keys=None)
    sup = Supervisor(args, tmp_path, tmp_path / "zpd-1.json", {"SLURM_JOB_ID": "1"})
    step = LocalStep("decode0", "decode", Node("n3", "127.0.0.1", 1), 1, [], tmp_path)
    sup.steps = [step]
    step.start()
    deadline = time.monotonic() + 10
    while not step.gave_up:
        assert time.monotonic() < deadline, step
        sup._tend(step, time.monotonic())
        time.sleep(0.01)
    assert step.restarts == 1 and step.exits == [-15, -15]     # SIGTERM, twice
    assert sup._lost() == "every decode worker given up"
    assert (tmp_path / "logs" / "decode0.log").read_text().count("start decode0 on n3") == 2
    assert sup.watch() == 1
