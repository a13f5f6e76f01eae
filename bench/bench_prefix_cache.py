"""Prefix cache on a GRPO-shaped load: two 1P1D `zpd launch` clusters, one with the
prefix cache (the default) and one with --no-prefix-cache, the same load on each,
side by side in one run.

    python bench/bench_prefix_cache.py [--prompts 32] [--samples 8] [--prompt-len 512]
                                       [--new-tokens 64] [--rounds 2] [--model random|tiny|DIR]
                                       [--max-batch 64] [--kv-cache-mb 1024] [--quiet-wait 10]

Load: --prompts random prompts of --prompt-len ids, each submitted --samples times
(temperature 1.0, one seed per sample, ignore_eos, --new-tokens each), all at once,
streamed on one zpd.Client. Each round draws fresh prompts, so a round never hits
the cache of the one before; within a round the samples of a prompt share it. Both
clusters get the same prompts and seeds; they run one after the other (never at once:
they share the cores), alternating which goes first, and before each run the
script waits up to --quiet-wait s for the machine to go idle.

Figures per run, from the cluster's status counters (differences around the run)
and the client: prefill compute s (the prefill's forward calls), prompt tokens
computed, KV MB the prefill wrote to the decode, TTFT (submit to the first streamed
chunk, per request; the prefill sends it straight to the router, so it is the
prefill's queue and compute) p50 and p99, wall (first submit to last finish),
output tokens/s, prefix-cache hit rates (hit / asked prompt tokens) on the prefill
and the decode, the CPU seconds each process of the cluster used and, as "busy",
the prefill's and decode's CPU s / wall s (near 1: that process bounds the run),
and the cores other processes on the machine took meanwhile. The table gives
medians over rounds.
Target: prefill compute <= 0.25x and throughput >= 1.5x with the cache on.

The default model ("random": a random Llama, 4 layers, hidden 768, 12 query / 2 KV
heads, MLP 2048, vocab 4096, float32, ~31M parameters) gives prefill compute the
weight it has in real serving: ~0.6 ms a prompt token on one thread, and per layer
~24k weights for each KV value a decode step reads (an 8B Llama: ~100k). With less
(bench_e2e.py's "mid" shape: --layers 6 --hidden 384 --intermediate 1024 --heads 6)
about half of a decode step is attention over KV gathered from the pool, and the
decode bounds throughput with the cache on and off alike; the embedded "tiny" model
computes a 512-token prompt in a few ms, so there the control plane dominates.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (Launch, cpu_seconds, log_step, machine_busy_seconds, make_model,  # noqa: E402
                    med, pct, random_prompts, wait_quiet)
from zpd.client import Client  # noqa: E402

MODES = ("on", "off")
PREFILL_COUNTERS = ("prefill_forward_seconds", "prompt_tokens_computed", "kv_bytes_written",
                    "kv_transfer_seconds", "prefix_cache_hit_tokens", "prefix_cache_query_tokens")
NO_RATIO = ("prefill hit rate", "decode hit rate", "others' cores")
TINY_VOCAB = 256                       # the tiny model's byte ids (BOS and EOS above them)
Requests = dict[str, tuple[list[int], dict]]          # rid -> (prompt, sampling params)


@dataclass
class Run:
    """One load on one cluster."""
    ttft_ms: list[float]
    wall_s: float
    tokens: int
    outputs: dict[str, list[int]]
    counters: dict[str, float]         # prefill counters and decode_hit / decode_query, this run's
    cpu_s: dict[str, float]            # per process of the cluster
    others_cores: float                # cores busy with others' work during the run


@dataclass
class Side:
    """A cluster with or without the cache, and its runs."""
    cluster: Launch
    client: Client
    runs: list[Run] = field(default_factory=list)


# --- the cluster --------------------------------------------------------------------

def model_path(args: argparse.Namespace, tmp: Path) -> str:
    if args.model != "random":
        return args.model
    c = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
             num_hidden_layers=args.layers, num_attention_heads=args.heads,
             num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads)
    return str(make_model(tmp / "model", c, max_position=4096))


def start(mode: str, model: str, args: argparse.Namespace, tmp: Path) -> Launch:
    """The cache `mode` cluster, started; connect() waits for it."""
    (tmp / mode).mkdir()
    # The whole load is queued at once: without the cache its last requests wait for the
    # prefill (and all wait for decode slots) longer than the default 60 s queue deadline.
    flags = ["--dtype", "float32", "--threads", "1", "--kv-cache-mb", str(args.kv_cache_mb),
             "--max-batch", str(args.max_batch), "--kv-wait-timeout", f"{args.timeout:g}",
             "--log-level", "WARNING"]
    return Launch(tmp / mode, model, flags + (["--no-prefix-cache"] if mode == "off" else []), wait=False)


def connect(mode: str, cluster: Launch, args: argparse.Namespace) -> Side:
    cluster.wait_ready()
    side = Side(cluster, Client(cluster.router, timeout=args.timeout))
    workers = side.client.admin("status")["workers"]
    enabled = {w["role"]: w["prefix_cache"]["enabled"] for w in workers}
    if set(enabled.values()) != {mode == "on"}:
        raise RuntimeError(f"cache {mode} cluster reports prefix_cache enabled: {enabled}")
    return side


def counters(client: Client) -> dict[str, float]:
    """The cluster's cumulative counters: prefill ones summed over prefills, and the
    decodes' prefix-cache hit and asked tokens."""
    out = dict.fromkeys(PREFILL_COUNTERS + ("decode_hit", "decode_query"), 0.0)
    for w in client.admin("status")["workers"]:
        c = w.get("counters", {})
        if w["role"] == "prefill":
            for k in PREFILL_COUNTERS:
                out[k] += c.get(k, 0)
        else:
            out["decode_hit"] += c.get("prefix_cache_hit_tokens", 0)
            out["decode_query"] += c.get("prefix_cache_query_tokens", 0)
    return out


# --- the load -------------------------------------------------------------------------

def requests(prompts: list[list[int]], args: argparse.Namespace, tag: str) -> Requests:
    """The samples of each prompt, next to each other, one seed each."""
    out = {}
    for p, ids in enumerate(prompts):
        for s in range(args.samples):
            sampling = {"temperature": 1.0, "seed": p * args.samples + s,
                        "max_new_tokens": args.new_tokens, "ignore_eos": True}
            out[f"{tag}-p{p}-s{s}"] = (ids, sampling)
    return out


def load(client: Client, reqs: Requests, args: argparse.Namespace
         ) -> tuple[list[float], float, dict[str, list[int]]]:
    """Submit every request at once, streamed; TTFTs (ms), wall s and the outputs."""
    submitted, first, outputs, left = {}, {}, {rid: [] for rid in reqs}, len(reqs)
    t0 = time.perf_counter()
    for rid, (ids, sampling) in reqs.items():
        submitted[rid] = time.perf_counter()
        client.submit(input_ids=ids, rid=rid, stream=True, sampling_params=sampling)
    while left:
        chunk = client.receive(args.timeout)
        rid = chunk["rid"]
        if rid not in reqs:
            continue
        if chunk["token_ids"] and rid not in first:
            first[rid] = time.perf_counter()
        outputs[rid] += chunk["token_ids"]
        if chunk["finished"]:
            left -= 1
            if len(outputs[rid]) != args.new_tokens:
                raise RuntimeError(f"{rid}: {len(outputs[rid])} tokens, "
                                   f"finish {chunk['finish_reason']}")
    wall = time.perf_counter() - t0
    return [(first[r] - submitted[r]) * 1e3 for r in reqs], wall, outputs


def ours(sides: dict[str, Side]) -> float:
    """CPU seconds of this process and of every process of both clusters."""
    pids = [os.getpid()] + [p for s in sides.values()
                            for p in (s.cluster.proc.pid, *s.cluster.pids.values()) if p]
    return sum(cpu_seconds(p) for p in pids)


def measure(side: Side, sides: dict[str, Side], reqs: Requests, args: argparse.Namespace) -> Run:
    wait_quiet(args.quiet_wait)
    pids = side.cluster.pids
    cpu0, before = {k: cpu_seconds(p) for k, p in pids.items()}, counters(side.client)
    busy0, ours0 = machine_busy_seconds(), ours(sides)
    ttft, wall, outputs = load(side.client, reqs, args)
    others = max(0.0, machine_busy_seconds() - busy0 - (ours(sides) - ours0)) / wall
    after = counters(side.client)
    cpu = {k: cpu_seconds(p) - cpu0[k] for k, p in pids.items()}
    return Run(ttft, wall, sum(map(len, outputs.values())), outputs,
               {k: after[k] - before[k] for k in after}, cpu, others)


def rounds(sides: dict[str, Side], vocab: int, args: argparse.Namespace) -> int:
    """Alternate the sides over --rounds of fresh prompts; how many requests gave
    the same tokens with the cache on and off (seeded sampling, same prompts)."""
    same = 0
    for r in range(args.rounds):
        prompts = random_prompts(args.prompts, args.prompt_len, vocab, seed=1000 + r)
        order = MODES if r % 2 == 0 else MODES[::-1]
        for mode in order:
            run = measure(sides[mode], sides, requests(prompts, args, f"r{r}"), args)
            sides[mode].runs.append(run)
            log_step(f"round {r + 1} cache {mode}: wall {run.wall_s:.2f} s, "
                     f"prefill compute {run.counters['prefill_forward_seconds']:.2f} s, "
                     f"{run.tokens / run.wall_s:.1f} out tok/s")
        on, off = (sides[m].runs[-1].outputs for m in MODES)
        same += sum(on[rid] == off[rid] for rid in on)
    return same


def warm_up(side: Side, vocab: int, args: argparse.Namespace) -> None:
    """A small load of the same shape first, on prompts no round uses."""
    prompts = random_prompts(2, args.prompt_len, vocab, seed=7)
    load(side.client, requests(prompts, args, "warm"), args)


# --- the report ----------------------------------------------------------------------------

def describe(args: argparse.Namespace) -> str:
    if args.model != "random":
        return args.model
    return (f"random Llama, {args.layers} layers, hidden {args.hidden}, MLP {args.intermediate}, "
            f"{args.heads} query / {args.kv_heads} KV heads, vocab {args.vocab}")


def figures(run: Run) -> dict[str, float]:
    c = run.counters
    return {"prefill compute s": c["prefill_forward_seconds"],
            "prompt tokens computed": c["prompt_tokens_computed"],
            "KV MB moved": c["kv_bytes_written"] / 1e6,
            "KV transfer s": c["kv_transfer_seconds"],
            "TTFT p50 ms": pct(run.ttft_ms, 50), "TTFT p99 ms": pct(run.ttft_ms, 99),
            "wall s": run.wall_s, "output tok/s": run.tokens / run.wall_s,
            "prefill hit rate": c["prefix_cache_hit_tokens"]
            / max(1, c["prefix_cache_query_tokens"]),
            "decode hit rate": c["decode_hit"] / max(1, c["decode_query"]),
            "prefill CPU s": run.cpu_s["prefill"], "decode CPU s": run.cpu_s["decode"],
            "router CPU s": run.cpu_s["router"],
            "prefill busy": run.cpu_s["prefill"] / run.wall_s,     # CPU s / wall s
            "decode busy": run.cpu_s["decode"] / run.wall_s, "others' cores": run.others_cores}


def report(sides: dict[str, Side], same: int, args: argparse.Namespace) -> None:
    cols = {m: [figures(r) for r in sides[m].runs] for m in MODES}
    meds = {m: {k: med([f[k] for f in fs]) for k in fs[0]} for m, fs in cols.items()}
    print(f"\n{'median of ' + str(args.rounds) + ' rounds':<24}{'cache on':>12}{'cache off':>12}"
          f"{'on/off':>9}")
    for k in meds["on"]:
        on, off = meds["on"][k], meds["off"][k]
        digits = 0 if k == "prompt tokens computed" else 3
        ratio = f"{on / off:>9.3f}" if off and k not in NO_RATIO else f"{'-':>9}"
        print(f"{k:<24}{on:>12.{digits}f}{off:>12.{digits}f}{ratio}")
    compute = meds["on"]["prefill compute s"] / meds["off"]["prefill compute s"]
    rate = meds["on"]["output tok/s"] / meds["off"]["output tok/s"]
    per_round = [a.tokens / a.wall_s / (b.tokens / b.wall_s)
                 for a, b in zip(*(sides[m].runs for m in MODES))]
    print(f"ratio prefill compute on/off: {compute:.3f} (target <= 0.25)")
    print(f"ratio throughput on/off: {rate:.3f} (target >= 1.5; per round: "
          f"{', '.join(f'{x:.2f}' for x in per_round)})")
    total = args.rounds * args.prompts * args.samples
    print(f"same output with the cache on and off: {same}/{total} requests (seeded sampling)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="random",
                   help="random (shaped by --hidden and the rest), tiny or an HF directory")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=64, help="zpd launch --max-batch")
    p.add_argument("--kv-cache-mb", type=int, default=1024, help="zpd launch --kv-cache-mb")
    p.add_argument("--quiet-wait", type=float, default=10.0,
                   help="wait at most this long for an idle machine before each run")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for any one chunk; also the clusters' --kv-wait-timeout")
    args = p.parse_args()
    vocab = TINY_VOCAB if args.model.startswith("tiny") else args.vocab
    with tempfile.TemporaryDirectory(prefix="zpd-prefix-") as name:
        tmp = Path(name)
        model = model_path(args, tmp)
        clusters: dict[str, Launch] = {}
        sides: dict[str, Side] = {}
        try:
            for mode in MODES:                                  # both start at once
                log_step(f"starting the cache {mode} cluster")
                clusters[mode] = start(mode, model, args, tmp)
            for mode in MODES:
                sides[mode] = connect(mode, clusters[mode], args)
                warm_up(sides[mode], vocab, args)
            shown = sides["off"].cluster.shown.replace(model, "$MODEL")
            same = rounds(sides, vocab, args)
        finally:
            for side in sides.values():
                side.client.close()
            for cluster in clusters.values():
                cluster.stop()
    print(f"model: {describe(args)}, float32; {os.cpu_count()} CPUs")
    print(f"cluster: {shown} (cache on: without --no-prefix-cache)")
    print(f"load: {args.prompts} prompts x {args.samples} samples = {args.prompts * args.samples} "
          f"requests at once, {args.prompt_len} prompt ids, {args.new_tokens} new tokens "
          f"(temperature 1.0, one seed per sample, ignore_eos), fresh prompts each of "
          f"{args.rounds} rounds")
    report(sides, same, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
