"""Issue 49: a zpd cluster submitted, supervised and torn down by a real Slurm.
scripts/slurm/local_slurm.sh starts munge, slurmctld and three slurmd (n1..n3, all on
127.0.0.1) in a directory of its own; one job of scripts/slurm/zpd.sbatch (1P1D, the
null model) answers /generate as `zpd run` does, goes through pause (retract) ->
update weights -> continue by `zpd admin`, gets its decode step killed -9 and started
again, and leaves no process after scancel. The daemons are stopped by their pid
files at the end. Skipped only where they cannot run (not root)."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest

from engines.loader import load_model
from engines.models.null import predict
from engines.offline import OfflineEngine
from engines.request import Request
from engines.sampler import SamplingParams
from tests.e2e.cluster import ROOT, zpd_cmd

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")

SLURM = ROOT / "scripts" / "slurm"
MODEL = "null:step_ms=20,prefill_us=20,kv_bytes=1024"
PROMPT = [5, 9, 2, 7, 1]


class LocalSlurm:
    """The project's test Slurm, in a fresh directory (munge wants every parent of its
    socket searchable, so not under pytest's private tmp)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="zpd-slurm-", dir="/tmp"))
        self.env = os.environ | {"ZPD_SLURM_DIR": str(self.dir),
                                 "SLURM_CONF": str(self.dir / "slurm.conf"),
                                 "PYTHONPATH": str(ROOT)}

    def script(self, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SLURM / "local_slurm.sh"), *argv], env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def run(self, *argv: str, cwd: Path | None = None) -> str:
        out = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60,
                             cwd=cwd)
        assert out.returncode == 0, (argv, out.stderr)
        return out.stdout


class Job:
    """One `sbatch -N3 zpd.sbatch ...` and its address file."""

    def __init__(self, slurm: LocalSlurm, submit: Path, *zpd_args: str,
                 sbatch: tuple[str, ...] = ()) -> None:
        self.slurm, self.submit = slurm, submit
        self.t0 = time.monotonic()
        self.id = slurm.run("sbatch", "--parsable", "-N3", f"--output={submit}/slurm-%j.out",
                            *sbatch, str(SLURM / "zpd.sbatch"), *zpd_args, cwd=submit).strip()
        self.out = submit / f"slurm-{self.id}.out"
        self.address_file = submit / f"zpd-{self.id}.json"

    def wait_ready(self, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while not self.address_file.exists():
            assert time.monotonic() < deadline and self.state() in ("PENDING", "RUNNING"), \
                f"job {self.id} not ready ({self.state()}):\n{self.output()}"
            time.sleep(0.1)
        self.ready_s = time.monotonic() - self.t0
        return orjson.loads(self.address_file.read_bytes())

    def show(self) -> str:
        return self.slurm.run("scontrol", "show", "job", self.id)

    def state(self) -> str:
        return self.show().split("JobState=")[1].split()[0]

    def output(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    def processes(self) -> list[int]:
        """Every process on this machine that runs for the job (its environment says so),
        whatever its parent: a daemonised child that escaped its step is found too."""
        mark, pids = f"SLURM_JOB_ID={self.id}".encode(), []
        for p in Path("/proc").iterdir():
            try:
                if p.name.isdigit() and mark in (p / "environ").read_bytes().split(b"\0"):
                    pids.append(int(p.name))
            except OSError:
                pass
        return pids


@pytest.fixture(scope="module")
def slurm():
    if os.geteuid() != 0:
        pytest.skip("slurmd runs jobs as their users: the test Slurm needs root")
    s = LocalSlurm()
    try:
        started = s.script("start", "--install")
        assert started.returncode == 0, started.stdout + started.stderr
        yield s
    finally:
        pids = [int(p.read_text()) for p in (*s.dir.glob("*.pid"), *s.dir.glob("munge/*.pid"))]
        stopped = s.script("stop", timeout=120)
        left = [p for p in pids if Path(f"/proc/{p}").exists()]
        shutil.rmtree(s.dir, ignore_errors=True)
        assert stopped.returncode == 0, stopped.stderr
        assert len(pids) == 5 and not left, (pids, left)    # munged, slurmctld, 3 slurmd


@pytest.fixture(scope="module")
def job(slurm, tmp_path_factory):
    submit = tmp_path_factory.mktemp("submit")
    j = Job(slurm, submit, "--model", MODEL, "--prefill", "1", "--decode", "1", "--port", "0",
            "--http-port", "0", "--kv-cache-mb", "16", "--log-level", "INFO",
            "--restart-backoff", "0.2", "--peer-timeout", "1",
            # memory counted (CR_Core_Memory): the steps share each node's, side by side
            sbatch=("--mem=1000",))
    try:
        j.info = j.wait_ready()
        yield j
    finally:
        subprocess.run(["scancel", j.id], env=slurm.env, timeout=30)


def http_generate(url: str, prompt: list[int], n: int, timeout: float = 30) -> tuple[int, dict]:
    """(status, answer): the HTTP status, or the status of the request's abort."""
    body = orjson.dumps({"input_ids": prompt,
                         "sampling_params": {"temperature": 0, "max_new_tokens": n}})
    req = urllib.request.Request(f"{url}/generate", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = orjson.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, orjson.loads(e.read())
    reason = out["meta_info"]["finish_reason"]     # SGLang's: an abort is answered 200
    return (reason["status_code"] if reason["type"] == "abort" else 200), out


def admin(job: Job, *argv: str, endpoint: str | None = None) -> dict:
    out = subprocess.run(zpd_cmd("admin", "--endpoint", endpoint or job.info["router"],
                                 "--curve-keys", job.info["curve_keys"], *argv),
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, (argv, out.stdout, out.stderr)
    return orjson.loads(out.stdout)


def test_a_job_over_three_nodes_answers_as_zpd_run(job):
    info, root = job.info, Path(job.info["job_dir"])
    assert info["http"].startswith("http://127.0.0.1:") and info["router"].startswith("tcp://")
    assert {w["name"]: w["node"] for w in info["workers"]} == {"prefill0": "n2", "decode0": "n3"}
    assert str(job.address_file) in job.output() and info["http"] in job.output()
    status, out = http_generate(info["http"], PROMPT, 12)
    ref = OfflineEngine(load_model(MODEL)).run(
        [Request("r", PROMPT, SamplingParams(temperature=0, max_new_tokens=12))])[0]
    assert status == 200 and out["output_ids"] == ref["output_ids"] == predict(PROMPT, 12)
    # keys and secret made once in the job's directory, private; one log per step
    assert (root / "keys" / "server.key").exists() and info["curve_keys"] == str(root / "keys")
    assert (root / "router.secret").stat().st_mode & 0o077 == 0
    assert {p.stem for p in (root / "logs").glob("*.log")} == {
        "job", "prefill0", "decode0", "router", "http"}
    assert "on n2" in (root / "logs" / "prefill0.log").read_text()
    print(f"sbatch -> answering: {job.ready_s:.1f} s")


def test_retract_update_continue_through_zpd_admin(job):
    n, got = 120, []
    streaming = threading.Thread(target=lambda: got.append(http_generate(
        job.info["http"], PROMPT, n, timeout=60)))
    streaming.start()
    time.sleep(0.8)                                 # some tokens under the first weights
    try:
        paused = admin(job, "pause", "--mode", "retract")
        assert paused["ok"] and len(paused["workers"]) == 2, paused
        updated = admin(job, "update-weights", "--path", "null:seed=7", "--version", "v7")
        assert updated["ok"], updated
    finally:
        admin(job, "continue")
    streaming.join(60)
    status, out = got[0]
    assert status == 200, out
    versions, ids = out["meta_info"]["output_token_weight_versions"], out["output_ids"]
    k = versions.count("null")
    assert 0 < k < n and versions == ["null"] * k + ["v7"] * (n - k), versions
    assert out["meta_info"]["retractions"] >= 1
    # the tokens after the update are the new weights' answer to all that came before
    assert ids == predict(PROMPT, k) + predict(PROMPT + ids[:k], n - k, seed=7)
    status, after = http_generate(job.info["http"], PROMPT, 6)
    assert status == 200 and after["output_ids"] == predict(PROMPT, 6, seed=7)


def test_a_killed_worker_step_is_restarted_and_serves_again(job):
    root = Path(job.info["job_dir"])
    decode = orjson.loads((root / "ready" / "decode0.json").read_bytes())
    results: list[tuple[int, dict]] = []
    threads = [threading.Thread(target=lambda: results.append(
        http_generate(job.info["http"], PROMPT, 200, timeout=45))) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.8)
    killed = time.monotonic()
    os.kill(decode["pid"], 9)
    for t in threads:
        t.join(50)
    assert not any(t.is_alive() for t in threads), "a request hung after its decode died"
    print(f"requests of the killed decode ended {time.monotonic() - killed:.1f} s after the kill")
    # each ends 503 (its decode died) or whole: never a hang, never a wrong token
    for status, out in results:
        assert status == 503 or (status == 200 and out["output_ids"] == predict(PROMPT, 200,
                                                                                seed=7)), out
    assert any(status == 503 for status, _ in results), results
    ready = root / "ready" / "decode0.json"
    deadline = time.monotonic() + 60
    while not (ready.exists() and orjson.loads(ready.read_bytes())["pid"] != decode["pid"]):
        assert time.monotonic() < deadline, job.output()
        time.sleep(0.1)
    back = orjson.loads(ready.read_bytes())
    print(f"killed decode step ready again after {time.monotonic() - killed:.1f} s")
    assert back["endpoint"] == decode["endpoint"]          # on its port: the router finds it
    # it loaded --model, not the update of the test before: the job says so, by name
    deadline = time.monotonic() + 30
    while "decode0 came back with weights 'null'" not in job.output():
        assert time.monotonic() < deadline, job.output()
        time.sleep(0.1)
    assert "while the cluster serves 'v7'" in job.output()
    admin(job, "update-weights", "--path", "null:seed=7", "--version", "v7",
          endpoint=back["endpoint"])
    # the router routes to it again once it answers a heartbeat
    deadline = time.monotonic() + 30
    while True:
        status, out = http_generate(job.info["http"], PROMPT, 6)
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status == 200 and out["output_ids"] == predict(PROMPT, 6, seed=7), out
    print(f"killed decode step answering again after {time.monotonic() - killed:.1f} s")
    assert "decode0 on n3 (" in job.output() and "exited with code 137" in job.output()
    assert "decode0 back on n3" in job.output()


def test_a_killed_router_step_comes_back_on_its_port_and_its_stream_completes(job):
    router = orjson.loads((Path(job.info["job_dir"]) / "ready" / "router.json").read_bytes())
    got: list[tuple[int, dict]] = []
    streaming = threading.Thread(target=lambda: got.append(http_generate(
        job.info["http"], PROMPT, 150, timeout=60)))
    streaming.start()
    time.sleep(1.0)
    killed = time.monotonic()
    os.kill(router["pid"], 9)
    ready = Path(job.info["job_dir"]) / "ready" / "router.json"
    while not (ready.exists() and orjson.loads(ready.read_bytes())["pid"] != router["pid"]):
        assert time.monotonic() - killed < 60, job.output()
        time.sleep(0.05)
    print(f"killed router step ready again after {time.monotonic() - killed:.1f} s")
    streaming.join(60)
    status, out = got[0]
    # the front resumed it from the router started again on its port, which adopted it
    assert status == 200 and out["output_ids"] == predict(PROMPT, 150, seed=7), out
    assert "router on n1 (" in job.output() and "router back on n1" in job.output()


def test_scancel_leaves_no_process_and_the_job_ended_cleanly(job):
    assert job.processes(), "no process of the running job found"
    t0 = time.monotonic()
    job.slurm.run("scancel", job.id)
    while job.processes():
        assert time.monotonic() - t0 < 15, f"left after scancel: {job.processes()}"
        time.sleep(0.05)
    print(f"scancel -> no process: {time.monotonic() - t0:.2f} s")
    deadline = time.monotonic() + 15
    while "zpd cluster stopped" not in job.output():
        assert time.monotonic() < deadline, job.output()
        time.sleep(0.1)
    assert "restarts {'decode0': 1, 'router': 1}" in job.output()
    assert not job.address_file.exists()          # it named a cluster that is gone
    assert "ExitCode=0:0" in job.show()            # every step ended cleanly


def test_bad_options_fail_the_job_by_name(slurm, tmp_path):
    j = Job(slurm, tmp_path, "--model", MODEL, "--prefill", "1", "--decode", "1",
            "--ib-device-map", "n9=mlx5_0")
    deadline = time.monotonic() + 60
    while j.state() in ("PENDING", "RUNNING", "COMPLETING"):
        assert time.monotonic() < deadline, j.output()
        time.sleep(0.2)
    assert j.state() == "FAILED" and "ExitCode=2:0" in j.show(), j.show()
    assert "--ib-device-map: node 'n9' is not in the job (n1, n2, n3)" in j.output()
    assert not j.processes() and not j.address_file.exists()


def test_a_step_given_up_stops_the_job_with_exit_code_1(slurm, tmp_path):
    j = Job(slurm, tmp_path, "--model", MODEL, "--prefill", "1", "--decode", "1", "--port", "0",
            "--http-port", "0", "--kv-cache-mb", "16", "--max-restarts", "0")
    j.info = j.wait_ready()
    router = orjson.loads((Path(j.info["job_dir"]) / "ready" / "router.json").read_bytes())
    os.kill(router["pid"], 9)
    deadline = time.monotonic() + 30
    while j.state() in ("RUNNING", "COMPLETING"):
        assert time.monotonic() < deadline, j.output()
        time.sleep(0.1)
    assert j.state() == "FAILED" and "ExitCode=1:0" in j.show(), j.show()
    assert "router on n1 exited with code 137; given up after 0 restarts" in j.output()
    assert "router given up: stopping the cluster" in j.output()
    assert not j.processes() and not j.address_file.exists()
