"""The benchmark scripts still run end to end (tiny settings: seconds, not figures).
CI does not judge their targets, which need a quiet machine and full-size loads;
this only keeps the scripts from rotting unseen. The selected scripts run two at a
time from the module's start (most of a smoke run waits on processes starting), and
each test checks its own script's run."""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.cluster import ROOT

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")

RUNS = {
    "bench_attention.py": (["--smoke"], [r"float32\s+4\s+40(\s+[\d.]+){2}\s+[\d.]+x",
                                         r"bfloat16\s+1\s+40(\s+[\d.]+){2}\s+[\d.]+x"]),
    "bench_deterministic.py": (["--smoke"], [r"decode b1(\s+[\d.]+){2}\s+[\d.]+x",
                                             r"prefill(\s+[\d.]+){2}\s+[\d.]+x"]),
    "bench_busy_poll.py": (["--settings", "0,500", "--requests", "4", "--rounds", "1", "--idle-s", "0.5",
                            "--quiet-wait", "0"],
                           [r"(?m)^\s+0(\s+[\d.]+){4}$", r"(?m)^\s+500(\s+[\d.]+){4}$"]),
    "bench_control_plane.py": (["--quick"], [r"(?m)^\s+1\s+1 \|(\s+[\d.]+){5} \|\s+[\d.]+",
                                             r"(?m)^\s+8\s+2 \|(\s+[\d.]+){5} \|\s+[\d.]+",
                                             r"fairness .* ratio [\d.]+/[\d.]+",
                                             r"requests check: PASS",
                                             r"(?m)^\s+512 \|\s+5120000 \|\s+[\d.]+ \|\s+[\d.]+$"]),
    "bench_e2e.py": (["--requests", "8", "--prompt-len", "64", "--new-tokens", "8",
                      "--concurrency", "4", "--rounds", "1", "--isolated", "2", "--repeats", "1",
                      "--rtt-samples", "50", "--quiet-wait", "0"],
                     [r"output tok/s\s+[\d.]+\s+[\d.]+", r"thread split: prefill work [\d.]+ s",
                      r"\s16\s+[\d.]+\s+[\d.]+\s+-?[\d.]+\s+-?[\d.]+"]),
    "bench_prefix_cache.py": (["--model", "tiny", "--prompts", "2", "--samples", "2",
                               "--prompt-len", "48", "--new-tokens", "4", "--rounds", "1",
                               "--kv-cache-mb", "64", "--quiet-wait", "0"],
                              [r"prompt tokens computed\s+128\s+192\s",
                               r"prefill hit rate\s+0\.333\s+0\.000\s",
                               r"TTFT p99 ms(\s+[\d.]+){3}",
                               r"ratio prefill compute on/off: [\d.]+",
                               r"ratio throughput on/off: [\d.]+",
                               r"same output with the cache on and off: \d+/4 requests"]),
    "bench_retract.py": (["--requests", "16", "--cycles", "1", "--repeats", "1", "--quiet-wait", "0"],
                         [r"pause\(retract\) round trip\s+[\d.]+ ms",
                          r"ratio recompute/fresh time, median of per-repeat ratios: [\d.]+"]),
    "bench_scale_out.py": (["--quick"], [r"(?m)^1\+1\s+\|\s+8 \|(\s+[\d.,]+ \|){2}",
                                         r"(?m)^2\+2\s+\|\s+16 \|\s+[\d,]+ \|\s+[\d.]+ [\d.]+ \|",
                                         r"capacity 2\+2 / 1\+1 per round: [\d.]+; mean"]),
    "bench_score.py": (["--quick", "--model", "deep"], [r"prompt tok/s(\s+[\d.]+){3}",
                                                        r"ratio scoring/plain prompt tok/s: [\d.]+",
                                                        r"scores check: PASS",
                                                        r"ratio engine logprobs/prefill prompt tok/s: [\d.]+",
                                                        r"peak allocated during prompt_logprobs [\d.]+ MiB",
                                                        r"ratio that work allows: 0\.9\d\d"]),
    "bench_tp.py": (["--quick"], [r"(?m)^\s+16(\s+-?[\d.]+){5}$",
                                  r"inside the 4 all-reduces \(incl. waiting\)(\s+[\d.]+){2}",
                                  r"word round trip - all-reduce of 1 float(\s+-?[\d.]+){2}",
                                  r"writes/page scattered\s+1\.000\s+2\.000\s+1\.000\s+2\.000"]),
    "bench_threads.py": (["--sizes", "8,16", "--repeats", "1", "--quiet-wait", "0"],
                         [r"\s16\s+1\s+[\d.]+\s+[\d.]+", r"split: spread max/min [\d.]+"]),
    "bench_transfer.py": (["--repeats", "1", "--tokens", "256"], [r"ratio"]),
    "bench_loop.py": (["--quick"], [r"ratio"]),
    "bench_relay.py": (["--steps", "100", "--batches", "8", "--rounds", "1"],
                       [r"(?m)^\s+8\s+4\s+tokens\s+[\d.]+ /\s+[\d.]+\s+[\d.]+$",
                        r"(?m)^\s+8\s+4\s+step\s+[\d.]+ /\s+[\d.]+\s+[\d.]+$"]),
    "bench_peer.py": (["--smoke"], [r"float32\s+zpd [\d.]+\s+zpd [\d.]+\s+zpd [\d.]+"]),
    "bench_peer_products.py": (["--smoke"], [r"gate/up 3072x576(\s+[\d.]+){4}", r"sum(\s+[\d.]+){3}"]),
    "bench_models.py": (["--repeats", "1", "--new-tokens", "4", "--batches", "2",
                         "--dtypes", "float32", "--no-hf-load", "--hf-random-weights"],
                        [r"float32\s+[\d.]+\s+\d+\s+nan\s+nan",
                         r"float32\s+2\s+[\d.]+\s+[\d.]+\s+[\d.]+x"]),
    "bench_moe.py": (["--size", "tiny", "--batches", "1,2", "--repeats", "1", "--steps", "2", "--context", "16",
                      "--prefill-len", "32", "--quiet-wait", "0"],
                     [r"(?m)^float32\s+1(\s+[\d.]+){3}x(\s+[\d.]+){2}x\s+[\d.]+\s+[-+][\d.]+%\s+[\d.]+%"
                      r"\s+step [\d.]+ ms \(best [\d.]+\), floor [\d.]+ ms \([\d.]+ MiB\): [\d.]+x limit",
                      r"(?m)^bfloat16\s+2(\s+[\d.]+){3}x(\s+[\d.]+){2}x\s+[\d.]+\s+[-+][\d.]+%\s+[\d.]+%$",
                      r"bfloat16\s+prefill 32 tokens: moe \d+ tok/s, dense \d+ tok/s, ratio moe/dense [\d.]+"]),
    "bench_clear.py": (["--repeats", "1", "--tokens", "64"], [r"8B-class bf16\s+64\s+[\d.]+"]),
    "bench_grammar.py": (["--model", "tiny", "--batch", "4", "--steps", "3", "--repeats", "1"],
                         [r"whole step(\s+[\d.]+){2}", r"ratio constrained/plain: [\d.]+"]),
    "bench_http.py": (["--requests", "5", "--warmup", "1", "--streams", "4", "--stream-tokens", "4",
                       "--rounds", "1", "--duration", "1", "--warmup-s", "0.2"],
                      [r"HTTP stream\s+[\d.]+\s+[\d.]+", r"tok/s ratio HTTP/zpd.Client [\d.]+"]),
    "bench_sse_events.py": (["--smoke"], [r"before\s+200(\s+[\d.]+){4}",
                                          r"spaced\s+\d+(\s+[\d.]+){4}",
                                          r"incremental\s+200(\s+[\d.]+){4}",
                                          r"fragments\s+200(\s+[\d.]+){4}"]),
    "bench_weight_sync.py": (["--hidden", "64", "--layers", "2", "--intermediate", "128",
                              "--vocab", "512", "--heads", "4", "--kv-heads", "2", "--rounds", "1",
                              "--bucket-mib", "0.05", "--quiet-wait", "0"],
                             [r"push buckets(\s+[\d.]+){7}",
                              r"push relay(\s+[\d.]+){7}",
                              r"relay buckets(\s+[\d.]+){7}",
                              r"relay cost: push relay / push seconds [\d.]+",
                              r"from disk(\s+[\d.]+){4}",
                              r"ratio push/raw bytes/s: [\d.]+",
                              r"ratio push buckets/raw bytes/s: [\d.]+",
                              r"weights check: PASS"]),
}


def run_bench(argv: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """subprocess.run, except that a benchmark past its time gets SIGINT first: its
    `finally` then stops the clusters it started in sessions of their own, which a
    SIGKILL would leave running for the rest of the suite."""
    with subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


# How many runs at once: two leave each run a core on CI's 2-core machines.
AT_ONCE = 2
# the runs of a few seconds, started after the rest
QUICK = ("attention", "clear", "deterministic", "grammar", "peer", "relay", "moe", "transfer",
         "sse_events")


def commands(out: Path) -> dict[str, list[str]]:
    """Every run this module checks, by the test that checks it."""
    runs = {f"test_benchmark_runs[{script}]": [sys.executable, str(ROOT / "bench" / script), *args]
            for script, (args, _) in RUNS.items()}
    runs["test_interference_runs"] = [sys.executable, str(ROOT / "bench" / "bench_interference.py"),
                                      "--smoke", "--plot", str(out / "itl.png")]
    runs["test_gpu_check_cpu_dry_run"] = ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu",
                                          "--skip-install", "--time-limit", "300", "--quick"]
    return runs


@pytest.fixture(scope="module")
def runs(request):
    """The selected tests' runs, started AT_ONCE at a time, longest first: test name ->
    a future of its finished process."""
    selected = {item.name for item in request.session.items if item.module is request.module}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(AT_ONCE) as pool:
        todo = {name: argv for name, argv in commands(Path(tmp)).items() if name in selected}
        futures: dict[str, Future] = {}
        for name in sorted(todo, key=lambda n: any(fast in n for fast in QUICK)):
            env = os.environ | {"OUT": tmp, "PYTHON": sys.executable} if "gpu_check" in name else None
            futures[name] = pool.submit(run_bench, todo[name], 330, env)
        yield futures, Path(tmp)


def finished(runs, name: str) -> subprocess.CompletedProcess:
    done = runs[0][name].result()
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done


@pytest.mark.parametrize("script", sorted(RUNS))
def test_benchmark_runs(runs, script: str) -> None:
    done = finished(runs, f"test_benchmark_runs[{script}]")
    for pattern in RUNS[script][1]:
        assert re.search(pattern, done.stdout), (pattern, done.stdout[-3000:])


def test_interference_runs(runs) -> None:
    done = finished(runs, "test_interference_runs")
    png = runs[1] / "itl.png"
    for pattern in (r"SLOs:\s+TTFT <= \d+ ms", r"ITL p99 ms(\s+[\d.]+){2}", r"ITL p99/p50(\s+[\d.]+){2}",
                    r"TTFT long p50 ms(\s+[\d.]+){2}", r"goodput(\s+[\d.]+){2}"):
        assert re.search(pattern, done.stdout), (pattern, done.stdout[-3000:])
    assert png.read_bytes().startswith(b"\x89PNG")


def test_gpu_check_cpu_dry_run(runs) -> None:
    """scripts/gpu_check.sh (issue #16) as CI can run it: every check on shrunk models on
    the CPU, one table, written to $OUT."""
    done = finished(runs, "test_gpu_check_cpu_dry_run")
    table = (runs[1] / "gpu_check.txt").read_text()
    reference = "PASS" if importlib.util.find_spec("transformers") else "SKIP"
    for row, result in (("env", "PASS"), ("parity fp32 logits", reference),
                        ("parity bf16 greedy", reference), ("cluster 1P1D", "PASS"),
                        ("tp 2 greedy", "PASS"),
                        ("llama1m prefill", "PASS"), ("llama1m decode b1", "PASS"),
                        ("llama1m decode b16", "PASS"), ("smollm2 speed", "SKIP")):
        assert re.search(rf"^{re.escape(row)}\s+{result}\s", table, re.M), (row, table)
    assert re.search(r"^overall: PASS: \d+/\d+ passed", table, re.M), table
    assert table.strip() in done.stdout
