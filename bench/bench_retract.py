"""True retraction on a real 1P1D cluster: pause(retract) and continue latency with many
running requests, and the recompute after continue vs a fresh prefill of the same tokens.

    python bench/bench_retract.py [--model tiny|small|mid|DIR] [--requests 256] [--cycles 5]
                                  [--repeats 7] [--prompt-len 64,192] [--pin 0|1]

One `zpd launch` (1 prefill, 1 decode, --threads 1, log level INFO, one log per process)
serves every phase; this process is the client (one zpd.Client per load, owned by one
receiving thread that stamps every streamed chunk with time.monotonic() on arrival) and
the admin (a second Client in the main thread).

1. pause/continue: --requests streaming requests (greedy, ignore_eos, long
   max_new_tokens), all decoding (each has >= 1 streamed token). Each cycle: pause(retract)
   timed as the admin round trip on the client; then continue, and for each request the
   time from sending continue to its first chunk after the pause; p50/p99/max over the
   requests and the time until all have a new token. Medians over --cycles cycles (the
   same requests throughout, so their contexts grow from cycle to cycle).
2. recompute vs fresh, --repeats interleaved repeats on the same cluster, same N:
   recompute: N new requests decoding (each has >= --min-output tokens), pause(retract),
   continue; time from sending continue until every held request has its next token
   (the prefill recomputes prompt + output[:-1], writes it, the decode feeds the last
   token). Then those requests are ended (pause abort, continue) and the cluster drains.
   fresh: N new requests whose prompts are exactly those prefixes (prompt + output so
   far), max_new_tokens=2; time from the first submit until every one has its 2nd token
   (prefill + transfer + one decode step each). Tokens/s for both count the same tokens:
   the prefix lengths. Target: recompute / fresh time <= 1.1 (median of per-repeat ratios).
   Diagnostics in the same repeats: fresh-long (the same prefixes with the long
   max_new_tokens: after their 2nd token they keep decoding and streaming, as resumed
   requests do after a recompute) and, with --pin 1, a recompute and its fresh run with
   the prefill process pinned alone to CPU 0 (decode, router and client on CPU 1).
   The breakdown comes from the workers' INFO logs (millisecond timestamps: the prefill's
   "queued" and "kv written (N bytes, X ms)", the decode's "kv received"), from each
   process's CPU seconds in the window (/proc), and from the model work alone, timed in
   this process after the cluster stops (prefill of the same prefixes, decode steps).

The machine's cores are shared (other jobs may run); compared figures are measured in the
same run, interleaved, and the CPU used by other processes during each window is printed
("others (cores)"). Bigger models (--model small/mid) need a bigger --kv-cache-mb and a
--max-prefill-tokens small enough that one prefill forward stays well under the workers'
2 s peer timeout on a loaded core; otherwise the router and decode mark the busy prefill
dead and requests fail with 503.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (Launch, cpu_seconds, log_step, machine_busy_seconds, make_model, med,  # noqa: E402
                    median_time, pct, wait_quiet)
from retract_load import Stream, end_all, gaps_in, make_requests, wait_idle  # noqa: E402

from retract_report import parse_log, report  # noqa: E402
from zpd.client import Client  # noqa: E402

PRESETS = {   # random Llamas written as HF directories; "tiny" is the embedded model
    "small": dict(vocab_size=32000, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "mid": dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=2, head_dim=64),
}
TINY_DESC = "tiny: embedded Llama, 2 layers, hidden 64, 4/2 heads, MLP 128, vocab 258"


class CpuWindow:
    """CPU seconds of our processes, and of everything else on the machine, over a window."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.t0, self.busy0 = time.monotonic(), machine_busy_seconds()
        self.cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}

    def end(self) -> dict[str, float]:
        cpu = {k: cpu_seconds(p) - self.cpu0[k] for k, p in self.pids.items()}
        wall = time.monotonic() - self.t0
        others = machine_busy_seconds() - self.busy0 - sum(cpu.values())
        return cpu | {"others (cores)": max(0.0, others) / wall, "wall": wall}


def launch(tmp: Path, model: str, args) -> Launch:
    """1P1D, one torch thread per worker, INFO logs (the breakdown reads them)."""
    flags = ["--dtype", args.dtype, "--threads", "1", "--kv-cache-mb", str(args.kv_cache_mb),
             "--max-batch", str(args.max_batch), "--log-level", "INFO"]
    if args.max_prefill_tokens:
        flags += ["--max-prefill-tokens", str(args.max_prefill_tokens)]
    cluster = Launch(tmp, model, flags)
    cluster.pids["client (this process)"] = os.getpid()     # CPU windows and pinning count it
    return cluster


# --- phases ----------------------------------------------------------------------------

def phase_pause_continue(cluster: Launch, admin: Client, args, vocab: int, rng: random.Random) -> dict:
    n = args.requests
    stream = Stream(cluster.router, make_requests("pc", n, args.prompt_lens, vocab, args.max_new, rng),
                    args.timeout)
    stream.wait_until(lambda: stream.min_tokens() >= 1, f"all {n} requests decoding", args.timeout)
    res = {"pause": [], "continue_rtt": [], "p50": [], "p99": [], "max": [], "held": [],
           "running_at_pause": [], "tokens_at_pause": []}
    for cycle in range(args.cycles):
        wait_quiet(args.quiet_wait)
        status = admin.admin("status")
        running = sum(w["queues"].get("running", 0) for w in status["workers"] if w["role"] == "decode")
        t = time.perf_counter()
        reply = admin.admin("pause", mode="retract")
        res["pause"].append(time.perf_counter() - t)
        assert reply["ok"], reply
        stream.drain()
        held = admin.admin("status")
        held_n = sum(len(w.get("held", [])) for w in held["workers"] if w["role"] == "decode")
        res["held"].append(held_n)
        res["running_at_pause"].append(running)
        res["tokens_at_pause"].append(sum(stream.tokens().values()) / n)
        t0 = time.monotonic()
        t = time.perf_counter()
        assert admin.admin("continue")["ok"]
        res["continue_rtt"].append(time.perf_counter() - t)
        stream.wait_until(lambda: len(stream.first_after(t0)) == n, "a token after continue", args.timeout)
        lat = [ts - t0 for ts in stream.first_after(t0).values()]
        for q, key in ((50, "p50"), (99, "p99"), (100, "max")):
            res[key].append(pct(lat, q))
        log_step(f"  cycle {cycle + 1}: pause {res['pause'][-1] * 1e3:.1f} ms, held {held_n}, "
                 f"continue -> all have a new token {res['max'][-1] * 1e3:.0f} ms")
    end_all(admin, stream)
    wait_idle(admin)
    return res


@dataclass
class Run:
    """One measured window."""
    t: float                  # seconds until every request has its next (fresh: 2nd) token
    tokens: int               # prefix tokens: prompt + output so far, summed
    cpu: dict                 # CPU seconds per process in the window, others' cores, wall
    rids: set
    t0_wall: float
    all_wall: float
    extra_tokens: int         # streamed in the window beyond each request's first new one
    gap: float = float("nan")  # median gap between consecutive tokens of a request in the window

    @property
    def tok_s(self) -> float:
        return self.tokens / self.t


def run_recompute(cluster: Launch, admin: Client, args, vocab: int, rng: random.Random, tag: str):
    """N requests decoding, pause(retract), continue: seconds until each has its next token."""
    n = args.requests
    stream = Stream(cluster.router, make_requests(f"{tag}-", n, args.prompt_lens, vocab,
                                                  args.max_new, rng), args.timeout)
    stream.wait_until(lambda: stream.min_tokens() >= args.min_output, f"{args.min_output} tokens each",
                      args.timeout)
    assert admin.admin("pause", mode="retract")["ok"]
    stream.drain()
    prefixes = {rid: ids + stream.output[rid] for rid, ids, _ in stream.reqs}
    wait_quiet(args.quiet_wait)
    window = CpuWindow(cluster.pids)
    t0_wall, t0 = time.time(), time.monotonic()
    assert admin.admin("continue")["ok"]
    stream.wait_until(lambda: len(stream.first_after(t0)) == n, "a token after continue", args.timeout)
    t_all = max(stream.first_after(t0).values())
    cpu = window.end()
    # tokens that reached the client inside the window beyond each request's first new one
    with stream.lock:
        extra = sum(max(0, stream.counts[rid][bisect_right(stream.times[rid], t_all) - 1]
                        - stream.counts[rid][bisect_right(stream.times[rid], t0) - 1] - 1)
                    for rid in prefixes)
    gap = med(gaps_in(stream, t0, t_all))
    end_all(admin, stream)
    wait_idle(admin)
    return Run(t_all - t0, sum(map(len, prefixes.values())), cpu, set(prefixes), t0_wall,
               t0_wall + t_all - t0, extra, gap), prefixes


def run_fresh(cluster: Launch, admin: Client, args, prefixes: dict[str, list[int]], tag: str,
              max_new: int = 2) -> "Run":
    """N new requests of exactly these prompts: until each has 2 tokens. max_new > 2: they
    keep decoding and streaming after that, as resumed requests do after a recompute."""
    sampling = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    reqs = [(f"{tag}-{i}", ids, sampling) for i, ids in enumerate(prefixes.values())]
    wait_quiet(args.quiet_wait)
    window = CpuWindow(cluster.pids)
    t0_wall, t0 = time.time(), time.monotonic()
    stream = Stream(cluster.router, reqs, args.timeout)
    stream.wait_until(lambda: len(stream.first_after(0, count=2)) == len(reqs), "2 tokens each",
                      args.timeout)
    t_all = max(stream.first_after(0, count=2).values())
    cpu = window.end()
    t0_wall += stream.submitted_at - t0             # from the first submit, once connected
    t0 = stream.submitted_at
    with stream.lock:
        extra = sum(max(0, c[bisect_right(stream.times[rid], t_all) - 1] - 2)
                    for rid, c in stream.counts.items())
    gap = med(gaps_in(stream, t0, t_all))
    if max_new > 2:
        end_all(admin, stream)
    else:
        stream.wait_until(lambda: len(stream.finish) == len(reqs), "finished", 60)
        stream.join()
    wait_idle(admin)
    return Run(t_all - t0, sum(map(len, prefixes.values())), cpu, {r for r, _, _ in reqs}, t0_wall,
               t0_wall + t_all - t0, extra, gap)


def phase_pairs(cluster: Launch, admin: Client, args, vocab: int, rng: random.Random) -> list[dict]:
    """Each repeat: a recompute, then fresh runs of exactly its prefixes, max_new_tokens 2
    and long (alternating which goes first); with --pin, a recompute and its fresh run
    again with the prefill alone on CPU 0."""
    reps = []
    for rep in range(args.repeats):
        re_run, prefixes = run_recompute(cluster, admin, args, vocab, rng, f"re{rep}")
        got = {"re": re_run, "prefixes": prefixes}
        for kind in (("fresh", "long") if rep % 2 == 0 else ("long", "fresh")):
            got[kind] = run_fresh(cluster, admin, args, prefixes, f"{kind}{rep}",
                                  2 if kind == "fresh" else args.max_new)
        line = (f"  repeat {rep + 1}: recompute {re_run.t * 1e3:.0f} ms, fresh {got['fresh'].t * 1e3:.0f} ms "
                f"(ratio {re_run.t / got['fresh'].t:.2f}, {re_run.tokens} prefix tokens), fresh "
                f"long {got['long'].t * 1e3:.0f} ms")
        if args.pin:
            cluster.pin(True)
            try:
                got["re_pin"], pinned = run_recompute(cluster, admin, args, vocab, rng, f"rp{rep}")
                got["fresh_pin"] = run_fresh(cluster, admin, args, pinned, f"fp{rep}")
            finally:
                cluster.pin(False)
            line += (f"; pinned: recompute {got['re_pin'].t * 1e3:.0f} ms, fresh "
                     f"{got['fresh_pin'].t * 1e3:.0f} ms")
        reps.append(got)
        log_step(line)
    return reps


# --- in-process reference: the model work alone -------------------------------------------

def components(model_path: str, args, prefixes: list[list[int]]) -> dict[str, float]:
    """Seconds, in this process with torch threads 1 (as each worker), no cluster running:
    prefill of exactly these prefixes in batches of 32 (what the prefill takes per loop
    iteration: 64 messages, two per request), and one decode step of N and of 8 requests
    at their median context. Medians of 3."""
    import torch
    from engines.kv.layout import KVLayout
    from engines.kv.pool import KVPool
    from engines.loader import load_model
    from engines.sampler import SamplingParams
    from engines.compute import Compute
    from engines.request import Request
    torch.set_num_threads(1)
    model = load_model(model_path, dtype=args.dtype)
    pool = KVPool.with_budget(KVLayout.for_model(model.cfg, 16, model.dtype), args.kv_cache_mb,
                              model.dtype, model.device)
    compute = Compute(model, pool)
    greedy = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)

    def prefill_all() -> None:
        for i in range(0, len(prefixes), 32):
            reqs = [Request(f"p{j}", p, greedy) for j, p in enumerate(prefixes[i:i + 32])]
            for r in reqs:
                r.pages = pool.allocator.alloc(pool.pages_for(len(r.prompt)))
            compute.prefill(reqs)
            for r in reqs:
                pool.allocator.free_pages(r.pages)

    def step(n: int):
        ctx = int(statistics.median(map(len, prefixes)))
        reqs = []
        for i in range(n):
            r = Request(f"s{i}", [1] * ctx, SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True))
            r.output = [1]
            r.pages = pool.allocator.alloc(pool.pages_for(ctx + 16))
            reqs.append(r)

        def run() -> None:
            compute.decode(reqs)
            for r in reqs:                      # stay at the same context
                r.output = r.output[:1]
                r.weight_versions = r.weight_versions[:1]
        return run

    def timed(fn, repeats: int = 3) -> float:
        return median_time(fn, repeats)
    with torch.inference_mode():
        return {"prefill": timed(prefill_all), "step_n": timed(step(len(prefixes)), 5),
                "step_8": timed(step(8), 5), "ctx": statistics.median(map(len, prefixes))}


# --- main ----------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny, small, mid (random Llamas) or an HF dir")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=256, help="N: requests held at each pause")
    ap.add_argument("--prompt-len", default="64,192", help="prompt lengths: MIN,MAX (uniform)")
    ap.add_argument("--max-new", type=int, default=0,
                    help="max_new_tokens of the long requests (default: what the KV pool holds)")
    ap.add_argument("--max-new-cap", type=int, default=1024,
                    help="cap on the default max_new_tokens (long contexts slow every decode step)")
    ap.add_argument("--min-output", type=int, default=8,
                    help="part 2: every request has at least this many tokens before the pause")
    ap.add_argument("--cycles", type=int, default=5, help="part 1: pause/continue cycles")
    ap.add_argument("--repeats", type=int, default=7, help="part 2: interleaved repeats")
    ap.add_argument("--kv-cache-mb", type=float, default=256)
    ap.add_argument("--max-batch", type=int, default=512)
    ap.add_argument("--max-prefill-tokens", type=int, default=0,
                    help="passed to the workers (default: theirs). Keep one prefill forward well "
                         "under the 2 s peer timeout: a bigger model needs a smaller value")
    ap.add_argument("--pin", type=int, default=1,
                    help="1 (default): each repeat also runs a recompute and its fresh run with the "
                         "prefill pinned alone to CPU 0 (diagnostic); 0: skip")
    ap.add_argument("--quiet-wait", type=float, default=1.0,
                    help="before each measured window, wait up to this long for the machine to idle")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-logs", default="", help="copy the cluster's log directory here")
    args = ap.parse_args()
    args.prompt_lens = tuple(int(x) for x in args.prompt_len.split(","))
    return args


@dataclass
class ModelInfo:
    path: str
    desc: str
    vocab: int              # prompts draw token ids below this
    token_bytes: int        # KV bytes per token
    context: int


def prepare_model(args, tmp: Path) -> ModelInfo:
    """The model directory (written for a preset) and what the load needs to know of it."""
    elt = {"float32": 4, "float64": 8}.get(args.dtype, 2)
    if args.model.startswith("tiny"):
        return ModelInfo(args.model, TINY_DESC, 256, 2 * 2 * 2 * 16 * elt, 4096)
    if args.model in PRESETS:
        c = PRESETS[args.model]
        path = str(make_model(tmp / "model", c, args.seed))
        desc = (f"{args.model}: random Llama, {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
                f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads, MLP "
                f"{c['intermediate_size']}, vocab {c['vocab_size']}")
    else:
        path, desc = args.model, args.model
        c = json.loads((Path(args.model) / "config.json").read_text())
    kv_heads = c.get("num_key_value_heads", c["num_attention_heads"])
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    return ModelInfo(path, desc, c["vocab_size"], c["num_hidden_layers"] * 2 * kv_heads * head_dim * elt,
                     c.get("max_position_embeddings", 4096))


def default_max_new(args, model: ModelInfo) -> int:
    """The decode reserves prompt + max_new_tokens per request: fit N of them in 90% of the
    pool (the rest for the fresh requests and rounding to pages) and in the context."""
    per_req = int(args.kv_cache_mb * 2**20 * 0.9 / model.token_bytes / args.requests)
    longest = args.prompt_lens[1]
    max_new = min(args.max_new_cap, model.context - longest - 1, per_req - longest - 16)
    if max_new < 64:
        raise SystemExit(f"--kv-cache-mb {args.kv_cache_mb:g} holds only {per_req} tokens per request "
                         f"for {args.requests} requests: raise it")
    return max_new


def measure(cluster: Launch, args, vocab: int, rng: random.Random) -> tuple[dict, list[dict]]:
    with Client(cluster.router, timeout=args.timeout) as admin:
        log_step("warm-up")
        warm = Stream(cluster.router, make_requests("warm", 32, args.prompt_lens, vocab, 4, rng))
        warm.wait_until(lambda: len(warm.finish) == 32, "finished", args.timeout)
        warm.join()
        log_step(f"part 1: pause(retract)/continue with {args.requests} running, {args.cycles} cycles")
        pc = phase_pause_continue(cluster, admin, args, vocab, rng)
        log_step(f"part 2: recompute vs fresh, N={args.requests}, {args.repeats} repeats")
        return pc, phase_pairs(cluster, admin, args, vocab, rng)


def main() -> None:
    args = parse_args()
    rng = random.Random(args.seed)
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-retract-") as tmp_name:
        tmp = Path(tmp_name)
        model = prepare_model(args, tmp)
        args.model_desc = model.desc
        args.max_new = args.max_new or default_max_new(args, model)
        log_step(f"zpd launch ({args.model})")
        cluster = launch(tmp, model.path, args)
        try:
            pc, reps = measure(cluster, args, model.vocab, rng)
        except BaseException:
            cluster.stop()
            for name in ("router", "prefill0", "decode0"):
                tail = "\n".join(line for line in cluster.log(name).splitlines()
                                 if " INFO " not in line)[-3000:]
                print(f"--- {name} log (without INFO lines), tail ---\n{tail}", file=sys.stderr)
            raise
        finally:
            cluster.stop()
            if args.keep_logs:
                subprocess.run(["cp", "-r", str(cluster.logs), args.keep_logs], check=False)
        logs = {role: parse_log(cluster.log(f"{role}0")) for role in ("prefill", "decode")}
        log_step("model work alone, in this process")
        wait_quiet(args.quiet_wait)
        comp = components(model.path, args, list(reps[0]["prefixes"].values()))
        report(args, cluster, pc, reps, logs, comp)
    print(f"\ntotal run time {time.monotonic() - t_start:.0f} s")


if __name__ == "__main__":
    main()
