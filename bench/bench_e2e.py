"""End to end: 1P1D (`zpd launch`) vs the colocated `zpd run` engine on the same model,
load and cores: TTFT, inter-token latency, output tokens/s, plus the control-plane
overhead per request.

    python bench/bench_e2e.py [--model mid|tiny|DIR] [--requests 64] [--prompt-len 512]
                              [--new-tokens 128] [--concurrency 16] [--ramp-s 0] [--rounds 2]

Load: a closed loop of --concurrency slots; each slot sends one request after
another (greedy, ignore_eos, so both sides make exactly --new-tokens tokens for
the same prompts; the outputs are compared). --ramp-s spreads the slots' first
requests over that many seconds (0: all start at once; with equal lengths the
slots then move in waves). --rounds alternate colocated and 1P1D runs and pool
them, so a burst of other work on a shared machine skews both sides.

Cores: the machine's cores, unpinned, are shared by everything on both sides.
Colocated: this process runs OfflineEngine (the `zpd run` path) with 2 torch
threads. 1P1D: `zpd launch --prefill-threads 1 --decode-threads 1` by default, i.e.
prefill and decode one torch thread each (other splits: --prefill-threads,
--decode-threads, and --cluster-env GOMP_SPINCOUNT=N to tame OpenMP's spinning when
their threads outnumber the cores), plus the router and this process's client
threads (one Client per slot), which take CPU from the same cores; their CPU use is printed, and so is
the CPU that other processes on the machine took during each phase (before
each phase the script waits up to --quiet-wait s for the machine to go idle).

TTFT: colocated, Request.first_token_at - arrived (the token is sampled right
after prefill); 1P1D, first streamed chunk received - submit, on the client.
ITL: every gap between consecutive tokens of a request, pooled (colocated: the
first token's time, then the time each decode step of DecodeBatch returns;
1P1D: chunk arrival times on the client). Output tokens/s: all output tokens /
(last finish - first submit).

Control-plane overhead: requests one at a time, back to back, each paired with
this process's timing of the prefill worker's compute call on the same prompt
(same code, one thread); overhead = median(TTFT - compute) - one KV transfer of
the prompt (two Mooncake backends of the project's transport in this process),
in ms and in ZeroMQ DEALER/ROUTER round trips measured here.

The default model ("mid": random Llama, 6 layers, hidden 384, 6 query / 2 KV
heads, MLP 1024, vocab 32000, ~34M parameters, float32) is written to a
temporary HF directory. It is sized so the whole default run takes about 4
minutes on 2 idle cores (a 512-token prefill ~125 ms on one thread, a decode
step of 16 requests ~45 ms), far above the control plane's per-message cost.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (Launch, cpu_seconds, log_step, machine_busy_seconds, make_model,  # noqa: E402
                    random_prompts, wait_quiet)
from e2e_components import PAGE_SIZE, compute_times, transfer_time, zmq_round_trip  # noqa: E402

from e2e_report import report  # noqa: E402

from engines.kv.layout import KVLayout  # noqa: E402
from engines.loader import LoadedModel, load_model  # noqa: E402
from engines.sampler import SamplingParams  # noqa: E402
from zpd.client import Client  # noqa: E402
from engines.offline import OfflineEngine  # noqa: E402
from engines.request import Request  # noqa: E402

MID = dict(vocab_size=32000, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
           num_attention_heads=6, num_key_value_heads=2, head_dim=64)


# --- model and workload ---------------------------------------------------------------

def make_mid_model(root: Path, seed: int = 0) -> Path:
    return make_model(root, MID, seed, max_position=4096)


@dataclass
class LoadResult:
    ttft: list[float] = field(default_factory=list)           # seconds, one per request
    gaps: list[float] = field(default_factory=list)           # seconds, every inter-token gap
    outputs: dict[int, list[int]] = field(default_factory=dict)
    tokens: int = 0
    wall: float = 0.0
    mismatched_rounds: int = 0
    rounds: list[tuple[float, float]] = field(default_factory=list)    # (tok/s, wall) per round

    def merge(self, other: "LoadResult") -> None:
        """Pool another round of the same prompts; every round must give the same tokens."""
        for i, out in other.outputs.items():
            if self.outputs.setdefault(i, out) != out:
                self.mismatched_rounds += 1
        self.ttft += other.ttft
        self.gaps += other.gaps
        self.tokens += other.tokens
        self.wall += other.wall
        self.rounds.append((other.tokens / other.wall, other.wall))

    def add(self, i: int, submitted: float, stamps: list[float], output: list[int]) -> None:
        self.ttft.append(stamps[0] - submitted)
        self.gaps += [b - a for a, b in zip(stamps, stamps[1:])]
        self.outputs[i] = output
        self.tokens += len(output)


# --- colocated: the `zpd run` engine in this process ---------------------------------

def run_colocated(model: LoadedModel, prompts: list[list[int]], sampling: dict, args) -> LoadResult:
    engine = OfflineEngine(model, kv_cache_mb=args.kv_cache_mb, max_batch=args.max_batch,
                           max_prefill_tokens=args.max_prefill_tokens)
    stamps: dict[str, list[float]] = {}
    decode_step = engine.batch.step

    def timed_step() -> list[Request]:
        got = decode_step()
        now = time.monotonic()
        for r in got:
            stamps[r.rid].append(now)
        return got
    engine.batch.step = timed_step          # per-token times without touching zpd code

    res, index, live = LoadResult(), {}, {}
    start = time.monotonic()
    slot_at = [start + k * args.ramp_s / args.concurrency for k in range(args.concurrency)]
    pending = iter(range(len(prompts)))

    def submit() -> bool:
        i = next(pending, None)
        if i is None:
            return False
        r = Request(f"c{i}", prompts[i], SamplingParams.from_dict(sampling))
        stamps[r.rid], index[r.rid], live[r.rid] = [], i, r
        engine.submit(r)
        return True
    while len(res.outputs) < len(prompts):
        now = time.monotonic()
        if now - start > args.timeout:
            raise RuntimeError(f"colocated run exceeded --timeout {args.timeout:g} s")
        while slot_at and slot_at[0] <= now:
            slot_at.pop(0)
            submit()
        if not live:
            time.sleep(max(0.0, slot_at[0] - now) if slot_at else 0.0)
            continue
        for r in engine.step():
            del live[r.rid]
            res.add(index[r.rid], r.arrived, [r.first_token_at] + stamps.pop(r.rid), r.output)
            submit()
    res.wall = time.monotonic() - start
    return res


# --- 1P1D: `zpd launch` --------------------------------------------------------------

def launch(tmp: Path, model: str, args) -> Launch:
    """1P1D, --prefill-threads / --decode-threads torch threads (default one each)."""
    env = dict(kv.split("=", 1) for kv in args.cluster_env)
    return Launch(tmp, model, ["--dtype", args.dtype, "--prefill-threads", str(args.prefill_threads),
                               "--decode-threads", str(args.decode_threads),
                               "--kv-cache-mb", str(args.kv_cache_mb), "--max-batch", str(args.max_batch),
                               "--max-prefill-tokens", str(args.max_prefill_tokens),
                               "--peer-timeout", str(args.peer_timeout), "--log-level", args.log_level],
                  env)


class Others:
    """CPU seconds used by processes not ours during a phase (noise on a shared machine)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.t0, self.total0, self.ours0 = time.monotonic(), machine_busy_seconds(), self._ours()

    def _ours(self) -> float:
        return sum(cpu_seconds(p) for p in self.pids if p)

    def cores(self) -> float:
        others = machine_busy_seconds() - self.total0 - (self._ours() - self.ours0)
        return max(0.0, others) / (time.monotonic() - self.t0)


def run_disagg(router: str, prompts: list[list[int]], sampling: dict, args) -> LoadResult:
    res, lock = LoadResult(), threading.Lock()
    pending = iter(range(len(prompts)))
    start = time.monotonic()
    errors: list[str] = []

    def slot(k: int) -> None:
        time.sleep(k * args.ramp_s / args.concurrency)
        with Client(router, timeout=args.timeout) as client:
            while not errors:
                with lock:
                    i = next(pending, None)
                if i is None:
                    return
                submitted, stamps, out, last = time.monotonic(), [], [], {}
                for last in client.stream(input_ids=prompts[i], sampling_params=sampling):
                    now = time.monotonic()
                    stamps += [now] * len(last["token_ids"])
                    out += last["token_ids"]
                if last.get("finish_reason", {}).get("type") != "length":
                    raise RuntimeError(f"request {i} ended with {last.get('finish_reason')}")
                with lock:
                    res.add(i, submitted, stamps, out)

    def guarded(k: int) -> None:
        try:
            slot(k)
        except Exception as e:       # a failed slot must fail the run, not shrink it
            errors.append(f"slot {k}: {e!r}")
    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("1P1D requests failed: " + "; ".join(errors[:3]))
    res.wall = time.monotonic() - start
    return res


def isolated(router: str, prompts: list[list[int]], args) -> dict:
    """Requests one at a time, back to back, streamed (2 new tokens; the first is timed).
    The prefill worker reports its forward (meta.timings, ms); subtracted from the
    client's time to first token, what is left is the control plane (the first token
    goes prefill -> router -> client beside the KV write). Medians, s."""
    sampling = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
    ttft, forward, transfer, over = [], [], [], []
    with Client(router, timeout=args.timeout) as client:
        for p in prompts:
            chunks = client.stream(input_ids=p, sampling_params=sampling)
            t0 = time.monotonic()
            next(chunks)
            t = time.monotonic() - t0
            timings = [c for c in chunks][-1]["meta"]["timings"]
            f, x = timings["prefill_forward"] / 1e3, timings["kv_transfer"] / 1e3
            ttft.append(t), forward.append(f), transfer.append(x), over.append(t - f)
    med = statistics.median
    return {"ttft": med(ttft), "forward": med(forward), "transfer": med(transfer), "overhead": med(over)}


# --- report ------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mid", help="mid (random Llama, see above), tiny, or an HF dir")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--ramp-s", type=float, default=0.0,
                    help="spread the slots' first requests over this many seconds (default 0)")
    ap.add_argument("--kv-cache-mb", type=float, default=256)
    ap.add_argument("--max-batch", type=int, default=64, help="both sides (default 64, as zpd's)")
    ap.add_argument("--prefill-threads", type=int, default=1,
                    help="1P1D prefill worker's torch threads (default 1; colocated has 2)")
    ap.add_argument("--decode-threads", type=int, default=1,
                    help="1P1D decode worker's torch threads (default 1)")
    ap.add_argument("--cluster-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment for the 1P1D processes only (repeatable), e.g. "
                         "GOMP_SPINCOUNT=20000 when their threads outnumber the cores")
    ap.add_argument("--max-prefill-tokens", type=int, default=8192,
                    help="most prompt tokens in one prefill forward, both sides (default 8192, as zpd's)")
    ap.add_argument("--peer-timeout", type=float, default=2.0,
                    help="1P1D heartbeat timeout (default 2 s, as zpd's; pings are answered during "
                         "forwards longer than that)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="load rounds, each colocated then 1P1D, pooled (default 2)")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="start no further round if the load rounds would then take longer (default 300)")
    ap.add_argument("--isolated", type=int, default=15, help="isolated requests per prompt length")
    ap.add_argument("--short-len", type=int, default=16, help="short prompt for the overhead figure")
    ap.add_argument("--repeats", type=int, default=7, help="repeats of in-process component timings")
    ap.add_argument("--rtt-samples", type=int, default=2000,
                    help="hot round trips timed; the idle ones: at most 100")
    ap.add_argument("--log-level", default="WARNING",
                    help="cluster log level; INFO also reports the in-cluster KV write times "
                         "(and adds a few log lines per request to every process)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds a request (1P1D) or the colocated load may take before the run fails")
    ap.add_argument("--quiet-wait", type=float, default=20.0,
                    help="before each measured phase, wait up to this many seconds for other "
                         "processes on the machine to go idle (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def measure_components(model: LoadedModel, args) -> tuple[float, dict, dict]:
    log_step("ZeroMQ round trip, KV transfer and compute, in-process")
    wait_quiet(args.quiet_wait, 0.15, 1.0)
    rtt = {"hot": zmq_round_trip(args.rtt_samples),
           "idle": zmq_round_trip(min(100, args.rtt_samples), idle_s=0.02)}
    page_bytes = KVLayout.for_model(model.cfg, PAGE_SIZE, model.dtype).page_bytes
    xfer = {"long": transfer_time(model, args.prompt_len, args.repeats * 3),
            "short": transfer_time(model, args.short_len, args.repeats * 3),
            "bytes": -(-args.prompt_len // PAGE_SIZE) * page_bytes}
    ctx = args.prompt_len + args.new_tokens // 2
    per_thread = {n: compute_times(model, args.prompt_len, args.short_len, args.concurrency, ctx,
                                   n, args.repeats, args.kv_cache_mb) for n in (1, 2)}
    return rtt, xfer, {k: {n: per_thread[n][k] for n in (1, 2)} for k in per_thread[1]}


def warm_up(model: LoadedModel, cluster: Launch, warm: list[list[int]], sampling: dict, args) -> None:
    """One burst of --concurrency prompts (2 new tokens) on each side: first-use costs
    (allocations, connections, the hello handshake) stay out of the figures."""
    log_step("warm-up, both sides")
    torch.set_num_threads(2)
    params = SamplingParams.from_dict(sampling | {"max_new_tokens": 2})
    with torch.inference_mode():
        OfflineEngine(model, kv_cache_mb=args.kv_cache_mb, max_batch=args.max_batch,
                      max_prefill_tokens=args.max_prefill_tokens).run(
            [Request(f"w{i}", p, params) for i, p in enumerate(warm)])
    with Client(cluster.router, timeout=args.timeout) as c:
        c.generate_many([{"input_ids": p, "sampling_params": sampling | {"max_new_tokens": 2}}
                         for p in warm])


def measure_load(model: LoadedModel, cluster: Launch, prompts, sampling: dict, args,
                 noise: dict) -> tuple[LoadResult, LoadResult, dict]:
    """--rounds rounds, each colocated then 1P1D, pooled: a burst of other work on a
    shared machine then skews both sides rather than one."""
    co, dg, cpu = LoadResult(), LoadResult(), {}
    pids = {"prefill": cluster.pids.get("prefill", 0), "decode": cluster.pids.get("decode", 0),
            "router": cluster.pids["router"], "client (this process)": os.getpid()}
    started = time.monotonic()
    for r in range(args.rounds):
        spent = time.monotonic() - started
        if r and spent / r * (r + 1) > args.budget_s:
            log_step(f"skipping rounds {r + 1}-{args.rounds}: another would end past --budget-s "
                     f"{args.budget_s:g} (the machine is slow or busy)")
            args.rounds = r
            break
        log_step(f"round {r + 1}/{args.rounds}: colocated load (torch threads 2)")
        torch.set_num_threads(2)
        wait_quiet(args.quiet_wait, 0.15, 1.0)
        others = Others([os.getpid()])
        with torch.inference_mode():
            co.merge(run_colocated(model, prompts, sampling, args))
        noise.setdefault("colocated load", []).append(others.cores())
        log_step(f"round {r + 1}/{args.rounds}: 1P1D load")
        wait_quiet(args.quiet_wait, 0.15, 1.0)
        others = Others(list(pids.values()) + [cluster.proc.pid])
        before = {k: cpu_seconds(p) for k, p in pids.items()}
        dg.merge(run_disagg(cluster.router, prompts, sampling, args))
        for k, p in pids.items():
            cpu[k] = cpu.get(k, 0.0) + cpu_seconds(p) - before[k]
        noise.setdefault("1P1D load", []).append(others.cores())
    return co, dg, cpu


def measure_isolated(cluster: Launch, model: LoadedModel, args, noise: dict) -> dict:
    log_step("1P1D: isolated requests")
    iso = {}
    for key, n, count, seed in (("long", args.prompt_len, args.isolated, 2),
                                ("short", args.short_len, 2 * args.isolated, 3)):
        wait_quiet(args.quiet_wait, 0.15, 1.0)
        others = Others(list(cluster.pids.values()) + [cluster.proc.pid, os.getpid()])
        prompts = random_prompts(count + 1, n, model.cfg.vocab_size, args.seed + seed)
        isolated(cluster.router, prompts[:1], args)            # warm-up
        iso[key] = isolated(cluster.router, prompts[1:], args)
        noise[f"isolated {key}"] = [others.cores()]
    return iso


def main() -> None:
    args = parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")       # Mooncake's per-connection INFO lines
    sampling = {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    noise: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp_name:
        tmp = Path(tmp_name)
        model_path, args.model_desc = args.model, args.model
        if args.model == "mid":
            (tmp / "model").mkdir()
            model_path = str(make_mid_model(tmp / "model", args.seed))
            args.model_desc = ("mid: random Llama, {num_hidden_layers} layers, hidden {hidden_size}, "
                               "{num_attention_heads}/{num_key_value_heads} heads, MLP "
                               "{intermediate_size}, vocab {vocab_size}").format(**MID)
        model = load_model(model_path, dtype=args.dtype)
        vocab = model.cfg.vocab_size
        prompts = random_prompts(args.requests, args.prompt_len, vocab, args.seed)
        rtt, xfer, comp = measure_components(model, args)
        log_step("1P1D: zpd launch")
        cluster = launch(tmp, model_path, args)
        try:
            warm_up(model, cluster, random_prompts(args.concurrency, args.prompt_len, vocab, args.seed + 1),
                    sampling, args)
            co, dg, cpu = measure_load(model, cluster, prompts, sampling, args, noise)
            iso = measure_isolated(cluster, model, args, noise)
        finally:
            cluster.stop()
        kv_ms = [float(m) for m in re.findall(r"kv written \(\d+ bytes, ([\d.]+) ms\)",
                                              cluster.log("prefill0"))]
        report(args, cluster, co, dg, comp, xfer, rtt, iso, cpu, {"kv_ms": kv_ms}, noise)


if __name__ == "__main__":
    main()
