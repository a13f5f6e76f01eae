"""One process of a zpd cluster run as a Slurm job step (`srun --exact` on its node):
started, watched, started again on its port after it dies, and stopped."""
from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from zpd.ops.slurm_nodes import Node

log = logging.getLogger("zpd.ops.slurm")

CLEAN_EXITS = (0, 143, -signal.SIGTERM)      # ended by our SIGTERM, or on its own


@dataclass
class Step:
    """`zpd ROLE ARGV --port P --ready-file F` as one step on `node`. The port is 0 (any
    free one) until the first start is ready; a restart takes the same port, so the
    router finds a worker again where it was, and the clients their router."""
    name: str                   # prefill0, decode1, router, http
    role: str                   # the zpd subcommand
    node: Node
    cpus: int
    argv: list[str]
    job_dir: Path
    port: int = 0
    gpus: int = 0
    mem_per_cpu: int = 0        # MB; 0: the job holds no memory (zpd.ops.slurm_nodes)
    overlap: bool = False       # shares its node's CPUs with the other steps (routers, front)
    env: dict[str, str] | None = None    # the whole environment (None: this one)
    proc: subprocess.Popen | None = None
    info: dict | None = None    # the ready file, once it is there
    restarts: int = 0
    due: float | None = None    # when a dead step starts again
    started: float = 0.0
    gave_up: bool = False
    hurried: bool = False       # stopped for not being ready within --startup-timeout
    exits: list[int] = field(default_factory=list)

    @property
    def ready_file(self) -> Path:
        return self.job_dir / "ready" / f"{self.name}.json"

    @property
    def log_file(self) -> Path:
        return self.job_dir / "logs" / f"{self.name}.log"

    @property
    def endpoint(self) -> str:
        return self.info["endpoint"] if self.info else f"{self.node.addr}:{self.port}"

    def srun_argv(self) -> list[str]:
        # --exact: the step takes only its CPUs, so the cluster's steps run side by side;
        # --kill-on-bad-exit: a step is one task, so its death ends the step at once.
        return ["srun", "--exact", "--nodes=1", "--ntasks=1", f"--nodelist={self.node.name}",
                f"--cpus-per-task={self.cpus}", f"--job-name={self.name}",
                "--kill-on-bad-exit=1", "--unbuffered"] \
            + ([f"--gpus-per-task={self.gpus}"] if self.gpus else []) \
            + ([f"--mem-per-cpu={self.mem_per_cpu}"] if self.mem_per_cpu else []) \
            + (["--overlap"] if self.overlap else []) \
            + [sys.executable, "-m", "zpd", self.role, *self.argv, "--port", str(self.port),
               "--ready-file", str(self.ready_file)]

    def start(self) -> None:
        self.ready_file.unlink(missing_ok=True)
        self.info, self.due, self.started, self.hurried = None, None, time.monotonic(), False
        with open(self.log_file, "ab") as out:
            out.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} start {self.name} on "
                      f"{self.node.name} (start {self.restarts + 1})\n".encode())
            out.flush()
            self.proc = subprocess.Popen(self.srun_argv(), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL,
                                         env=self.env)

    def poll_ready(self) -> bool:
        if self.info is None and self.ready_file.exists():
            self.info = orjson.loads(self.ready_file.read_bytes())
            self.port = int(self.info["endpoint"].rpartition(":")[2])
        return self.info is not None

    def exited(self) -> int | None:
        """The step's exit code once it ended (srun's: the task's, or 128 + its signal)."""
        return None if self.proc is None else self.proc.poll()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """srun passes SIGTERM on to the step's task."""
        if self.running():
            self.proc.send_signal(sig)

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def wait_ready(steps: list[Step], timeout: float, stopping=lambda: False) -> None:
    """Until every step wrote its ready file; a step that ends first, the timeout, or
    `stopping()` raises with the node, the exit code and the end of its log."""
    deadline = time.monotonic() + timeout
    while not all(s.poll_ready() for s in steps):
        if stopping():
            raise RuntimeError("stopped (SIGTERM) while starting")
        for s in steps:
            if not s.poll_ready() and (code := s.exited()) is not None:
                raise RuntimeError(f"{s.name} on {s.node.name} exited with code {code} before "
                                   f"it was ready; the end of {s.log_file}:\n{s.tail()}")
        if time.monotonic() > deadline:
            late = ", ".join(f"{s.name} on {s.node.name}" for s in steps if not s.poll_ready())
            raise RuntimeError(f"not ready within {timeout:.0f} s: {late}")
        time.sleep(0.1)


def stop_steps(steps: list[Step], timeout: float) -> dict[str, int | None]:
    """SIGTERM to each running step, in order; SIGKILL to what is left after `timeout`.
    Each step's exit code (None for one that never started)."""
    for s in steps:
        s.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for s in steps:
        if s.proc is None:
            continue
        try:
            s.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("%s on %s ignored SIGTERM for %.0f s: SIGKILL", s.name, s.node.name, timeout)
            s.proc.kill()
            s.proc.wait()
    return {s.name: s.exited() for s in steps}
