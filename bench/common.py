"""What the cluster benchmarks share: a random Llama written as an HF directory, a
`zpd launch` cluster in its own session, CPU accounting from /proc, and small
statistics helpers. Imported by bench_e2e.py and bench_retract.py (run from the
repository root or anywhere: ROOT goes on sys.path)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# --- model ------------------------------------------------------------------------

def make_model(root: Path, c: dict, seed: int = 0, max_position: int = 8192) -> Path:
    """A random Llama with config `c` as a Hugging Face directory (config.json +
    model.safetensors); the same seed gives the same weights."""
    import torch
    from safetensors.torch import save_file
    h, d, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> "torch.Tensor":
        return (torch.randn(*shape, generator=g) * 0.02).contiguous()
    t = {"model.embed_tokens.weight": w(c["vocab_size"], h), "model.norm.weight": torch.ones(h),
         "lm_head.weight": w(c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": w(c["num_attention_heads"] * d, h),
              p + "self_attn.k_proj.weight": w(c["num_key_value_heads"] * d, h),
              p + "self_attn.v_proj.weight": w(c["num_key_value_heads"] * d, h),
              p + "self_attn.o_proj.weight": w(h, c["num_attention_heads"] * d),
              p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
              p + "mlp.down_proj.weight": w(h, inter),
              p + "input_layernorm.weight": torch.ones(h),
              p + "post_attention_layernorm.weight": torch.ones(h)}
    root.mkdir(parents=True, exist_ok=True)
    save_file(t, str(root / "model.safetensors"))
    cfg = c | {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "max_position_embeddings": max_position, "rms_norm_eps": 1e-5,
               "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
               "bos_token_id": 1, "eos_token_id": 2}
    (root / "config.json").write_text(json.dumps(cfg))
    return root


# --- statistics and output ----------------------------------------------------------

def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def median_time(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls of fn, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def log_step(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- processes and CPU ----------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process (all threads); nan once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds spent by everything on the machine so far (all cores)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def wait_quiet(max_s: float, limit_cores: float = 0.3, window_s: float = 0.5) -> float:
    """Wait (at most max_s) until the machine is nearly idle for one window, since these
    benchmarks share the cores with whatever else runs; returns the cores busy in the
    last window (others' work: ours is idle then). max_s <= 0 (a smoke run's
    --quiet-wait 0): no wait and no window, nan."""
    if max_s <= 0:
        return float("nan")
    deadline = time.monotonic() + max_s
    while True:
        before = machine_busy_seconds()
        time.sleep(window_s)
        busy = (machine_busy_seconds() - before) / window_s
        if busy <= limit_cores or time.monotonic() >= deadline:
            return busy


# --- the cluster -----------------------------------------------------------------------

class Launch:
    """`zpd launch --prefill 1 --decode 1` plus `flags`, in its own session, one log per
    process under `tmp/logs`. `pids`: prefill, decode and router. wait=False returns
    once the launcher is started; `wait_ready()` then (several clusters start at once)."""

    def __init__(self, tmp: Path, model: str, flags: list[str], env: dict | None = None,
                 wait: bool = True) -> None:
        self.tmp, self.logs = tmp, tmp / "logs"
        self.argv = [sys.executable, "-m", "zpd", "launch", "--model", model, "--prefill", "1",
                     "--decode", "1", "--port", "0", "--ready-file", str(tmp / "cluster.json"),
                     "--log-dir", str(self.logs), *flags]
        self.shown = shlex.join(self.argv).replace(str(tmp), "$TMP")
        env = os.environ | {"MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")} | (env or {})
        with open(tmp / "launch.log", "wb") as out:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=env)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        tmp, ready = self.tmp, self.tmp / "cluster.json"
        deadline = time.monotonic() + 180
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("cluster did not start:\n" + (tmp / "launch.log").read_text()[-3000:])
            time.sleep(0.1)
        info = json.loads(ready.read_text())
        self.router = info["router"]
        self.pids = {w["role"]: w["pid"] for w in info["workers"]}
        self.pids["router"] = next((p for p in children(self.proc.pid) if p not in self.pids.values()), 0)

    def pin(self, on: bool, extra: dict[str, int] | None = None) -> None:
        """on: the prefill alone on CPU 0; decode, router (and `extra` processes) on CPU 1,
        every thread (threads started later inherit it); off: all on every CPU."""
        every = set(range(os.cpu_count() or 1))
        for name, pid in (self.pids | (extra or {})).items():
            cpus = ({0} if name == "prefill" else {1}) if on else every
            for task in Path(f"/proc/{pid}/task").iterdir():
                try:
                    os.sched_setaffinity(int(task.name), cpus)
                except OSError:
                    pass                        # a thread that just ended

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def log(self, name: str) -> str:
        f = self.logs / f"{name}.log"
        return f.read_text(errors="replace") if f.exists() else ""


async def http_post(endpoint: str, path: str, body: dict, local: str = "127.0.0.1",
                    opening: asyncio.Semaphore | None = None) -> tuple[int, dict | None]:
    """(HTTP status, JSON answer or None) of one POST on a connection of its own, from
    the address `local` (`opening` bounds the connections being opened at once)."""
    host, port = endpoint.rsplit(":", 1)
    raw = orjson.dumps(body)
    async with opening if opening is not None else contextlib.nullcontext():
        reader, writer = await asyncio.open_connection(host, int(port), local_addr=(local, 0))
    try:
        writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
                     % (path.encode(), host.encode(), len(raw), raw))
        answer = await reader.read(-1)
    finally:
        writer.close()
    head, _, data = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    try:
        return status, orjson.loads(data)
    except orjson.JSONDecodeError:
        return status, None
